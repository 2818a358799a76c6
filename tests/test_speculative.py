"""Speculative decoding on tiny targets (CPU): lossless, τ of oracle / always-wrong drafts, cache crop."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import TINY_MASK_ID, TINY_VOCAB, check_speculative_report, make_tiny_target

from dflash.attention import dense_dflash_mask
from dflash.evaluation import speculative as sp
from dflash.evaluation.evaluate import prompt_ids
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel
from dflash.target_model.frozen import FrozenTarget

BS = 4


def _draft(target, bs: int = BS, layers: int = 2, seed: int = 0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    cfg = DFlashDraftConfig.for_target(target.config, mask_token_id=TINY_MASK_ID, num_hidden_layers=layers,
                                       block_size=bs)
    return DFlashDraftModel(cfg).eval()


def _prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 5, 12, 29, 7, 3][:n]
    return [torch.randint(0, TINY_VOCAB - 1, (k,), generator=g).tolist() for k in lengths]


def _oracle(reference: list[int], prompt_len: int, shift: int = 0):
    """A `propose_draft_tokens` stand-in that proposes the target's own greedy continuation (+ shift)."""

    def propose(draft, target_model, context, first_token, start, block_size, mask_token_id):
        i = start - prompt_len + 1  # index in `reference` of the token at position start + 1
        out = (reference + [0] * block_size)[i:i + block_size - 1]
        return (torch.tensor([out]) + shift) % TINY_VOCAB

    return propose


# ---- the KV-cache crop helper ------------------------------------------------------------------


def test_crop_cache_on_installed_transformers(target):
    ids = torch.randint(0, 100, (1, 10))
    _, cache = sp._target_forward(target, ids, None)
    assert cache.get_seq_length() == 10
    sp.crop_cache(cache, 10)  # no-op: must not empty the cache (0 means "keep 0" to the old API)
    assert cache.get_seq_length() == 10
    sp.crop_cache(cache, 6)
    assert cache.get_seq_length() == 6
    # decoding after the crop equals a fresh forward over the kept prefix + new tokens
    nxt = torch.randint(0, 100, (1, 3))
    logits, _ = sp._target_forward(target, nxt, cache)
    fresh, _ = sp._target_forward(target, torch.cat([ids[:, :6], nxt], dim=1), None)
    torch.testing.assert_close(logits, fresh[:, 6:], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="cannot crop"):
        sp.crop_cache(cache, 100)


class _LegacyCache:
    """Older transformers: crop(max_length), absolute; negative removes that many; 0 empties."""

    def __init__(self, n: int) -> None:
        self.n = n

    def get_seq_length(self) -> int:
        return self.n

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.n - abs(max_length)
        self.n = min(self.n, max_length)


class _NewCache(_LegacyCache):
    """transformers 5.24: crop(tokens_to_remove) takes a negative count, raises on > 0 (5.17 warns)."""

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("Calling `crop` with a positive value is not supported")
        self.n -= abs(tokens_to_remove)


@pytest.mark.parametrize("cls", [_LegacyCache, _NewCache])
def test_crop_cache_speaks_both_crop_apis(cls):
    cache = cls(12)
    sp.crop_cache(cache, 12)
    assert cache.get_seq_length() == 12
    sp.crop_cache(cache, 7)
    assert cache.get_seq_length() == 7
    sp.crop_cache(cache, 0)
    assert cache.get_seq_length() == 0


# ---- features and the draft's context cache ------------------------------------------------------


def test_serving_features_equal_training_features(target):
    """The hooks used at serving time give FrozenTarget's features, including the last layer
    (HF's hidden_states[L] is post-norm and would not), also when computed incrementally."""
    layer_ids = [0, 3]
    ids = torch.randint(0, 100, (1, 11))
    train = FrozenTarget(target, layer_ids)(ids)
    with torch.inference_mode(), sp.capture_layer_outputs(target, layer_ids) as cap:
        _, cache = sp._target_forward(target, ids[:, :7], None)
        first = cap.features()
        sp._target_forward(target, ids[:, 7:], cache)
        rest = cap.features()
    torch.testing.assert_close(torch.cat([first, rest], dim=1), train, rtol=1e-4, atol=1e-4)


def test_draft_context_cache_appends_equal_full_projection(target):
    draft = _draft(target)
    feats = torch.randn(1, 13, 2 * 64)
    cache = sp.DraftContextCache(draft, capacity=20)
    with torch.inference_mode():
        for lo, hi in [(0, 5), (5, 6), (6, 13)]:
            cache.append(feats[:, lo:hi])
        full = draft.context_kv(feats, torch.arange(13).unsqueeze(0))
    for (k, v), (fk, fv) in zip(cache.kv(), full, strict=True):
        torch.testing.assert_close(k, fk)
        torch.testing.assert_close(v, fv)
    with pytest.raises(ValueError, match="overflow"):
        cache.append(feats[:, :8])


def test_proposals_equal_the_trainers_block_predictions(trained):
    """Serving proposes exactly what the training forward predicts for the same anchor."""
    draft, frozen = trained.draft.eval(), trained.target
    seq = torch.randint(0, 100, (1, 24))
    with torch.inference_mode():
        feats = frozen(seq)
        for a in (1, 9, 17):
            anchors, keep = torch.tensor([[a]]), torch.tensor([[True]])
            block_ids, pos = trained.objective.block_inputs(seq, anchors)
            hidden = draft(frozen.embed(block_ids), pos, dense_dflash_mask(anchors, keep, 24, BS), target_hidden=feats)
            expected = (hidden[:, 1:] @ frozen.lm_head_weight.t()).argmax(-1)
            context = sp.DraftContextCache(draft, capacity=32)
            context.append(feats[:, :a])
            got = sp.propose_draft_tokens(draft, frozen.model, context, seq[:, a:a + 1], a, BS, TINY_MASK_ID)
            assert torch.equal(got, expected), a


# ---- lossless ----------------------------------------------------------------------------------


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 14, 23])
@pytest.mark.parametrize("block_size", [None, 2, 6])
def test_random_draft_is_lossless(target, max_new_tokens, block_size):
    draft = _draft(target)
    for prompt in _prompts(3):
        base = sp.target_generate(target, prompt, max_new_tokens)
        spec = sp.speculative_generate(target, draft, prompt, max_new_tokens=max_new_tokens, block_size=block_size)
        assert spec.output_ids == base.output_ids
        assert len(spec.output_ids) == max_new_tokens
        assert sum(spec.acceptance_lengths) == max_new_tokens - 1  # the prefill made the first token


@pytest.mark.parametrize("max_new_tokens", [3, 21, 40])
def test_trained_draft_is_lossless_and_accepts(target, trained, max_new_tokens):
    prompts = _prompts(5, seed=7)
    report = sp.evaluate_speculative(target, trained.draft, prompts, max_new_tokens=max_new_tokens)
    assert report["num_prompts"] == 5 and report["new_tokens"] == 5 * max_new_tokens
    if max_new_tokens >= 10:
        assert report["tau"] > 1.0, report  # it learned something, so accepted paths are exercised


def test_stop_token_ends_both_the_same_way(target):
    draft = _draft(target)
    for prompt in _prompts():
        full = sp.target_generate(target, prompt, 30).output_ids
        stop = full[6]  # a token the target does emit; generation ends at its first occurrence
        end = full.index(stop) + 1
        base = sp.target_generate(target, prompt, 30, [stop])
        spec = sp.speculative_generate(target, draft, prompt, max_new_tokens=30, stop_token_ids=[stop])
        assert base.output_ids == full[:end] == spec.output_ids
    # a stop token that the prefill itself produces: one token, no decode forward
    prompt = _prompts(1)[0]
    first = sp.target_generate(target, prompt, 1).output_ids[0]
    spec = sp.speculative_generate(target, draft, prompt, max_new_tokens=30, stop_token_ids=[first])
    assert spec.output_ids == [first] and spec.num_target_forwards == 0


def test_frozen_target_and_bf16_are_accepted(target):
    draft = _draft(target)
    prompt = _prompts(3)[2]
    ref = sp.target_generate(target, prompt, 12).output_ids
    assert sp.speculative_generate(FrozenTarget(target, draft.config.target_layer_ids), draft, prompt,
                                   max_new_tokens=12).output_ids == ref
    t16, d16 = make_tiny_target().to(torch.bfloat16), _draft(target).to(torch.bfloat16)
    ref16 = sp.target_generate(t16, prompt, 12).output_ids
    assert sp.speculative_generate(t16, d16, prompt, max_new_tokens=12).output_ids == ref16


def test_lossless_error_names_prompt_and_position(target, monkeypatch):
    draft = _draft(target)
    real = sp.speculative_generate

    def corrupt(*args, **kwargs):
        result = real(*args, **kwargs)
        if args[2] == prompts[1]:
            result.output_ids[3] = (result.output_ids[3] + 1) % TINY_VOCAB
        return result

    prompts = _prompts(3)
    monkeypatch.setattr(sp, "speculative_generate", corrupt)
    with pytest.raises(sp.LosslessError, match="prompt 1: first difference at new token 3") as info:
        sp.evaluate_speculative(target, draft, prompts, max_new_tokens=8, warmup=False)
    assert (info.value.prompt_index, info.value.position) == (1, 3)
    with pytest.raises(sp.LosslessError, match="new token 2"):
        sp.check_lossless(0, [1, 2, 3], [1, 2])


def test_a_first_difference_at_a_rounding_tie_is_listed_not_raised(target, monkeypatch):
    """A bf16 block verification may pick the other of two equal logits: `near_tie` tells that apart
    from a draft error, and evaluation lists it instead of failing."""
    prompt = _prompts(2)[1]
    ref = sp.target_generate(target, prompt, 8).output_ids
    with torch.inference_mode():
        logits = target(input_ids=torch.tensor([prompt + ref[:3]])).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    assert not sp.near_tie(target, prompt, ref, ref[:3] + [runner_up], 3)  # a real gap in fp32 is no tie
    assert sp.near_tie(target, prompt, ref, ref, 3)  # the same logit: a gap of 0

    real = sp.speculative_generate

    def corrupt(*args, **kwargs):
        result = real(*args, **kwargs)
        if args[2] == prompt:
            result.output_ids[3] = runner_up
        return result

    monkeypatch.setattr(sp, "speculative_generate", corrupt)
    monkeypatch.setattr(sp, "near_tie", lambda *args, **kwargs: True)  # as if the two logits were equal
    report = sp.evaluate_speculative(target, _draft(target), _prompts(2), max_new_tokens=8, warmup=False)
    assert report["numerical_ties"] == [{"prompt": 1, "position": 3}]


# ---- τ and per-position acceptance ---------------------------------------------------------------


def test_oracle_draft_reaches_tau_equal_block_size(target, monkeypatch):
    """Every block fully accepted: τ = bs when max_new_tokens = 1 + m*bs. Otherwise the final block
    verifies only the tokens still allowed, so exactly the last forward emits fewer."""
    draft = _draft(target)
    for prompt in _prompts():
        for max_new, last in [(1 + 3 * BS, BS), (1 + 3 * BS + 2, 2)]:
            ref = sp.target_generate(target, prompt, max_new).output_ids
            monkeypatch.setattr(sp, "propose_draft_tokens", _oracle(ref, len(prompt)))
            spec = sp.speculative_generate(target, draft, prompt, max_new_tokens=max_new)
            monkeypatch.undo()
            assert spec.output_ids == ref
            assert spec.acceptance_lengths[:-1] == [BS] * (len(spec.acceptance_lengths) - 1)
            assert spec.acceptance_lengths[-1] == last
            if last == BS:
                assert spec.tau == BS and spec.num_target_forwards == 3
            stats = sp.acceptance_stats([spec], BS)
            assert stats["per_position_acceptance"] == [1.0] * (BS - 1)


def test_always_wrong_draft_gives_tau_one(target, monkeypatch):
    draft = _draft(target)
    prompts = _prompts()
    results = []
    for prompt in prompts:
        ref = sp.target_generate(target, prompt, 15).output_ids
        monkeypatch.setattr(sp, "propose_draft_tokens", _oracle(ref, len(prompt), shift=1))
        spec = sp.speculative_generate(target, draft, prompt, max_new_tokens=15)
        monkeypatch.undo()
        assert spec.output_ids == ref  # still lossless: every token is the target's bonus token
        assert spec.acceptance_lengths == [1] * 14 and spec.tau == 1.0
        results.append(spec)
    stats = sp.acceptance_stats(results, BS)
    assert stats["tau"] == 1.0
    assert stats["acceptance_histogram"] == [14 * len(prompts), 0, 0, 0]
    assert stats["per_position_acceptance"] == [0.0] * (BS - 1)


def test_evaluate_report_is_consistent(target, trained):
    prompts = _prompts(4, seed=3)
    report = sp.evaluate_speculative(target, trained.draft, prompts, max_new_tokens=17, stop_token_ids=[])
    assert (report["block_size"], report["num_prompts"], report["new_tokens"]) == (BS, len(prompts), 17 * len(prompts))
    check_speculative_report(report)  # τ from the histogram, the new tokens and the per-prompt τ alike
    assert report["tau"] > 1.0  # the trained draft's tokens are accepted: the identities see accepted drafts
    assert report["speculative_tokens_per_s"] > 0 and report["target_tokens_per_s"] > 0
    assert report["speedup"] == pytest.approx(report["speculative_tokens_per_s"] / report["target_tokens_per_s"])


def test_generation_leaves_draft_mode_and_needs_no_grad(target):
    draft = _draft(target).train()
    spec = sp.speculative_generate(target, draft, [1, 2, 3], max_new_tokens=6)
    assert draft.training and len(spec.output_ids) == 6
    assert all(p.grad is None for p in draft.parameters())


def test_draft_context_is_exactly_the_features_before_the_block(target, trained, monkeypatch):
    """At every step the draft's cached context = draft.context_kv of FrozenTarget features of the
    emitted sequence at positions < start (no rejected drafts, nothing missing, right positions)."""
    draft, frozen = trained.draft, trained.target
    prompt = _prompts(3)[2]
    ref = sp.target_generate(target, prompt, 30).output_ids
    full = torch.tensor([prompt + ref])
    with torch.inference_mode():
        expected = draft.context_kv(frozen(full), torch.arange(full.shape[1]).unsqueeze(0))
    starts = []
    real = sp.propose_draft_tokens

    def checked(draft_, target_model, context, first_token, start, block_size, mask_token_id):
        assert context.length == start and int(first_token) == int(full[0, start])
        for (k, v), (ek, ev) in zip(context.kv(), expected, strict=True):
            torch.testing.assert_close(k, ek[:, :, :start], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, ev[:, :, :start], rtol=1e-4, atol=1e-4)
        starts.append(start)
        return real(draft_, target_model, context, first_token, start, block_size, mask_token_id)

    monkeypatch.setattr(sp, "propose_draft_tokens", checked)
    spec = sp.speculative_generate(target, draft, prompt, max_new_tokens=30)
    assert spec.output_ids == ref and len(starts) >= 2
    assert any(b - a > 1 for a, b in zip(starts, starts[1:], strict=False)), "no draft token was ever accepted"


def test_speculative_prompts_are_distinct_and_skips_are_counted(caplog):
    """A repeated first turn would be decoded again to the same output and only weigh τ toward itself:
    it is skipped and counted, and `num_prompts` distinct prompts are taken."""
    class CharTokenizer:  # one id per character, the role's first letter before each turn
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return [ord(c) for m in messages for c in m["role"][0] + m["content"]]

    def chat(*turns):
        return {"messages": [{"role": role, "content": text} for role, text in turns]}

    conversations = [chat(("user", "Hello?")), chat(("user", "Hello?"), ("assistant", "hi")),
                     chat(("assistant", "no user turn")), chat(("user", "x" * 40)),
                     chat(("system", "Be brief."), ("user", "Hello?")), chat(("user", "Hello?")), chat(("user", "Why?")),
                     chat(("user", "Last"))]
    with caplog.at_level(logging.INFO, logger="dflash.evaluation.evaluate"):
        prompts = prompt_ids(CharTokenizer(), conversations, num_prompts=3, max_prompt_tokens=20)
    texts = ["".join(map(chr, p)) for p in prompts]
    assert texts == ["uHello?", "sBe brief.uHello?", "uWhy?"]  # a system turn makes a different prompt
    assert "skipped {'no user turn': 1, 'empty or too long': 1, 'duplicate prompt': 2}" in caplog.text
    # The prompt is the one the held-out split and regeneration key by (`prompt_turns(messages, 1)`): a
    # system message counts only when it leads the conversation.
    late_system = chat(("assistant", "hi"), ("system", "Be brief."), ("user", "Why not?"))
    (ids,) = prompt_ids(CharTokenizer(), [late_system], num_prompts=1)
    assert "".join(map(chr, ids)) == "uWhy not?"


def test_decoding_runs_a_draft_compiled_in_place_eagerly(target):
    """`compile: true` compiles the draft's layers in place; decoding (a new context length every round) must
    not recompile them at each length (it did on an H200, inside the timed decoding of a run's final eval)."""
    from torch._dynamo.utils import counters

    from dflash.run.compiling import compile_draft_call

    draft = _draft(target)
    compile_draft_call(draft.forward, draft.layers, "layers")
    torch._dynamo.reset()
    before = counters["frames"]["total"]
    report = sp.evaluate_speculative(target, draft, _prompts(2), max_new_tokens=6, stop_token_ids=[])
    assert report["new_tokens"] == 12
    assert counters["frames"]["total"] == before, "decoding called into dynamo: the draft's layers were compiled"
