"""Compare training recipes on the embedded default, in one process, with the same number of steps.

Each variant is `dflash train` with a few overrides (the embedded default's preset fills the rest);
the target is loaded once and shared, so one flex-attention compile serves every variant. After
each run: held-out teacher-forced τ̂ (uniform anchors), the decode-chain τ̂ (dflash.evaluation.chain), and real
τ from lossless speculative decoding of the held-out prompts. Ends with one summary line.

    python scripts/compare_recipes.py --steps 1500
    python scripts/compare_recipes.py --variants regen,domino --steps 1000 key=value ...
    python scripts/compare_recipes.py --variants regen,dflash,dspark --steps 1000 --warm-steps 100 --equal-time

`--warm-steps` first trains each variant for a few steps (discarded), so its kernels are compiled (a cold
compile is 30-75 s per kind on an H200) and its step time is known. `--equal-time` then gives each variant the
steps that take the first variant's `--steps` time: steps x (the first's ms per step / its own), both read from
the warm-up's last log window. Step time, not tokens/s: a variant that changes what a step holds (`data.packing`,
the batch size, the lengths) is timed right too. (Sections of docs/benchmarks.md before the commit that made this
change scaled by tokens/s, the same ratio for their variants, which all saw the same batches.) Each run keeps its
own full schedule (warm-up and cosine over its steps), which a time budget cutting a longer schedule short would
not. `--reference-step-ms` continues a comparison begun in another process (the first variant's warm-up figure,
printed there).

Variants: regen (the default: the target's regenerated replies; the preset's kind), labels-data (human replies,
dataset tokens as labels), labels-target (human replies, the target's greedy next token as labels),
dflash and domino (those draft kinds on the regenerated replies), domino-ss (Domino with scheduled sampling 0.5),
dflash2 and dspark (those draft kinds), packed (`data.packing: true`), graph (`cuda_graph: true`), fp8
(`fp8: true`), muon and muon-lr3x (`optim.optimizer: muon`, at the preset's lr and at 3e-3), fixed-width
(`draft.anchor_widths=1`: no host-bounded width). Any other variant can be written out as
`LABEL:key=value+key=value`, e.g. `block8:draft.block_size=8` or `deep:draft.num_layers=3+optim.lr=3e-4`.
Each row also gives the training throughput and step time of its last log window, the seconds its training phase
took (the check of equal time after the fact: on an H100 the 50-step windows of one run ranged 62-93 ms, so a warm-up
window can miss a run's mean by several percent), the share of real tokens in its batches' slots, the peak
accelerator memory and the number of CUDA graphs captured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.config import TrainConfig  # noqa: E402
from dflash.runtime import resolve_device, resolve_dtype  # noqa: E402
from dflash.target_model.loading import load_target  # noqa: E402
from dflash.trainer import DFlashTrainer  # noqa: E402

VARIANTS: dict[str, list[str]] = {
    "regen": [],
    "labels-data": ["data.regenerate=false"],
    "labels-target": ["data.regenerate=false", "data.labels=target"],
    "dflash": ["draft.kind=dflash"],
    "domino": ["draft.kind=domino"],
    "domino-ss": ["draft.kind=domino", "domino.scheduled_sampling=0.5"],
    "graph": ["cuda_graph=true"],  # the hot path: every step a CUDA-graph replay (one graph per batch shape)
    "fixed-width": ["draft.anchor_widths=1"],  # every batch at the full anchor width N
    "dflash2": ["draft.kind=dflash2"],  # DFlash 2: block convolutions and the candidate selector
    "dspark": ["draft.kind=dspark"],  # DSpark: the Markov and confidence heads, slot k predicts a + k + 1
    "packed": ["data.packing=true"],  # rows packed into full sequences (issue 51): more real tokens a step
    "fp8": ["fp8=true"],  # float8 GEMMs in the draft's linear layers (torchao): its quality cost, same steps
    "muon": ["optim.optimizer=muon"],  # Muon for the layers' and fc's matrices at the same (RMS-matched) lr
    "muon-lr3x": ["optim.optimizer=muon", "optim.lr=3e-3"],  # ... at three times the CPU preset's lr
}


def parse_variant(spec: str) -> tuple[str, list[str] | None]:
    """A named variant ("muon") or one written out, "LABEL:key=value+key=value" ("block8:draft.block_size=8");
    None for an unknown name."""
    label, sep, overrides = spec.partition(":")
    return (label, overrides.split("+")) if sep else (spec, VARIANTS.get(spec))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="regen,labels-data,labels-target,domino")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--out", default="runs/compare")
    p.add_argument("--warm-steps", type=int, default=0,
                   help="train each variant this many steps first (discarded) to fill the compile cache")
    p.add_argument("--equal-time", action="store_true",
                   help="scale each variant's steps by the first variant's warm-up step time against its own")
    p.add_argument("--reference-step-ms", type=float, default=None,
                   help="with --equal-time: the ms per step that --steps refers to (default: the first variant's)")
    p.add_argument("overrides", nargs="*", help="key=value settings applied to every variant")
    args = p.parse_args()
    variants = dict(parse_variant(v) for v in args.variants.split(","))
    names = list(variants)
    if args.equal_time and args.warm_steps < 4:
        p.error("--equal-time reads each variant's throughput from its warm-up: give --warm-steps >= 4")
    unknown = [n for n, overrides in variants.items() if overrides is None]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {sorted(VARIANTS)} or write LABEL:key=value+key=value")
    common = [f"max_steps={args.steps}", "progress_bar=false", "save_interval=0", *args.overrides]
    base = TrainConfig.from_sources(None, common)
    device = resolve_device(base.device)
    model, tokenizer = load_target(base.target, resolve_dtype(base.dtype, device))
    rows, reference = [], args.reference_step_ms
    for name in names:
        steps = [f"max_steps={args.steps}"]
        if args.warm_steps:
            # The last log window is the warm-up's second half: past the compiles of the first steps.
            warm = [f"max_steps={args.warm_steps}", f"log_interval={args.warm_steps // 2}", "time_budget_minutes=null",
                    "spec_eval_prompts=0", "eval_interval=0", f"output_dir={args.out}/{name}-warm"]
            warm_summary = DFlashTrainer(TrainConfig.from_sources(None, [*common, *variants[name], *warm]),
                                         target=model, tokenizer=tokenizer).fit()
            step_ms = warm_summary["train"]["step_ms"]
            reference = reference or step_ms
            if args.equal_time:
                steps = [f"max_steps={max(1, round(args.steps * reference / step_ms))}"]
            print(f"warm-up of {name}: {step_ms:.2f} ms/step, {warm_summary['train']['tokens_per_s']:,.0f} tokens/s "
                  f"(reference {reference:.2f} ms/step) -> {steps[0]}", flush=True)
        cfg = TrainConfig.from_sources(None, [*common, *variants[name], *steps, f"output_dir={args.out}/{name}"])
        start = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer = DFlashTrainer(cfg, target=model, tokenizer=tokenizer)
        summary = trainer.fit()
        held, spec = summary.get("held_out", {}), summary.get("speculative", {})
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        rows.append({"variant": name, "steps": summary["steps"], "minutes": (time.perf_counter() - start) / 60,
                     "train_tokens_per_s": summary["train"].get("tokens_per_s"), "step_ms": summary["train"].get("step_ms"),
                     # the training phase's seconds: equal time checked after the fact (step time drifts along a run)
                     "train_s": summary["phases"]["training"],
                     # real tokens / slots of an epoch's batches: tokens/s counts slots, padding included
                     "real_fraction": summary.get("padding", {}).get("real_fraction"), "peak_gib": peak,
                     "graphs": len(trainer.graphs) if trainer.graphs is not None else 0,
                     "train_tau": summary["train"].get("tau"), "held_out_tau": held.get("tau"),
                     "held_out_chain_tau": held.get("chain_tau"), "real_tau": spec.get("tau"),
                     "numerical_ties": len(spec.get("numerical_ties", [])), "speedup": spec.get("speedup")})
        print(json.dumps(rows[-1]), flush=True)

    def fmt(x):
        return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)

    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(fmt(r[k]) for k in keys) + " |")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "compare.json").write_text(json.dumps(rows, indent=2))
    length = f"the time of {args.steps} steps of {names[0]}" if args.equal_time else f"{args.steps} steps"
    print(f"compare_recipes ({length}, {device}): "
          + "; ".join(f"{r['variant']} real tau {fmt(r['real_tau'])} (chain {fmt(r['held_out_chain_tau'])}, "
                      f"uniform {fmt(r['held_out_tau'])}), {fmt(r['train_tokens_per_s'])} tok/s "
                      f"({fmt(r['real_fraction'])} real), {fmt(r['step_ms'])} ms/step, {fmt(r['train_s'])} s training, "
                      f"peak {fmt(r['peak_gib'])} GiB, {r['graphs']} graphs" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
