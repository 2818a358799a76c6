"""D-PACE position weights: the closed form, no gradient through them, and the loss they make."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import make_tiny_target, random_batch, tiny_config

from dflash.diagnostics import forbid_syncs
from dflash.factory import build_objective
from dflash.losses import dpace_weights


def _closed_form(ce: list[float], valid: list[bool], alpha: float) -> list[float]:
    """w_j = sum_{m >= j} prod_{i <= m} q~_i, the chain ending at the first invalid slot."""
    q = [(1 - alpha) * math.exp(-c) + alpha if v else 0.0 for c, v in zip(ce, valid, strict=True)]
    out = []
    for j in range(len(ce)):
        if not valid[j]:
            out.append(0.0)
            continue
        out.append(sum(math.prod(q[: m + 1]) for m in range(j, len(ce))))
    return out


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_dpace_weights_match_the_closed_form(alpha):
    g = torch.Generator().manual_seed(0)
    ce = torch.rand(3, 5, 7, generator=g, dtype=torch.float64) * 3
    valid = torch.rand(3, 5, 7, generator=g) < 0.8
    weights = dpace_weights(ce, valid, alpha)
    for b in range(3):
        for n in range(5):
            expected = _closed_form(ce[b, n].tolist(), valid[b, n].tolist(), alpha)
            torch.testing.assert_close(weights[b, n].double(), torch.tensor(expected, dtype=torch.float64),
                                       rtol=1e-5, atol=1e-6)
    if alpha == 1.0:  # full smoothing: slot j of a fully valid block weighs the slots from j to the end
        full = dpace_weights(torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool), 1.0)
        assert full.tolist() == [[4.0, 3.0, 2.0, 1.0]]


def test_dpace_weights_carry_no_gradient():
    ce = torch.rand(2, 3, 4, requires_grad=True)
    weights = dpace_weights(ce, torch.ones(2, 3, 4, dtype=torch.bool), 0.5)
    assert not weights.requires_grad and weights.grad_fn is None


def test_dpace_loss_and_gradient_equal_a_plain_reference():
    """The objective's D-PACE loss is sum(w.detach() * CE) over the supervised slots, its gradient that of
    the reference on full logits, and the planned weights (the denominator) are the slot count."""
    cfg = tiny_config(draft__position_weights="dpace", draft__dpace_alpha=0.25)
    objective = build_objective(cfg, make_tiny_target(), None, device=torch.device("cpu"), dtype=torch.float32)
    batch = random_batch()
    anchors, keep, targets = objective.plan(batch["input_ids"], batch["loss_mask"], torch.Generator().manual_seed(0))
    assert torch.equal(targets.weights, targets.valid.float())
    with forbid_syncs():
        out = objective(batch["input_ids"], anchors, keep, targets)
    out.loss_sum.backward()
    grads = {n: p.grad.clone() for n, p in objective.draft.named_parameters() if p.grad is not None}
    objective.draft.zero_grad(set_to_none=True)

    hidden, labels = objective.draft_hidden(batch["input_ids"], anchors, keep, targets)
    logits = hidden[:, :, 1:].float() @ objective.target.lm_head_weight.float().T
    valid = targets.valid[..., 1:]
    ce = F.cross_entropy(logits.flatten(0, 2), labels[..., 1:].flatten(), reduction="none").view(valid.shape)
    ce = torch.where(valid, ce, 0.0)
    weights = dpace_weights(ce, valid, 0.25)
    reference = (weights * ce).sum()
    reference.backward()
    torch.testing.assert_close(out.loss_sum, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.ce_sum, ce.sum().detach(), rtol=1e-5, atol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, dict(objective.draft.named_parameters())[name].grad, rtol=1e-4, atol=1e-6,
                                   msg=name)


def test_dpace_is_refused_for_domino_drafts_and_alpha_is_checked():
    with pytest.raises(ValueError, match="does not support draft.position_weights: dpace: it is for DFlash drafts"):
        tiny_config(draft__kind="domino", draft__position_weights="dpace").validate()
    with pytest.raises(ValueError, match="dpace_alpha"):
        tiny_config(draft__position_weights="dpace", draft__dpace_alpha=1.5).validate()
    with pytest.raises(ValueError, match="position_weights"):
        tiny_config(draft__position_weights="linear").validate()
