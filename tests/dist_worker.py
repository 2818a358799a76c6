"""Run by tests/test_distributed.py under `accelerate launch --cpu --num_processes 2`.

Each rank trains on its half of a fixed batch with fixed anchors (one step, the optimizer update
held back so the all-reduced gradients can be compared), then records the anchors it draws in a
normal step. Rank 0 writes everything to OUT.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from conftest import make_tiny_target, random_batch, tiny_config  # noqa: E402
from dflash.anchors import sample_anchors  # noqa: E402
from dflash.trainer import DFlashTrainer  # noqa: E402


def fixed_plan():
    """The 4-row batch (unequal supervised counts) and its anchors, identical in every process."""
    batch = random_batch(batch=4, seed=1)
    batch["loss_mask"][0, 10:] = False
    anchors, keep = sample_anchors(batch["loss_mask"], 8, generator=torch.Generator().manual_seed(0))
    return batch, anchors, keep


def main(out: Path) -> None:
    torch.manual_seed(0)
    trainer = DFlashTrainer(tiny_config(), target=make_tiny_target())
    rank, world = trainer.rank, trainer.world_size
    assert world == 2, world
    batch, anchors, keep = fixed_plan()
    rows = slice(2 * rank, 2 * rank + 2)
    mine = {k: v[rows] for k, v in batch.items()}
    import dflash.objective as objective

    real_sample = objective.sample_anchors
    objective.sample_anchors = lambda loss_mask, n, generator=None: (anchors[rows], keep[rows])
    trainer.optimizer.step = lambda: None  # keep the all-reduced gradients for comparison
    trainer.optimizer.zero_grad = lambda set_to_none=True: None
    trainer.train_step(mine)
    grads = {n: p.grad.clone() for n, p in trainer.draft.named_parameters()}
    metrics = trainer.metrics.flush()
    objective.sample_anchors = real_sample
    drawn, _, _ = trainer.objective.plan(mine["input_ids"], mine["loss_mask"], trainer._anchor_generator(0, 1))
    gathered = [torch.zeros_like(drawn) for _ in range(world)]
    dist.all_gather(gathered, drawn)
    if rank == 0:
        torch.save({"grads": grads, "metrics": metrics, "anchors": gathered,
                    "init": {n: p.detach().clone() for n, p in trainer.draft.named_parameters()}}, out)
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
