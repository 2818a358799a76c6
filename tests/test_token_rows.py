"""Pre-tokenized rows (input_ids + loss_mask, what agent frameworks log): trained exactly as given, every bad row
counted and named, the held-out split and the speculative prompt of a token row, and `dflash train` end to end."""

from __future__ import annotations

import json
import logging

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import tiny_config
from test_sources import write_jsonl
from transformers import AutoTokenizer

from dflash.cli.dry_run import phases
from dflash.cli.main import main
from dflash.config import DataSettings, TrainConfig
from dflash.data import tokenization
from dflash.data.corpus import first_prompt_id, speculative_entries, split_held_out, training_data
from dflash.data.rows import last_turn_prompt, token_prompt_id
from dflash.data.sources import dataset_report, load_conversations
from dflash.data.tokenization import build_dataset
from dflash.evaluation.evaluate import eval_conversations, prompt_ids
from dflash.report.sinks import read_history
from dflash.trainer import DFlashTrainer


def token_row(i: int, turns: int = 1) -> dict:
    """Row `i`: a prompt of 4 ids of its own, then `turns` supervised replies of 10 ids in a cycle a draft learns
    quickly, each later one after 3 unsupervised ids (a tool result, a user turn). Ids from 100 up: never the
    tests' mask token (16)."""
    ids, mask = [200 + i, 300 + i % 7, 400 + i % 5, 500 + i], [0, 0, 0, 0]
    for turn in range(turns):
        if turn:
            ids, mask = ids + [600 + i, 601, 602], mask + [0, 0, 0]
        ids, mask = ids + [100 + (i + k) % 20 for k in range(10)], mask + [1] * 10
    return {"id": f"r{i}", "input_ids": ids, "loss_mask": mask}


ROWS = [token_row(i, turns=1 + i % 3) for i in range(24)]  # 14 to 40 tokens


def test_token_rows_are_trained_as_given_and_cut_at_max_length(tmp_path, tokenizer, monkeypatch):
    rows = [{**ROWS[0], "loss_mask": [bool(m) for m in ROWS[0]["loss_mask"]]}, *ROWS[1:6]]  # bools are 0/1
    write_jsonl(tmp_path / "rows.jsonl", rows)
    ds = build_dataset(tmp_path / "rows.jsonl", tokenizer, max_length=20, cache_dir=tmp_path / "cache")
    assert ds.column_names == ["input_ids", "loss_mask"] and len(ds) == 6
    assert (ds.features["input_ids"].feature.dtype, ds.features["loss_mask"].feature.dtype) == ("int32", "int8")
    assert ds["input_ids"] == [r["input_ids"][:20] for r in ROWS[:6]]
    assert ds["loss_mask"] == [r["loss_mask"][:20] for r in ROWS[:6]]
    report = dataset_report(ds)
    assert report.truncated == sum(len(r["input_ids"]) > 20 for r in ROWS[:6]) == 4 and report.skipped == {}
    assert report.summary().startswith(f"{tmp_path / 'rows.jsonl'}: 6 token rows from 6 rows; 6 rows, ")
    monkeypatch.setattr(tokenization, "_token_columns", lambda *a: pytest.fail("read again, not from the cache"))
    assert build_dataset(tmp_path / "rows.jsonl", tokenizer, max_length=20, cache_dir=tmp_path / "cache")[:] == ds[:]
    # Every source kind gives the same rows: Parquet, a save_to_disk folder, in-memory rows and datasets.
    pq.write_table(pa.Table.from_pylist(ROWS[:6]), tmp_path / "rows.parquet")
    datasets.Dataset.from_list(ROWS[:6]).save_to_disk(str(tmp_path / "saved"))
    # A row that logs its conversation beside its ids is a token row too: the ids are what the model saw.
    logged = [{**row, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
              for row in ROWS[:6]]
    for source in (tmp_path / "rows.parquet", tmp_path / "saved", logged, datasets.Dataset.from_list(ROWS[:6])):
        loaded, report = load_conversations(source)
        assert [r["input_ids"] for r in loaded] == [r["input_ids"] for r in ROWS[:6]], source
        assert report.shape == "token rows" and [r["id"] for r in loaded] == [r["id"] for r in ROWS[:6]]


def test_every_bad_token_row_is_counted_and_named(tmp_path, tokenizer):
    good = ROWS[1]
    rows = [
        good,  # line 1
        {"input_ids": "1 2 3", "loss_mask": [0, 1, 1]},  # line 2
        {"input_ids": [1, 2, 3]},  # line 3: no loss_mask
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1]},  # line 4
        {"input_ids": [], "loss_mask": []},  # line 5
        {"input_ids": [1, 2, 3], "loss_mask": [0, 2, 1]},  # line 6
        {"input_ids": [1, -2, 3], "loss_mask": [0, 1, 1]},  # line 7
        {"input_ids": [1, 2, 3, 4], "loss_mask": [1, 0, 1, 0]},  # line 8: no two consecutive supervised tokens
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},  # line 9
        {"id": "big", "input_ids": [1, len(tokenizer), 3], "loss_mask": [0, 1, 1]},  # line 10: another tokenizer's
        {"id": "late", "input_ids": list(range(100, 140)), "loss_mask": [0] * 30 + [1] * 10},  # line 11: cut away
    ]
    write_jsonl(tmp_path / "bad.jsonl", rows)
    where = f"{tmp_path / 'bad.jsonl'} line"
    report = dataset_report(build_dataset(tmp_path / "bad.jsonl", tokenizer, max_length=20, cache_dir=tmp_path / "c"))
    assert report.rows == 1 and report.conversations == 3 and report.rows_read == 11
    assert report.skipped == {
        "token row without input_ids and loss_mask lists of ints": 2, "token row lengths differ": 1,
        "empty token row": 1, "loss_mask values outside 0/1": 1, "negative token ids": 1,
        "no two consecutive supervised tokens": 2, "conversation in a source of token rows (mixed shapes)": 1,
        "token ids outside the vocabulary": 1}
    assert report.first_bad == {
        "token row without input_ids and loss_mask lists of ints": f"{where} 2: input_ids: str, loss_mask: list",
        "token row lengths differ": f"{where} 4: input_ids 3, loss_mask 2",
        "empty token row": f"{where} 5",
        "loss_mask values outside 0/1": f"{where} 6: 2",
        "negative token ids": f"{where} 7: -2",
        "no two consecutive supervised tokens": f"{where} 8",
        "conversation in a source of token rows (mixed shapes)":
            f"{where} 9: the first usable row ({where} 1) made it a source of token rows; give each shape its own source",
        "token ids outside the vocabulary":
            f"big: id {len(tokenizer)} >= {len(tokenizer)}, the tokenizer's size (another tokenizer's ids?)"}
    assert report.truncated == 2  # the good row (27 tokens), and "late", cut before its reply (then counted above)
    # A conversation source counts token rows as the other shape.
    write_jsonl(tmp_path / "chats.jsonl", [rows[8], good])
    _, chats = load_conversations(tmp_path / "chats.jsonl")
    assert chats.skipped == {"token row in a source of conversations (mixed shapes)": 1}
    assert chats.shape == "conversations"


def test_held_out_split_and_speculative_prompt_of_token_rows():
    held_ids = {r["id"] for r in split_held_out(ROWS, 4)[1]}
    assert held_ids == {r["id"] for r in split_held_out(ROWS[::-1], 4)[1]}  # by id hash, not by place
    # A training row opening with a held-out row's prompt is dropped, as a conversation would be.
    held = next(r for r in ROWS if r["id"] in held_ids)
    echo = {"id": "echo", "input_ids": held["input_ids"][:4] + [7, 8, 9], "loss_mask": [0, 0, 0, 0, 1, 1, 1]}
    assert first_prompt_id(echo) == first_prompt_id(held) == token_prompt_id(held["input_ids"][:4])
    train, held_out = split_held_out([*ROWS, echo], 4)
    assert {r["id"] for r in held_out} == held_ids and "echo" not in {r["id"] for r in train}
    assert len(train) == len(ROWS) - 4
    # Rows supervised from their first token open with no prompt: they do not drop each other.
    bare = [{"id": f"b{i}", "input_ids": [100 + i, 101, 102], "loss_mask": [1, 1, 1]} for i in range(6)]
    assert len(split_held_out(bare, 2)[0]) == 4
    # The speculative prompt: the ids before the last run of supervised tokens (a multi-turn row's whole history).
    three = token_row(5, turns=3)
    (entry,) = speculative_entries([three])
    assert entry == {"id": "r5", "prompt_ids": three["input_ids"][:30]} and three["loss_mask"][29:31] == [0, 1]
    assert last_turn_prompt(token_row(5)) == token_row(5)["input_ids"][:4]


def test_prompt_ids_takes_token_entries_as_given(tokenizer):
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    entries = [{"id": "a", "prompt_ids": [5, 6, 7]}, {"id": "again", "prompt_ids": [5, 6, 7]},
               {"id": "long", "prompt_ids": list(range(600))}, chat, {"id": "b", "prompt_ids": [8, 9]}]
    prompts = prompt_ids(tokenizer, entries, num_prompts=4)
    assert prompts == [[5, 6, 7], tokenizer.apply_chat_template(chat["messages"][:1], add_generation_prompt=True,
                                                                return_dict=True)["input_ids"], [8, 9]]
    assert prompt_ids(tokenizer, entries, num_prompts=4, max_prompt_tokens=600)[1] == list(range(600))


def test_the_runs_speculative_prompts_reach_data_max_length(target, monkeypatch):
    """A token row's prompt is its whole history before its last reply: a run decodes prompts of up to
    data.max_length tokens (512 at least), through the trainer, the held-out evaluation and `prompt_ids`."""
    class Decoded(Exception):
        pass

    def decode(target_model, draft, prompts, **kwargs):
        raise Decoded(prompts)

    monkeypatch.setattr("dflash.evaluation.evaluate.evaluate_speculative", decode)
    trainer = DFlashTrainer(tiny_config(data__max_length=1024), target=target)
    entries = [{"id": "long", "prompt_ids": [k % 100 for k in range(700)]}, {"id": "short", "prompt_ids": [5, 6]}]
    with pytest.raises(Decoded) as decoded:
        trainer.speculative_eval(entries)
    assert decoded.value.args[0] == [e["prompt_ids"] for e in entries]
    trainer.config.data.max_length = 64
    with pytest.raises(Decoded) as decoded:
        trainer.speculative_eval(entries)
    assert decoded.value.args[0] == [[5, 6]]  # past 512 tokens, with a max_length below it


def test_the_dry_run_counts_token_rows_and_says_regeneration_does_not_apply(tmp_path):
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    config = TrainConfig()
    config.data = DataSettings(source=str(tmp_path / "rows.jsonl"), eval_size=4, cache_dir=str(tmp_path / "cache"))
    out = phases(config)
    assert out["phase_regeneration"] == "off (token rows: trained as given, data.regenerate does not apply)"
    assert "over 20 training conversations of 24 in the source" in out["phase_training"]


def test_dflash_train_on_token_rows_trains_them_as_given(tiny_target_dir, tmp_path, capsys, caplog):
    """One run under the default data.regenerate=true: one warning that it does not apply, the loss moves, the
    supervised tokens are the file's, and the held-out token rows are the speculative prompts of the run and of
    `dflash eval --prompts auto`."""
    source, out = tmp_path / "rows.jsonl", tmp_path / "run"
    write_jsonl(source, ROWS)
    args = ["train", f"target={tiny_target_dir}", f"data.source={source}", f"output_dir={out}", "device=cpu",
            "draft.mask_token_id=16", "draft.block_size=4", "draft.num_anchors=8", "batch_size=4", "max_steps=6",
            "optim.lr=3e-3", "data.max_length=64", "data.bucket_multiple=32", "data.eval_size=6", "data.num_workers=0",
            "log_interval=1", "ce_chunk_size=256", "spec_eval_prompts=3", "spec_eval_max_new_tokens=8",
            f"data.cache_dir={out}/cache"]
    corpus_log = logging.getLogger("dflash.data.corpus")
    corpus_log.addHandler(caplog.handler)  # the CLI's "dflash" logger does not propagate to pytest's root handler
    try:
        assert main(args) == 0, capsys.readouterr().err[-3000:]
    finally:
        corpus_log.removeHandler(caplog.handler)
    err = capsys.readouterr().err
    warning = "holds token rows (input_ids + loss_mask): they are trained as given, data.regenerate does not apply"
    assert err.count(warning) == 1, err[-3000:]
    assert [r.levelno for r in caplog.records if warning in r.getMessage()] == [logging.WARNING]
    losses = [r["loss"] for r in read_history(out) if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    summary = json.loads((out / "summary.json").read_text())
    assert summary["speculative"]["num_prompts"] == 3 and summary["speculative"]["lossless"]

    config = TrainConfig.from_sources(str(out / "config.yaml"), [])
    prepared = training_data(None, config.data, AutoTokenizer.from_pretrained(tiny_target_dir), None, config.target)
    supervised = sum(map(sum, prepared.train["loss_mask"])) + sum(map(sum, prepared.eval["loss_mask"]))
    assert supervised == sum(map(sum, (r["loss_mask"] for r in ROWS)))
    assert sorted([*prepared.train["input_ids"], *prepared.eval["input_ids"]]) == sorted(r["input_ids"] for r in ROWS)
    by_id = {r["id"]: r for r in ROWS}
    held = prepared.held_out_conversations
    assert len(held) == 6 and all(e["prompt_ids"] == last_turn_prompt(by_id[e["id"]]) for e in held)
    assert eval_conversations("auto", out / "export") == held
