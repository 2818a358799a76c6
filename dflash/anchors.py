"""Anchor sampling: where the draft's blocks start.

A block of `block_size` tokens starts at an *anchor* position a: slot 0 holds the clean token at a,
slots 1..bs-1 are predicted. Position i of row b is a valid anchor when `loss_mask[b, i]` and
`loss_mask[b, i + 1]` are both set (at least one supervised token follows a supervised anchor) and, in a
packed row (`position_ids` restarting at 0 for each document, `dflash.data.packing`), i + 1 is in i's
document.
That rule is written once, in `valid_anchor_mask`; the host-side width bound (`max_valid_anchors`)
and tokenization's test for a usable row (`has_valid_anchor`) are built on it.

Every row gets exactly `min(N, valid_count)` distinct anchors, drawn without replacement, in a tensor of
fixed width N (static shapes: the step can be compiled and graph-captured). The draw is "N smallest of
i.i.d. scores" via `topk`, which never reads a device value to the host: uniform scores give a uniform
subset; `spread="later"` divides Exp(1) scores by a weight growing with the position in the document
(Efraimidis-Spirakis weighted sampling without replacement), so later positions of a long conversation,
whose long context the draft serves, hold more of the anchors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Score given to invalid positions: above any finite draw, so topk(largest=False) takes every valid position
# before any invalid one, and a picked slot is real exactly when its score is finite.
_INVALID_SCORE = float("inf")
SPREADS = ("uniform", "later")


def valid_anchor_mask(loss_mask: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, S]` bool: position i is a valid anchor (loss_mask[i] and loss_mask[i+1], and with packed rows'
    `position_ids` `[B, S]` i + 1 in i's document); the last is never."""
    lm = loss_mask.bool()
    valid = torch.zeros_like(lm)
    valid[:, :-1] = lm[:, :-1] & lm[:, 1:]
    if position_ids is not None:  # a document starts where the position restarts
        valid[:, :-1] &= position_ids[:, 1:] == position_ids[:, :-1] + 1
    return valid


def max_valid_anchors(loss_mask_cpu: torch.Tensor, position_ids_cpu: torch.Tensor | None = None) -> int:
    """Largest per-row count of valid anchors in a `[B, S]` loss mask on the host (0 when empty); packed rows
    pass their `position_ids`.

    Reads the collator's CPU copy, before the copy to the device, so bounding the anchor width
    costs no device sync; a device tensor is refused.
    """
    if loss_mask_cpu.device.type != "cpu":
        raise ValueError("max_valid_anchors reads a host tensor; call it before the copy to the device")
    if loss_mask_cpu.numel() == 0:
        return 0
    return int(valid_anchor_mask(loss_mask_cpu, position_ids_cpu).sum(dim=1).max())


def has_valid_anchor(loss_mask: Sequence[int]) -> bool:
    """Whether one tokenized row (its 0/1 `loss_mask` list) holds a valid anchor: a row without one
    gives the draft nothing to learn, and tokenization drops it."""
    return max_valid_anchors(torch.as_tensor(loss_mask, dtype=torch.bool).reshape(1, -1)) > 0


@dataclass(frozen=True)
class GlobalRows:
    """Where a micro-batch's rows sit in the batch of all ranks: rows `offset .. offset + B` of `total`,
    positions up to `width` (the longest a padded row can be, `data.max_length`). Every rank draws the
    scores of the whole `[total, width]` batch from the same generator state and keeps its slice, so a
    row's anchors depend on (seed, step, micro-step, global row, position) alone, not on how rows are spread over
    processes: 2 processes of B rows draw, at each micro-step, what one process of 2B rows draws. The global rows
    are numbered per micro-batch, so with gradient accumulation one process matches 2 ranks when its micro-batch
    i holds each rank's micro-batch i (the sampler's layout: `data.loader`, a block of each global micro-batch per
    rank); any per-row draw (anchors, Domino's scheduled sampling) follows that order."""

    offset: int
    total: int
    width: int

    @classmethod
    def of_rank(cls, rank: int, world_size: int, rows: int, length: int, max_length: int) -> GlobalRows:
        """Rank `rank`'s `rows` of `length` positions (the same row count on every rank) among the
        `world_size` ranks' rows. The width is `max_length` (the collator's bound); a longer batch passed
        to the step directly widens it (such a run draws per its own length)."""
        return cls(rank * rows, world_size * rows, max(length, max_length))


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    *,
    generator: torch.Generator | None = None,
    rows: GlobalRows | None = None,
    position_ids: torch.Tensor | None = None,
    spread: str = "uniform",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw up to `num_anchors` distinct valid anchors per row.

    Args:
        loss_mask: `[B, S]` bool or 0/1, True on supervised tokens.
        num_anchors: N, the fixed output width.
        generator: RNG on `loss_mask.device`; the trainer seeds it from (seed, step), alike on every rank.
        rows: this micro-batch's place in the global batch (`GlobalRows`); None: the rows alone.
        position_ids: `[B, S]` of packed rows (restarting per document): no anchor's next token in another document.
        spread: "uniform" (every valid position alike) or "later" (position i drawn with weight i + 1, i its
            position in its document: the weighted subset of Efraimidis and Spirakis, N smallest of Exp(1) / w).

    Returns:
        anchors: `LongTensor[B, N]`, ascending among kept slots; padded slots hold 0.
        keep: `BoolTensor[B, N]`, True for the `min(N, valid_count)` real anchors (kept slots first).
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    if spread not in SPREADS:
        raise ValueError(f"anchor spread {spread!r}: choose one of {', '.join(SPREADS)}")
    bsz, seq_len = loss_mask.shape
    valid = valid_anchor_mask(loss_mask, position_ids)
    if rows is None:
        scores = torch.rand(bsz, seq_len, generator=generator, device=loss_mask.device)
    else:
        if rows.offset + bsz > rows.total or seq_len > rows.width:
            raise ValueError(f"rows {rows.offset}..{rows.offset + bsz} x {seq_len} positions lie outside the global "
                             f"batch [{rows.total}, {rows.width}]")
        scores = torch.rand(rows.total, rows.width, generator=generator, device=loss_mask.device)
        scores = scores[rows.offset:rows.offset + bsz, :seq_len]
    if spread == "later":
        position = torch.arange(seq_len, device=loss_mask.device) if position_ids is None else position_ids
        scores = -torch.log1p(-scores) / (position + 1)  # Exp(1) / weight: finite, since the draws are < 1
    scores = torch.where(valid, scores, _INVALID_SCORE)

    k = min(num_anchors, seq_len)
    picked_scores, picked = torch.topk(scores, k, dim=1, largest=False, sorted=False)
    picked_valid = picked_scores < _INVALID_SCORE
    # Sort the kept positions ascending; the dropped ones get the sentinel `seq_len` so they sort last.
    picked = torch.where(picked_valid, picked, seq_len)
    picked, _ = torch.sort(picked, dim=1)
    keep = picked < seq_len
    anchors = torch.where(keep, picked, 0)
    if k < num_anchors:  # host-side shapes only: pad the width to N with dropped slots
        pad = num_anchors - k
        anchors = torch.nn.functional.pad(anchors, (0, pad), value=0)
        keep = torch.nn.functional.pad(keep, (0, pad), value=False)
    return anchors, keep


def anchor_widths(num_anchors: int, count: int) -> list[int]:
    """The widths a training batch may take: `ceil(N * k / count)` for k = 1..count, ascending, the
    last one N (`count` 1: N only). Few widths keep few compiled shapes and CUDA graphs."""
    if count < 1:
        raise ValueError(f"the number of anchor widths must be >= 1, got {count}")
    return sorted({-(-num_anchors * k // count) for k in range(1, count + 1)})


def bounded_width(loss_mask_cpu: torch.Tensor, widths: Sequence[int], position_ids_cpu: torch.Tensor | None = None) -> int:
    """The smallest of `widths` (ascending, the last one N) that holds every row's valid anchors.

    Runs on the collator's CPU copy before the host-to-device transfer, so it reads no device value.
    A row keeps `min(N, valid count)` anchors either way, so the kept anchors, their order and the
    random draws are those of the fixed width N; only dropped slots are left out.
    """
    if loss_mask_cpu.device.type != "cpu":
        raise ValueError("bounded_width reads the batch on the host: pass the CPU loss_mask")
    most = max_valid_anchors(loss_mask_cpu, position_ids_cpu)
    return next((w for w in widths if w >= most), widths[-1])


def anchor_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed from (seed, rank, step): ranks draw differently and resume is exact."""
    x = (seed * 0x9E3779B97F4A7C15 + rank * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & (2**64 - 1)
    x ^= x >> 32
    return x & (2**63 - 1)


def reseed(generator: torch.Generator, seed: int, rank: int, micro_step: int) -> torch.Generator:
    """`generator` seeded for micro-batch `micro_step` of rank `rank` (the trainer counts step * accum +
    index, the Trainer module its micro-batches): host-side generator state only, no device work and no
    sync, and a resumed run draws the same anchors."""
    return generator.manual_seed(anchor_seed(seed, rank, micro_step))
