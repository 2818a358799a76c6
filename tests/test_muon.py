"""`optim.optimizer: muon`: torch's Muon step with a device lr, clipping and skip as tensors, sync-free."""

from __future__ import annotations

import pytest
import torch
from helpers import DOMINO_HEAD, make_tiny_target, random_batch, tiny_config

from dflash.config import TrainConfig
from dflash.diagnostics import forbid_syncs
from dflash.optim import DraftOptimizers, Muon, build_optimizer, muon_matrices
from dflash.trainer import DFlashTrainer

SHAPES = [(12, 5), (5, 12), (8, 8)]  # tall, wide (Newton-Schulz transposes it), square


def _matrices(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*s, generator=g) for s in SHAPES]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_step_equals_torch_muon_with_a_float_lr(weight_decay):
    """Ours reads the lr from a tensor and applies clipping as `grad_scale`; torch's reads a float and takes the
    clipped gradient. Same matrices, gradients and steps: the same weights (torch's RMS-matched lr adjustment)."""
    ours, ref = _matrices(), _matrices()
    lr = torch.tensor(0.02)
    mine = Muon(ours, lr, weight_decay)
    theirs = torch.optim.Muon(ref, lr=0.02, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
    for step in range(4):
        scale = torch.tensor(1.0 + step)  # the trainer's clip factor: gradients are divided by it
        for p, q, grad in zip(ours, ref, _grads(step), strict=True):
            p.grad, q.grad = grad.clone(), grad / scale
        mine.grad_scale = scale
        mine.step()
        theirs.step()
        for p, q in zip(ours, ref, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_skipped_step_leaves_weights_and_momentum_even_with_nan_gradients():
    params, again = _matrices(), _matrices()
    opt, clean = Muon(params, torch.tensor(0.02), 0.1), Muon(again, torch.tensor(0.02), 0.1)
    opt.found_inf = torch.tensor(0.0)
    for p, q, grad in zip(params, again, _grads(0), strict=True):
        p.grad, q.grad = grad.clone(), grad.clone()
    opt.step()
    clean.step()
    for p, grad in zip(params, _grads(1), strict=True):
        p.grad = torch.full_like(grad, float("nan"))
    opt.found_inf = torch.tensor(1.0)
    opt.step()  # skipped: nothing moves, not even the momentum
    assert all(torch.isfinite(p).all() for p in params)
    opt.found_inf = torch.tensor(0.0)
    for p, q, grad in zip(params, again, _grads(2), strict=True):
        p.grad, q.grad = grad.clone(), grad.clone()
    opt.step()
    clean.step()
    for p, q in zip(params, again, strict=True):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], clean.state[q]["momentum_buffer"])


@pytest.mark.parametrize("head", [{}, DOMINO_HEAD], ids=["dflash", "domino"])
def test_muon_trains_the_layers_and_fc_matrices_and_adamw_the_rest(head):
    """Domino's GRU and embedding tables are 2-D too: they stay with AdamW, as Muon's authors leave such tables."""
    trainer = DFlashTrainer(tiny_config(optim__optimizer="muon", **head), target=make_tiny_target())
    opt = trainer.optimizer
    assert isinstance(opt, DraftOptimizers)
    muon, adamw = opt.parts
    names = {p: n for n, p in trainer.draft.named_parameters()}
    in_muon = {names[p] for group in muon.param_groups for p in group["params"]}
    assert in_muon == {n for n, p in trainer.draft.named_parameters() if p.dim() == 2 and (
        n == "fc.weight" or n.startswith("layers."))}
    in_adamw = {names[p] for group in adamw.param_groups for p in group["params"]}
    assert in_muon.isdisjoint(in_adamw) and in_muon | in_adamw == {n for n, p in trainer.draft.named_parameters()
                                                                    if p.requires_grad}
    assert any("norm" in n for n in in_adamw)
    assert muon_matrices(trainer.draft) == {p for group in muon.param_groups for p in group["params"]}
    # the lr is the trainer's schedule tensor itself, in both parts (no copy, no host float)
    assert all(group["lr"] is trainer.lr for group in opt.param_groups)


def test_the_pair_gives_clipping_and_the_skip_to_both_parts():
    """The trainer sets `grad_scale` / `found_inf` on the pair as on a lone fused AdamW: both parts must read them.
    With `found_inf` 1 neither part's weights move; the same gradients unskipped move both."""
    trainer = DFlashTrainer(tiny_config(optim__optimizer="muon"), target=make_tiny_target())
    opt, draft = trainer.optimizer, trainer.draft
    scale, skip = torch.tensor(2.0), torch.tensor(1.0)
    opt.grad_scale, opt.found_inf = scale, skip
    assert opt.grad_scale is scale and opt.found_inf is skip
    assert all(part.grad_scale is scale and part.found_inf is skip for part in opt.parts)
    before = {n: p.detach().clone() for n, p in draft.named_parameters() if p.requires_grad}
    for p in draft.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    opt.step()  # skipped
    assert all(torch.equal(p, before[n]) for n, p in draft.named_parameters() if n in before)
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    moved = {n for n, p in draft.named_parameters() if n in before and not torch.equal(p, before[n])}
    muon, adamw = ({n for n, p in draft.named_parameters() if any(p is q for g in part.param_groups for q in g["params"])}
                   for part in opt.parts)
    assert moved & muon and moved & adamw


def test_muon_steps_make_no_sync_and_the_loss_falls():
    trainer = DFlashTrainer(tiny_config(optim__optimizer="muon", optim__grad_accum=2, optim__lr=2e-2), target=make_tiny_target())
    batch = random_batch(batch=4)
    trainer.train_step(batch)
    first = trainer.metrics.flush()["loss"]
    with forbid_syncs(raise_on_first=False) as report:
        for _ in range(20):
            trainer.train_step(batch)
    assert report.findings == [], report
    assert trainer.metrics.flush()["loss"] < 0.7 * first  # the same batch: Muon fits it (AdamW's lr 1e-3 is slower here)


def test_torch_muon_with_a_tensor_lr_syncs():
    """Why `Muon` is ours: torch's applies its lr as an `add_` alpha, a host read of a device lr."""
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.Muon([w], lr=torch.tensor(0.01))
    w.grad = torch.randn(4, 3)
    opt.step()
    with forbid_syncs(raise_on_first=False) as report:
        opt.step()
    assert report.findings


def test_muon_under_fsdp2_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="distributed: ddp, or optim.optimizer: adamw"):
        TrainConfig.from_sources(None, ["optim.optimizer=muon", "distributed=fsdp2"], presets=False)
    with pytest.raises(ValueError, match="optim.optimizer"):
        TrainConfig.from_sources(None, ["optim.optimizer=sgd"], presets=False)


def test_muon_refuses_a_draft_whose_matrices_it_cannot_find():
    """A wrapped draft (DDP's names start with `module.`) would silently train with AdamW alone."""
    trainer = DFlashTrainer(tiny_config(), target=make_tiny_target())
    wrapped = torch.nn.ModuleDict({"module": trainer.draft})
    settings = TrainConfig.from_sources(None, ["optim.optimizer=muon"], presets=False).optim
    with pytest.raises(ValueError, match="found no trainable linear layer"):
        build_optimizer(wrapped, settings, trainer.lr, capturable=False)
