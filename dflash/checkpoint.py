"""Crash-safe checkpoints: write to a temporary folder, fsync, rename, then move the `latest` pointer.

Layout of a run folder:
    RUN/config.yaml                      resolved TrainConfig
    RUN/checkpoints/step-00000100/       one complete checkpoint
        draft.safetensors                draft weights (fp32, trainer names)
        draft_config.json                DFlashDraftConfig
        trainer_state.pt                 optimizer, schedule, step, RNG, data position, metric window
        COMPLETE                         written last, before the rename
    RUN/checkpoints/latest               name of the newest complete checkpoint (replaced atomically)

A checkpoint folder without COMPLETE (a process killed mid-save) is reported and skipped.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash.factory import draft_model_for_config
from dflash.modeling import DFlashDraftConfig

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(path)


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
    """SYNC POINT: write a complete checkpoint atomically; returns its folder."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(run_dir, step)
    name = final.name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in draft_state.items()}, str(tmp / "draft.safetensors"))
    (tmp / "draft_config.json").write_text(json.dumps(draft_config, indent=2))
    torch.save(trainer_state, tmp / "trainer_state.pt")
    (tmp / COMPLETE).write_text(str(step))
    _fsync_tree(tmp)
    if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    pointer_tmp = root / f".latest-{os.getpid()}"
    pointer_tmp.write_text(name)
    with open(pointer_tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(pointer_tmp, root / "latest")
    _fsync_dir(root)
    _prune(root, keep_last)
    return final


def _prune(root: Path, keep_last: int) -> None:
    done = sorted(p for p in root.glob("step-*") if (p / COMPLETE).exists())
    for old in done[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def find_latest(run_dir: str | Path) -> Path | None:
    """Newest complete checkpoint of a run, skipping (and reporting) half-written ones."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return None
    candidates = sorted(root.glob("step-*"), reverse=True)
    pointer = root / "latest"
    if pointer.exists():
        named = root / pointer.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
    for cand in candidates:
        if (cand / COMPLETE).exists():
            return cand
        if cand.exists():
            log.warning("skipping incomplete checkpoint %s (no %s marker: the save was interrupted)", cand, COMPLETE)
    for tmp in root.glob(".tmp-*"):
        log.warning("ignoring interrupted save %s", tmp)
    return None


def resolve_resume(resume_from: str | None, run_dir: str | Path) -> Path | None:
    """`latest` -> newest complete checkpoint of `run_dir` (None on a fresh run); a path -> that checkpoint."""
    if not resume_from:
        return None
    if resume_from == "latest":
        return find_latest(run_dir)
    path = Path(resume_from)
    if (path / "checkpoints").exists():
        path = find_latest(path) or path
    if not (path / COMPLETE).exists():
        raise FileNotFoundError(f"resume_from={resume_from!r}: {path} is not a complete checkpoint (no {COMPLETE})")
    return path


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu") -> tuple[dict, dict, dict]:
    """(draft_state, draft_config, trainer_state) of a complete checkpoint."""
    path = Path(path)
    draft_state = load_file(str(path / "draft.safetensors"), device=str(device))
    draft_config = json.loads((path / "draft_config.json").read_text())
    trainer_state = torch.load(path / "trainer_state.pt", map_location=device, weights_only=False)
    return draft_state, draft_config, trainer_state


def draft_from_checkpoint(draft_state: dict[str, torch.Tensor], draft_config: dict[str, Any]) -> torch.nn.Module:
    """Rebuild the draft saved in a checkpoint (DFlash, or Domino when its config says so)."""
    model = draft_model_for_config(DFlashDraftConfig.from_dict(draft_config))
    model.load_state_dict(draft_state)
    return model
