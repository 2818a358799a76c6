"""Source formats -> normalized conversations: input shapes, bad rows, files, folders, hub names."""

from __future__ import annotations

import json
import logging

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash.data import sources
from dflash.data.sources import load_conversations

SYSTEM = "You are terse."
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Name a color."},
    {"role": "assistant", "content": "Blue."},
]


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_sharegpt_system_and_trailing_user_turn():
    row = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "Q"},
            {"from": "gpt", "value": "A"},
            {"from": "human", "value": "unanswered"},
        ]
    }
    assert sources.normalize_row(row) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]
    assert sources.normalize_row(row, require_assistant=False)[-1]["content"] == "unanswered"


# --------------------------------------------------------------------------- bad input


def test_bad_rows_are_counted_and_named(tmp_path, caplog):
    good = {"messages": CHAT[1:3]}
    lines = [
        json.dumps(good),
        json.dumps({"messages": [{"content": "no role"}, CHAT[2]]}),  # line 2
        json.dumps({"messages": [CHAT[1], {"role": "assistant", "content": "  "}]}),  # line 3
        json.dumps({"messages": [CHAT[1]]}),  # line 4: no assistant turn
        json.dumps({"messages": [CHAT[1], {"role": "narrator", "content": "x"}, CHAT[2]]}),  # line 5
        '{"messages": [',  # line 6: malformed
        json.dumps(good),
        json.dumps({"text": "plain"}),  # line 8
        json.dumps([1, 2]),  # line 9
        "",
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, CHAT[2]]}),
    ]
    blob = "\n".join(lines).encode() + b"\n\xff\xfe broken\n"  # line 12: not UTF-8
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(blob)
    with caplog.at_level(logging.WARNING, logger="dflash.data.sources"):
        rows, report = load_conversations(path)
    assert len(rows) == report.conversations == 3 and report.rows_read == 11
    assert report.skipped == {
        "missing role": 1,
        "empty content": 1,
        "no assistant turn": 1,
        "unknown role": 1,
        "malformed JSON lines": 1,
        "no conversation fields": 1,
        "not a JSON object": 1,
        "non-UTF-8 lines": 1,
    }
    assert report.first_bad["missing role"] == f"{path} line 2"
    assert report.first_bad["unknown role"] == f"{path} line 5: 'narrator'"  # a tool result: tests/test_tool_calls.py
    assert report.first_bad["malformed JSON lines"].startswith(f"{path} line 6")
    assert report.first_bad["non-UTF-8 lines"].startswith(f"{path} line 12")
    assert f"(first: {path} line 2)" in caplog.text and "skipped 8" in caplog.text
    assert rows[0]["id"] == f"{path} line 1"


def test_empty_and_unreadable_sources_fail_naming_the_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.jsonl is empty"):
        load_conversations(empty)
    array = tmp_path / "array.json"
    array.write_text("[]")
    with pytest.raises(ValueError, match="array.json holds no rows"):
        load_conversations(array)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'[{"prompt": "caf\xe9"}]')
    with pytest.raises(ValueError, match="cannot read .*latin.json"):
        load_conversations(latin)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="cannot read .*garbage.parquet"):
        load_conversations(garbage)
    all_bad = tmp_path / "bad.jsonl"
    all_bad.write_text('{"prompt": "no reply"}\n')
    with pytest.raises(
        ValueError, match=r"no usable conversations in .*bad.jsonl.*no assistant turn \(first: .*line 1"
    ):
        load_conversations(all_bad)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match="no .json/.jsonl/.parquet files in .*nothing"):
        load_conversations(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_conversations(tmp_path / "missing.jsonl")


def test_hub_name_unreachable_offline_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cannot load 'someone/no-such-dataset'.*load_dataset failed"):
        load_conversations("someone/no-such-dataset")


def test_json_parquet_and_folder_sources(tmp_path):
    rows = [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(3)]
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.json").write_text(json.dumps(rows[:1]))
    write_jsonl(folder / "b.jsonl", rows[1:2])
    pq.write_table(pa.Table.from_pylist(rows[2:]), folder / "sub" / "c.parquet")
    (folder / "notes.txt").write_text("ignored")
    loaded, report = load_conversations(folder)
    assert [r["messages"][1]["content"] for r in loaded] == ["a0", "a1", "a2"]
    assert report.rows_read == 3 and loaded[2]["id"].endswith("c.parquet row 0")
    # In-memory rows and datasets.Dataset work too (notebook use).
    assert load_conversations(rows).rows[1]["messages"][0]["content"] == "q1"
    assert len(load_conversations(datasets.Dataset.from_list(rows)).rows) == 3


def test_chitchat_source_keeps_conversations_with_a_reply():
    rows, report = load_conversations("chitchat")
    assert len(rows) == 4017 and report.rows_read == 7168
    assert report.skipped == {"no assistant turn": 3151}
    assert all(r["messages"][-1]["role"] == "assistant" for r in rows)
