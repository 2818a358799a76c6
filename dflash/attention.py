"""The one DFlash attention rule, as a dense boolean mask (CPU / SDPA) and a flex-attention BlockMask (GPU).

Layout of the draft's attention for one row:
    queries: N blocks x bs slots, flattened to `q = j * bs + k`                      (Q = N * bs)
    keys:    the S context positions (target features), then the N * bs block slots (KV = S + Q)

Query (block j, slot k) with anchor a = anchors[b, j] sees
    context position c  iff keep[b, j] and c < a   (strictly: the target feature at the anchor itself
                                                    is not available at inference time)
    block slot (j', k') iff j' == j                (its own block, both directions)
and nothing else. A dropped block (keep false) still sees its own slots, so no SDPA row is empty
(no NaN); it carries zero loss weight, and on GPU its context tiles are skipped by the BlockMask.
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


def dflash_mask_mod(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, block_size: int) -> MaskMod:
    """The rule as a flex-attention `mask_mod(b, h, q_idx, kv_idx) -> bool` (also evaluated densely)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        block = q_idx // block_size
        anchor = anchors[b, block]
        kept = keep[b, block]
        sees_context = (kv_idx < seq_len) & (kv_idx < anchor) & kept
        sees_own_block = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == block)
        return sees_context | sees_own_block

    return mask_mod


def dense_dflash_mask(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """`BoolTensor[B, 1, N*bs, S + N*bs]` for SDPA: the same `mask_mod` evaluated on index grids."""
    bsz, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    device = anchors.device
    b = torch.arange(bsz, device=device).view(bsz, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv = torch.arange(seq_len + q_len, device=device).view(1, 1, 1, seq_len + q_len)
    return dflash_mask_mod(anchors, keep, seq_len, block_size)(b, h, q, kv)


def flex_dflash_mask(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, block_size: int, *,
                     tile: int = _DEFAULT_SPARSE_BLOCK_SIZE) -> BlockMask:
    """The rule as a flex-attention `BlockMask` (GPU path); fully masked tiles are skipped by the kernel.

    Built from the anchors, not by evaluating `mask_mod` on every (query, key) pair: each query row sees
    two key intervals, `[0, min(a, S))` when its block is kept and its own block's slots, so the number of
    keys it sees in each key tile is two interval overlaps. A tile is full when every row of the query
    tile sees all `tile` keys of it (a tile padded past Q or KV never is, as in `create_block_mask`) and
    partial when some row sees some key. This gives `create_block_mask`'s tiles exactly
    (tests/test_attention.py), on fixed shapes with no sync, without compiling anything: compiled,
    `create_block_mask`'s kernel for this rule took 190 s of Inductor's time before the first paper-recipe
    step on an H200 (docs/benchmarks.md). Eager, it would materialize the `[B, Q, KV]` mask."""
    bsz, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    kv_len = seq_len + q_len
    q_tiles, kv_tiles = -(-q_len // tile), -(-kv_len // tile)
    device = anchors.device
    rows = torch.arange(q_tiles * tile, device=device)  # query rows, padded to whole tiles
    block = (rows // block_size).clamp(max=num_blocks - 1).expand(bsz, -1)  # [B, Qp]
    context_end = torch.minimum(anchors, torch.full_like(anchors, seq_len)) * keep  # [B, N]: 0 when dropped
    context_end = context_end.gather(1, block)
    own_start = seq_len + block * block_size
    starts = torch.arange(kv_tiles, device=device) * tile  # [T]

    def overlap(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """Keys of `[lo, hi)` (`[B, Qp]`) inside each key tile: `[B, Qp, T]`."""
        lo, hi = lo.unsqueeze(-1), hi.unsqueeze(-1)
        return (torch.minimum(hi, starts + tile) - torch.maximum(lo, starts)).clamp(min=0)

    seen = overlap(torch.zeros_like(context_end), context_end) + overlap(own_start, own_start + block_size)
    seen = (seen * (rows < q_len).unsqueeze(-1)).view(bsz, 1, q_tiles, tile, kv_tiles)  # padded rows see nothing
    full = seen.amin(dim=3) == tile  # [B, 1, Qt, T]
    partial = (seen.amax(dim=3) > 0) & ~full
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=tile,
                                    mask_mod=dflash_mask_mod(anchors, keep, seq_len, block_size),
                                    seq_lengths=(q_len, kv_len))


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A `[B, H, Qt, T]` tile flag as flex attention's (count `[B, H, Qt]`, indices `[B, H, Qt, T]`): the
    flagged key tiles first, in order (a stable sort keeps the shape fixed)."""
    count = tiles.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count, order
