"""Where a target comes from: `config.target` ("embedded", a local folder or a hub id) resolved to what
`from_pretrained` reads, and its model, config and tokenizer loaded from there, with a one-line error for a
missing folder or an unreachable hub id; `weights_fingerprint` names the weights without loading them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dflash.embedded import embedded_target_dir, load_embedded_target
from dflash.modeling import text_config_of


def target_location(name: str) -> str:
    """What `from_pretrained` reads for `config.target`: the embedded target's converted folder, a local
    folder or a hub id. A path that names no folder is a FileNotFoundError (not a hub lookup)."""
    if name == "embedded":
        return str(embedded_target_dir())
    path = Path(name).expanduser()
    if not path.is_dir() and (path.exists() or path.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1):
        raise FileNotFoundError(f"target={name}: no such model folder")  # a path, not a hub id
    return name


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


# Files up to 1 GiB are hashed whole; larger ones by a 64 KiB block every 16 MiB, with their head and tail.
_WHOLE_FILE, _SAMPLE_BYTES, _SAMPLE_EVERY = 1 << 30, 1 << 16, 1 << 24



def weights_fingerprint(name: str) -> str:
    """12 hex digits that change when the weights behind target `name` change, read from its files without
    loading them (so a dry run and the run agree): every weight file's name, size and bytes (a file over
    1 GiB: its head with the safetensors header, its tail and a 64 KiB block every 16 MiB, so a change
    confined to a few small tensors of a huge file can escape it). A retrained model saved to the same
    folder, another hub revision, another project's `./model` get another fingerprint. "unknown" when the
    files are not on this machine (a hub id not yet downloaded).

    The embedded target's folder once also held the GGUF reference logits (`embedded.GGUF_REFERENCE`), and
    they were hashed here like weights; `target_location` moves them out before this reads the folder, so
    that target's fingerprint changed once, and a corpus regenerated before is regenerated once more.
    Accepted rather than kept by special-casing the old file: the logits are not weights, and their bytes
    can depend on the converting CPU's float summation order, so the old key could differ between machines
    holding the same weights; the new one hashes the weights alone."""
    location = target_location(name)
    folder = Path(location).expanduser()
    if not folder.is_dir():
        try:  # a hub id: the local snapshot only, never a download here
            folder = Path(snapshot_download(location, local_files_only=True))
        except Exception:  # not cached (or the hub client's own errors): nothing to read
            return "unknown"
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.suffix in _WEIGHT_SUFFIXES and p.is_file()):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(folder)}:{size}".encode())
        with path.open("rb") as f:
            if size <= _WHOLE_FILE:
                while block := f.read(1 << 24):
                    digest.update(block)
                continue
            for offset in [*range(0, size, _SAMPLE_EVERY), size - _SAMPLE_BYTES]:
                f.seek(offset)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:12]



def _from_pretrained(name: str, load: Callable[[str], Any]) -> Any:
    """`load(location)` of `config.target`, transformers' OSError for a missing folder or an unreachable hub
    id turned into a one-line FileNotFoundError."""
    location = target_location(name)
    try:
        return load(location)
    except OSError as e:  # keep its first line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = "the model folder" if Path(location).expanduser().is_dir() else "not a local folder, and the hub"
        raise FileNotFoundError(f"target={name} could not be loaded ({where}: {reason})") from None



def load_target(name: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """(model, tokenizer) for "embedded" or any HF model id / local path."""
    if name == "embedded":
        return load_embedded_target(dtype=dtype)
    return _from_pretrained(name, lambda where: (AutoModelForCausalLM.from_pretrained(where, dtype=dtype),
                                                 AutoTokenizer.from_pretrained(where)))



def load_target_config(name: str) -> Any:
    """The HF config of `config.target` (no weights read)."""
    return _from_pretrained(name, AutoConfig.from_pretrained)



def target_positions(name: str) -> int | None:
    """The positions `config.target` was built for (its text config's `max_position_embeddings`; None when it
    names none): an engine refuses a longer `max_model_len`. No weights read."""
    return getattr(text_config_of(load_target_config(name)), "max_position_embeddings", None)



def load_tokenizer(name: str) -> Any:
    """The tokenizer of `config.target` (no weights read)."""
    return _from_pretrained(name, AutoTokenizer.from_pretrained)
