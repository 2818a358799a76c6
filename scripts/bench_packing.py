"""Packed rows against bucketed padding through `dflash train`: real tokens/s, ms/step, peak memory, one summary line.

Runs `python -m dflash train` twice on the same data and settings (the embedded default's preset unless overrides say
otherwise), bucketed and with `data.packing=true` plus `--packed` overrides, without evaluation, export or
speculative decoding, and reads each run's own records: ms/step and input tokens/s (slots, padding included) of its
full log windows after the first `--skip` (compilation), peak memory, and the padding of its epoch
(`summary.json` "padding"). Real (non-padding) tokens/s = slots/s x the epoch's real fraction (exact over an epoch,
the windows' average otherwise). Both runs share the regeneration cache (the first run fills it).

    python scripts/bench_packing.py max_steps=400 log_interval=50                   # the GPU default
    python scripts/bench_packing.py --packed draft.num_anchors=192 max_steps=400 log_interval=50
    python scripts/bench_packing.py --also n192:draft.num_anchors=192 max_steps=400 log_interval=50   # two packed runs
    python scripts/bench_packing.py --out /tmp/bp target=... data.source=... max_steps=6 log_interval=2   # CPU smoke

Ends with `bench_packing: bucketed ... | packed ... | real tokens/s x R` (a line per packed variant).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["spec_eval_prompts=0", "spec_eval_interval_prompts=0", "eval_interval=0", "export_on_finish=false",
         "report_to=[]", "progress_bar=false", "save_interval=0"]


def train(output_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """One `dflash train` run's figures: the median full window after the skipped ones, and the epoch's padding."""
    command = [sys.executable, "-m", "dflash", "train", *overrides, *QUIET, f"output_dir={output_dir}"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_packing: {' '.join(command[2:])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((output_dir / "summary.json").read_text())
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {"windows": [r for r in lines if "tokens_per_s" in r and not r.get("partial_window")],
            "padding": summary["padding"], "steps": summary["steps"]}


def figures(run: dict[str, Any], skip: int) -> dict[str, Any]:
    """ms/step, slots/s and real tokens/s (medians over the windows after `skip`), peak memory, real fraction."""
    windows = run["windows"][skip:] or run["windows"][-1:]
    if not windows:
        raise SystemExit("bench_packing: no full log window: raise max_steps or lower log_interval")
    slots = statistics.median(w["tokens_per_s"] for w in windows)
    real = run["padding"]["real_fraction"]
    ms = statistics.median(w["step_ms"] for w in windows)
    return {"ms_per_step": round(ms, 2), "slots_per_s": round(slots), "real_fraction": real,
            "real_tokens_per_s": round(slots * real), "windows": len(windows),
            "peak_memory_gib": max((w.get("peak_memory_gib") or 0.0) for w in windows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packed", action="append", default=[], help="an override for the packed run only (repeat)")
    parser.add_argument("--also", action="append", default=[], metavar="NAME:K=V+K=V",
                        help="another packed run with these overrides (repeat)")
    parser.add_argument("--skip", type=int, default=1, help="full windows left out first (compilation)")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="config overrides for both runs, e.g. max_steps=400")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dflash-bench-packing-") as tmp:
        base = args.out or Path(tmp)
        runs = [("bucketed", []), ("packed", ["data.packing=true", *args.packed])]
        for spec in args.also:
            name, _, keys = spec.partition(":")
            runs.append((f"packed-{name}", ["data.packing=true", *filter(None, keys.split("+"))]))
        results = {}
        for name, extra in runs:
            results[name] = figures(train(base / name, [*args.overrides, *extra]), args.skip)
            print(json.dumps({"run": name, "overrides": extra, **results[name]}), flush=True)
    b = results["bucketed"]
    for name, p in list(results.items())[1:]:
        ratio = p["real_tokens_per_s"] / max(b["real_tokens_per_s"], 1)
        print(f"bench_packing: bucketed {b['ms_per_step']} ms/step, {b['real_tokens_per_s']:,} real tok/s "
              f"({b['real_fraction']:.1%} real), peak {b['peak_memory_gib']:.1f} GiB | {name} {p['ms_per_step']} ms/step, "
              f"{p['real_tokens_per_s']:,} real tok/s ({p['real_fraction']:.1%} real), peak {p['peak_memory_gib']:.1f} GiB"
              f" | real tokens/s x{ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
