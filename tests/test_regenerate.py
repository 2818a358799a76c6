"""Regeneration: the target's own greedy replies, batched, cached and resumable."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from filelock import FileLock
from helpers import make_chat_target
from transformers import LlamaForCausalLM

import dflash.data.corpus as corpus
import dflash.data.regenerate as regen
from dflash.config import DataSettings, TrainConfig
from dflash.data.regenerate import prompt_id, prompt_turns, regenerate, stop_token_ids
from dflash.data.sources import load_conversations
from dflash.data.tokenization import tokenize_conversation
from dflash.embedded import cache_root, load_embedded_target
from dflash.engines import Reply
from dflash.target_model.loading import weights_fingerprint

CONVERSATIONS = [
    {
        "id": "a",
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "human reply"}],
    },
    {
        "id": "b",
        "messages": [{"role": "user", "content": "Tell me a long story about dragons and their gold"}],
    },
    {
        "id": "c",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    },
    {"id": "d", "messages": [{"role": "user", "content": "Hi"}]},  # same prompt as "a"
    {"id": "e", "messages": [{"role": "assistant", "content": "no user turn"}]},
    {"id": "f", "messages": [{"role": "user", "content": "Why is the sky blue?"}]},
    {"id": "g", "messages": [{"role": "user", "content": "Name a fruit."}]},
]
ANSWERABLE = 5  # a, b, c, f, g


@pytest.fixture(scope="module")
def chat_target(tokenizer):
    """A random 2-layer Llama over SmolLM2's vocabulary (its eos / pad is <|im_end|>)."""
    return make_chat_target(tokenizer)


class CountingGenerate:
    """Wraps ``model.generate``: counts calls, optionally raises on call number ``fail_at``."""

    def __init__(self, model, fail_at: int | None = None) -> None:
        self.model, self.inner, self.fail_at, self.calls = model, model.generate, fail_at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyboardInterrupt("interrupted")
        return self.inner(*args, **kwargs)


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def greedy_ids(model, tokenizer, messages, max_new_tokens: int) -> list[int]:
    """The reference: one unbatched, unpadded greedy generate; its ids up to and with <|im_end|>."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    out = model.generate(
        **ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    reply = out[0, ids["input_ids"].shape[1] :].tolist()
    eos = tokenizer.eos_token_id
    return reply[: reply.index(eos) + 1] if eos in reply else reply


def greedy_reply(model, tokenizer, messages, max_new_tokens: int) -> str:
    reply = greedy_ids(model, tokenizer, messages, max_new_tokens)
    return tokenizer.decode(reply[:-1] if reply[-1:] == [tokenizer.eos_token_id] else reply)


def test_replies_are_the_targets_own_greedy_output(tmp_path, chat_target, tokenizer):
    out = tmp_path / "regen.jsonl"
    result = regenerate(CONVERSATIONS, chat_target, tokenizer, out, batch_size=2, max_new_tokens=6)
    assert (result.written, result.reused) == (ANSWERABLE, 0)
    assert result.skipped == {"duplicate prompt": 1, "no user turn": 1}
    rows = read_rows(out)
    assert sorted(r["source_id"] for r in rows) == ["a", "b", "c", "f", "g"]  # written in prompt-length order
    for row in rows:
        *prompt, reply = row["messages"]
        assert reply["role"] == "assistant" and prompt[-1]["role"] == "user"
        assert reply["content"] == greedy_reply(chat_target, tokenizer, prompt, 6)
        assert row["prompt_id"] == prompt_id(prompt) and row["target"] == "LlamaForCausalLM"
        assert row["truncated"]  # a random model never says <|im_end|> within 6 tokens
    by_id = {r["source_id"]: r for r in rows}
    assert by_id["c"]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert "human reply" not in out.read_text()
    loaded, report = load_conversations(out)
    assert [r["messages"] for r in loaded] == [r["messages"] for r in rows] and report.skipped == {}


def test_rerun_reuses_the_file_without_generating(tmp_path, chat_target, tokenizer, monkeypatch):
    out = tmp_path / "regen.jsonl"
    regenerate(CONVERSATIONS, chat_target, tokenizer, out, batch_size=4, max_new_tokens=4)
    before = out.read_text()
    counter = CountingGenerate(chat_target)
    monkeypatch.setattr(chat_target, "generate", counter)
    result = regenerate(CONVERSATIONS, chat_target, tokenizer, out, batch_size=4, max_new_tokens=4)
    # Every prompt is found in the file, the duplicate "d" too.
    assert counter.calls == 0 and (result.written, result.reused) == (0, ANSWERABLE + 1)
    assert out.read_text() == before


def test_interrupted_run_resumes_without_duplicates(tmp_path, chat_target, tokenizer, monkeypatch):
    clean = tmp_path / "clean.jsonl"
    regenerate(CONVERSATIONS, chat_target, tokenizer, clean, batch_size=2, max_new_tokens=4)

    out = tmp_path / "regen.jsonl"
    monkeypatch.setattr(chat_target, "generate", CountingGenerate(chat_target, fail_at=2))
    with pytest.raises(KeyboardInterrupt):
        regenerate(CONVERSATIONS, chat_target, tokenizer, out, batch_size=2, max_new_tokens=4)
    assert len(read_rows(out)) == 2  # the first batch was flushed
    with open(out, "a") as f:
        f.write('{"messages": [{"role": "user", "con')  # killed in the middle of a write
    monkeypatch.undo()

    result = regenerate(CONVERSATIONS, chat_target, tokenizer, out, batch_size=2, max_new_tokens=4)
    assert (result.written, result.reused) == (ANSWERABLE - 2, 3)  # a, b and d (same prompt as a)
    rows = read_rows(out)
    assert len({r["prompt_id"] for r in rows}) == len(rows) == ANSWERABLE
    assert rows == read_rows(clean)


def test_a_second_process_waits_for_the_first_and_reuses_its_rows(tmp_path, chat_target, tokenizer, caplog):
    """Two runs sharing a cache regenerate the same file one after the other: the second, started while the
    first holds the file's lock, asks nothing and appends nothing (unlocked, both appended every row)."""
    first = tmp_path / "first.jsonl"
    regenerate(CONVERSATIONS, chat_target, tokenizer, first, batch_size=2, max_new_tokens=4)
    out = tmp_path / "regen.jsonl"
    results = []
    with FileLock(f"{out}.lock"):  # the first run, mid-regeneration
        second = threading.Thread(target=lambda: results.append(
            regenerate(CONVERSATIONS, chat_target, tokenizer, out, batch_size=2, max_new_tokens=4)))
        with caplog.at_level(logging.INFO, logger="dflash.data.regenerate"):
            second.start()
            time.sleep(0.5)
            out.write_bytes(first.read_bytes())  # the first run's rows land
    second.join(timeout=60)
    assert (results[0].written, results[0].reused) == (0, ANSWERABLE + 1)
    assert out.read_bytes() == first.read_bytes()
    assert "another process is writing it" in caplog.text


def test_limit_then_complete(tmp_path, chat_target, tokenizer):
    out = tmp_path / "regen.jsonl"
    assert regenerate(CONVERSATIONS, chat_target, tokenizer, out, max_new_tokens=3, limit=2).written == 2
    result = regenerate(CONVERSATIONS, chat_target, tokenizer, out, max_new_tokens=3)
    assert (result.written, result.reused) == (ANSWERABLE - 2, 3)


def test_truncated_reply_ends_a_multi_turn_conversation(tmp_path, chat_target, tokenizer):
    chat = {
        "messages": [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "human"},
            {"role": "user", "content": "And then?"},
            {"role": "assistant", "content": "human"},
            {"role": "user", "content": "Third"},
        ]
    }
    assert [m["content"] for m in prompt_turns(chat["messages"], turns=2)] == ["Hello", "And then?"]
    out = tmp_path / "regen.jsonl"
    regenerate([chat], chat_target, tokenizer, out, max_new_tokens=5, turns=None)
    (row,) = read_rows(out)
    # The random model never ends its reply: later turns would answer a cut-off text, so stop.
    assert len(row["messages"]) == 2 and row["truncated"]
    assert row["messages"][1]["content"] == greedy_reply(chat_target, tokenizer, row["messages"][:1], 5)


def test_target_mismatch_and_long_prompts(tmp_path, chat_target, tokenizer):
    out = tmp_path / "regen.jsonl"
    regenerate(CONVERSATIONS[:1], chat_target, tokenizer, out, max_new_tokens=2, target_name="one")
    with pytest.raises(ValueError, match="generated by 'one', not 'two'"):
        regenerate(CONVERSATIONS[:1], chat_target, tokenizer, out, max_new_tokens=2, target_name="two")
    result = regenerate(CONVERSATIONS, chat_target, tokenizer, tmp_path / "short.jsonl", max_prompt_tokens=10)
    assert result.written == 0 and result.skipped["prompt longer than max_prompt_tokens"] == ANSWERABLE


def test_a_rerun_counts_a_too_long_prompt_without_asking_it(tmp_path, chat_target, tokenizer, caplog):
    """The prompts left out as too long are counted before any batch: a rerun over a complete file has
    nothing to ask (the GPU preset's runs each logged "21 to ask" and "regenerated 21/21" for none written)."""
    long = {"id": "long", "messages": [{"role": "user", "content": "word " * 60}]}
    out = tmp_path / "regen.jsonl"
    first = regenerate([*CONVERSATIONS, long], chat_target, tokenizer, out, max_new_tokens=2, max_prompt_tokens=40)
    assert first.written == ANSWERABLE and first.skipped["prompt longer than max_prompt_tokens"] == 1
    with caplog.at_level(logging.DEBUG, logger="dflash.data.regenerate"):
        again = regenerate([*CONVERSATIONS, long], chat_target, tokenizer, out, max_new_tokens=2, max_prompt_tokens=40)
    assert again.written == 0 and again.skipped["prompt longer than max_prompt_tokens"] == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.endswith(f"{ANSWERABLE + 1} prompts already answered (cached), 0 to ask") for m in messages), messages
    assert not any("regenerated" in m for m in messages)


def test_a_batch_out_of_memory_is_answered_in_halves(tmp_path, tokenizer, monkeypatch):
    """A round that runs out of accelerator memory is asked again in halves, down to single prompts;
    rounds already answered are not asked again, and one prompt that does not fit fails loudly."""
    calls: list[int] = []

    def generate(model, tokenizer, prompts, max_new_tokens):  # round 1 of the whole batch fits, no later one
        calls.append(len(prompts))
        if len(calls) > 1 and len(prompts) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (planted)")
        return [Reply(f"reply to {len(ids)} tokens", True) for ids in prompts]

    monkeypatch.setattr(regen, "_generate", generate)
    chats = [{"id": str(k), "messages": [{"role": "user", "content": f"question {k}"},
                                         {"role": "assistant", "content": "human"},
                                         {"role": "user", "content": "and then?" + "?" * k}]} for k in range(4)]
    out = tmp_path / "regen.jsonl"
    result = regenerate(chats, torch.nn.Module(), tokenizer, out, batch_size=4, turns=2, target_name="t")
    assert calls == [4, 4, 2, 1, 1, 2, 1, 1]  # round 1 once; round 2: 4 -> 2 + 2 -> 1 + 1 + 1 + 1
    assert (result.written, result.batches_split) == (4, 3)
    for row in read_rows(out):
        assert [m["role"] for m in row["messages"]] == ["user", "assistant", "user", "assistant"]

    calls.clear()
    monkeypatch.setattr(regen, "_generate", lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError("planted")))
    with pytest.raises(torch.OutOfMemoryError):
        regenerate(chats[:1], torch.nn.Module(), tokenizer, tmp_path / "one.jsonl", batch_size=4, target_name="t")


@pytest.mark.slow
def test_real_target_stops_at_end_of_turn_and_answers_turns_in_sequence(tmp_path, tokenizer):
    model, _ = load_embedded_target()
    two_turns = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "a human reply the target never wrote"},
            {"role": "user", "content": "What is the capital of France?"},
        ]
    }
    one_turn = {"messages": [{"role": "user", "content": "What is 2+2?"}]}
    out = tmp_path / "regen.jsonl"
    # Prompts with short greedy replies: CPU generation of the 135M model is slow.
    regenerate([two_turns, one_turn], model, tokenizer, out, batch_size=2, max_new_tokens=32, turns=2)
    first, second = read_rows(out)
    assert [m["role"] for m in first["messages"]] == ["user", "assistant", "user", "assistant"]
    assert len(second["messages"]) == 2
    for row in (first, second):
        assert not row["truncated"]
        for k, message in enumerate(row["messages"]):
            if message["role"] == "assistant":  # each reply is greedy given the regenerated context
                expected = greedy_ids(model, tokenizer, row["messages"][:k], 32)
                assert expected[-1] == tokenizer.eos_token_id
                assert message["content"] == tokenizer.decode(expected[:-1])
                # Training re-tokenizes the reply: the supervised tokens are exactly what the
                # target generated, end-of-turn included.
                tokens = tokenize_conversation(row["messages"][: k + 1], tokenizer, 1024)
                supervised = [t for t, m in zip(tokens["input_ids"], tokens["loss_mask"], strict=True) if m]
                assert supervised[-len(expected) :] == expected


def test_regenerated_file_is_keyed_by_source_target_and_settings(tmp_path, monkeypatch):
    """The file a run regenerates into (`corpus._regenerated_file`, the one path rule): under the cache
    root's `regenerated/`, named by the target, and another for another source, target or setting."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    settings = DataSettings(source="chitchat", regenerate_turns=1, regenerate_max_new_tokens=256)

    def path_of(settings: DataSettings, target: str = "org/smollm2", part: str = "train") -> Path:
        return corpus._regenerated_file(settings, cache_root(), target, part, weights_fingerprint(target))

    path = path_of(settings)
    assert path.parent == tmp_path / "regenerated" and path.name.startswith("org_smollm2-")
    assert path == path_of(DataSettings(regenerate_max_new_tokens=256, regenerate_turns=1, source="chitchat"))
    assert path != path_of(replace(settings, regenerate_turns=2))
    assert path != path_of(settings, target="other")
    assert path != path_of(replace(settings, source="other.jsonl"))
    assert path != path_of(replace(settings, regenerate_max_new_tokens=128))
    assert path != path_of(settings, part="eval")
    assert path_of(settings, target="x" * 100).name.startswith("x" * 60 + "-")  # the end of a long name kept


def test_stop_token_ids_are_the_eos_ids_of_the_config_and_tokenizer(chat_target, tokenizer):
    assert stop_token_ids(chat_target, tokenizer) == [tokenizer.eos_token_id]
    config = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[5, 3]))
    assert stop_token_ids(config, SimpleNamespace(eos_token_id=3)) == [3, 5]
    assert stop_token_ids(torch.nn.Module(), SimpleNamespace(eos_token_id=7)) == [7]  # no generation config
    with pytest.raises(ValueError, match="defines an eos token"):
        stop_token_ids(torch.nn.Module(), SimpleNamespace(eos_token_id=None))


def test_regenerate_turns_applies_to_training_rows_only(tmp_path, monkeypatch):
    """`data.regenerate_turns` reaches regenerate() for the training split; held-out rows keep one turn
    (their first user turns are the speculative-evaluation prompts). Single-turn files keep their names.
    The turns already answered come from the existing file of the same settings with the most turns
    below the run's own."""
    calls = {}

    def fake_regenerate(rows, model, tokenizer, out_path, **kwargs):
        earlier = kwargs["earlier"]
        calls[Path(out_path).name] = (kwargs["turns"], earlier and Path(earlier).name)
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).touch()  # regenerate() always leaves its file
        return SimpleNamespace(path=Path(out_path))

    def stop(*args, **kwargs):  # the plumbing up to here is what this test reads
        raise RuntimeError("stop before tokenizing")

    source = tmp_path / "convs.jsonl"
    chats = [{"id": str(i), "messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": "A"},
                                         {"role": "user", "content": "more?"}, {"role": "assistant", "content": "B"}]}
             for i in range(4)]
    source.write_text("\n".join(json.dumps(c) for c in chats))
    settings = DataSettings(source=str(source), eval_size=1, regenerate_turns=3, cache_dir=str(tmp_path))
    monkeypatch.setattr(corpus, "regenerate", fake_regenerate)
    monkeypatch.setattr(corpus, "build_dataset", stop)

    def file(turns: int, part: str = "train") -> Path:
        return corpus._regenerated_file(replace(settings, regenerate_turns=turns), tmp_path, "t", part,
                                        weights_fingerprint("t"))

    def run() -> dict:
        calls.clear()
        with pytest.raises(RuntimeError, match="stop before tokenizing"):
            corpus.prepare_corpus(settings, tokenizer=None, target_model=None, target_name="t")
        return dict(calls)

    train, held_out = file(3).name, file(3, "eval").name
    assert train.endswith("-256-3turns-train.jsonl")
    assert held_out.endswith("-256-eval.jsonl")  # one turn: the name every earlier cache used
    assert file(1).name.endswith("-256-train.jsonl")
    assert run() == {train: (3, None), held_out: (1, None)}  # nothing to take turns from yet
    file(1).parent.mkdir(parents=True, exist_ok=True)
    file(1).write_text("")
    assert run() == {train: (3, file(1).name), held_out: (1, None)}
    file(2).write_text("")
    assert run() == {train: (3, file(2).name), held_out: (1, None)}  # the most turns below 3


def test_regenerate_turns_must_be_positive():
    cfg = TrainConfig()
    cfg.set("data.regenerate_turns", 0)
    with pytest.raises(ValueError, match="data.regenerate_turns must be >= 1"):
        cfg.validate()


def test_earlier_turns_stand_in_for_generated_ones(tmp_path, chat_target, tokenizer):
    """A multi-turn run takes the longest prefix of each conversation's turns answered in a file with fewer
    turns of the same target and generates only the later turns; a truncated reply taken over ends its
    conversation; a conversation the earlier file does not know starts from scratch."""
    def chat(cid, *users):
        return {"id": cid, "messages": [m for u in users for m in ({"role": "user", "content": u},
                                                                    {"role": "assistant", "content": "human"})]}

    def row(cid, turns, truncated=False):
        users = [{"role": "user", "content": u} for u, _ in turns]
        messages = [m for u, a in turns for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})]
        return json.dumps({"messages": messages, "prompt_id": prompt_id(users), "target": "tiny", "source_id": cid,
                           "truncated": truncated}) + "\n"

    conversations = [chat("x", "Hello", "And then?", "Why?"), chat("y", "Tell me", "More", "Again"),
                     chat("w", "Short"), chat("z", "Fresh", "Again", "Still")]
    two = tmp_path / "two.jsonl"
    two.write_text(row("x", [("Hello", "A finished reply."), ("And then?", "Because.")])
                   + row("y", [("Tell me", "A cut-off rep")], truncated=True)  # y ended at its first turn
                   + row("w", [("Short", "Whole.")]))
    counting = CountingGenerate(chat_target)
    chat_target.generate = counting
    try:
        result = regenerate(conversations, chat_target, tokenizer, tmp_path / "three.jsonl", max_new_tokens=4,
                            turns=3, target_name="tiny", earlier=two)
    finally:
        del chat_target.generate
    assert result.turns_reused == 4 and result.written == 4
    assert counting.calls == 1  # one batch: x's third turn and z's first (z's reply is cut off there)
    by_id = {row["source_id"]: row for row in read_rows(tmp_path / "three.jsonl")}
    x = [m["content"] for m in by_id["x"]["messages"]]
    assert x[:5] == ["Hello", "A finished reply.", "And then?", "Because.", "Why?"] and len(x) == 6
    assert x[5] == greedy_reply(chat_target, tokenizer, by_id["x"]["messages"][:5], 4)
    assert [m["content"] for m in by_id["y"]["messages"]] == ["Tell me", "A cut-off rep"] and by_id["y"]["truncated"]
    assert [m["content"] for m in by_id["w"]["messages"]] == ["Short", "Whole."]  # the whole row taken over
    assert by_id["z"]["messages"][0]["content"] == "Fresh" and len(by_id["z"]["messages"]) == 2
    with pytest.raises(ValueError, match="not 'other'"):
        regenerate(conversations, chat_target, tokenizer, tmp_path / "other.jsonl", max_new_tokens=4, turns=3,
                   target_name="other", earlier=two)


def test_an_earlier_row_with_more_replies_than_turns_is_cut_to_its_turns(tmp_path, chat_target, tokenizer):
    """A row of a foreign or edited earlier file may carry more replies than its prompt has user turns:
    only as many as the matched turns are taken."""
    user = [{"role": "user", "content": "Only"}]
    row = {"messages": [*user, {"role": "assistant", "content": "One."}, {"role": "user", "content": "x"},
                        {"role": "assistant", "content": "Two."}],
           "prompt_id": prompt_id(user), "target": "tiny", "source_id": "a", "truncated": False}
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text(json.dumps(row) + "\n")
    result = regenerate([{"id": "a", "messages": user}], chat_target, tokenizer, tmp_path / "out.jsonl",
                        max_new_tokens=4, turns=2, target_name="tiny", earlier=earlier)
    assert result.turns_reused == 1 and result.written == 1
    assert [m["content"] for m in read_rows(tmp_path / "out.jsonl")[0]["messages"]] == ["Only", "One."]


def test_other_weights_behind_the_same_target_name_never_reuse_its_replies(tmp_path, capsys):
    """A retrained target saved to the same folder reused the old replies ("0 new rows, N reused") and the
    dry run called them cached: the draft trained on another model's text. The cache is keyed by the
    weights' fingerprint, in `dflash generate`, `dflash train` and the dry run alike."""
    from helpers import chat_file, save_tiny_target

    from dflash.cli.main import main

    target = tmp_path / "tiny-llama"
    save_tiny_target(target)
    args = [f"target={target}", f"data.source={chat_file(tmp_path / 'chats.jsonl')}", "device=cpu", "data.eval_size=4",
            "data.limit=12", "data.regenerate_max_new_tokens=4", f"data.cache_dir={tmp_path / 'cache'}",
            "draft.mask_token_id=16", "draft.block_size=4", "data.max_length=64"]

    def generate() -> str:
        assert main(["generate", *args]) == 0
        return capsys.readouterr().out.strip().splitlines()[-1]

    def dry_run_cached() -> str:
        assert main(["train", *args, "--dry-run"]) == 0
        return next(line for line in capsys.readouterr().out.splitlines() if "training prompts" in line)

    assert "(0 cached)" in dry_run_cached() and "8 new replies, 0 reused" in generate()
    assert "(8 cached)" in dry_run_cached() and "0 new replies, 8 reused" in generate()
    before = weights_fingerprint(str(target))
    model = LlamaForCausalLM.from_pretrained(target)
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.add_(0.01)  # a retrain: the same names, shapes and sizes
    model.save_pretrained(target)
    assert weights_fingerprint(str(target)) != before
    assert "8 training prompts (0 cached)" in dry_run_cached() and "8 new replies, 0 reused" in generate()
    assert weights_fingerprint("no-org/not-downloaded") == "unknown"
