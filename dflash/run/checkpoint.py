"""Crash-safe checkpoints: write to a temporary folder, fsync, rename, then move the `latest` pointer.

Layout of a run folder:
    RUN/config.yaml                      resolved TrainConfig (written once a resume is accepted)
    RUN/checkpoints/step-00000100/       one complete checkpoint
        draft.safetensors                draft weights (fp32, trainer names)
        draft_config.json                DFlashDraftConfig
        trainer_state.pt                 optimizer, schedule, step, RNG, data position, metric window:
                                         tensors and plain values only (read with weights_only=True)
        COMPLETE                         written last, before the rename: the step, each file's size and CRC-32
    RUN/checkpoints/latest               name of the newest complete checkpoint (replaced atomically)

What no kill can break (tests/test_faults.py drills each step):
- A save writes `.tmp-step-N-PID/` and renames it to `step-N` only when complete. Re-saving an existing
  step renames the old folder aside (`.old-step-N-PID`), renames the new one in, then deletes the old.
- A deletion (pruning, the old folder of a re-save) removes `COMPLETE` first, so a half-deleted folder
  is never taken for a checkpoint.
- At the next start `prepare_run_dir` removes what an interrupted save or deletion left (logged), and
  puts back an old folder whose replacement never arrived.
- `find_latest` returns the newest *intact* checkpoint (every file present, of the size and CRC-32
  COMPLETE recorded, safetensors header and zip directory whole) and logs each damaged one it passes
  over. The checksum catches what keeps a file's size (a flipped block on disk, a copy overwritten in
  place): such a `trainer_state.pt` once loaded and the run exported NaN weights.
- A failed write (disk full, read-only output) raises `CheckpointWriteError`: one line with the path and
  the cause; the temporary folder is removed and the earlier checkpoints are untouched.

`DFLASH_FAULT=point:n[:TERM]` (the fault drills' hook) SIGKILLs the process, or SIGTERMs its process
group, the n-th time it reaches a named point of a save or deletion (`FAULT_POINTS`).
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import pickle
import re
import shutil
import signal
import zipfile
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from dflash.files import write_atomic
from dflash.kinds.registry import draft_model_for_config
from dflash.modeling import DFlashDraftConfig
from dflash.run.safe_load import header_problem, trainer_state_problems, weights_problem

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
DRAFT_FILES = ("draft.safetensors", "draft_config.json")
FILES = (*DRAFT_FILES, "trainer_state.pt")
# dflash's own names in `checkpoints/`: only these are ever cleaned, pruned or removed (a user's
# `step-best/` matches `step-*` and was once deleted as a half-deleted checkpoint).
STEP_NAME = re.compile(r"step-\d{8}")
_TMP_NAME, _OLD_NAME, _POINTER_TMP = (re.compile(r"\.tmp-step-\d{8}-\d+"), re.compile(r"\.old-(step-\d{8})-\d+"),
                                      re.compile(r"\.latest-\d+"))
OWN_CHECKPOINT_ENTRY = re.compile(r"step-\d{8}|latest|\.latest-\d+|\.(tmp|old)-step-\d{8}-\d+")
FAULT_POINTS = ("save-write", "save-complete", "save-aside", "save-installed", "save-pointer", "delete", "clean")
_fault_hits: Counter[str] = Counter()


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: damaged, incomplete, or holding more than tensors and values."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, read-only output, ...); the earlier ones are intact."""


def _fault(point: str) -> None:
    """Crash injection for the fault drills (`DFLASH_FAULT=point:n[:TERM]`); a no-op without it."""
    spec = os.environ.get("DFLASH_FAULT", "").split(":")
    if spec[0] != point:
        return
    _fault_hits[point] += 1
    if _fault_hits[point] == int(spec[1] if len(spec) > 1 and spec[1] else 1):
        if len(spec) > 2 and spec[2] == "TERM":
            os.killpg(os.getpgrp(), signal.SIGTERM)  # what a scheduler sends: the process and its workers
        else:
            os.kill(os.getpid(), signal.SIGKILL)


def _own(root: Path, pattern: re.Pattern[str]) -> list[Path]:
    """The entries of `root` that `pattern` names, links left out: dflash makes no links, so a link is a
    user's, and cleaning through it would reach into another folder (another run's checkpoints)."""
    return sorted(p for p in root.iterdir() if pattern.fullmatch(p.name) and not p.is_symlink())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> None:
    """Write and fsync one file with plain file I/O, so a full or read-only disk is an OSError naming it."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e  # a failed write names no file of its own


def write_run_config(run_dir: str | Path, config: dict[str, Any]) -> None:
    """RUN/config.yaml, the resolved configuration (written by `fit` once a resume has been accepted, so a
    refused one leaves the run's file as it was)."""
    write_atomic(Path(run_dir) / "config.yaml", yaml.safe_dump(config, sort_keys=False))


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    draft_state: dict[str, torch.Tensor],
    draft_config: dict[str, Any],
    trainer_state: dict[str, Any],
    keep_last: int = 3,
) -> Path:
    """SYNC POINT: write a complete checkpoint atomically; returns its folder. Raises CheckpointWriteError."""
    root = Path(run_dir) / "checkpoints"
    final = checkpoint_path(run_dir, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    state = io.BytesIO()
    torch.save(trainer_state, state)
    files = {"draft.safetensors": safetensors_bytes({k: v.detach().contiguous().cpu() for k, v in draft_state.items()}),
             "draft_config.json": json.dumps(draft_config, indent=2).encode(),
             "trainer_state.pt": state.getvalue()}
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        for name, data in files.items():
            _write(tmp / name, data)
            _fault("save-write")
        seq = 1 + max((_marker(p).get("seq", 0) for p in _own(root, STEP_NAME)), default=0)  # the newest save
        marker = {"step": step, "seq": seq, "sizes": {n: len(d) for n, d in files.items()},
                  "crc32": {n: zlib.crc32(d) for n, d in files.items()}}  # about 6 GB/s: seconds for a 1B draft
        _write(tmp / COMPLETE, json.dumps(marker).encode())
        _fsync_dir(tmp)
        _fault("save-complete")
        aside = _install(root, tmp, final)
        pointer = root / f".latest-{os.getpid()}"
        _write(pointer, final.name.encode())
        os.replace(pointer, root / "latest")
        _fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = e.strerror or str(e)
        raise CheckpointWriteError(f"could not write checkpoint {final} ({e.filename or tmp}: {cause}); "
                                   "the earlier checkpoints are intact") from e
    _fault("save-pointer")
    if aside is not None:
        _remove(aside)
    _prune(root, keep_last, final)
    return final


def _install(root: Path, tmp: Path, final: Path) -> Path | None:
    """Rename the complete `tmp` to `final`. An existing `final` (a step saved again, e.g. after a
    resume from an older checkpoint) is renamed aside first and only deleted by the caller once the new
    one is in place and named by `latest`; returns the aside folder."""
    aside = None
    if final.exists():
        aside = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, aside)
        _fault("save-aside")
    try:
        os.replace(tmp, final)
    except OSError:
        if aside is not None:
            os.replace(aside, final)
        raise
    _fsync_dir(root)
    _fault("save-installed")
    return aside


def _remove(path: Path, fault: str = "delete") -> None:
    """Delete a checkpoint folder: its COMPLETE marker first (made durable), then the rest, so a kill
    part way leaves a folder nobody resumes from (removed at the next start). A link (a user's) is
    removed as a link: nothing behind it is touched."""
    if path.is_symlink():
        path.unlink()
        return
    try:
        (path / COMPLETE).unlink(missing_ok=True)
        _fsync_dir(path)
    except OSError:
        pass
    _fault(fault)
    shutil.rmtree(path, ignore_errors=True)


def _prune(root: Path, keep_last: int, current: Path) -> None:
    """Keep `current` and the `keep_last - 1` newest complete checkpoints before it. Later steps (left
    by a run that went further before this one resumed from an older checkpoint) are not touched."""
    older = [p for p in _own(root, STEP_NAME) if p.name < current.name and (p / COMPLETE).exists()]
    for old in older[: max(0, len(older) - (keep_last - 1))]:
        _remove(old)


def prepare_run_dir(run_dir: str | Path) -> None:
    """At a run's start: make `run_dir`, refusing one that cannot be written (before any data work), and
    remove what interrupted saves and deletions of an earlier launch left in its checkpoints (each
    logged): temporary folders, half-deleted checkpoints (no COMPLETE), and old folders of a re-save,
    which are put back when their replacement never arrived. Safe to call from every rank."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(run_dir, os.W_OK):
        raise PermissionError(errno.EROFS if _read_only(run_dir) else errno.EACCES,
                              "Read-only file system" if _read_only(run_dir) else "not writable", str(run_dir))
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return
    for old in _own(root, _OLD_NAME):
        name = _OLD_NAME.fullmatch(old.name).group(1)
        try:
            if (old / COMPLETE).exists() and not (root / name).exists():
                os.replace(old, root / name)
                log.warning("restored checkpoint %s (its re-save was interrupted before the new copy was in place)",
                            root / name)
                continue
        except OSError:
            continue  # another rank got there first
        log.warning("removing %s, the old copy of a checkpoint saved again", old)
        _remove(old, fault="clean")
    for tmp in _own(root, _TMP_NAME):
        log.warning("removing %s, left by an interrupted save", tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    for pointer in _own(root, _POINTER_TMP):
        pointer.unlink(missing_ok=True)
    for cand in _own(root, STEP_NAME):
        if cand.is_dir() and not (cand / COMPLETE).exists():
            log.warning("removing %s: no %s marker (its deletion was interrupted)", cand, COMPLETE)
            shutil.rmtree(cand, ignore_errors=True)


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


# ---- reading -----------------------------------------------------------------------------------


def _marker(folder: Path) -> dict[str, Any]:
    """A checkpoint's COMPLETE marker ({} when missing, or an older marker holding the step alone)."""
    try:
        marker = json.loads((folder / COMPLETE).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def _zip_problem(path: Path) -> str | None:
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as z:
            if any(i.header_offset + i.compress_size > size for i in z.infolist()):
                return f"{path.name} is truncated"
    except (zipfile.BadZipFile, OSError, ValueError):
        return f"{path.name} is truncated or not a torch file ({size} bytes)"
    return None


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


def damage(path: str | Path, files: tuple[str, ...] = FILES) -> str | None:
    """Why checkpoint folder `path` cannot be used (None: intact): sizes, headers, then each file's CRC-32
    against COMPLETE's (markers written before checksums were recorded are checked by size alone)."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        return f"no {COMPLETE} marker (its save or deletion was interrupted)"
    missing = [name for name in files if not (path / name).is_file()]
    if missing:
        return f"{', '.join(missing)} missing"
    sizes = _marker(path).get("sizes", {})
    for name in files:
        saved, actual = sizes.get(name), (path / name).stat().st_size
        if saved is not None and saved != actual:
            return f"{name} is {actual} bytes, {saved} when it was saved (truncated or overwritten)"
    problems = [header_problem(path / "draft.safetensors")]
    if "trainer_state.pt" in files:
        problems.append(_zip_problem(path / "trainer_state.pt"))
    problem = next((p for p in problems if p), None)
    if problem:
        return problem
    crcs = _marker(path).get("crc32", {})
    for name in files:
        if crcs.get(name) is not None and crcs[name] != _crc32(path / name):
            return f"{name} does not match the checksum recorded when it was saved (changed on disk since)"
    return None


def find_latest(run_dir: str | Path, files: tuple[str, ...] = FILES) -> Path | None:
    """Newest intact checkpoint of a run: the last one saved (the save counter in COMPLETE, which also
    covers a save killed before it moved `latest`; then `latest`, then the step, for older markers).
    Damaged ones are passed over with a log line naming the folder and why; when checkpoints exist and
    none is intact, a CheckpointError (a run never silently starts again at step 0). `files`: the files
    that must be whole (the weights and config alone for an export)."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return None
    pointer = root / "latest"
    named = pointer.read_text().strip() if pointer.is_file() else ""
    named = named if STEP_NAME.fullmatch(named) else ""
    candidates = sorted((p for p in root.glob("step-*") if STEP_NAME.fullmatch(p.name) and p.is_dir()), reverse=True,
                        key=lambda p: (_marker(p).get("seq", 0), p.name == named, p.name))
    damaged = []
    for cand in candidates:
        why = damage(cand, files)
        if why is None:
            if damaged:
                log.warning("resuming from %s, the newest intact checkpoint", cand)
            return cand
        if (cand / COMPLETE).exists():
            damaged.append(f"{cand.name}: {why}")
            log.warning("checkpoint %s is damaged (%s): falling back to an older one", cand, why)
        else:
            log.warning("skipping incomplete checkpoint %s (%s)", cand, why)
    if damaged:
        advice = ("Remove the damaged folders to start again from step 0, or name another checkpoint in resume_from"
                  if "trainer_state.pt" in files else "Name an intact checkpoint folder instead")  # a resume / an export
        raise CheckpointError(f"no intact checkpoint in {root} ({'; '.join(damaged)}). {advice}")
    return None


def _checkpoint(path: Path, what: str, files: tuple[str, ...]) -> Path:
    """A named checkpoint folder, or a run folder's newest intact one; `what` names the setting in errors."""
    if (path / "checkpoints").is_dir():
        found = find_latest(path, files)
        if found is None:
            raise FileNotFoundError(f"{what}: the run folder {path} has no complete checkpoint")
        return found
    if not path.is_dir():
        raise FileNotFoundError(f"{what}: {path} is neither a checkpoint folder nor a run folder with checkpoints")
    why = damage(path, files)
    if why:
        raise CheckpointError(f"{what}: checkpoint {path} cannot be used: {why}")
    return path


def resolve_resume(resume_from: str | None, run_dir: str | Path) -> Path | None:
    """`latest` -> newest intact checkpoint of `run_dir` (None on a fresh run); a path -> that checkpoint,
    or a run folder's newest intact one."""
    if not resume_from:
        return None
    if resume_from == "latest":
        return find_latest(run_dir)
    return _checkpoint(Path(resume_from), f"resume_from={resume_from!r}", FILES)


def checkpoint_folder(path: str | Path) -> Path:
    """What `dflash export PATH` reads: a checkpoint folder, or a run folder's newest intact checkpoint."""
    return _checkpoint(Path(path), f"checkpoint {str(path)!r}", DRAFT_FILES)


def load_checkpoint_draft(path: str | Path, device: torch.device | str = "cpu", draft: Any = None) -> tuple[dict, dict]:
    """(draft_state, draft_config) of a checkpoint: its weights and config only, no optimizer state. The weights'
    header is checked against the draft its draft_config.json describes, and `draft` (a resume's), before any tensor
    is read (`safe_load.weights_problem`): a header declaring a huge tensor allocated all of it before any check."""
    path = Path(path)
    try:
        draft_config = json.loads((path / "draft_config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / 'draft_config.json'} cannot be read: {e}") from None
    weights = path / "draft.safetensors"
    if problem := weights_problem(weights, draft_config, draft):
        raise CheckpointError(problem)
    try:
        draft_state = load_file(str(weights), device=str(device))
    except Exception as e:  # safetensors' own error type names no file: say which one
        raise CheckpointError(f"{weights} cannot be read: {e}") from None
    return draft_state, draft_config


def load_trainer_state(path: str | Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """A checkpoint's trainer_state.pt, unpickled with `weights_only=True`: tensors, containers and plain
    values only, so a checkpoint from elsewhere cannot run code when it is loaded; its step and data position
    whole numbers >= 0 (`safe_load.trainer_state_problems`)."""
    file = Path(path) / "trainer_state.pt"
    try:
        state = torch.load(file, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{file} holds objects other than tensors and plain values, refused: loading it could "
                              f"run code ({reason})") from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{file} cannot be read: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}") \
            from None
    if problems := trainer_state_problems(state):  # values no run writes (a crafted or damaged file), never trained on
        raise CheckpointError(f"{file} holds values out of range, not resumed: {'; '.join(problems)}")
    return state


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu", draft: Any = None) -> tuple[dict, dict, dict]:
    """(draft_state, draft_config, trainer_state) of a complete checkpoint; `draft`: the module it is loaded into."""
    draft_state, draft_config = load_checkpoint_draft(path, device, draft)
    return draft_state, draft_config, load_trainer_state(path, device)


def draft_from_checkpoint(draft_state: dict[str, torch.Tensor], draft_config: dict[str, Any]) -> torch.nn.Module:
    """Rebuild the draft saved in a checkpoint (of the kind its config holds: `registry.kind_of`); a CheckpointError
    naming the tensors when the weights do not fit the config (an edited or swapped draft_config.json)."""
    try:
        model = draft_model_for_config(DFlashDraftConfig.from_dict(draft_config))
        model.load_state_dict(draft_state)
    except (RuntimeError, TypeError, ValueError) as e:
        problems = [line.strip() for line in str(e).strip().splitlines()[1:]] or [str(e)]  # line 0: a header
        raise CheckpointError(f"draft.safetensors does not fit the checkpoint's draft_config.json: "
                              f"{'; '.join(problems[:3])}") from None
    return model
