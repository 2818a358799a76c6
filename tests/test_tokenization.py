"""Chat template -> input_ids / loss_mask; the tokenized dataset and its cache."""

from __future__ import annotations

import copy
import time

import pytest
from test_sources import CHAT, SYSTEM, write_jsonl

from dflash.data import tokenization
from dflash.data.loader import Collator, make_dataloader
from dflash.data.sources import dataset_report, load_conversations
from dflash.data.tokenization import build_dataset, tokenize_conversation


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
    monkeypatch.setattr(tokenization, "_tokenize_batch", lambda *a, **k: calls.append(1))
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
