"""Packed rows (`data.packing`): whole training rows (documents) laid end to end in sequences of one fixed length.

Short chat rows in bucketed slots spend much of a step on padding (`loader.PaddingCost`); packed, a step's slots hold
several documents each. A packed sequence is described by its `position_ids`, restarting at 0 for each document
(the convention of transformers' `DataCollatorWithFlattening`): the target attends inside each document with
positions restarting there (`dflash.target_model.frozen.document_attention`), anchors never take the next document's
token as their first label (`dflash.anchors`), a block's slots past its document's end are unsupervised
(`dflash.losses.block_positions`) and its context is its own document's (`dflash.attention.document_starts`).
So a packed step computes, for the same rows and anchors, the losses and metrics of the unpacked step
(tests/test_packing.py, per draft kind).

Rows are grouped once per run, best-fit decreasing on their lengths alone (deterministic; no row is read), and the
groups are shuffled per epoch by the loader like rows are: resume and data parallelism work on groups unchanged.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset


def pack_lengths(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Row indices grouped into bins of at most `capacity` tokens, best-fit decreasing: rows from the longest down,
    each into the fullest bin that still holds it (a new bin when none does). A row longer than `capacity` gets a
    bin of its own (the collator cuts it, as it cuts an unpacked row at `data.max_length`). Ties keep row order, so
    the grouping is a function of the lengths alone."""
    if capacity < 1:
        raise ValueError(f"the packed length must be >= 1, got {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []  # sorted free capacities of the open bins ...
    holders: dict[int, list[int]] = {}  # ... and, per free capacity, the bins that have it (last opened last)
    for i in order:
        n = min(lengths[i], capacity)
        k = bisect.bisect_left(free, n)
        if k < len(free):  # the fullest bin that fits: the smallest free capacity >= n
            room = free[k]
            b = holders[room].pop()
            if not holders[room]:
                del holders[room], free[k]
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        left = room - n
        if left > 0:
            if left not in holders:
                bisect.insort(free, left)
                holders[left] = []
            holders[left].append(b)
    return bins


class PackedRows(Dataset):
    """Tokenized rows (`input_ids`, `loss_mask` lists) as packed sequences: item g is the rows of group g end to end,
    with `position_ids` restarting at 0 for each row. `lengths` gives each group's tokens (the padding cost reads
    them without building a sequence)."""

    def __init__(self, rows: Any, row_lengths: Sequence[int], capacity: int) -> None:
        self.rows, self.capacity = rows, capacity
        self.groups = pack_lengths(row_lengths, capacity)
        self.lengths = [min(sum(row_lengths[i] for i in group), capacity) for group in self.groups]

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        ids: list[int] = []
        mask: list[int] = []
        positions: list[int] = []
        for i in self.groups[index]:
            row: Mapping[str, Sequence[int]] = self.rows[i]
            n = min(len(row["input_ids"]), self.capacity - len(ids))
            ids.extend(row["input_ids"][:n])
            mask.extend(row["loss_mask"][:n])
            positions.extend(range(n))
        return {"input_ids": ids, "loss_mask": mask, "position_ids": positions}


def packed_positions(rows: Sequence[Mapping[str, Sequence[int]]], seq: int) -> torch.Tensor:
    """`LongTensor[B, seq]`: each packed row's `position_ids`, its padding a document of its own (0, 1, ...), so
    the padding attends only to itself and no real document sees it."""
    positions = torch.arange(seq, dtype=torch.long).repeat(len(rows), 1)
    for b, row in enumerate(rows):
        n = min(len(row["position_ids"]), seq)
        positions[b, :n] = torch.as_tensor(row["position_ids"][:n], dtype=torch.long)
        positions[b, n:] -= n
    return positions
