"""Who may write to a run folder (`output_dir`), and what a starting run may find there.

A run writes checkpoints, `config.yaml`, `metrics.jsonl`, `summary.json` and `export/` into its folder,
and cleans what its own interrupted saves left. These rules keep it from destroying another's files:

- **Dangerous folders are refused**: a filesystem root, a folder directly under it (`/tmp`, `/usr`,
  ...), the home folder and its ancestors.
- **One writer at a time**: rank 0 holds an exclusive `flock` on `RUN/.dflash.lock` for the run's life.
  The kernel releases it when the process ends, however it ends, so a lock left by a killed run is
  simply taken over (and said so); a second run on the folder fails at start naming the holder.
  (`flock` is advisory and per host: a folder shared by two hosts over NFS is not covered.)
- **A folder is a run's, or it is refused**: a new run starts only in a missing or empty folder. A
  folder that holds a previous run (dflash's own record, `run.json`: a `config.yaml` or `checkpoints/`
  alone may be anyone's) is continued with `resume_from=latest` or replaced with
  `overwrite_output_dir=true`; otherwise it is refused with those choices named. A folder of other files
  is never written to, overwrite or not. Only after the folder is claimed are interrupted saves cleaned
  (`dflash.run.checkpoint.prepare_run_dir`), and only by rank 0; the other ranks wait at a barrier.
- **Only dflash's own names are removed**: an overwrite removes the top-level entries dflash writes, and
  inside `checkpoints/` and `export/` only dflash's own names (`step-00000002`, not a user's `step-best`;
  the export's files): a user's file there is kept, and said so.
- **No write through a link the run did not make**: a run entry that is a symbolic link (the lock file,
  `checkpoints/` into another run, `metrics.jsonl`, ...) is refused at start naming the link; the lock
  file is opened without following links and refused when it is not a plain file of its own.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import stat
import time
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dflash.files import write_atomic
from dflash.report.phases import dflash_version
from dflash.report.sinks import HISTORY_BACKUP, SUMMARY_NAME, last_step
from dflash.run.checkpoint import OWN_CHECKPOINT_ENTRY, STEP_NAME, prepare_run_dir

log = logging.getLogger("dflash")

RUN_RECORD = "run.json"  # {"run_id", "created", "dflash_version"}: written when a run claims a new or replaced folder
LOCK_NAME = ".dflash.lock"
# Everything a run writes at the folder's top level (a test checks a finished run's folder against it).
RUN_ENTRIES = frozenset({RUN_RECORD, LOCK_NAME, HISTORY_BACKUP, "config.yaml", "metrics.jsonl", "checkpoints",
                         "export", SUMMARY_NAME, "tensorboard", "wandb", "plots"})
# What dflash writes into `export/`: the published draft (`dflash.evaluation.export`; run/ sits below
# evaluation, hence its names again) and the evaluation reports beside it (`REPORT_FILE`); a test checks a
# finished run's export against them. A name missing here is kept by an overwrite, never lost.
EXPORT_FILES = frozenset({"config.json", "model.safetensors"})
# The evaluation reports beside a draft: `fit` and `dflash eval` write eval.json, `dflash eval --engine vllm`
# eval_vllm.json. One owner for their naming rule (`new_report_path`), here below evaluation, so that the
# writers pick names by it and `export/` recognises what they wrote by it.
REPORT_NAME, ENGINE_REPORT_NAME = "eval.json", "eval_vllm.json"
_STEMS = "|".join(re.escape(Path(name).stem) for name in (REPORT_NAME, ENGINE_REPORT_NAME))
REPORT_FILE = re.compile(rf"({_STEMS})(-[2-9]|-[1-9][0-9]+)?\.json")  # NAME.json or NAME-N.json, N from 2
_RUN_ID = re.compile(r"[0-9a-f]{32}")


class RunFolderError(ValueError):
    """The run folder cannot be used as asked; the message names the choices."""


def _is_run_entry(name: str) -> bool:
    """An entry a run writes, or the temporary file of one (`files.write_atomic`, left by a kill mid-write)."""
    return name in RUN_ENTRIES or (name.startswith(".") and name[1:].split(".tmp-")[0] in RUN_ENTRIES)


def is_run_folder(run_dir: Path) -> bool:
    """Whether `run_dir` holds dflash's own record of a run: a plain `run.json` (not a link) holding the
    run id dflash wrote. A `config.yaml` or a `checkpoints/` folder alone is any trainer's."""
    path = run_dir / RUN_RECORD
    try:
        if not stat.S_ISREG(path.lstat().st_mode) or path.stat().st_size > 4096:
            return False
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and isinstance(record.get("run_id"), str) and bool(_RUN_ID.fullmatch(record["run_id"]))


def refuse_dangerous(run_dir: Path) -> None:
    """Raise `RunFolderError` for a filesystem root, a folder directly under one, or the home folder
    or one of its ancestors: places where a run's cleaning and overwriting have no business."""
    path = run_dir.expanduser().resolve()
    home = Path.home().resolve()
    if len(path.parts) <= 2 or path == home or path in home.parents:
        raise RunFolderError(f"output_dir={str(run_dir)!r} ({path}) is a system or home folder; give the run a "
                             "folder of its own, e.g. output_dir=runs/my-run")


class RunLock:
    """An exclusive lock on `RUN/.dflash.lock`, held from construction until `release()` or process end.
    The file records the holder (pid, host, start time) for the error a second run gets."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
        self._fd: int | None = _open_lock(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = self._read()
            os.close(self._fd)
            self._fd = None
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise _in_use(run_dir, holder) from None
        stale = self._read()
        if stale:  # a holder ended without releasing (killed): the kernel dropped its lock, its record stayed
            log.warning("%s: taking over the lock of a run that ended without releasing it (%s)", run_dir,
                        _describe(stale))
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(record).encode(), 0)

    def _read(self) -> dict[str, Any]:
        try:
            return json.loads(os.pread(self._fd, 4096, 0) or b"{}")
        except ValueError:
            return {}

    def release(self) -> None:
        """Clear the holder record and unlock (a clean end leaves no record to report as stale)."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _open_lock(path: Path, flags: int) -> int:
    """Open the lock file without following a link (O_NOFOLLOW; O_NONBLOCK: a FIFO planted there does not
    hang the start) and only when it is a plain file with no other name: the lock's holder record is
    truncated and written, and a link would truncate its target (a user's file emptied)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise _link_error(path) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        what = "not a plain file" if not stat.S_ISREG(info.st_mode) else f"a hard link ({info.st_nlink} names)"
        raise RunFolderError(f"{path} is {what}: dflash writes its lock only into a file of its own. Remove it "
                             f"(rm {path}; the file it shares its contents with is kept) and start again")
    return fd


def _link_error(path: Path) -> RunFolderError:
    target = os.readlink(path) if path.is_symlink() else "?"
    return RunFolderError(f"{path} is a symbolic link (to {target}): dflash never writes, truncates or prunes "
                          f"through a link it did not make. Remove the link (rm {path}; its target is kept), or "
                          "give the run a folder of its own in output_dir")


def _refuse_links(run_dir: Path) -> None:
    """Refuse a run entry that is a symbolic link: the lock file truncated through a link once emptied a
    user's file, and a `checkpoints/` link into another run pruned that run's checkpoints."""
    if not run_dir.is_dir():
        return
    for name in sorted(os.listdir(run_dir)):
        if _is_run_entry(name) and (run_dir / name).is_symlink():
            raise _link_error(run_dir / name)


def _in_use(run_dir: Path, holder: dict[str, Any]) -> RunFolderError:
    return RunFolderError(f"{run_dir} is in use by another dflash run ({_describe(holder)}); wait for it to end, "
                          "or choose another output_dir")


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}"


def _previous_run(run_dir: Path, names: list[str]) -> str:
    """One line on what a previous run left: its newest checkpoint and last logged step."""
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")
                   if STEP_NAME.fullmatch(p.name)) if "checkpoints" in names else []
    metrics = run_dir / "metrics.jsonl"
    last = last_step(metrics.read_bytes()) if metrics.is_file() else -1
    parts = [f"checkpoints up to {steps[-1]}" if steps else "no checkpoint"]
    if last >= 0:
        parts.append(f"metrics logged to step {last}")
    return ", ".join(parts)


def _refuse_foreign(run_dir: Path, names: list[str]) -> None:
    # A run's folder has dflash's record: a folder of anything else, another trainer's `config.yaml` and
    # `checkpoints/` included (a `config.yaml` once made such a folder pass for a run, and its
    # `checkpoints/step-2000` was deleted), is not cleaned or written to.
    if names and not is_run_folder(run_dir):
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        older = (" (a run of a dflash from before run records: continue it in a new output_dir with "
                 "resume_from=<its checkpoint folder>)" if "config.yaml" in names else "")
        raise RunFolderError(f"output_dir {run_dir} is not a dflash run folder (no dflash {RUN_RECORD}; it holds "
                             f"{shown}); dflash writes only into a new or empty folder, or one of its own runs: "
                             f"choose another output_dir{older}")


def _refuse_previous_run(run_dir: Path, names: list[str], resume_from: str | None, overwrite: bool) -> None:
    if names and not resume_from and not overwrite:
        raise RunFolderError(
            f"output_dir {run_dir} holds a previous run ({_previous_run(run_dir, names)}): continue it with "
            "resume_from=latest, replace it with overwrite_output_dir=true, or choose another output_dir")


def check_folder(run_dir: Path, *, resume_from: str | None, overwrite: bool) -> None:
    """What `claim` would refuse, read-only (the dry run): a dangerous or foreign folder, a previous run
    without a choice, a folder another run holds the lock of."""
    refuse_dangerous(run_dir)
    names = _names(run_dir)
    _refuse_foreign(run_dir, names)
    _refuse_links(run_dir)
    _refuse_previous_run(run_dir, names, resume_from, overwrite)
    if (run_dir / LOCK_NAME).is_file():
        fd = _open_lock(run_dir / LOCK_NAME, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released at close: only a probe
        except OSError:
            raise _in_use(run_dir, json.loads(os.pread(fd, 4096, 0) or b"{}")) from None
        finally:
            os.close(fd)


def claim(run_dir: Path, *, resume_from: str | None, overwrite: bool) -> RunLock:
    """Rank 0: refuse a dangerous or foreign folder (before writing anything into it), lock it, then
    accept or refuse the previous run it holds (module doc). Returns the held lock; writes `run.json`
    when the folder starts a new run."""
    refuse_dangerous(run_dir)
    _refuse_foreign(run_dir, _names(run_dir))
    _refuse_links(run_dir)  # before the lock file is opened: it may be the link
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run_dir)  # before judging the previous run: nobody else changes the folder meanwhile
    try:
        names = _names(run_dir)
        _refuse_previous_run(run_dir, names, resume_from, overwrite)
        if names and not resume_from:
            _remove_previous_run(run_dir, names)
        if not is_run_folder(run_dir):  # a new run or a replaced one
            write_atomic(run_dir / RUN_RECORD, json.dumps({"run_id": uuid.uuid4().hex,
                                                           "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                           "dflash_version": dflash_version()}))
    except BaseException:
        lock.release()
        raise
    return lock


def new_report_path(folder: Path, name: str) -> Path:
    """`folder/name` (`REPORT_NAME` or `ENGINE_REPORT_NAME`), or the first free `STEM-N.json` (N from 2) when a
    report is there already: the training run's (its summary.json names it) or an earlier evaluation's is never
    replaced by an evaluation that did not name its output (`--out` does)."""
    path, n = folder / name, 2
    while path.exists() or path.is_symlink():
        path, n = folder / f"{Path(name).stem}-{n}.json", n + 1
    return path


def own_export_file(name: str) -> bool:
    """Whether `name` inside a run's `export/` is one dflash writes there: the draft's files or a report."""
    return name in EXPORT_FILES or REPORT_FILE.fullmatch(name) is not None


def _own_inside(folder: str, name: str) -> bool:
    """Whether `name` inside a run's `checkpoints/` or `export/` is one dflash writes there."""
    return OWN_CHECKPOINT_ENTRY.fullmatch(name) is not None if folder == "checkpoints" else own_export_file(name)


def _remove_previous_run(run_dir: Path, names: list[str]) -> None:
    """`overwrite_output_dir=true`: remove the entries dflash writes, and in `checkpoints/` and `export/`
    only dflash's own names. A user's file there (`checkpoints/step-best/`, notes beside an export) is
    kept and named: deleting it would be the one loss an overwrite cannot undo, and keeping it costs a
    leftover the new run never reads (it resumes and prunes dflash's names alone)."""
    removed, kept = [], []
    for name in (n for n in names if _is_run_entry(n)):
        path = run_dir / name
        if name in ("checkpoints", "export") and path.is_dir():
            for inner in sorted(os.listdir(path)):
                entry = path / inner
                if not _own_inside(name, inner) or entry.is_symlink():  # dflash makes no links: a user's
                    kept.append(f"{name}/{inner}")
                    continue
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            if not os.listdir(path):
                path.rmdir()
        else:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        removed.append(name)
    log.warning("overwrite_output_dir: removed the previous run in %s (%s)%s", run_dir, ", ".join(removed),
                f"; kept what dflash did not write: {', '.join(kept)}" if kept else "")


def _names(run_dir: Path) -> list[str]:
    """The folder's entries, less the lock file (none for a missing folder)."""
    return sorted(n for n in os.listdir(run_dir) if n != LOCK_NAME) if run_dir.is_dir() else []


class RunFolder:
    """`with RunFolder(output_dir, resume_from, overwrite, rank, world_size) as run_dir:` the run's folder,
    claimed and locked by rank 0 and cleaned of what its own interrupted saves left before any rank goes
    on (a barrier under several processes); the lock is released when the block ends."""

    def __init__(self, output_dir: str | os.PathLike[str], *, resume_from: str | None, overwrite: bool,
                 rank: int = 0, world_size: int = 1) -> None:
        self.run_dir, self.resume_from, self.overwrite = Path(output_dir), resume_from, overwrite
        self.rank, self.world_size = rank, world_size
        self.lock: RunLock | None = None

    def __enter__(self) -> Path:
        if self.rank == 0:
            self.lock = claim(self.run_dir, resume_from=self.resume_from, overwrite=self.overwrite)
            try:
                prepare_run_dir(self.run_dir)  # writable? and what interrupted saves / deletions left (logged)
            except BaseException:
                self.lock.release()
                raise
        if self.world_size > 1:
            dist.barrier()  # the other ranks read checkpoints only once rank 0 has claimed and cleaned
        return self.run_dir

    def __exit__(self, *exc: Any) -> None:
        if self.lock is not None:
            self.lock.release()
