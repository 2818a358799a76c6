"""Anchor sampling: exact width, min(N, valid) kept, only valid/distinct/sorted, uniform, seeded."""

from __future__ import annotations

import pytest
import torch

from dflash.anchors import (
    anchor_seed,
    anchor_widths,
    bounded_width,
    has_valid_anchor,
    max_valid_anchors,
    sample_anchors,
    valid_anchor_mask,
)


def _row_with_valid(seq_len: int, num_valid: int) -> torch.Tensor:
    """A loss_mask row with exactly `num_valid` valid anchors (one supervised run of num_valid+1)."""
    row = torch.zeros(seq_len, dtype=torch.bool)
    if num_valid:
        row[2 : 2 + num_valid + 1] = True
    return row


@pytest.mark.parametrize("num_valid", [0, 1, 7, 8, 58])
def test_keeps_exactly_min_n_valid(num_valid):
    n = 8
    lm = torch.stack([_row_with_valid(64, num_valid), _row_with_valid(64, 3)])
    anchors, keep = sample_anchors(lm, n, generator=torch.Generator().manual_seed(0))
    assert anchors.shape == (2, n) and keep.shape == (2, n)
    assert anchors.dtype == torch.long and keep.dtype == torch.bool
    assert keep[0].sum().item() == min(n, num_valid)  # no "- 1": k <= N valid keeps all k
    assert keep[1].sum().item() == 3
    assert (anchors[~keep] == 0).all()  # padded slots hold a safe position


def test_zero_valid_row_is_all_false_without_error():
    lm = torch.zeros(3, 16, dtype=torch.bool)
    lm[1, 5] = True  # isolated supervised token: still no valid anchor
    anchors, keep = sample_anchors(lm, 4)
    assert not keep.any() and (anchors == 0).all()


def test_only_valid_distinct_sorted():
    g = torch.Generator().manual_seed(1)
    lm = torch.rand(16, 50, generator=g) < 0.6
    valid = valid_anchor_mask(lm)
    for _ in range(20):
        anchors, keep = sample_anchors(lm, 12, generator=g)
        for b in range(lm.shape[0]):
            kept = anchors[b][keep[b]]
            assert valid[b, kept].all()
            assert len(set(kept.tolist())) == len(kept)
            assert torch.equal(kept, kept.sort().values)
            # kept slots come first
            assert not (keep[b, 1:] & ~keep[b, :-1]).any()
            assert keep[b].sum() == min(12, int(valid[b].sum()))


def test_width_larger_than_sequence_is_padded():
    lm = torch.ones(2, 6, dtype=torch.bool)  # 5 valid anchors per row, S = 6 < N
    anchors, keep = sample_anchors(lm, 10)
    assert anchors.shape == (2, 10)
    assert keep.sum(dim=1).tolist() == [5, 5]
    assert anchors[keep].view(2, 5).tolist() == [[0, 1, 2, 3, 4]] * 2


def test_uniform_over_valid_positions_chi_square():
    # 20 valid positions, 5 drawn per row: each position is picked with probability 1/4.
    lm = _row_with_valid(32, 20).unsqueeze(0).expand(2000, -1).contiguous()
    g = torch.Generator().manual_seed(123)
    counts = torch.zeros(32)
    for _ in range(5):
        anchors, keep = sample_anchors(lm, 5, generator=g)
        counts.index_add_(0, anchors[keep], torch.ones(int(keep.sum())))
    observed = counts[2:22]
    expected = observed.sum() / 20
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    # 19 degrees of freedom: the 99.9% quantile is 43.8
    assert chi2 < 43.8, chi2
    assert counts[:2].sum() == 0 and counts[22:].sum() == 0


def test_generator_controls_draws():
    lm = torch.ones(4, 64, dtype=torch.bool)
    a1, _ = sample_anchors(lm, 8, generator=torch.Generator().manual_seed(0))
    a2, _ = sample_anchors(lm, 8, generator=torch.Generator().manual_seed(0))
    a3, _ = sample_anchors(lm, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a1, a2)
    assert not torch.equal(a1, a3)
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    b1, _ = sample_anchors(lm, 8, generator=g)
    g.set_state(state)
    b2, _ = sample_anchors(lm, 8, generator=g)
    assert torch.equal(b1, b2)


def test_anchor_seed_differs_by_rank_and_step():
    seeds = {anchor_seed(0, r, s) for r in range(4) for s in range(100)}
    assert len(seeds) == 400
    assert anchor_seed(3, 1, 7) == anchor_seed(3, 1, 7)
    assert all(0 <= s < 2**63 for s in seeds)


def test_anchor_widths_are_few_and_end_at_n():
    assert anchor_widths(32, 4) == [8, 16, 24, 32]
    assert anchor_widths(100, 3) == [34, 67, 100]
    assert anchor_widths(5, 8) == [1, 2, 3, 4, 5]
    assert anchor_widths(64, 1) == [64]
    with pytest.raises(ValueError):
        anchor_widths(64, 0)


def test_bounded_width_host_side():
    lm = torch.zeros(2, 300, dtype=torch.bool)
    lm[0, :71] = True  # 70 valid
    lm[1, :11] = True  # 10 valid
    assert bounded_width(lm, anchor_widths(512, 4)) == 128
    assert bounded_width(lm, anchor_widths(64, 4)) == 64  # more valid anchors than N: N
    assert bounded_width(lm, [70, 80]) == 70
    assert bounded_width(torch.zeros(2, 10, dtype=torch.bool), anchor_widths(512, 4)) == 128
    with pytest.raises(ValueError):
        bounded_width(lm.to("meta"), [512])


def test_max_valid_anchors():
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1], [1, 0, 1, 0, 1, 0, 1], [0] * 7], dtype=torch.bool)
    assert max_valid_anchors(mask) == 3  # row 0: positions 1, 2, 5
    assert max_valid_anchors(torch.zeros(2, 1, dtype=torch.bool)) == 0
    with pytest.raises(ValueError, match="host tensor"):
        max_valid_anchors(mask.to("meta"))


def test_has_valid_anchor_is_the_same_rule_on_a_row():
    """Tokenization keeps a row when it has a valid anchor: some i with loss_mask[i] and loss_mask[i+1]."""
    for row in ([], [1], [1, 0, 1, 0, 1], [0, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]):
        expected = any(row[i] and row[i + 1] for i in range(len(row) - 1))
        assert has_valid_anchor(row) == expected
        if row:
            assert has_valid_anchor(row) == bool(valid_anchor_mask(torch.tensor([row])).any())


def test_rejects_nonpositive_width():
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(torch.ones(1, 4, dtype=torch.bool), 0)

