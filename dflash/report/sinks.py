"""Where flushed metrics go: console, a JSONL file in the run folder, wandb, tensorboard.

Called only with host floats from `Metrics.flush()` at a log interval; nothing here sees a tensor.
"""

from __future__ import annotations

import json
import logging
import os
import typing
import zlib
from pathlib import Path
from typing import Any

from dflash.config import Sink
from dflash.files import write_atomic
from dflash.report.phases import PhaseTimer, dflash_version, format_phases

log = logging.getLogger("dflash")
HISTORY_BACKUP = "metrics.before-resume.jsonl"  # the lines a resume went back past, until it ends past them
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
                   peak_bytes: int | None = None, log_interval: int | None = None) -> dict[str, Any]:
    """A flushed window as it is logged: throughput added, and the loss None when no update of the window
    was finite (skipped and empty steps add no supervised weight; 0.0 would read as a perfect draft).
    A window of fewer steps than `log_interval` (a time budget, or a `max_steps` off the interval, ended it)
    is marked `partial_window`: `training_figures` and the plots pass over it.

    One unit, input tokens per second (the rows of every batch at their padded length): `tokens_per_s`
    over all ranks (this rank's count times `world_size`: every rank takes as many rows per step, each
    batch padded to its own bucket, so it is within the buckets' spread) and `tokens_per_s_per_rank`;
    `supervised_tokens_per_s` counts the supervised tokens of all ranks (exact: a flushed sum); `step_ms` is the
    window's wall time per step (its log flush included).
    `peak_bytes` (this rank's peak device memory so far, GPU only) is logged as `peak_memory_gib`."""
    per_rank = tokens / elapsed
    out = {**flushed, "tokens_per_s": per_rank * world_size, "tokens_per_s_per_rank": per_rank, "ranks": world_size,
           "supervised_tokens_per_s": flushed["supervised_tokens"] / elapsed,
           **({"step_ms": 1000 * elapsed / flushed["steps"]} if flushed.get("steps") else {})}
    if peak_bytes is not None:
        out["peak_memory_gib"] = peak_bytes / 2**30
    if out.get("loss") == 0.0 and (out.get("nonfinite_skips") or out.get("empty_windows")):
        out.update({k: None for k in ("loss", "base_loss") if k in out})
    if log_interval is not None and flushed["steps"] < log_interval:  # `steps`: counted once, whatever the ranks
        out["partial_window"] = True
    return out


def training_figures(history: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's training summary from its recorded rows: the last full log window, else (a run shorter than
    one window) the last partial one, else {}. A few steps' window is noise next to a full one."""
    windows = [row for row in history if "tokens_per_s" in row]
    chosen = next((row for row in reversed(windows) if not row.get("partial_window")), windows[-1] if windows else {})
    return {key: value for key, value in chosen.items() if key != "step"}


def progress_postfix(metrics: dict[str, Any]) -> str:
    """The progress bar's summary of a window (tokens/s over all ranks)."""
    loss = metrics.get("loss")
    return f"loss={'n/a' if loss is None else f'{loss:.3f}'}, tau={metrics['tau']:.2f}, tok/s={metrics['tokens_per_s']:,.0f}"


def write_summary(run_dir: str | Path, summary: dict[str, Any], *, enabled: bool = True, timer: PhaseTimer | None = None,
                  stopped_by: str | None = None) -> dict[str, Any]:
    """Write RUN/summary.json, the whole summary `fit` returns (the console shows a short table of it), when
    `enabled` (rank 0); returns it. It gets `dflash_version`, and `timer`'s `wall_seconds` and `phases`
    (`dflash.report.phases`), also logged in one line. `stopped_by`: the signal that stopped the run between
    steps, its last step saved; the summary is marked `interrupted` with its `signal`, and the log line says what
    is saved and how to go on (`dflash train` then prints the whole command: `dflash.cli.main.resume_command`)."""
    summary = {**summary, **(timer.record() if timer is not None else {"dflash_version": dflash_version()})}
    if stopped_by is not None:
        checkpoint = summary.get("checkpoint")
        log.info("stopped by signal %s at step %s; saved %s; to continue, run again with resume_from=latest (the same "
                 "output_dir) or resume_from=%s", stopped_by, summary.get("steps"), checkpoint, checkpoint)
        summary.update(interrupted=True, signal=stopped_by)
    if timer is not None:
        log.info("time: %s", format_phases(summary))  # the same figures as RUN/summary.json's
    if enabled:
        path = Path(run_dir) / SUMMARY_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(summary, indent=2) + "\n")
    return summary


def truncate_history(path: str | Path, step: int, size: int | None = None, crc: int | None = None) -> int:
    """Drop what a run logged after its checkpoint at `step`, which a resumed run logs again: the bytes past
    `size` (the file's length when that checkpoint was saved), else the lines of later steps and a
    half-written last line. Returns the number of lines dropped.

    `crc` (the CRC-32 of those `size` bytes) tells which history the checkpoint continues. When metrics.jsonl
    does not hold it and RUN/metrics.before-resume.jsonl does, a launch that went back to an older
    checkpoint was killed before its first checkpoint committed, and this resume (`latest`) continues the
    history that launch set aside: metrics.jsonl is rebuilt from the backup (the cut version once lost the
    steps past the rewind for good). The killed launch's own lines are dropped, logged: no checkpoint
    continues them."""
    path = Path(path)
    backup = path.with_name(HISTORY_BACKUP)
    data = path.read_bytes() if path.is_file() else b""
    if (size is not None and crc is not None and not _holds(data, size, crc) and backup.is_file()
            and _holds(aside := backup.read_bytes(), size, crc)):
        write_atomic(path, aside[:size])
        shared = data.rfind(b"\n", 0, len(os.path.commonprefix([data, aside[:size]]))) + 1
        log.warning("%s: restored steps to %d from %s (the launch that went back to an older checkpoint was "
                    "stopped before its first checkpoint); dropped its %d line(s), which no checkpoint continues",
                    path, step, backup, data[shared:].count(b"\n"))
        return 0
    if not path.is_file():
        return 0
    if size is not None and size <= len(data) and (crc is None or _holds(data, size, crc)):
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


def _holds(data: bytes, size: int, crc: int) -> bool:
    return len(data) >= size and zlib.crc32(data[:size]) == crc


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
    """Keep the whole history a resume goes back past in `backup` until the resumed run ends having logged
    past its last step (`Reporter.close`): if that run is killed first, the later lines are still there
    (and `truncate_history` takes them back when the next resume continues them). An older backup that
    reaches further is kept instead."""
    if not (backup.is_file() and last_step(backup.read_bytes()) >= last_step(data)):
        write_atomic(backup, data)


def wandb_names(config: dict[str, Any]) -> dict[str, Any]:
    """`wandb.init`'s project, name and tags from the run's config: a key that is set wins, else wandb's own
    variables as the `transformers.Trainer` leaves them to it (WANDB_PROJECT, WANDB_NAME, WANDB_TAGS), else
    the project "dflash" (wandb's default, "uncategorized", would mix the runs with every other project's)."""
    return {"project": config.get("wandb_project") or os.environ.get("WANDB_PROJECT") or "dflash",
            "name": config.get("run_name") or None, "tags": config.get("wandb_tags") or None}


class Reporter:
    """Fans one metrics dict out to every configured sink (`report_to`: wandb, tensorboard)."""

    def __init__(self, run_dir: str | Path, report_to: list[str], config: dict[str, Any], *,
                 enabled: bool = True, console: bool = True, resumed: dict[str, Any] | None = None) -> None:
        """`resumed` (`dflash.run.state.resume_record`, or `{"step": 0}` for a fresh start): metrics.jsonl loses
        what an earlier launch logged after that step, so no step is logged twice; those lines wait in
        RUN/metrics.before-resume.jsonl until this run ends (`close`) having logged past them."""
        self.enabled, self.console = enabled, console
        self.jsonl = Path(run_dir) / "metrics.jsonl"
        self.backup, self.backup_until, self.last_logged = self.jsonl.with_name(HISTORY_BACKUP), -1, -1
        self._wandb = self._tb = None
        if not enabled:
            return
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        if resumed is not None:
            dropped = truncate_history(self.jsonl, resumed["step"], resumed.get("metrics_bytes"),
                                       resumed.get("metrics_crc32"))
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

            self._wandb = wandb.init(**wandb_names(config), dir=str(run_dir), config=config)
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
        self.last_logged = step  # the backup is not dropped here: only once this run's last checkpoint is saved
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
        """End the sinks. The trainer closes after its last save, so the lines a resume went back past are
        dropped only once a checkpoint past them is committed: a launch killed earlier leaves them, and
        the next resume of the checkpoint they belong to takes them back (`truncate_history`)."""
        if 0 <= self.backup_until <= self.last_logged:  # the run ended having logged every step again
            self._drop_backup()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()


def history_record(run_dir: str | Path) -> dict[str, int]:
    """metrics.jsonl's length in bytes and CRC-32 (saved with each checkpoint for `truncate_history`: the
    length says where a resume cuts, the checksum which history, this file's or the backup's, it continues)."""
    path = Path(run_dir) / "metrics.jsonl"
    data = path.read_bytes() if path.is_file() else b""
    return {"metrics_bytes": len(data), "metrics_crc32": zlib.crc32(data)}


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
