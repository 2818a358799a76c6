"""Whole conversations regenerated turn by turn as exact token rows (`dflash.data.conversations`): the row is the
template's opening, each reply's own ids and the template's glue; every prompt the target gets is the row so far;
a prompt the engine ran differently is a named error; rows that end early are counted; a rerun resumes."""

from __future__ import annotations

import json

import pytest
from test_tokenization import supervised_pieces
from test_tool_calls import TOOL_CHAT, TOOLS, tool_tokenizer  # noqa: F401 (a fixture)

from dflash.data.conversations import regenerate_conversations
from dflash.engines import ReplayMismatch, Reply

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "(human reply)"}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "(human reply)"}]


class ScriptedTarget:
    """A `Replier` that answers turn k of every prompt with `replies[k]` (text ending in its stop token), reports the
    prompt it ran (`prompt_edit` may change it: a server that tokenizes on its own), and records what it was sent."""

    def __init__(self, tokenizer, replies: list[str], *, finished: bool = True, prompt_edit=None) -> None:
        self.tokenizer, self.replies, self.finished, self.prompt_edit = tokenizer, replies, finished, prompt_edit
        self.sent: list[list[int]] = []

    def reply(self, prompts, max_new_tokens):
        out = []
        for prompt in prompts:
            turn = sum(p == prompt[:len(p)] for p in self.sent)  # earlier prompts of this conversation are its prefixes
            self.sent.append(list(prompt))
            ids = self.tokenizer(self.replies[turn], add_special_tokens=False)["input_ids"]
            ran = self.prompt_edit(list(prompt)) if self.prompt_edit else list(prompt)
            out.append(Reply(self.tokenizer.decode(ids[:-1]), self.finished, tuple(ids), tuple(ran)))
        return out

    def close(self) -> None:
        pass


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_conversation_becomes_one_exact_token_row(tokenizer, tmp_path):
    replies = ["Hello there!<|im_end|>", "Blue.<|im_end|>"]
    target = ScriptedTarget(tokenizer, replies)
    result = regenerate_conversations([{"id": "c0", "messages": CHAT}], target, tokenizer, tmp_path / "c.jsonl",
                                      target_name="t")
    (row,) = _rows(tmp_path / "c.jsonl")
    assert result.written == 1 and row["turns"] == 2 and not row["truncated"] and row["source_id"] == "c0"
    # The row is the conversation as the template renders it with the target's replies, token for token ...
    answered = [*CHAT[:2], {"role": "assistant", "content": "Hello there!"}, CHAT[3],
                {"role": "assistant", "content": "Blue."}]
    assert row["input_ids"] == tokenizer.apply_chat_template(answered, return_dict=True)["input_ids"][:len(row["input_ids"])]
    assert supervised_pieces(row, tokenizer) == replies  # ... every reply supervised through its stop token, nothing else
    # ... and each turn's prompt was exactly the row before that turn's reply
    starts = [i for i in range(1, len(row["loss_mask"])) if row["loss_mask"][i] and not row["loss_mask"][i - 1]]
    assert [len(p) for p in target.sent] == starts and all(p == row["input_ids"][:len(p)] for p in target.sent)


def test_tool_results_are_kept_and_the_calls_regenerated(tool_tokenizer, tmp_path):  # noqa: F811
    calls = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
             "Paris is mild.<|im_end|>", "Looking.<|im_end|>", "Cold.<|im_end|>"]
    target = ScriptedTarget(tool_tokenizer, calls)
    regenerate_conversations([{"id": "t", "messages": TOOL_CHAT, "tools": TOOLS}], target, tool_tokenizer,
                             tmp_path / "t.jsonl", target_name="t")
    (row,) = _rows(tmp_path / "t.jsonl")
    assert row["turns"] == 4 and supervised_pieces(row, tool_tokenizer) == calls
    text = tool_tokenizer.decode(row["input_ids"])
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text and "# Tools" in text  # recorded, unsupervised
    unsupervised = tool_tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if not m])
    assert '{"temp": 25}' in unsupervised and "Paris is mild" not in unsupervised


def test_a_prompt_the_engine_ran_differently_is_a_named_error(tokenizer, tmp_path):
    bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    target = ScriptedTarget(tokenizer, ["Hi.<|im_end|>", "Red.<|im_end|>"], prompt_edit=lambda ids: [bos, *ids])
    with pytest.raises(ReplayMismatch, match=r"conversation c0, assistant turn 1.*position 0"):
        regenerate_conversations([{"id": "c0", "messages": CHAT}], target, tokenizer, tmp_path / "c.jsonl",
                                 target_name="t")


def test_rows_that_end_early_are_counted_and_a_rerun_resumes(tokenizer, tmp_path):
    path = tmp_path / "c.jsonl"
    cut = ScriptedTarget(tokenizer, ["Hello there and more<|im_end|>"], finished=False)  # hit max_new_tokens
    other_end = ScriptedTarget(tokenizer, ["Hi.<|endoftext|>"])  # a stop token the template does not close turns with
    second = [{"id": "c1", "messages": [*CHAT[:4], {"role": "assistant", "content": "x"}, CHAT[1],
                                         {"role": "assistant", "content": "y"}]}]
    first = regenerate_conversations([{"id": "c0", "messages": CHAT}], cut, tokenizer, path, target_name="t")
    assert first.written == 1 and first.skipped == {"reply hit max_new_tokens": 1}
    ended = regenerate_conversations(second, other_end, tokenizer, path, target_name="t")
    assert ended.skipped == {"reply ended with a token the chat template does not end a turn with": 1}
    rows = _rows(path)
    assert [(r["turns"], r["truncated"]) for r in rows] == [(1, True), (1, False)]
    again = regenerate_conversations([{"id": "c0", "messages": CHAT}, *second], cut, tokenizer, path, target_name="t")
    assert again.written == 0 and again.reused == 2 and len(_rows(path)) == 2


def _scripted_generate(model, tokenizer, prompts, max_new_tokens):
    """`regenerate._generate` replaced: reply k of a prompt names the prompt's length, then <|im_end|>."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for ids in prompts:
        text = f"Reply to {len(ids)} tokens."
        out.append(Reply(text, True, (*tokenizer(text, add_special_tokens=False)["input_ids"], end), tuple(ids)))
    return out


def test_dflash_train_regenerates_whole_conversations(tiny_target_dir, tmp_path, monkeypatch):
    """`data.regenerate_turns=all` through `dflash train`: both parts regenerated whole into token rows, the run
    trains on them and decodes the held-out histories before their last replies."""
    import dflash.data.regenerate as regen
    from dflash.cli.main import main
    from dflash.config import DataSettings
    from dflash.data.corpus import prepare_corpus
    from dflash.target_model.loading import load_target

    source = tmp_path / "chats.jsonl"
    with source.open("w") as f:
        for i in range(12):
            turns = [{"role": r, "content": f"{r} message {k} of chat {i}"} for k in range(3) for r in ("user", "assistant")]
            f.write(json.dumps({"id": f"chat{i}", "messages": turns}) + "\n")
    monkeypatch.setattr(regen, "_generate", _scripted_generate)
    settings = DataSettings(source=str(source), eval_size=2, regenerate_turns="all", max_length=256,
                            cache_dir=str(tmp_path / "cache"))
    model, tokenizer = load_target(str(tiny_target_dir), None)
    corpus = prepare_corpus(settings, tokenizer, model, str(tiny_target_dir))
    rows = {r["id"]: r for r in map(json.loads, open(corpus.description["files"]["eval"]).read().splitlines())}
    assert len(rows) == 2 and all(r["turns"] == 3 for r in rows.values())
    for entry in corpus.held_out_conversations:  # the history before the last reply, the target's own replies in it
        row = rows[entry["id"]]
        last = max(i for i in range(1, len(row["loss_mask"])) if row["loss_mask"][i] and not row["loss_mask"][i - 1])
        assert entry["prompt_ids"] == row["input_ids"][:last]
        assert tokenizer.decode(entry["prompt_ids"]).count("Reply to") == 2
    assert len(corpus.train) == 10 and sum(map(sum, corpus.train["loss_mask"])) > 0

    run = tmp_path / "run"
    assert main(["train", f"target={tiny_target_dir}", f"data.source={source}", "data.eval_size=2",
                 "data.regenerate_turns=all", "data.max_length=256", f"data.cache_dir={tmp_path / 'cache'}", "device=cpu",
                 "draft.mask_token_id=16", "draft.num_layers=1", "draft.block_size=4", "draft.num_anchors=8",
                 "batch_size=2", "max_steps=2", "spec_eval_prompts=2", "spec_eval_max_new_tokens=8",
                 "progress_bar=false", f"output_dir={run}"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["speculative"]["num_prompts"] == 2 and summary["speculative"]["lossless"]


def test_single_turn_regeneration_checks_the_prompt_the_engine_ran(tokenizer, tmp_path):
    """`check_replay` guards the text rows too: an engine that ran another prompt is named, and one that does not
    report its prompt (a server without `return_token_ids`) is not checked."""
    from dflash.data.regenerate import regenerate

    chats = [{"id": "a", "messages": CHAT[:3]}]
    shifted = ScriptedTarget(tokenizer, ["Hi.<|im_end|>"], prompt_edit=lambda ids: ids[1:])  # dropped the first token
    with pytest.raises(ReplayMismatch, match="exact replay failed for a: the engine ran a prompt of"):
        regenerate(chats, shifted, tokenizer, tmp_path / "r.jsonl", target_name="t", progress=False)

    class TextOnly(ScriptedTarget):
        def reply(self, prompts, max_new_tokens):
            return [Reply(r.text, r.finished) for r in super().reply(prompts, max_new_tokens)]

    result = regenerate(chats, TextOnly(tokenizer, ["Hi.<|im_end|>"]), tokenizer, tmp_path / "r.jsonl", target_name="t",
                        progress=False)
    assert result.written == 1
    with pytest.raises(ValueError, match="returned text only"):
        regenerate_conversations(chats, TextOnly(tokenizer, ["Hi.<|im_end|>"]), tokenizer, tmp_path / "c.jsonl",
                                 target_name="t")
