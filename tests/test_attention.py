"""The DFlash mask: dense and flex forms agree with a per-element reference of DESIGN §4."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from dflash.anchors import sample_anchors
from dflash.attention import dense_dflash_mask, flex_dflash_mask


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


@pytest.mark.parametrize("seed,compile_mask", [(0, False), (5, False), (0, True)])
def test_flex_matches_dense_forward(seed, compile_mask, monkeypatch):
    """The BlockMask gives the dense mask's attention. The GPU path builds it with
    `torch.compile(create_block_mask)`, not the `_compile` flag torch deprecated. Inductor's CPU code for
    this mask does not compile, so here torch.compile is replaced by the identity and the test checks
    that it was asked for, with no deprecation warning."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash import attention

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(fn.__name__) or fn)
    attention._compiled_create_block_mask.cache_clear()
    anchors, keep, seq_len, bs = _random_case(seed, bsz=2, seq_len=60, n=8, bs=4)
    dense = dense_dflash_mask(anchors, keep, seq_len, bs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        block_mask = flex_dflash_mask(anchors, keep, seq_len, bs, compile=compile_mask)
    attention._compiled_create_block_mask.cache_clear()
    assert compiled == (["create_block_mask"] if compile_mask else [])
    assert not [w for w in caught if "_compile" in str(w.message)]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, dense.shape[2], 16, generator=g)
    k = torch.randn(2, 2, dense.shape[3], 16, generator=g)
    v = torch.randn(2, 2, dense.shape[3], 16, generator=g)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile" on CPU
        flex = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)
