"""The decode chain: teacher-forced acceptance replayed along the path a real decoder takes."""

from __future__ import annotations

import pytest
import torch
from helpers import KIND_HEADS, continuation_batch, make_tiny_target, train_on_continuations

from dflash.evaluation import speculative as sp
from dflash.evaluation.chain import chain_tau_sums, reply_spans
from dflash.kinds.registry import kind_named


def test_reply_spans():
    assert reply_spans([0, 1, 1, 0, 0, 1, 0, 1]) == [(1, 2), (5, 5), (7, 7)]
    assert reply_spans([1, 1]) == [(0, 1)] and reply_spans([0, 0]) == []


def test_chain_follows_accepted_lengths_by_hand():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])  # reply at 2..7: the prefill makes 2, blocks make 3..7
    acc = torch.tensor([[-1, -1, 2, 9, 9, 0, 1, -1]])  # 9s are skipped over by the chain
    # p=2 accepts 2 -> emits 3, 4, 5 (bonus); p=5 accepts 0 -> emits 6; p=6 accepts 1 -> only 7 is left.
    assert chain_tau_sums(acc, mask) == (5, 3)
    assert chain_tau_sums(acc, mask, max_new_tokens=3) == (2, 1)  # 3 new tokens: prefill + 2 from one block
    with pytest.raises(ValueError, match="position 2"):
        chain_tau_sums(torch.full((1, 8), -1), mask)


def test_uniform_average_overstates_the_chain_when_acceptance_varies():
    """An easy stretch of 8 tokens then hard positions: the chain crosses the stretch in one block."""
    mask = torch.ones(1, 20, dtype=torch.int)
    acc = torch.tensor([[8, 7, 6, 5, 4, 3, 2, 1] + [0] * 12])[:, :20]
    emitted, forwards = chain_tau_sums(acc, mask)
    uniform = (acc[0, :19] + 1).float().mean().item()  # every valid anchor, as uniform sampling averages
    assert emitted == 19 and forwards == 11  # one block of 9 tokens, then ten blocks of one
    assert uniform > 1.2 * emitted / forwards


def _selector_trained(draft) -> bool:
    return draft.candidate_selector.successor_codebook.abs().max() > 0


# kind -> (its training keys beside its head, training steps, the least real τ, whether some blocks accept every
# draft, a check of its trained draft). Domino trains with scheduled sampling (a GRU fed sampled tokens at
# evaluation would part τ̂ from τ, and two evaluations would differ); DSpark's blocks accept up to every slot,
# slot 0's included.
CHAIN_KINDS = {
    "dflash": ({}, 20, 1.1, False, None),
    "domino": ({"domino__decay_ratio": 0.3, "domino__scheduled_sampling": 0.5}, 30, 1.1, False, None),
    "dflash2": ({}, 30, 1.1, False, _selector_trained),
    "dspark": ({}, 30, 1.5, True, None),
}


@pytest.mark.parametrize("kind, new_tokens", [("dflash", 26), ("dflash", 12), ("domino", 26), ("dflash2", 26),
                                              ("dspark", 26)], ids=lambda v: str(v))
def test_held_out_chain_tau_equals_real_tau_on_the_targets_greedy_text(target, kind, new_tokens):
    """On text the target itself generates greedily, the chain is the real decoder's path: the held-out
    evaluation's chain τ̂ equals τ from real (lossless) speculative decoding of the same prompts, for every kind.
    The held-out metrics score what the kind's decoder proposes along an accepted prefix (Domino's GRU over the
    drafted tokens, DFlash 2's selector walk, DSpark's Markov walk, each with the teacher-forced previous token);
    a trained draft, so that blocks accept: a chain of all-ones would prove nothing. Every valid anchor is scored,
    with no sampling (two evaluations agree exactly)."""
    import datasets

    extra, steps, least_tau, full_blocks, trained_check = CHAIN_KINDS[kind]
    trainer = train_on_continuations(target, steps=steps, **KIND_HEADS[kind], **extra)
    assert trainer.draft.__class__ is kind_named(kind).model
    ids, loss_mask = continuation_batch(target)  # prompts of 6 tokens + 26 greedy tokens
    trainer.config.spec_eval_max_new_tokens = new_tokens
    rows = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "loss_mask": loss_mask.int().tolist()})
    held_out = trainer.evaluate(rows)
    assert trainer.evaluate(rows) == held_out
    real = sp.evaluate_speculative(target, trainer.draft.eval(), ids[:, :6].tolist(), max_new_tokens=new_tokens,
                                   warmup=False)
    assert real["tau"] > least_tau, real["tau"]
    hist = real["acceptance_histogram"]  # a block verifies the last token and the draft's proposals
    assert len(hist) == trainer.draft.proposals_per_block(trainer.block_size) + 1, hist
    assert not full_blocks or hist[-1] > 0, hist  # some blocks accepted every draft
    assert held_out["chain_tau"] == pytest.approx(real["tau"], rel=1e-9)
    assert held_out["chain_forwards"] == real["target_forwards"]
    assert held_out["anchors_kept"] == 1.0  # every drawn slot is a real anchor: the width is the valid count
    assert trained_check is None or trained_check(trainer.draft)


def test_chain_tau_on_the_speculative_outputs_equals_their_real_tau():
    """The end-of-run report's `teacher_forced_chain_tau`: the chain over the very prompts and outputs of
    the speculative evaluation. In exact arithmetic it equals the real tau, whatever the prompts."""
    target = make_tiny_target()
    trainer = train_on_continuations(target)
    ids, _ = continuation_batch(target)
    real = sp.evaluate_speculative(target, trainer.draft.eval(), ids[:, :6].tolist(), max_new_tokens=26,
                                   warmup=False, return_texts=True)
    assert [p for p, _ in real["texts"]] == ids[:, :6].tolist() and real["tau"] > 1.1
    assert sum(len(o) for _, o in real["texts"]) == real["new_tokens"]
    assert trainer._chain_tau_on(real["texts"]) == pytest.approx(real["tau"], rel=1e-9)
