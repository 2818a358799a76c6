"""Run by tests/test_distributed.py under `accelerate launch --multi_gpu --num_processes 2` (CPU, gloo), and
by tests/test_kinds_distributed.py under `torch.distributed.run --nproc_per_node 2` (one launch per kind of
HEAD_VARIANTS: `domino`, `dflash2`, `dspark`).

    python tests/dist_worker.py OUT            DDP: one step on each rank's half of a fixed batch with
                                               fixed anchors (the optimizer update held back so the
                                               all-reduced gradients can be compared), then the anchors
                                               each rank draws in a normal step.
    python tests/dist_worker.py OUT fsdp2      FSDP2: two full steps (2 micro-batches each, updates
                                               applied) on each rank's half of the batch, recording the
                                               gathered gradients before each update, the updated
                                               weights and the reduce-scatters issued; then a step with
                                               a non-finite loss (must be skipped) and a step inside
                                               forbid_syncs().
    python tests/dist_worker.py OUT KIND       `draft.kind: KIND` (domino, dflash2, dspark), under DDP then
                                               FSDP2, for each of its HEAD_VARIANTS (DFlash 2: both
                                               `dflash2.selector_gold`s; DSpark: both heads, Markov head of
                                               rank 8; Domino: base-loss weight 0.5, without and with
                                               scheduled sampling):
                                               two full steps on each rank's half of a batch whose rank-0
                                               rows are nearly unsupervised (the gradients before each
                                               update, the updated weights, the metrics), then a step
                                               inside forbid_syncs().
    python tests/dist_worker.py OUT muon       `optim.optimizer: muon` under DDP: one full step (the update
                                               applied) on each rank's half of the fixed batch; both ranks'
                                               weights after it, and the names Muon updates.

Rank 0 writes everything to OUT.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from helpers import KIND_HEADS, make_tiny_target, random_batch, tiny_config  # noqa: E402

from dflash.anchors import reseed, sample_anchors  # noqa: E402
from dflash.diagnostics import forbid_syncs  # noqa: E402
from dflash.factory import build_draft  # noqa: E402
from dflash.runtime import shutdown_distributed  # noqa: E402
from dflash.trainer import DFlashTrainer  # noqa: E402

# The FSDP2 comparison: 2 micro-batches per step, 2 steps, clipping active (the grad norm is ~6).
FSDP2_CONFIG = {"distributed": "fsdp2", "optim__grad_accum": 2, "optim__max_grad_norm": 1.0}
FSDP2_STEPS = 2
FSDP2_DRAFT_SEED = 1000  # + rank: the seed each rank builds its draft with


def fixed_plan():
    """The 4-row batch (unequal supervised counts) and its anchors, identical in every process."""
    batch = random_batch(batch=4, seed=1)
    batch["loss_mask"][0, 10:] = False
    anchors, keep = sample_anchors(batch["loss_mask"], 8, generator=torch.Generator().manual_seed(0))
    return batch, anchors, keep


def fixed_anchors(anchors: torch.Tensor, keep: torch.Tensor, rows: Sequence[int]):
    """A stand-in for `sample_anchors` that hands out the fixed anchors of `rows` in order, as many rows
    per call as the micro-batch has, wrapping around at the end of `rows` (so every step repeats)."""
    position = 0

    def sample(loss_mask, n, generator=None, **_):
        nonlocal position
        take = [rows[(position + j) % len(rows)] for j in range(loss_mask.shape[0])]
        position = (position + loss_mask.shape[0]) % len(rows)
        return anchors[take], keep[take]

    return sample


def main_ddp(out: Path, position_weights: str = "decay") -> None:
    torch.manual_seed(0)
    trainer = DFlashTrainer(tiny_config(draft__position_weights=position_weights), target=make_tiny_target())
    rank, world = trainer.rank, trainer.world_size
    assert world == 2, world
    batch, anchors, keep = fixed_plan()
    rows = slice(2 * rank, 2 * rank + 2)
    mine = {k: v[rows] for k, v in batch.items()}
    import dflash.objective as objective

    real_sample = objective.sample_anchors
    objective.sample_anchors = lambda loss_mask, n, generator=None, **_: (anchors[rows], keep[rows])
    trainer.optimizer.step = lambda: None  # keep the all-reduced gradients for comparison
    trainer.optimizer.zero_grad = lambda set_to_none=True: None
    trainer.train_step(mine)
    grads = {n: p.grad.clone() for n, p in trainer.draft.named_parameters()}
    metrics = trainer.metrics.flush()
    objective.sample_anchors = real_sample
    generator = reseed(trainer.anchor_generator, trainer.config.seed, trainer.rank, 0)
    drawn, _, _ = trainer.objective.plan(mine["input_ids"], mine["loss_mask"], generator)
    gathered = [torch.zeros_like(drawn) for _ in range(world)]
    dist.all_gather(gathered, drawn)
    if rank == 0:
        torch.save({"grads": grads, "metrics": metrics, "anchors": gathered,
                    "init": {n: p.detach().clone() for n, p in trainer.draft.named_parameters()}}, out)
    dist.barrier()


def main_ddp_muon(out: Path) -> None:
    torch.manual_seed(0)
    trainer = DFlashTrainer(tiny_config(optim__optimizer="muon"), target=make_tiny_target())
    rank = trainer.rank
    batch, anchors, keep = fixed_plan()
    rows = slice(2 * rank, 2 * rank + 2)
    init = {n: p.detach().clone() for n, p in trainer.draft.named_parameters()}  # after DDP's broadcast
    import dflash.objective as objective

    objective.sample_anchors = lambda loss_mask, n, generator=None, **_: (anchors[rows], keep[rows])
    trainer.train_step({k: v[rows] for k, v in batch.items()})
    after = [None] * trainer.world_size
    dist.all_gather_object(after, {n: p.detach().clone() for n, p in trainer.draft.named_parameters()})
    names = {p: n for n, p in trainer.draft.named_parameters()}
    muon = sorted(names[p] for group in trainer.optimizer.parts[0].param_groups for p in group["params"])
    if rank == 0:
        torch.save({"init": init, "after": after, "muon": muon}, out)
    dist.barrier()


def main_fsdp2(out: Path) -> None:
    from torch.distributed.tensor import DTensor

    import dflash.objective as objective

    target = make_tiny_target()
    # Each rank builds different initial weights (different seeds): rank 0's must win, as under DDP.
    trainer = DFlashTrainer(tiny_config(**FSDP2_CONFIG, seed=FSDP2_DRAFT_SEED + int(os.environ["RANK"])),
                            target=target)
    rank, world = trainer.rank, trainer.world_size
    assert world == 2 and trainer.fsdp, (world, trainer.fsdp)
    params = dict(trainer.draft.named_parameters())
    assert all(isinstance(p, DTensor) for p in params.values()), "fully_shard left plain parameters"
    shard_rows = {n: p.to_local().shape[0] for n, p in params.items()}
    init = trainer.draft_state_dict()

    batch, anchors, keep = fixed_plan()
    mine = {k: v[2 * rank: 2 * rank + 2] for k, v in batch.items()}
    objective.sample_anchors = fixed_anchors(anchors, keep, range(2 * rank, 2 * rank + 2))

    reduce_scatters = []  # FSDP2 issues its gradient reduce-scatters through this function
    real_reduce_scatter = dist.reduce_scatter_single

    def counting_reduce_scatter(*args, **kwargs):
        reduce_scatters.append(trainer.step)
        return real_reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counting_reduce_scatter
    grads = []  # the gathered (clipped) gradients each update applies
    real_step = trainer.optimizer.step

    def recording_step():
        grads.append({n: p.grad.full_tensor().cpu() for n, p in trainer.draft.named_parameters()})  # all-gathers
        real_step()

    trainer.optimizer.step = recording_step
    for _ in range(FSDP2_STEPS):
        trainer.train_step(mine)
    dist.reduce_scatter_single = real_reduce_scatter
    trainer.optimizer.step = real_step
    metrics = trainer.metrics.flush()
    updated = trainer.draft_state_dict()

    # A non-finite loss: the update must be skipped on every shard (weights unchanged), and counted.
    real_forward = trainer.objective.forward

    def nan_forward(*args, **kwargs):
        result = real_forward(*args, **kwargs)
        return dataclasses.replace(result, loss_sum=result.loss_sum * float("nan"))

    trainer.objective.forward = nan_forward
    trainer.train_step(mine)
    trainer.objective.forward = real_forward
    after_nan = trainer.draft_state_dict()
    nan_metrics = trainer.metrics.flush()

    # Invariant 1 under FSDP2: a non-log step reads nothing back to the host (raises SyncError otherwise).
    with forbid_syncs():
        trainer.train_step(mine)
    trainer.metrics.flush()

    if rank == 0:
        torch.save({"init": init, "grads": grads, "updated": updated, "metrics": metrics, "after_nan": after_nan,
                    "nan_metrics": nan_metrics, "reduce_scatters": reduce_scatters, "shard_rows": shard_rows}, out)
    dist.barrier()


# Draft kinds with heads of their own (`draft.kind`), each under DDP then FSDP2, 2 micro-batches per step, clipping
# active: the config keys of each variant of a kind. DFlash 2: both selector golds; DSpark: both heads, rank 8;
# Domino: the base CE weighted 0.5 (at 1 the head would get zero gradients), then also a quarter of the GRU's inputs
# drawn from the draft's own base predictions (scheduled sampling: per-row draws from the anchor generator).
DOMINO_MIXED = {**KIND_HEADS["domino"], "domino__lambda_start": 0.5}
HEAD_VARIANTS = {
    "domino": {"mixed": DOMINO_MIXED, "sampled": {**DOMINO_MIXED, "domino__scheduled_sampling": 0.25}},
    "dflash2": {gold: {**KIND_HEADS["dflash2"], "dflash2__selector_gold": gold} for gold in ("strict", "insert")},
    "dspark": {"vanilla": KIND_HEADS["dspark"]},
}
HEAD_STEPS = 2
# Where the objectives draw their anchors: every kind's `plan` draws through `DFlashObjective.sample`.
ANCHOR_SAMPLERS = ("dflash.objective",)


def head_runs(kind: str) -> list[tuple[str, str]]:
    """Every (distributed mode, variant) pair of `kind`."""
    return [(mode, variant) for mode in ("ddp", "fsdp2") for variant in HEAD_VARIANTS[kind]]


def head_config(kind: str, mode: str, variant: str):
    return tiny_config(**HEAD_VARIANTS[kind][variant], distributed=mode, optim__grad_accum=2, optim__max_grad_norm=1.0)


def uneven_plan():
    """The 4-row batch and its anchors: rows 0-1 (rank 0's) supervise 3 tokens, so they keep 2 anchors each
    against 8 in rows 2-3: the window's global weight sum, not a rank's, must divide every loss term."""
    batch = random_batch(batch=4, seed=1)
    batch["loss_mask"][:2, 7:] = False
    anchors, keep = sample_anchors(batch["loss_mask"], 8, generator=torch.Generator().manual_seed(0))
    return batch, anchors, keep


def use_anchors(sample, setattr_=setattr) -> None:
    """Make every objective draw its anchors with `sample` (`setattr_`: a test's `monkeypatch.setattr`)."""
    for module in ANCHOR_SAMPLERS:
        setattr_(importlib.import_module(module), "sample_anchors", sample)


def head_trainer(kind: str, mode: str, variant: str) -> DFlashTrainer:
    """A trainer of `kind` whose draft has every weight non-trivial, alike in every process (a fresh DFlash 2
    draft's successor codebook is 0: the selector's other weights would get no gradient in the first step)."""
    config, target = head_config(kind, mode, variant), make_tiny_target()
    torch.manual_seed(config.seed)
    draft = build_draft(config, target, None)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return DFlashTrainer(config, target=target, draft=draft)


def copied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in state.items()}  # a CPU state dict may share the parameters' storage


def head_steps(trainer: DFlashTrainer, batch: dict[str, torch.Tensor]) -> dict:
    """HEAD_STEPS steps on `batch`: the whole gradients each update applies, the weights before and after
    (both collectives under FSDP2: call on every rank) and the metrics."""
    init, grads, real_step = copied(trainer.draft_state_dict()), [], trainer.optimizer.step

    def recording_step():
        grads.append({n: (p.grad.full_tensor() if trainer.fsdp else p.grad).detach().clone().cpu()
                      for n, p in trainer.draft.named_parameters()})
        real_step()

    trainer.optimizer.step = recording_step
    for _ in range(HEAD_STEPS):
        trainer.train_step(batch)
    trainer.optimizer.step = real_step
    return {"init": init, "grads": grads, "updated": copied(trainer.draft_state_dict()), "metrics": trainer.metrics.flush()}


def launch_two_ranks(kind: str, out: Path) -> dict:
    """The test side: this file's `kind` branch on 2 ranks (`torch.distributed.run`, CPU, gloo); rank 0's results."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, str(out), kind]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out)


def assert_two_ranks_equal_one(two: dict, one: dict, metrics: tuple[str, ...]) -> None:
    """The test side: `head_steps` on two ranks (`two`, from rank 0) equals it in one process on the concatenated
    batch (`one`): the same start, every weight's gradient before each update (each one nonzero), the weights
    after the updates (each one moved) and the window's `metrics`."""
    for name, p in one["init"].items():
        assert torch.equal(two["init"][name], p), f"{name}: the ranks did not start from the same weights"
    assert len(two["grads"]) == len(one["grads"]) == HEAD_STEPS
    for step, (ranked, single) in enumerate(zip(two["grads"], one["grads"], strict=True)):
        assert ranked.keys() == single.keys()
        for name, g in single.items():
            top = g.abs().max()
            assert top > 0, f"step {step}: {name} got no gradient"
            # fp32 sums in another order, amplified by AdamW's first update (nearly sign(g) where g is ~0)
            torch.testing.assert_close(ranked[name], g, rtol=1e-4, atol=1e-5 * top.item(),
                                       msg=lambda m, at=f"step {step}: {name}": f"{at}: {m}")
    for name, p in one["updated"].items():
        assert not torch.equal(p, one["init"][name]), f"{name} was not updated"
        torch.testing.assert_close(two["updated"][name], p, rtol=1e-4, atol=1e-5, msg=lambda m, at=name: f"{at}: {m}")
    for key in metrics:
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key
    assert one["metrics"]["grad_norm"] > 1.0  # clipping (max_grad_norm 1) was active


def main_heads(out: Path, kind: str) -> None:
    """Every run of `kind` (`head_runs`) on each rank's half of `uneven_plan`, then a step inside forbid_syncs()."""
    batch, anchors, keep = uneven_plan()
    results = {}
    for mode, variant in head_runs(kind):
        trainer = head_trainer(kind, mode, variant)
        rank = trainer.rank
        assert trainer.world_size == 2 and trainer.fsdp == (mode == "fsdp2"), (trainer.world_size, trainer.fsdp)
        mine = {k: v[2 * rank: 2 * rank + 2] for k, v in batch.items()}
        use_anchors(fixed_anchors(anchors, keep, range(2 * rank, 2 * rank + 2)))
        record = head_steps(trainer, mine)
        with forbid_syncs(raise_on_first=False) as report:  # invariant 1: a non-log step reads nothing back
            trainer.train_step(mine)
        trainer.metrics.flush()
        findings = [None, None]
        dist.all_gather_object(findings, [str(f) for f in report.findings])
        results[mode, variant] = {**record, "sync_findings": findings}
        del trainer
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()


if __name__ == "__main__":
    if sys.argv[2:] == ["fsdp2"]:
        main_fsdp2(Path(sys.argv[1]))
    elif sys.argv[2:] == ["muon"]:
        main_ddp_muon(Path(sys.argv[1]))
    elif len(sys.argv) == 3 and sys.argv[2] in HEAD_VARIANTS:
        main_heads(Path(sys.argv[1]), sys.argv[2])
    else:  # DDP, with the position weights named after the output path (default: decay)
        main_ddp(Path(sys.argv[1]), *sys.argv[2:])
    shutdown_distributed()  # the trainers are gone: their DDP reducers before the group, not at exit (SIGABRT)
