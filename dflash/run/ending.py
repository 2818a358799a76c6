"""The end of a completed run (held-out evaluation, the export, speculative decoding) under signals and a full disk.

Signals. `StopRequest` turns SIGTERM / SIGINT into a decision between training steps and is removed once the last
checkpoint is saved; the end-of-run work then ran with Python's own handlers: SIGINT gave a KeyboardInterrupt
traceback and SIGTERM a silent death, though the run was saved. `finish_unless_stopped` runs that work with
handlers of its own: a signal ends it at once (the evaluation may take minutes, more than a scheduler's grace
period), the run ends as an interrupted one (a line saying it is saved and what was skipped, RUN/summary.json with
`interrupted`, `dflash train`'s exit code 128 + the signal: `dflash.run.stopping.interrupted_exit_code`), and what
finished before the signal (held-out figures, the export) stays in the summary. The export's files are each
written to a temporary name and renamed (`dflash.evaluation.export_folder`), so a cut write leaves no half file.

A full disk. The export is written after the last checkpoint; a failed write (disk full, read-only output) was
safetensors' own error and a traceback. `finish_unless_stopped` makes a failed write into the run folder an
`EndOfRunWriteError` (an OSError: exit code 4) naming the file, the cause, and the saved checkpoint with the
command that exports it once there is room.

With several processes every rank runs the end-of-run work; a launcher (torchrun) signals every rank, so they stop
together. A signal sent to one rank alone stops that rank and leaves the others in their next collective, as
before these handlers.
"""

from __future__ import annotations

import errno
import logging
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash.report.phases import PhaseTimer
from dflash.report.sinks import write_summary

log = logging.getLogger("dflash")
# What a refused write reports: a full disk or quota, a file-size limit, a read-only or forbidden folder, a device error
_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


class EndOfRunStopped(Exception):
    """A signal ended the end-of-run work (raised by `EndOfRunSignals`' handler, caught by `finish_unless_stopped`)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"stopped by {signal_name} during the end-of-run work")
        self.signal_name = signal_name


class EndOfRunWriteError(OSError):
    """A file of the end-of-run work (the export) could not be written; the run's checkpoint is intact."""


class EndOfRunSignals:
    """SIGTERM / SIGINT handlers (main thread only) for the end-of-run work: a signal raises `EndOfRunStopped` where
    the work is; once the block has ended, a signal is only recorded (`pending`)."""

    def __init__(self) -> None:
        self.pending: str | None = None
        self._closed, self._previous = False, {}

    def __enter__(self) -> EndOfRunSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True  # a signal from here on is only recorded: the work has ended
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.pending = signal.Signals(signum).name
        if not self._closed:
            raise EndOfRunStopped(self.pending)


def finish_unless_stopped(finish: Callable[[], dict[str, Any]], run_dir: str | Path, summary: dict[str, Any],
                          reporter: Any, timer: PhaseTimer | None = None) -> dict[str, Any]:
    """`finish()` (the trainer's end-of-run work, which fills `summary` and returns it), under SIGTERM / SIGINT
    handlers: a signal ends it at once. Then the run ends as an interrupted one: the log line says it is saved, what
    finished and what was skipped; `reporter` (`dflash.report.sinks.Reporter`) is closed and RUN/summary.json written
    with `interrupted` and `signal` where the reporter writes (rank 0), and that summary is returned (`dflash train`
    exits 128 + the signal; `timer`'s phases go into it as a finished run's do). A failed write into `run_dir` (the
    export on a full disk) is an `EndOfRunWriteError` naming the file, the cause and the intact checkpoint."""
    with EndOfRunSignals():
        try:
            return finish()
        except EndOfRunStopped as e:
            stopped = e.signal_name
        except Exception as e:
            if (failed := _write_failure(e, Path(run_dir))) is None:
                raise
            checkpoint, export = summary.get("checkpoint"), Path(run_dir) / "export"
            raise EndOfRunWriteError(f"could not write {failed[0]} ({failed[1]}); the run is saved in its checkpoint "
                                     f"{checkpoint}, which is intact: make room, then write the export with: "
                                     f"dflash export {checkpoint} {export}") from e
    export = summary.get("export")
    done = f"; exported to {export}" if export else ""
    later = (f"dflash eval --draft {export}" if export else
             f"dflash export {summary.get('checkpoint')} DRAFT_DIR, then dflash eval --draft DRAFT_DIR")
    log.warning("stopped by %s during the end-of-run evaluation; the run is saved in %s%s; the rest of the "
                "end-of-run work was skipped (run it with: %s)", stopped, summary.get("checkpoint"), done, later)
    reporter.close()
    return write_summary(run_dir, {**summary, "interrupted": True, "signal": stopped, "end_of_run_skipped": True},
                         enabled=getattr(reporter, "enabled", True), timer=timer)


def _write_failure(e: BaseException, run_dir: Path) -> tuple[str, str] | None:
    """(what, reason) of a failed write into `run_dir`: an OSError naming a file there, or safetensors' own error
    wrapping one ("... (os error 28)": the export's weights, the one safetensors file the end of a run writes).
    None for anything else (an OSError elsewhere is not the run folder's write: it propagates as it is)."""
    if isinstance(e, OSError):
        inside = e.filename is not None and Path(str(e.filename)).resolve().is_relative_to(run_dir.resolve())
        return (str(e.filename), e.strerror or str(e)) if inside and e.errno in _WRITE_ERRORS else None
    if type(e).__name__ != "SafetensorError":
        return None
    if code := re.search(r"(.*?)\s*\(os error (\d+)\)", str(e)):
        return (f"the export to {run_dir / 'export'}", code[1].split(": ")[-1]) if int(code[2]) in _WRITE_ERRORS else None
    return (f"the export to {run_dir / 'export'}", str(e)) if re.search(r"I/O error|IoError", str(e)) else None
