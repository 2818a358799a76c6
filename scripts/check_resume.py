"""Resume on a GPU: a run stopped at step k and resumed matches an uninterrupted run within bf16 noise.

For each step mode (eager, and `cuda_graph: true`) three runs of `--steps` steps train the same draft
on the same data (SmolLM2-135M-shaped random target, bf16, flex attention):
  A  straight through,
  A' straight through again (the run-to-run noise floor of this GPU: atomics in backward kernels),
  B  interrupted by SIGTERM after step k = steps // 2 (clean save), then resumed from `latest`.
Per-step losses (log_interval 1) and the final weights of B are compared with A. PASS when B's
largest relative loss difference and its relative weight difference are within `--tolerance` (bf16
noise), printed next to the A-vs-A' figures for scale. On CPU it runs tiny shapes (bit-identical
there; tests/test_reliability.py asserts that in CI). Ends with one summary line.

    python scripts/check_resume.py
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from check_sync_free import config, rows, tiny_llama  # noqa: E402

from dflash.report.sinks import read_history  # noqa: E402
from dflash.trainer import DFlashTrainer  # noqa: E402


def train(out: Path, cuda: bool, steps: int, graph: bool, stop_at: int | None = None, resume: bool = False):
    """One run into `out`; returns (per-step losses, final draft weights, initial draft weights)."""
    import datasets

    cfg = config(cuda, cuda_graph=graph)
    cfg.output_dir, cfg.max_steps, cfg.log_interval = str(out), steps, 1
    cfg.save_interval, cfg.eval_interval, cfg.spec_eval_prompts, cfg.progress_bar = 10**9, 0, 0, False
    cfg.data.num_workers = 0
    if resume:
        cfg.resume_from = "latest"
    seq, vocab = (512, 49_152) if cuda else (64, 256)
    data = datasets.Dataset.from_list(rows(64, seq, vocab, prompt=seq // 4))
    torch.manual_seed(0)  # the same target and draft initialisation in every run
    trainer = DFlashTrainer(cfg, target=tiny_llama(cuda), tokenizer=None, dataset=data)
    initial = {k: v.detach().float().cpu().clone() for k, v in trainer.draft.state_dict().items()}
    if stop_at is not None:
        step = trainer.train_step

        def step_then_sigterm(batch):
            step(batch)
            if trainer.step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)  # a pre-emption notice: finish the step, save, return

        trainer.train_step = step_then_sigterm
    trainer.fit()
    losses = {r["step"]: r["loss"] for r in read_history(out) if "loss" in r}
    return losses, {k: v.float().cpu() for k, v in trainer.draft.state_dict().items()}, initial


def weight_difference(wa: dict[str, torch.Tensor], wb: dict[str, torch.Tensor]) -> float:
    """Relative L2 difference of two state dicts, over all weights."""
    num = sum((wa[k] - wb[k]).pow(2).sum() for k in wa) ** 0.5
    return float(num / sum(wa[k].pow(2).sum() for k in wa) ** 0.5)


def compare(a, b) -> tuple[float, float]:
    """(max relative loss difference over common steps, relative L2 difference of the final weights)."""
    (la, wa, _), (lb, wb, _) = a, b
    if sorted(la) != sorted(lb):
        raise AssertionError(f"logged steps differ: {sorted(la)} vs {sorted(lb)}")
    loss = max(abs(la[s] - lb[s]) / max(abs(la[s]), 1e-12) for s in la)
    return loss, weight_difference(wa, wb)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tolerance", type=float, default=1e-2, help="max relative loss / weight difference")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    modes = [("eager", False)] + ([("cuda_graph", True)] if cuda else [])
    parts, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for name, graph in modes:
            root = Path(tmp) / name
            straight = train(root / "a", cuda, args.steps, graph)
            repeat = train(root / "a2", cuda, args.steps, graph)
            train(root / "b", cuda, args.steps, graph, stop_at=args.steps // 2)
            resumed = train(root / "b", cuda, args.steps, graph, resume=True)
            noise, resume = compare(straight, repeat), compare(straight, resumed)
            ok &= resume[0] <= args.tolerance and resume[1] <= args.tolerance
            moved = weight_difference(straight[2], straight[1])
            ok &= moved > args.tolerance  # training moved the weights further than the tolerance: equality means something
            print(f"{name}: losses {straight[0][1]:.4f} -> {straight[0][args.steps]:.4f}, weights moved {moved:.2e} "
                  "from init; resumed vs straight: "
                  f"loss {resume[0]:.2e}, weights {resume[1]:.2e}; repeat vs straight: loss {noise[0]:.2e}, "
                  f"weights {noise[1]:.2e}")
            parts.append(f"{name} resumed-vs-straight loss {resume[0]:.1e} weights {resume[1]:.1e} "
                         f"(repeat {noise[0]:.1e}/{noise[1]:.1e})")
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"check_resume ({device}, stop at {args.steps // 2} of {args.steps}): " + "; ".join(parts)
          + (": PASS" if ok else ": FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
