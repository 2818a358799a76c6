"""The long-context step, side by side with SpecForge's: ms/step, peak memory (and dflash's estimate of it), syncs.

For every (sequence S, anchors N, rows B) shape and draft kind, one process each (an out-of-memory run ends its own
process only, and every figure comes from a fresh allocator):

  dflash      `scripts/bench_step.py --config specforge`: the Qwen3-8B-shaped 5-layer draft on random target
              features, compiled (`--compile --compile-scope layers`), with the CUDA sync debug mode over extra steps
              (`--sync-check`); when it runs out of memory, again with `--activation-checkpointing` (the row says so)
  specforge   `scripts/bench_specforge.py`: SpecForge's own step on the same shapes (`--peer`; a snapshot folder,
              see that script), its syncs counted per step
  end to end  `scripts/bench_step.py --config qwen3-8b`: dflash's step with a random-weight Qwen3-8B target's forward
              in it (`--end-to-end`: the shapes to run it at), the whole step on one GPU

`--fits N:S1,S2,...` also finds the longest S each side fits at N anchors (B = 1), trying the lengths in order and
stopping at the first that fails. Results go to `--out` (one JSON per run, `results.jsonl` as they finish, so a run
stopped midway keeps what it measured), then a table and one summary line.

    python scripts/bench_long.py --out runs/bench_long --peer --end-to-end 16384x4096x1,32768x4096x1 --fits 512:32768,65536,131072
    python scripts/bench_long.py --config tiny --shapes 64x8x2 --out /tmp/bl     # a CPU smoke run (CI)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SHAPES = "768x256x2,4096x1024x1,8192x2048x1,16384x4096x1,32768x4096x1"


@dataclass
class Run:
    """One benchmark process and what came of it: `status` ok | oom | timeout | error."""

    side: str  # dflash | specforge | end-to-end
    kind: str
    seq: int
    anchors: int
    batch: int
    status: str = ""
    ms_per_step: float | None = None
    peak_gib: float | None = None
    estimated_gib: float | None = None
    syncs: float | None = None
    checkpointing: bool = False
    seconds: float = 0.0
    note: str = ""


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """"SxNxB,..." -> [(S, N, B), ...]."""
    shapes = []
    for item in filter(None, text.split(",")):
        parts = [int(x) for x in item.lower().split("x")]
        if len(parts) != 3:
            raise SystemExit(f"bench_long: shape {item!r} is not SxNxB (sequence x anchors x rows)")
        shapes.append((parts[0], parts[1], parts[2]))
    return shapes


def command(run: Run, args: argparse.Namespace, out: Path) -> list[str]:
    """The process that measures `run`."""
    shape = ["--seq", str(run.seq), "--anchors", str(run.anchors), "--batch", str(run.batch),
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--json", str(out)]
    if args.memory_cap_gib:
        shape += ["--memory-cap-gib", str(args.memory_cap_gib)]
    if run.side == "specforge":
        return [sys.executable, str(REPO / "scripts" / "bench_specforge.py"), "--kind", run.kind,
                "--config", args.config, "--specforge", str(args.specforge), *shape]
    end_to_end = run.side == "end-to-end"
    config = "qwen3-8b" if end_to_end and args.config == "specforge" else args.config
    cmd = [sys.executable, str(REPO / "scripts" / "bench_step.py"), "--config", config, "--kind", run.kind, *shape]
    if end_to_end and config == "tiny":  # a real tiny target's forward
        cmd.append("--real-target")
    if args.config != "tiny":  # the GPU step as the presets run it; the CPU smoke run stays eager
        cmd += ["--compile", "--compile-scope", "layers", "--sync-check"]
    return cmd + (["--activation-checkpointing"] if run.checkpointing else [])


def measure(run: Run, args: argparse.Namespace) -> Run:
    """Run `run`'s process (at most `args.timeout` seconds) and read its JSON."""
    name = f"{run.side}-{run.kind}-{run.seq}x{run.anchors}x{run.batch}" + ("-ckpt" if run.checkpointing else "")
    out = args.out / f"{name}.json"
    start = time.perf_counter()
    try:
        done = subprocess.run(command(run, args, out), capture_output=True, text=True, timeout=args.timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        run.status, run.note = "timeout", f"no result in {args.timeout} s"
    else:
        (args.out / f"{name}.log").write_text(done.stdout + done.stderr)
        if done.returncode == 0 and out.is_file():
            result = json.loads(out.read_text())
            run.status, run.ms_per_step, run.peak_gib = "ok", result["ms_per_step"], result["peak_mem_gib"]
            run.estimated_gib = (result.get("estimated_mem_gib") or {}).get("peak")
            run.syncs = result.get("syncs", result.get("syncs_per_step"))
        else:
            oom = "OutOfMemoryError" in done.stderr or "out of memory" in done.stderr
            run.status = "oom" if oom else "error"
            lines = done.stderr.strip().splitlines() or ["(no output)"]
            run.note = next((line for line in reversed(lines) if "Error" in line), lines[-1])[:200]
    run.seconds = time.perf_counter() - start
    with (args.out / "results.jsonl").open("a") as f:
        f.write(json.dumps(asdict(run)) + "\n")
    print(f"[bench_long] {name}: {run.status} {run.ms_per_step or ''} {run.note}", file=sys.stderr, flush=True)
    return run


def ours(side: str, kind: str, shape: tuple[int, int, int], args: argparse.Namespace) -> Run:
    """dflash's step at `shape`; run again with activation checkpointing when it does not fit."""
    run = measure(Run(side, kind, *shape), args)
    if run.status == "oom" and args.config != "tiny":
        run = measure(Run(side, kind, *shape, checkpointing=True), args)
    return run


def longest_fit(side: str, kind: str, anchors: int, lengths: list[int], args: argparse.Namespace) -> list[Run]:
    """Runs at `lengths` (ascending) until the first that fails; the last ok one is the longest S that fits."""
    runs = []
    for seq in lengths:
        run = ours(side, kind, (seq, anchors, 1), args) if side == "dflash" else measure(Run(side, kind, seq, anchors, 1), args)
        runs.append(run)
        if run.status != "ok":
            break
    return runs


def table(runs: list[Run]) -> str:
    """A markdown table: one line per shape and kind, dflash beside SpecForge."""
    rows = ["| kind | S | N | B | dflash ms/step | peak GiB (estimate) | syncs | SpecForge ms/step | peak GiB | syncs/step "
            "| speed-up | end to end ms/step | peak GiB (estimate) |", "|" + "---|" * 13]
    keys = sorted({(r.kind, r.seq, r.anchors, r.batch) for r in runs}, key=lambda k: (k[0], k[1], k[2]))

    def cell(r: Run | None) -> tuple[str, str, str]:
        if r is None:
            return "–", "–", "–"
        if r.status != "ok":
            return r.status, "–", "–"
        est = f" ({r.estimated_gib:.1f})" if r.estimated_gib is not None else ""
        syncs = "–" if r.syncs is None else f"{r.syncs:g}"
        return f"{r.ms_per_step:.1f}" + (" (ckpt)" if r.checkpointing else ""), f"{r.peak_gib:.1f}{est}", syncs

    for key in keys:
        side = {r.side: r for r in runs if (r.kind, r.seq, r.anchors, r.batch) == key and
                (r.status == "ok" or not any(o.side == r.side and o.status == "ok" and (o.kind, o.seq, o.anchors, o.batch) == key
                                             for o in runs))}
        a, b, e = side.get("dflash"), side.get("specforge"), side.get("end-to-end")
        speed = (f"x{b.ms_per_step / a.ms_per_step:.2f}" if a and b and a.status == b.status == "ok" else "–")
        ec = cell(e)
        rows.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cell(a)) + " | "
                    + " | ".join(cell(b)) + f" | {speed} | {ec[0]} | {ec[1]} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--config", choices=["specforge", "tiny"], default="specforge")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="SxNxB,... (default: %(default)s)")
    p.add_argument("--kinds", default="dflash", help="draft kinds, comma-separated (dflash, domino)")
    p.add_argument("--peer", action="store_true", help="also SpecForge's step (scripts/bench_specforge.py)")
    p.add_argument("--specforge", type=Path, default=REPO / ".carry" / "specforge-snapshot")
    p.add_argument("--end-to-end", default="", help="SxNxB,... to run with the Qwen3-8B target's forward too")
    p.add_argument("--fits", default="", help="N:S1,S2,... the longest S each side fits at N anchors, B = 1")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=int, default=420, help="seconds per process")
    p.add_argument("--memory-cap-gib", type=float, help="GPU memory each process may allocate (79: an 80 GB card's, on an H200)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    kinds = [k for k in args.kinds.split(",") if k]
    for shape in parse_shapes(args.shapes):
        for kind in kinds:
            runs.append(ours("dflash", kind, shape, args))
            if args.peer:
                runs.append(measure(Run("specforge", kind, *shape), args))
    for shape in parse_shapes(args.end_to_end):
        runs.append(ours("end-to-end", kinds[0], shape, args))
    fits = {}
    if args.fits:
        anchors, _, lengths = args.fits.partition(":")
        lengths_ = [int(x) for x in lengths.split(",") if x]
        for side in ["dflash"] + (["specforge"] if args.peer else []):
            tried = longest_fit(side, kinds[0], int(anchors), lengths_, args)
            runs += tried
            fits[side] = max((r.seq for r in tried if r.status == "ok"), default=0)
    print(table(runs))
    (args.out / "bench_long.json").write_text(json.dumps({"runs": [asdict(r) for r in runs], "fits": fits}, indent=2))
    ok = [r for r in runs if r.status == "ok" and r.estimated_gib is not None and r.peak_gib]
    worst = max((abs(r.estimated_gib / r.peak_gib - 1) for r in ok), default=float("nan"))
    ratios = [f"{r.seq}x{r.anchors}:x{o.ms_per_step / r.ms_per_step:.2f}" for r in runs for o in runs
              if r.side == "dflash" and o.side == "specforge" and r.status == o.status == "ok"
              and (r.kind, r.seq, r.anchors, r.batch) == (o.kind, o.seq, o.anchors, o.batch)]
    print(f"bench_long: {sum(r.status == 'ok' for r in runs)}/{len(runs)} runs ok; dflash vs SpecForge "
          f"{' '.join(ratios) or 'n/a'}; longest S at the --fits width {fits or 'n/a'}; "
          f"memory estimate within {worst:.1%} of the measured peak over {len(ok)} runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
