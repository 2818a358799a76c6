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

import functools
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import create_block_mask

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


@functools.cache
def _compiled_create_block_mask() -> Callable[..., object]:
    """`create_block_mask` through torch.compile: the block mask is computed on the device, tile by tile,
    without materializing the `[Q, KV]` boolean mask. This is what its `_compile=True` flag did; torch
    2.6 deprecated the flag in favour of compiling the function."""
    return torch.compile(create_block_mask)


def flex_dflash_mask(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, block_size: int, *, compile: bool = True):
    """The rule as a flex-attention `BlockMask` (GPU path); fully masked tiles are skipped by the kernel."""
    bsz, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    build = _compiled_create_block_mask() if compile else create_block_mask
    return build(dflash_mask_mod(anchors, keep, seq_len, block_size), B=bsz, H=None, Q_LEN=q_len,
                 KV_LEN=seq_len + q_len, device=anchors.device)
