"""The DFlash mask: dense and flex forms agree with a per-element reference of DESIGN §4."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from dflash.anchors import sample_anchors
from dflash.attention import dense_dflash_mask, dflash_mask_mod, flex_dflash_mask
from dflash.diagnostics.syncs import forbid_syncs


def reference_mask(anchors, keep, seq_len, bs):
    """Per-element rule, written independently of dflash.attention."""
    bsz, n = anchors.shape
    q_len = n * bs
    out = torch.zeros(bsz, 1, q_len, seq_len + q_len, dtype=torch.bool)
    for b in range(bsz):
        for j in range(n):
            a = int(anchors[b, j])
            for k in range(bs):
                q = j * bs + k
                if keep[b, j]:
                    out[b, 0, q, :a] = True  # context strictly before the anchor
                out[b, 0, q, seq_len + j * bs : seq_len + (j + 1) * bs] = True  # own block, both ways
    return out


def _random_case(seed, bsz=3, seq_len=40, n=6, bs=4):
    g = torch.Generator().manual_seed(seed)
    lm = torch.rand(bsz, seq_len, generator=g) < 0.7
    lm[-1] = False  # one row without anchors: all blocks dropped
    anchors, keep = sample_anchors(lm, n, generator=g)
    return anchors, keep, seq_len, bs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dense_matches_reference(seed):
    anchors, keep, seq_len, bs = _random_case(seed)
    dense = dense_dflash_mask(anchors, keep, seq_len, bs)
    assert dense.shape == (3, 1, 6 * bs, seq_len + 6 * bs) and dense.dtype == torch.bool
    assert torch.equal(dense, reference_mask(anchors, keep, seq_len, bs))


def test_rule_properties():
    anchors, keep, seq_len, bs = _random_case(7)
    m = dense_dflash_mask(anchors, keep, seq_len, bs)[:, 0]
    for b in range(anchors.shape[0]):
        for j in range(anchors.shape[1]):
            rows = m[b, j * bs : (j + 1) * bs]
            a = int(anchors[b, j])
            # the target feature at the anchor itself (and anything after) is never visible
            assert not rows[:, a:seq_len].any()
            if keep[b, j]:
                assert rows[:, :a].all()
            else:
                assert not rows[:, :seq_len].any()  # dropped blocks see no context
            own = rows[:, seq_len + j * bs : seq_len + (j + 1) * bs]
            assert own.all()  # bidirectional inside the block
            others = rows[:, seq_len:].clone()
            others[:, j * bs : (j + 1) * bs] = False
            assert not others.any()  # no other block


def test_sdpa_rows_never_nan():
    anchors, keep, seq_len, bs = _random_case(3)
    mask = dense_dflash_mask(anchors, keep, seq_len, bs)
    q = torch.randn(3, 2, mask.shape[2], 8)
    kv = torch.randn(3, 2, mask.shape[3], 8)
    out = F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)
    assert torch.isfinite(out).all()


BLOCK_MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def assert_block_masks_equal(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, bs: int, tile: int):
    """Every tensor of `flex_dflash_mask`'s BlockMask equals `create_block_mask`'s (which evaluates the rule
    on every (query, key) pair): partial and full tiles, their order, the transposed (backward) tables."""
    bsz, n = anchors.shape
    ref = create_block_mask(dflash_mask_mod(anchors, keep, seq_len, bs), B=bsz, H=None, Q_LEN=n * bs,
                            KV_LEN=seq_len + n * bs, device="cpu", BLOCK_SIZE=tile)
    got = flex_dflash_mask(anchors, keep, seq_len, bs, tile=tile)
    assert got.seq_lengths == ref.seq_lengths and got.BLOCK_SIZE == ref.BLOCK_SIZE
    for name in BLOCK_MASK_FIELDS:
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=0, atol=0, msg=name)
    assert ref.kv_num_blocks.sum() > 0
    return ref


@pytest.mark.parametrize("bsz, seq_len, n, bs, tile", [(2, 60, 8, 4, 16), (3, 100, 7, 3, 16), (2, 300, 32, 16, 128),
                                                       (1, 130, 9, 7, 32), (2, 61, 5, 5, 8), (2, 64, 4, 8, 16)])
def test_the_block_mask_from_anchors_equals_create_block_mask(bsz, seq_len, n, bs, tile):
    """Q and KV not multiples of the tile, dropped blocks, an anchor at 0."""
    g = torch.Generator().manual_seed(bsz * 1000 + seq_len)
    anchors = torch.sort(torch.randint(0, seq_len, (bsz, n), generator=g), dim=1).values
    anchors[0, 0] = 0
    assert_block_masks_equal(anchors, torch.rand(bsz, n, generator=g) > 0.3, seq_len, bs, tile)


def test_full_context_tiles_are_found_like_create_block_mask():
    """Late anchors: the context tiles before every anchor of a query tile are full, the one an anchor
    cuts is partial (and a dropped block's rows make its query tile's context tiles partial at most)."""
    anchors = torch.tensor([[150, 161, 170, 199], [120, 121, 150, 190]])
    keep = torch.tensor([[True, True, True, True], [True, False, True, True]])
    ref = assert_block_masks_equal(anchors, keep, 200, 8, 8)
    assert ref.full_kv_num_blocks.sum() > 0
    # Q = 15 in tiles of 16: the padded 16th row sees nothing, so no tile of that query tile is full
    ref = assert_block_masks_equal(torch.tensor([[40, 50, 60]]), torch.tensor([[True, True, True]]), 64, 5, 16)
    assert ref.full_kv_num_blocks.sum() == 0 and ref.kv_num_blocks.sum() > 0


def test_the_block_mask_is_built_without_a_sync():
    anchors, keep, seq_len, bs = _random_case(1, bsz=2, seq_len=200, n=16, bs=8)
    with forbid_syncs(device="cpu", raise_on_first=False) as report:
        flex_dflash_mask(anchors, keep, seq_len, bs, tile=32)
    assert report.findings == []


@pytest.mark.parametrize("seed", [0, 5])
def test_flex_matches_dense_forward(seed):
    """The BlockMask gives the dense mask's attention (flex attention's CPU forward)."""
    from torch.nn.attention.flex_attention import flex_attention

    anchors, keep, seq_len, bs = _random_case(seed, bsz=2, seq_len=60, n=8, bs=4)
    dense = dense_dflash_mask(anchors, keep, seq_len, bs)
    block_mask = flex_dflash_mask(anchors, keep, seq_len, bs)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, dense.shape[2], 16, generator=g)
    k = torch.randn(2, 2, dense.shape[3], 16, generator=g)
    v = torch.randn(2, 2, dense.shape[3], 16, generator=g)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile" on CPU
        flex = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq_len, tile", [(100, 16), (61, 8), (300, 128)])
def test_packed_rows_block_mask_equals_create_block_mask(seq_len, tile):
    """Packed rows: a block's context starts at its document's first position (`document_starts`); the target's
    document-causal mask (`flex_document_mask`) also equals `create_block_mask`'s tiles of its rule."""
    from dflash.attention import document_mask_mod, document_starts, flex_document_mask

    g = torch.Generator().manual_seed(seq_len)
    bsz, n, bs = 2, 9, 4
    ends = torch.sort(torch.randint(1, seq_len, (bsz, 3), generator=g), dim=1).values  # up to 4 documents a row
    index = torch.arange(seq_len)
    starts_of = torch.zeros(bsz, seq_len, dtype=torch.long)
    for b in range(bsz):
        for end in ends[b].tolist():
            starts_of[b, end:] = end
    positions = index - starts_of
    anchors = torch.sort(torch.randint(0, seq_len, (bsz, n), generator=g), dim=1).values
    keep = torch.rand(bsz, n, generator=g) > 0.2
    starts = document_starts(anchors, positions)
    assert torch.equal(starts, starts_of.gather(1, anchors))
    ref = create_block_mask(dflash_mask_mod(anchors, keep, seq_len, bs, starts), B=bsz, H=None, Q_LEN=n * bs,
                            KV_LEN=seq_len + n * bs, device="cpu", BLOCK_SIZE=tile)
    got = flex_dflash_mask(anchors, keep, seq_len, bs, starts, tile=tile)
    for name in BLOCK_MASK_FIELDS:
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=0, atol=0, msg=name)
    dense = dense_dflash_mask(anchors, keep, seq_len, bs, starts)
    for b, j in [(0, 3), (1, 7)]:  # context [start, a) of a kept block; nothing of another document
        row = dense[b, 0, j * bs, :seq_len]
        expected = (index >= starts[b, j]) & (index < anchors[b, j]) & keep[b, j]
        assert torch.equal(row, expected)
    ref = create_block_mask(document_mask_mod(positions), B=bsz, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device="cpu",
                            BLOCK_SIZE=tile)
    got = flex_document_mask(positions, tile=tile)
    for name in BLOCK_MASK_FIELDS:
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=0, atol=0, msg=name)
