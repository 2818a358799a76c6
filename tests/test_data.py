"""Datasets -> chat template -> input_ids / loss_mask; collation, loading order, prefetching."""

from __future__ import annotations

import copy
import json
import logging
import time

import pytest
import torch

from dflash import data
from dflash.data import (
    Collator,
    DevicePrefetcher,
    build_dataset,
    dataset_report,
    load_conversations,
    make_dataloader,
    max_valid_anchors,
    tokenize_conversation,
)
from dflash.embedded import embedded_target_dir

SYSTEM = "You are terse."
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Name a color."},
    {"role": "assistant", "content": "Blue."},
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_target_dir())


def supervised_pieces(row: dict, tokenizer) -> list[str]:
    """Decoded runs of consecutive supervised tokens."""
    pieces, run = [], []
    for token, flag in zip(row["input_ids"], row["loss_mask"], strict=True):
        if flag:
            run.append(token)
        elif run:
            pieces.append(tokenizer.decode(run))
            run = []
    if run:
        pieces.append(tokenizer.decode(run))
    return pieces


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# --------------------------------------------------------------------------- loss mask


def test_loss_mask_is_exactly_the_replies_with_end_of_turn(tokenizer):
    row = tokenize_conversation(CHAT, tokenizer, max_length=1024)
    expected = tokenizer.apply_chat_template(CHAT, return_dict=True)["input_ids"]
    assert row["input_ids"] == expected  # the same tokens the template itself produces
    assert len(row["loss_mask"]) == len(expected)
    assert supervised_pieces(row, tokenizer) == ["Hello! How can I help?<|im_end|>", "Blue.<|im_end|>"]
    # Everything else (system, user turns, role headers, the newline after <|im_end|>) is unsupervised.
    unsupervised = tokenizer.decode(
        [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if not m]
    )
    assert unsupervised == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        "\n<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n\n"
    )
    assert row["unlocated_turns"] == 0 and not row["truncated"]


def test_token_merged_across_the_reply_boundary_is_supervised(tokenizer):
    # "assistant\n" + "\n\nIndented" tokenizes as "\n\n", "\n", ...: the first token straddles.
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "\n\nIndented"}]
    row = tokenize_conversation(chat, tokenizer, max_length=1024)
    assert row["input_ids"] == tokenizer.apply_chat_template(chat, return_dict=True)["input_ids"]
    assert supervised_pieces(row, tokenizer) == ["\n\n\nIndented<|im_end|>"]


def test_template_that_rerenders_the_last_reply_leaves_earlier_turns_unsupervised(tokenizer):
    # Like Qwen3: the final reply gets a think block, earlier ones do not -> prefix renders differ.
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and loop.last %}<think></think>{% endif %}"
        "{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    row = tokenize_conversation(CHAT[1:], tok, max_length=1024)
    assert row["unlocated_turns"] == 1
    assert supervised_pieces(row, tok) == ["<think></think>Blue.<|im_end|>"]


def test_truncation(tokenizer):
    full = tokenize_conversation(CHAT, tokenizer, max_length=1024)
    row = tokenize_conversation(CHAT, tokenizer, max_length=40)
    assert row["truncated"] and len(row["input_ids"]) == len(row["loss_mask"]) == 40
    assert row["input_ids"] == full["input_ids"][:40] and row["loss_mask"] == full["loss_mask"][:40]


@pytest.mark.parametrize(
    "raw",
    [
        {"messages": CHAT[1:3]},
        {
            "conversations": [
                {"from": "human", "value": "Hi there"},
                {"from": "gpt", "value": "Hello! How can I help?"},
            ]
        },
        {"prompt": "Hi there", "response": "Hello! How can I help?"},
        {"instruction": "Hi there", "output": "Hello! How can I help?"},
        {"instruction": "Hi", "input": "there", "output": "Hello! How can I help?", "ignored": 1},
    ],
)
def test_every_input_shape_gives_the_same_rows(tmp_path, tokenizer, raw):
    write_jsonl(tmp_path / "d.jsonl", [raw])
    (row,), report = load_conversations(tmp_path / "d.jsonl")
    if "input" in raw:
        assert row["messages"][0]["content"] == "Hi\n\nthere"
    else:
        assert row["messages"] == CHAT[1:3]
    tokens = tokenize_conversation(row["messages"], tokenizer, max_length=256)
    assert supervised_pieces(tokens, tokenizer) == ["Hello! How can I help?<|im_end|>"]
    assert report.skipped == {}


def test_sharegpt_system_and_trailing_user_turn():
    row = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "Q"},
            {"from": "gpt", "value": "A"},
            {"from": "human", "value": "unanswered"},
        ]
    }
    assert data.normalize_row(row) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]
    assert data.normalize_row(row, require_assistant=False)[-1]["content"] == "unanswered"


# --------------------------------------------------------------------------- bad input


def test_bad_rows_are_counted_and_named(tmp_path, caplog):
    good = {"messages": CHAT[1:3]}
    lines = [
        json.dumps(good),
        json.dumps({"messages": [{"content": "no role"}, CHAT[2]]}),  # line 2
        json.dumps({"messages": [CHAT[1], {"role": "assistant", "content": "  "}]}),  # line 3
        json.dumps({"messages": [CHAT[1]]}),  # line 4: no assistant turn
        json.dumps({"messages": [CHAT[1], {"role": "tool", "content": "x"}, CHAT[2]]}),  # line 5
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
    with caplog.at_level(logging.WARNING, logger="dflash.data"):
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
    assert report.first_bad["unknown role"] == f"{path} line 5: 'tool'"
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
    import pyarrow as pa
    import pyarrow.parquet as pq

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
    import datasets

    assert load_conversations(rows).rows[1]["messages"][0]["content"] == "q1"
    assert len(load_conversations(datasets.Dataset.from_list(rows)).rows) == 3


def test_chitchat_source_keeps_conversations_with_a_reply():
    rows, report = load_conversations("chitchat")
    assert len(rows) == 4017 and report.rows_read == 7168
    assert report.skipped == {"no assistant turn": 3151}
    assert all(r["messages"][-1]["role"] == "assistant" for r in rows)


# --------------------------------------------------------------------------- build + cache


def test_build_dataset_caches_and_drops_rows_without_anchor(tmp_path, tokenizer, monkeypatch):
    long_system = {"role": "system", "content": "word " * 60}
    rows = [
        {"messages": CHAT},
        {"messages": [long_system, *CHAT[1:3]]},  # the reply starts past max_length: dropped
        {"prompt": "Hi", "response": "Hello there, friend."},
    ]
    source = tmp_path / "train.jsonl"
    write_jsonl(source, rows)
    cache = tmp_path / "cache"
    ds = build_dataset(source, tokenizer, max_length=64, cache_dir=cache)
    assert ds.column_names == ["input_ids", "loss_mask"] and len(ds) == 2
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) <= 64 for r in ds)
    assert ds[0]["input_ids"] == tokenize_conversation(CHAT, tokenizer, 64)["input_ids"]
    report = dataset_report(ds)
    assert report.skipped == {"no two consecutive supervised tokens": 1} and report.truncated >= 1
    assert report.first_bad["no two consecutive supervised tokens"] == f"{source} line 2"
    assert report.rows == 2 and report.tokens == sum(len(r["input_ids"]) for r in ds)
    (batch,) = make_dataloader(ds, 2, Collator(tokenizer.pad_token_id, bucket_multiple=32), num_workers=0)
    assert batch["input_ids"].shape == (2, 64) and batch["loss_mask"].sum() == sum(map(sum, ds["loss_mask"]))

    calls = []
    monkeypatch.setattr(data, "_tokenize_batch", lambda *a, **k: calls.append(1))
    start = time.perf_counter()
    again = build_dataset(source, tokenizer, max_length=64, cache_dir=cache)
    assert time.perf_counter() - start < 2.0 and calls == []  # no re-tokenization
    assert again["input_ids"] == ds["input_ids"] and dataset_report(again) == report
    assert len(list(cache.iterdir())) == 1  # no temporary folder left behind

    monkeypatch.undo()
    build_dataset(source, tokenizer, max_length=48, cache_dir=cache)  # another key: a new entry
    write_jsonl(source, rows[:1])  # the file changed: a new entry
    assert len(build_dataset(source, tokenizer, max_length=64, cache_dir=cache)) == 1
    assert len(list(cache.iterdir())) == 3


# --------------------------------------------------------------------------- batches


def test_collator_pads_to_buckets():
    rows = [
        {"input_ids": [5] * 70, "loss_mask": [0] * 10 + [1] * 60},
        {"input_ids": [7] * 3, "loss_mask": [0, 1, 1]},
    ]
    batch = Collator(pad_token_id=2, bucket_multiple=64)(rows)
    assert batch["input_ids"].shape == batch["loss_mask"].shape == (2, 128)
    assert batch["input_ids"].dtype == torch.long and batch["loss_mask"].dtype == torch.bool
    assert batch["input_ids"][1, :3].tolist() == [7, 7, 7] and (batch["input_ids"][1, 3:] == 2).all()
    assert not batch["loss_mask"][:, 70:].any() and batch["loss_mask"][0].sum() == 60
    capped = Collator(pad_token_id=2, bucket_multiple=64, max_length=100)(rows)
    assert capped["input_ids"].shape == (2, 100)
    assert Collator(pad_token_id=0, bucket_multiple=64)(rows[1:])["input_ids"].shape == (1, 64)


def test_max_valid_anchors():
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1], [1, 0, 1, 0, 1, 0, 1], [0] * 7], dtype=torch.bool)
    assert max_valid_anchors(mask) == 3  # row 0: positions 1, 2, 5
    assert max_valid_anchors(torch.zeros(2, 1, dtype=torch.bool)) == 0


def _rows(n: int) -> list[dict]:
    return [{"input_ids": [i] * (i % 5 + 1), "loss_mask": [1] * (i % 5 + 1)} for i in range(n)]


def _order(loader) -> list[list[int]]:
    return [batch["input_ids"][:, 0].tolist() for batch in loader]


def test_dataloader_order_is_seeded_and_resumable():
    rows, collate = _rows(20), Collator(pad_token_id=0, bucket_multiple=8)
    first = _order(make_dataloader(rows, 4, collate, seed=3, num_workers=0))
    assert len(first) == 5 and sorted(sum(first, [])) == list(range(20))
    assert _order(make_dataloader(rows, 4, collate, seed=3, num_workers=0)) == first
    assert _order(make_dataloader(rows, 4, collate, seed=4, num_workers=0)) != first
    resumed = make_dataloader(rows, 4, collate, seed=3, num_workers=0, skip_batches=2)
    assert len(resumed) == 3 and _order(resumed) == first[2:]
    # The next epoch is a fresh permutation, the same one a run started at that epoch sees.
    second = _order(resumed)
    assert second != first and second == _order(
        make_dataloader(rows, 4, collate, seed=3, num_workers=0, epoch=1)
    )
    shards = [
        _order(make_dataloader(rows, 4, collate, seed=3, num_workers=0, rank=r, world_size=2)) for r in (0, 1)
    ]
    assert not set(sum(shards[0], [])) & set(sum(shards[1], [])) and len(shards[0]) == 2


def test_dataloader_workers_keep_the_order():
    rows, collate = _rows(12), Collator(pad_token_id=0, bucket_multiple=8)
    loader = make_dataloader(rows, 3, collate, seed=1, num_workers=2)
    assert loader.persistent_workers and loader.pin_memory == torch.cuda.is_available()
    assert _order(loader) == _order(make_dataloader(rows, 3, collate, seed=1, num_workers=0))


def test_device_prefetcher_on_cpu_keeps_order_and_content():
    rows, collate = _rows(10), Collator(pad_token_id=0, bucket_multiple=4)
    loader = make_dataloader(rows, 2, collate, shuffle=False, num_workers=0)
    expected = list(make_dataloader(rows, 2, collate, shuffle=False, num_workers=0))
    got = list(DevicePrefetcher(loader, "cpu"))
    assert len(got) == len(expected) == 5
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) and a[k].device.type == "cpu" for k in a)
