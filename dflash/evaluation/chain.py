"""The decode chain: a teacher-forced estimate of τ that follows the path a real decoder takes.

Teacher-forced τ̂ averages the accepted length over anchors drawn uniformly from a reply. A real
speculative decoder does not visit every position: after a block accepts `a` tokens the next block
starts `a + 1` positions later. A stretch the draft predicts well is crossed in one step and counts
once, while each position the draft gets wrong starts a block of its own. Uniform anchors sample
the good stretch at each of its positions, so whenever acceptance varies along the text the uniform
average overstates τ (the inspection paradox; docs/benchmarks.md has the figures).

`chain_tau_sums` replays the decoder on teacher-forced acceptance: given the accepted length `a(p)`
of a block anchored at every position `p` of a reply `[start, end]` (one forward with every valid
position as an anchor), the decoder's blocks are `p_0 = start` (the first reply token comes from the
prefill, as in serving) and `p_{k+1} = p_k + a(p_k) + 1`; each block is one target forward and emits
`min(a + 1, end - p)` tokens (accepted ones plus the target's bonus token, never past the reply's
last token). On the target's own greedy text (regenerated replies) this is exactly the path that
lossless greedy speculative decoding takes, so the ratio predicts real τ up to numerics.
"""

from __future__ import annotations

import torch


def reply_spans(loss_mask_row: list[int] | list[bool]) -> list[tuple[int, int]]:
    """Inclusive `(start, end)` of each maximal run of supervised positions of one row."""
    spans, start = [], None
    for i, m in enumerate(loss_mask_row):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i - 1))
            start = None
    if start is not None:
        spans.append((start, len(loss_mask_row) - 1))
    return spans


def chain_tau_sums(accepted: torch.Tensor, loss_mask: torch.Tensor, max_new_tokens: int | None = None) -> tuple[int, int]:
    """(tokens emitted, target forwards) of the decode chain over every reply of a batch.

    `accepted`: `[B, S]` accepted length of the block anchored at each position, `-1` where no block
    was scored; `loss_mask`: `[B, S]`. `max_new_tokens` caps each reply's generation like the real
    evaluation (the prefill makes the first token, so at most `max_new_tokens - 1` come from blocks).
    A SYNC POINT (reads both tensors to the host): call it only from evaluation.
    """
    acc, mask = accepted.tolist(), loss_mask.int().tolist()
    emitted = forwards = 0
    for row_acc, row_mask in zip(acc, mask, strict=True):
        for start, end in reply_spans(row_mask):
            budget = end - start if max_new_tokens is None else min(end - start, max_new_tokens - 1)
            p, made = start, 0
            while made < budget:
                a = row_acc[p]
                if a < 0:
                    raise ValueError(f"no block was scored at position {p} of a reply [{start}, {end}]: "
                                     "the chain needs every valid position as an anchor")
                step = min(a + 1, budget - made)
                made += step
                forwards += 1
                p += a + 1
            emitted += made
    return emitted, forwards
