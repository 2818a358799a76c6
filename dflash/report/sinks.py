"""Where flushed metrics go: console, a JSONL file in the run folder, wandb, tensorboard.

Called only with host floats from `Metrics.flush()` at a log interval; nothing here sees a tensor.
"""

from __future__ import annotations

import json
import logging
import typing
from pathlib import Path
from typing import Any

from dflash.config import Sink
from dflash.files import write_atomic

log = logging.getLogger("dflash")
HISTORY_BACKUP = "metrics.before-resume.jsonl"  # the lines a resume went back past, until it passes them
SUMMARY_NAME = "summary.json"  # RUN/summary.json: what `fit` returned, in full


def format_line(step: int, max_steps: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step}/{max_steps}"]
    for key, fmt in (("loss", ".4f"), ("accuracy", ".3f"), ("tau", ".3f"), ("lr", ".2e"), ("grad_norm", ".3f"),
                     ("tokens_per_s", ",.0f"), ("eval_tau", ".3f"), ("eval_chain_tau", ".3f"), ("eval_accuracy", ".3f"),
                     ("nonfinite_skips", ".0f"), ("peak_memory_gib", ".1f")):
        if key in metrics and (key != "nonfinite_skips" or metrics[key]):
            label = {"tokens_per_s": "tokens/s", "peak_memory_gib": "peak GiB"}.get(key, key)
            parts.append(f"{label} {metrics[key]:{fmt}}" if metrics[key] is not None else f"{label} n/a")
            if key == "tokens_per_s" and metrics.get("ranks", 1) > 1 and metrics.get("tokens_per_s_per_rank"):
                parts[-1] += f" over {metrics['ranks']} ranks ({metrics['tokens_per_s_per_rank']:,.0f} per rank)"
    return " | ".join(parts)


def window_metrics(flushed: dict[str, Any], elapsed: float, tokens: int, world_size: int = 1,
                   peak_bytes: int | None = None) -> dict[str, Any]:
    """A flushed window as it is logged: throughput added, and the loss None when no update of the window
    was finite (skipped and empty steps add no supervised weight; 0.0 would read as a perfect draft).

    One unit, input tokens per second (the rows of every batch at their padded length): `tokens_per_s`
    over all ranks (this rank's count times `world_size`: every rank takes as many rows per step, each
    batch padded to its own bucket, so it is within the buckets' spread) and `tokens_per_s_per_rank`;
    `supervised_tokens_per_s` counts the supervised tokens of all ranks (exact: a flushed sum).
    `peak_bytes` (this rank's peak device memory so far, GPU only) is logged as `peak_memory_gib`."""
    per_rank = tokens / elapsed
    out = {**flushed, "tokens_per_s": per_rank * world_size, "tokens_per_s_per_rank": per_rank, "ranks": world_size,
           "supervised_tokens_per_s": flushed["supervised_tokens"] / elapsed}
    if peak_bytes is not None:
        out["peak_memory_gib"] = peak_bytes / 2**30
    if out.get("loss") == 0.0 and (out.get("nonfinite_skips") or out.get("empty_windows")):
        out.update({k: None for k in ("loss", "base_loss") if k in out})
    return out


def progress_postfix(metrics: dict[str, Any]) -> str:
    """The progress bar's summary of a window (tokens/s over all ranks)."""
    loss = metrics.get("loss")
    return f"loss={'n/a' if loss is None else f'{loss:.3f}'}, tau={metrics['tau']:.2f}, tok/s={metrics['tokens_per_s']:,.0f}"


def write_summary(run_dir: str | Path, summary: dict[str, Any], *, enabled: bool = True) -> dict[str, Any]:
    """Write RUN/summary.json, the whole summary `fit` returns (the console shows a short table of it), when
    `enabled` (rank 0); returns `summary`."""
    if enabled:
        path = Path(run_dir) / SUMMARY_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(summary, indent=2) + "\n")
    return summary


def truncate_history(path: str | Path, step: int, size: int | None = None) -> int:
    """Drop what a run logged after its checkpoint at `step`, which a resumed run logs again: the bytes past
    `size` (the file's length when that checkpoint was saved), else the lines of later steps and a
    half-written last line. Returns the number of lines dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    data = path.read_bytes()
    if size is not None and size <= len(data):
        keep = data[:size]
    else:
        def kept(line: bytes) -> bool:
            try:
                return json.loads(line)["step"] <= step
            except (ValueError, KeyError, TypeError):
                return False

        keep = b"".join(line for line in data.splitlines(keepends=True) if line.endswith(b"\n") and kept(line))
    if keep == data:
        return 0
    _keep_aside(path.with_name(HISTORY_BACKUP), data)
    write_atomic(path, keep)
    return data.count(b"\n") + (not data.endswith(b"\n")) - keep.count(b"\n")


def last_step(data: bytes) -> int:
    """The step of the last whole line of a metrics.jsonl's bytes (-1 when there is none)."""
    for line in reversed(data.splitlines(keepends=True)):
        if not line.endswith(b"\n"):
            continue  # a half-written last line (a kill mid-write)
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return -1


def _keep_aside(backup: Path, data: bytes) -> None:
    """Keep the whole history a resume goes back past in `backup` until the resumed run logs past its last
    step (`Reporter.log`): if that run is killed first, the later lines are still there. An older backup
    that reaches further is kept instead."""
    if not (backup.is_file() and last_step(backup.read_bytes()) >= last_step(data)):
        write_atomic(backup, data)


class Reporter:
    """Fans one metrics dict out to every configured sink (`report_to`: wandb, tensorboard)."""

    def __init__(self, run_dir: str | Path, report_to: list[str], config: dict[str, Any], *,
                 enabled: bool = True, console: bool = True, resumed: dict[str, Any] | None = None) -> None:
        """`resumed` (`dflash.run.state.resume_record`, or `{"step": 0}` for a fresh start): metrics.jsonl loses
        what an earlier launch logged after that step, so no step is logged twice; those lines wait in
        RUN/metrics.before-resume.jsonl until this run has logged past them."""
        self.enabled, self.console = enabled, console
        self.jsonl = Path(run_dir) / "metrics.jsonl"
        self.backup, self.backup_until, self.last_logged = self.jsonl.with_name(HISTORY_BACKUP), -1, -1
        self._wandb = self._tb = None
        if not enabled:
            return
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        if resumed is not None:
            dropped = truncate_history(self.jsonl, resumed["step"], resumed.get("metrics_bytes"))
            if dropped:
                log.info("%s: moved %d line(s) an earlier launch logged after step %d to %s until this run logs "
                         "past them", self.jsonl, dropped, resumed["step"], self.backup)
        if self.backup.is_file():
            self.backup_until = last_step(self.backup.read_bytes())
        unknown = set(report_to) - set(typing.get_args(Sink))  # the config's one list of sinks
        if unknown:
            raise ValueError(f"report_to: unknown sink(s) {sorted(unknown)}; choose from {', '.join(typing.get_args(Sink))}")
        if "wandb" in report_to:
            import wandb  # honours WANDB_MODE (offline / disabled)

            self._wandb = wandb.init(project="dflash", dir=str(run_dir), config=config)
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("report_to: tensorboard needs the tensorboard package: pip install tensorboard") from e

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any], max_steps: int | None = None) -> None:
        if not self.enabled:
            return
        with self.jsonl.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        self.last_logged = step
        if 0 <= self.backup_until < step:  # written past every line the resume went back over
            self._drop_backup()
        if self.console:
            log.info(format_line(step, max_steps or step, metrics))
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        for i, v in enumerate(metrics.get("per_position_accuracy", [])):
            scalars[f"per_position_accuracy/{i + 1}"] = v
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)

    def _drop_backup(self) -> None:
        self.backup.unlink(missing_ok=True)
        self.backup_until = -1

    def close(self) -> None:
        if 0 <= self.backup_until <= self.last_logged:  # the run ended having logged every step again
            self._drop_backup()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()


def history_size(run_dir: str | Path) -> int:
    """metrics.jsonl's length in bytes (saved with each checkpoint for `truncate_history`)."""
    path = Path(run_dir) / "metrics.jsonl"
    return path.stat().st_size if path.is_file() else 0


def read_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl as a list of dicts (for plots and tests). A half-written last line (a run
    killed while writing it) is left out with a warning; a damaged line elsewhere is a ValueError naming
    the file and line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as e:
            if number < len(lines):
                raise ValueError(f"{path}, line {number}: not a JSON line ({e})") from None
            log.warning("%s: left out its half-written last line %d (the run was stopped while writing it)",
                        path, number)
    return rows
