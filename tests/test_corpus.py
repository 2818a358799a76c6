"""The held-out split: no training conversation opens with a held-out (speculative-evaluation) prompt."""

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

import dflash.data.corpus as corpus
from dflash.config import DataSettings, TrainConfig
from dflash.data.corpus import first_prompt_id, split_held_out
from dflash.target_model.loading import weights_fingerprint


def conv(cid: str, *users: str) -> dict:
    return {"id": cid, "messages": [m for u in users for m in ({"role": "user", "content": u},
                                                               {"role": "assistant", "content": "human"})]}


def conversations(n: int = 40) -> list[dict]:
    """Half open with "hello?" (as chitchat's openers repeat), half with a prompt of their own."""
    return [conv(str(i), "hello?" if i % 2 else f"question {i}", "and then?") for i in range(n)]


def test_no_training_conversation_opens_with_a_held_out_prompt():
    convs = conversations()
    train, held = split_held_out(convs, 6)
    held_prompts = {first_prompt_id(c) for c in held}
    assert len(held) == 6 and first_prompt_id(conv("x", "hello?")) in held_prompts  # the id hashes pick both kinds
    assert not held_prompts & {first_prompt_id(c) for c in train}
    # The held-out side is still the 6 smallest id hashes; only conversations opening with a held-out
    # prompt left the training side (the other "hello?" conversations).
    assert {c["id"] for c in held} == {c["id"] for c in sorted(convs, key=lambda c: corpus._stable_key(c["id"]))[:6]}
    expected = [c for c in convs if c not in held and first_prompt_id(c) not in held_prompts]
    assert train == expected and len(train) < 40 - 6


def test_a_split_with_no_training_conversation_left_is_an_error():
    with pytest.raises(ValueError, match="every training conversation opens with a held-out prompt"):
        split_held_out([conv(str(i), "hello?") for i in range(5)], 1)


def cached_corpus(tmp_path, monkeypatch, copies: int) -> tuple[list[dict], list[dict], dict, dict]:
    """`prepare_corpus` over a regeneration cache written before the corpus split and locked its files: one
    row per distinct first prompt of every conversation (held-out openers included), `copies` times over
    (two runs that regenerated it at once wrote 2). Returns (cached rows, held-out conversations, the rows
    each file held when tokenized, the corpus description)."""
    source = tmp_path / "convs.jsonl"
    convs = conversations()
    source.write_text("\n".join(json.dumps(c) for c in convs))
    settings = DataSettings(source=str(source), eval_size=6, cache_dir=str(tmp_path))
    _, held = split_held_out(convs, 6)
    cached = list({first_prompt_id(c): c for c in convs}.values())  # regenerate asks a prompt once

    def row(c) -> str:
        users = [m for m in c["messages"] if m["role"] == "user"][:1]
        return json.dumps({"messages": [*users, {"role": "assistant", "content": "greedy"}],
                           "prompt_id": first_prompt_id(c), "target": "t", "source_id": c["id"],
                           "truncated": False}) + "\n"

    def fake_regenerate(rows, model, tokenizer, out_path, **kwargs):
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        if not Path(out_path).exists():
            Path(out_path).write_text("".join(row(c) for c in cached) * copies)
        return SimpleNamespace(path=Path(out_path))

    read = {}

    def fake_build(path, tokenizer, max_length, **kwargs):
        read[Path(path).name] = [json.loads(line) for line in Path(path).read_text().splitlines()]
        return list(read[Path(path).name])

    monkeypatch.setattr(corpus, "regenerate", fake_regenerate)
    monkeypatch.setattr(corpus, "build_dataset", fake_build)
    result = corpus.prepare_corpus(settings, tokenizer=None, target_model=None, target_name="t")
    files = {part: read[corpus._regenerated_file(settings, tmp_path, "t", part, weights_fingerprint("t")).name]
             for part in ("train", "eval")}
    return cached, held, files, result.description


def test_cached_rows_opening_with_a_held_out_prompt_are_dropped(tmp_path, monkeypatch):
    """A regenerated training file written before the split dropped such conversations still holds their
    rows: the corpus keeps only the rows the run asked for before tokenizing, and counts the others."""
    cached, held, files, description = cached_corpus(tmp_path, monkeypatch, copies=1)
    held_prompts = {first_prompt_id(c) for c in held}
    stale = sum(first_prompt_id(c) in held_prompts for c in cached)
    assert stale >= 2  # "hello?" is held out, and its row was in the cache
    assert not held_prompts & {r["prompt_id"] for r in files["train"]}
    assert len(files["train"]) == len(cached) - stale
    # The fake cache gave the held-out file every prompt's row too: it keeps the held-out prompts only.
    assert {r["prompt_id"] for r in files["eval"]} == held_prompts and len(files["eval"]) == stale
    assert description["cached_rows_not_asked_for"] == {"train": stale, "eval": len(cached) - stale}


def test_a_cache_two_runs_wrote_at_once_keeps_one_row_per_prompt(tmp_path, monkeypatch):
    """Two runs that regenerated the same file at once, before `cache_writer` locked it, appended every row
    twice: the held-out evaluation scored each prompt twice. The corpus keeps the first row of each."""
    cached, held, files, description = cached_corpus(tmp_path, monkeypatch, copies=2)
    held_prompts = {first_prompt_id(c) for c in held}
    for part, rows in files.items():
        ids = [r["prompt_id"] for r in rows]
        assert len(ids) == len(set(ids)), part
    assert {r["prompt_id"] for r in files["eval"]} == held_prompts
    written = 2 * len(cached) * 2  # both files, every row twice
    assert sum(description["cached_rows_not_asked_for"].values()) == written - len(files["train"]) - len(files["eval"])


def test_standalone_turns_ask_each_user_message_on_its_own():
    """`data.standalone_turns` N: the first N user messages of each training conversation become
    single-turn prompts (a leading system turn kept); one equal to a held-out prompt is left out."""
    system = {"role": "system", "content": "Be brief."}
    train = [{"id": "a", "messages": [system, *conv("a", "first", "second", "third")["messages"]]},
             {"id": "b", "messages": conv("b", "other", "hello?")["messages"]}]
    held = [conv("h", "hello?")]
    rows = corpus._training_rows(train, held, DataSettings(standalone_turns=2))
    assert [r["id"] for r in rows] == ["a#0", "a#1", "b#0"]  # b's "hello?" is a held-out prompt
    assert rows[1]["messages"] == [system, {"role": "user", "content": "second"}]
    assert corpus._training_rows(train, held, DataSettings()) is train  # 1: the conversations as they are


def test_standalone_turns_have_their_own_file_and_reuse_the_first_turn_replies(tmp_path, monkeypatch):
    source = tmp_path / "convs.jsonl"
    source.write_text("\n".join(json.dumps(c) for c in conversations()))
    settings = DataSettings(source=str(source), eval_size=6, cache_dir=str(tmp_path), standalone_turns=2)
    single = corpus._regenerated_file(DataSettings(source=str(source), eval_size=6), tmp_path, "t", "train",
                                      weights_fingerprint("t"))
    single.parent.mkdir(parents=True)
    single.write_text("")
    calls = []

    def fake_regenerate(rows, model, tokenizer, out_path, **kwargs):
        calls.append((Path(out_path).name, len(rows), kwargs["turns"], kwargs["earlier"] and Path(kwargs["earlier"]).name))
        Path(out_path).touch()
        return SimpleNamespace(path=Path(out_path))

    def stop(*args, **kwargs):
        raise RuntimeError("stop before tokenizing")

    monkeypatch.setattr(corpus, "regenerate", fake_regenerate)
    monkeypatch.setattr(corpus, "build_dataset", stop)
    with pytest.raises(RuntimeError, match="stop before tokenizing"):
        corpus.prepare_corpus(settings, tokenizer=None, target_model=None, target_name="t")
    train, held = split_held_out(conversations(), 6)
    name, rows, turns, earlier = calls[0]
    assert name.endswith("-256-2standalone-train.jsonl") and turns == 1 and earlier == single.name
    assert rows == len(corpus._training_rows(train, held, settings)) == 2 * len(train)  # "and then?" twice over

    # With a 2-standalone file in the cache, a 3-standalone run takes its replies from there.
    two = corpus._regenerated_file(settings, tmp_path, "t", "train", weights_fingerprint("t"))
    calls.clear()
    with pytest.raises(RuntimeError, match="stop before tokenizing"):
        corpus.prepare_corpus(replace(settings, standalone_turns=3), tokenizer=None, target_model=None, target_name="t")
    assert calls[0][0].endswith("-3standalone-train.jsonl") and calls[0][3] == two.name


def test_standalone_turns_need_single_turn_regeneration():
    cfg = TrainConfig()
    cfg.set("data.standalone_turns", 3)
    cfg.set("data.regenerate_turns", 2)
    with pytest.raises(ValueError, match="data.standalone_turns > 1 .* data.regenerate_turns=1"):
        cfg.validate()
    cfg.set("data.regenerate_turns", 1)
    cfg.validate()


@pytest.mark.parametrize("target", ["./model", "../models/m", "_private", ".hidden"])
def test_cache_files_of_a_relative_target_are_not_hidden_files(tmp_path, target):
    """A target given as `./model` named its regenerated replies `._model-w...jsonl`: a hidden file, and the name
    macOS gives its AppleDouble side files. The readable part of a cache name starts with a letter or digit."""
    path = corpus._regenerated_file(DataSettings(), tmp_path, target, "train", "0123abcd")
    assert path.name[0].isalnum(), path.name
