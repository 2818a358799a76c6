"""An export's own files: written whole, checksummed, verified on load, and only where dflash may write them.

**The checksum.** `config.json` records the sha256 of the folder's `model.safetensors` at its top level
(`CHECKSUM_KEY`, computed from the bytes as written). vLLM, SGLang and `transformers` read config.json and
keep or ignore unknown top-level keys, so serving is unchanged; `load_exported` (behind `dflash eval`,
`init_from` and the Trainer's resume from a published save) verifies it once the names and shapes are checked
and before the weights are used, so a same-size byte flip is refused instead of evaluated. An export written
before the checksum loads with a warning. The same key marks a folder as a dflash export (a model folder's
config.json does not have it).

**Where `dflash export RUN OUT` writes** (the rules of `dflash train`'s `output_dir`, `dflash.run.folder`):
- a filesystem root, a folder directly under it and the home folder (or an ancestor) are refused;
- OUT is written when it is missing, empty, or an earlier dflash export (replaced in place: a re-export);
- any other folder (a model folder, the working folder) is refused with the choices named, unless the user
  passes `--overwrite`, which replaces OUT's `config.json` and `model.safetensors` and nothing else;
- nothing is ever deleted: every other file in OUT is kept. The two files are written to temporary names and
  renamed over the old ones, so a kill leaves the old file or the new one, and a symbolic link there is
  replaced, never written through (an HF cache snapshot links its files to shared blobs).
The end-of-run export of `dflash train` writes into the run's own `export/` (the run folder is claimed by
`RunFolder` first) and the Trainer path into its own checkpoints: neither goes through `check_export_folder`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dflash.data.features import file_sha256
from dflash.files import write_atomic
from dflash.run.folder import REPORT_FILE, RunFolderError, refuse_dangerous

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CHECKSUM_KEY = "dflash_weights_sha256"  # top level of config.json: the sha256 of model.safetensors
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ExportFolderError(ValueError):
    """The export's output folder cannot be written as asked; the message names the choices."""


def recorded_checksum(config: Any) -> str | None:
    """The weights' sha256 an export's config.json dict records, None when it records none."""
    value = config.get(CHECKSUM_KEY) if isinstance(config, dict) else None
    return value if isinstance(value, str) and _SHA256.fullmatch(value) else None


def is_export(folder: Path) -> bool:
    """Whether `folder` holds a dflash export: a plain `config.json` (not a link) recording the weights'
    checksum. A config.json alone is any model's."""
    path = folder / CONFIG_NAME
    try:
        if not stat.S_ISREG(path.lstat().st_mode) or path.stat().st_size > 1 << 20:
            return False
        return recorded_checksum(json.loads(path.read_text())) is not None
    except (OSError, ValueError):
        return False


def check_export_folder(out: Path, *, overwrite: bool) -> str | None:
    """Refuse an output folder `dflash export` may not write (module doc), before anything is read or
    written; returns the checksum of the earlier export there (None: none)."""
    try:
        refuse_dangerous(out)
    except RunFolderError:  # its message speaks of output_dir: say it for export
        raise ExportFolderError(f"{out} ({out.expanduser().resolve()}) is a system or home folder; export into a "
                                f"folder of its own, e.g. {out / 'draft'}") from None
    if out.exists() and not out.is_dir():
        raise ExportFolderError(f"{out} is a file, not a folder; give the export a new or empty folder")
    names = sorted(os.listdir(out)) if out.is_dir() else []
    if not names:
        return None
    if is_export(out):
        return recorded_checksum(json.loads((out / CONFIG_NAME).read_text()))
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    if not overwrite:
        raise ExportFolderError(
            f"{out} is not a dflash export (it holds {shown}); dflash export writes only into a new or empty "
            f"folder or an earlier export: choose another folder, or pass --overwrite to replace its {CONFIG_NAME} "
            f"and {WEIGHTS_NAME} (nothing else there is touched)")
    kept = [n for n in names if n not in (CONFIG_NAME, WEIGHTS_NAME)]
    log.warning("--overwrite: replacing %s in %s, which is not a dflash export%s", " and ".join(
        n for n in (CONFIG_NAME, WEIGHTS_NAME) if n in names) or "nothing", out,
        f"; kept: {', '.join(kept)}" if kept else "")
    return None


def warn_stale_reports(out: Path, before: str | None) -> None:
    """After a re-export: name the evaluation reports beside it that scored other weights (kept, not removed:
    a report is the user's record; `dflash eval --draft OUT` scores the new ones)."""
    after = recorded_checksum(json.loads((out / CONFIG_NAME).read_text()))
    reports = sorted(n for n in os.listdir(out) if REPORT_FILE.fullmatch(n))
    if before is not None and before != after and reports:
        log.warning("%s: %s scored the weights this export replaced; evaluate again with dflash eval --draft %s",
                    out, ", ".join(reports), out)


def write_export_files(state: dict[str, torch.Tensor], config: dict[str, Any], out: Path) -> Path:
    """Write `state` as `out/model.safetensors` and `config` (plus `CHECKSUM_KEY`) as `out/config.json`, each
    to a temporary name renamed over the old file (module doc); weights first, so a kill between the two
    leaves a config whose checksum refuses the new weights rather than one vouching for them."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{WEIGHTS_NAME}.tmp-{os.getpid()}"
    try:
        save_file(state, str(tmp), metadata={"format": "pt"})
        digest = file_sha256(tmp)  # of the bytes on disk, as `verify_weights` reads them
        os.replace(tmp, out / WEIGHTS_NAME)
    finally:
        tmp.unlink(missing_ok=True)
    write_atomic(out / CONFIG_NAME, json.dumps({**config, CHECKSUM_KEY: digest}, indent=2, sort_keys=True) + "\n")
    return out


def verify_weights(folder: Path, config: dict[str, Any]) -> None:
    """Check `folder/model.safetensors` against the checksum its config.json records: a mismatch is a
    ValueError naming the file and the fix; an export without one (written before it) is loaded, with a warning."""
    expected = recorded_checksum(config)
    weights = folder / WEIGHTS_NAME
    if expected is None:
        log.warning("%s records no checksum of %s (an export from an older dflash): its weights are not verified; "
                    "export it again to add one", folder / CONFIG_NAME, WEIGHTS_NAME)
        return
    if (found := file_sha256(weights)) != expected:
        raise ValueError(f"{weights} does not match the sha256 its {CONFIG_NAME} records ({CHECKSUM_KEY} "
                         f"{expected[:12]}..., the file's {found[:12]}...): it was changed or damaged after export; "
                         "export the draft again (dflash export RUN OUT_DIR)")
