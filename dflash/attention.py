"""The one DFlash attention rule, as a dense boolean mask (CPU / SDPA) and a flex-attention BlockMask (GPU).

Layout of the draft's attention for one row:
    queries: N blocks x bs slots, flattened to `q = j * bs + k`                      (Q = N * bs)
    keys:    the S context positions (target features), then the N * bs block slots (KV = S + Q)

Query (block j, slot k) with anchor a = anchors[b, j] sees
    context position c  iff keep[b, j] and start <= c < a   (strictly: the target feature at the anchor
                                                    itself is not available at inference time; start is
                                                    0, or in a packed row the first position of a's
                                                    document: `document_starts`)
    block slot (j', k') iff j' == j                (its own block, both directions)
and nothing else. A dropped block (keep false) still sees its own slots, so no SDPA row is empty
(no NaN); it carries zero loss weight, and on GPU its context tiles are skipped by the BlockMask.

The target of a packed row attends causally inside each document (`dense_document_mask`, `flex_document_mask`):
query i sees keys [i - position_ids[i], i].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE, BlockMask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def resolve_attention(name: str, device: torch.device | str) -> str:
    """The draft's attention backend for `draft.attention`: "auto" is flex attention on a GPU and SDPA
    with the dense mask elsewhere (flex attention has no CPU backward in the supported torch)."""
    if name != "auto":
        return name
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


def document_starts(anchors: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """`[B, N]` the first position of each anchor's document: `a - position_ids[a]` in a packed row (positions
    restart at 0 for each document), 0 without `position_ids`."""
    if position_ids is None:
        return torch.zeros_like(anchors)
    return anchors - torch.gather(position_ids, 1, anchors)


def dflash_mask_mod(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, block_size: int,
                    starts: torch.Tensor | None = None) -> MaskMod:
    """The rule as a flex-attention `mask_mod(b, h, q_idx, kv_idx) -> bool` (also evaluated densely);
    `starts` `[B, N]`: each anchor's document start (`document_starts`), None: 0."""
    starts = torch.zeros_like(anchors) if starts is None else starts

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        block = q_idx // block_size
        anchor = anchors[b, block]
        kept = keep[b, block]
        sees_context = (kv_idx < seq_len) & (kv_idx >= starts[b, block]) & (kv_idx < anchor) & kept
        sees_own_block = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == block)
        return sees_context | sees_own_block

    return mask_mod


def _grid(bsz: int, q_len: int, kv_len: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Index grids (b, h, q, kv) that broadcast to `[B, 1, Q, KV]`, to evaluate a `mask_mod` densely."""
    return (torch.arange(bsz, device=device).view(bsz, 1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device),
            torch.arange(q_len, device=device).view(1, 1, q_len, 1), torch.arange(kv_len, device=device).view(1, 1, 1, kv_len))


def dense_dflash_mask(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, block_size: int,
                      starts: torch.Tensor | None = None) -> torch.Tensor:
    """`BoolTensor[B, 1, N*bs, S + N*bs]` for SDPA: the same `mask_mod` evaluated on index grids."""
    bsz, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    grid = _grid(bsz, q_len, seq_len + q_len, anchors.device)
    return dflash_mask_mod(anchors, keep, seq_len, block_size, starts)(*grid)


def document_mask_mod(position_ids: torch.Tensor) -> MaskMod:
    """Causal attention inside each document of packed rows (`position_ids` `[B, S]` restarting per document)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx <= q_idx) & (kv_idx >= q_idx - position_ids[b, q_idx])

    return mask_mod


def dense_document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """`BoolTensor[B, 1, S, S]`: `document_mask_mod` evaluated densely (the target's SDPA mask on a CPU)."""
    bsz, seq_len = position_ids.shape
    return document_mask_mod(position_ids)(*_grid(bsz, seq_len, seq_len, position_ids.device))


def flex_document_mask(position_ids: torch.Tensor, *, tile: int = _DEFAULT_SPARSE_BLOCK_SIZE) -> BlockMask:
    """`document_mask_mod` as a flex-attention `BlockMask` (the target's attention on a GPU): query i sees the one
    key interval `[i - position_ids[i], i]`, so the tiles come from interval overlaps as in `flex_dflash_mask`."""
    bsz, seq_len = position_ids.shape
    q_pad = -(-seq_len // tile) * tile
    rows = torch.arange(q_pad, device=position_ids.device).expand(bsz, -1)  # query rows, padded to whole tiles
    position = torch.nn.functional.pad(position_ids, (0, q_pad - seq_len))
    return _interval_block_mask([(rows - position, rows + 1)], seq_len, seq_len, tile, document_mask_mod(position_ids))


def flex_dflash_mask(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, block_size: int,
                     starts: torch.Tensor | None = None, *, tile: int = _DEFAULT_SPARSE_BLOCK_SIZE) -> BlockMask:
    """The rule as a flex-attention `BlockMask` (GPU path); fully masked tiles are skipped by the kernel.

    Built from the anchors, not by evaluating `mask_mod` on every (query, key) pair: each query row sees
    two key intervals, `[start, min(a, S))` when its block is kept (start: 0, or the document's
    start in a packed row) and its own block's slots, so the number of
    keys it sees in each key tile is two interval overlaps. A tile is full when every row of the query
    tile sees all `tile` keys of it (a tile padded past Q or KV never is, as in `create_block_mask`) and
    partial when some row sees some key. This gives `create_block_mask`'s tiles exactly
    (tests/test_attention.py), on fixed shapes with no sync, without compiling anything: compiled,
    `create_block_mask`'s kernel for this rule took 190 s of Inductor's time before the first paper-recipe
    step on an H200 (docs/benchmarks.md). Eager, it would materialize the `[B, Q, KV]` mask."""
    bsz, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    q_pad = -(-q_len // tile) * tile
    rows = torch.arange(q_pad, device=anchors.device)  # query rows, padded to whole tiles
    block = (rows // block_size).clamp(max=num_blocks - 1).expand(bsz, -1)  # [B, Qp]
    starts = torch.zeros_like(anchors) if starts is None else starts
    context_end = (torch.minimum(anchors, torch.full_like(anchors, seq_len)) * keep).gather(1, block)  # 0: dropped
    context_start = torch.minimum(starts.gather(1, block), context_end)
    own_start = seq_len + block * block_size
    return _interval_block_mask([(context_start, context_end), (own_start, own_start + block_size)], q_len,
                                seq_len + q_len, tile, dflash_mask_mod(anchors, keep, seq_len, block_size, starts))


def _interval_block_mask(intervals: list[tuple[torch.Tensor, torch.Tensor]], q_len: int, kv_len: int, tile: int,
                         mask_mod: MaskMod) -> BlockMask:
    """A `BlockMask` for queries that each see disjoint key intervals `[lo, hi)` (`[B, Qp]` each, Qp: the query
    rows padded to whole tiles). The keys a row sees in each key tile are interval overlaps; a tile is full when
    every real row of the query tile sees all `tile` keys of it, partial when some row sees some key."""
    bsz, q_pad = intervals[0][0].shape
    q_tiles, kv_tiles = q_pad // tile, -(-kv_len // tile)
    device = intervals[0][0].device
    # int32: a count is at most `tile`, and the [B, Qp, T] grids are the builder's memory (Qp = 65,536 query rows
    # and T = 768 key tiles at 32K positions with 4,096 anchors: 200 MB each in int32, twice that in int64)
    starts = torch.arange(kv_tiles, device=device, dtype=torch.int32) * tile  # [T]
    seen = torch.zeros(bsz, q_pad, kv_tiles, dtype=torch.int32, device=device)
    for lo, hi in intervals:
        lo, hi = lo.to(torch.int32).unsqueeze(-1), hi.to(torch.int32).unsqueeze(-1)
        seen = seen + (torch.minimum(hi, starts + tile) - torch.maximum(lo, starts)).clamp(min=0)
    real = torch.arange(q_pad, device=device) < q_len
    seen = (seen * real.unsqueeze(-1)).view(bsz, 1, q_tiles, tile, kv_tiles)  # padded rows see nothing
    full = seen.amin(dim=3) == tile  # [B, 1, Qt, T]
    partial = (seen.amax(dim=3) > 0) & ~full
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=(q_len, kv_len))


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A `[B, H, Qt, T]` tile flag as flex attention's (count `[B, H, Qt]`, indices `[B, H, Qt, T]`): the
    flagged key tiles first, in order (a stable sort keeps the shape fixed)."""
    count = tiles.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count, order
