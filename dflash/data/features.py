"""Offline target features: run the frozen target once over the training rows and keep its hidden states.

`write_features` writes the features of `FrozenTarget.layer_ids` (and, with `labels=True`, the target's
greedy next tokens) of every row to safetensors shards plus a `manifest.json` describing what made them
(target identity, layer ids, dtype, tokenizer, max length, rows, and each shard's size and checksum).
The reader, the manifest check and the collate function are in `dflash.data.feature_data`.

Layout of a folder::

    manifest.json                 # written last: the folder is complete
    manifest.partial.json         # while writing: the header and the shards finished so far
    shard-00000.safetensors       # rows [0, shard_rows): concatenated along the token axis

A run's folder (`data.features`, written by `dflash features`) holds two such folders: `train/` (the
training rows) and `held_out/` (the held-out rows, absent when `data.eval_size` is 0).

A shard holds `features [T, K*H]` (the chosen dtype), `input_ids [T]` int32, `loss_mask [T]` uint8,
optionally `labels [T]` int32 (T = the tokens of its rows, unpadded), `offsets [n + 1]` int64 (row i
is tokens offsets[i]:offsets[i+1]) and `row_ids [n]` int64 (rows in row order); its metadata names the
manifest header it was written for and its rows (`shard_binding`). Safetensors was chosen over Arrow on
measured read throughput (`scripts/bench_features.py`).

Each shard is computed from its own rows only (sorted by length inside the shard, in fixed batches), so
a run resumed after an interruption writes the same bytes as one that was never interrupted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from dflash.data.tokenization import tokenizer_fingerprint
from dflash.files import format_bytes, write_atomic
from dflash.modeling import text_config_of
from dflash.target_model.frozen import FrozenTarget

logger = logging.getLogger(__name__)

# 2: each shard names, in its metadata, the manifest header it was written for and its rows (`shard_binding`)
FORMAT_VERSION = 2
BINDING_KEY = "dflash_features"  # the shard's one metadata entry (`shard_binding`)
MANIFEST = "manifest.json"
PARTIAL = "manifest.partial.json"
# `dflash features` writes the training rows and the held-out rows of a run to these sub-folders of `data.features`.
TRAIN_PART, HELD_OUT_PART = "train", "held_out"
SPLIT_RECORD = "held_out_split.json"  # in a run's feature folder: the settings that chose its held-out rows
FEATURE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Config entries that say how a checkpoint was saved or loaded, not what the model computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation",
                         "_attn_implementation_internal", "_commit_hash", "attn_implementation", "use_cache"}
_SAMPLE = 64  # values per tensor in the weights' sample checksum
# Bytes per token besides the features: input_ids int32, loss_mask uint8, labels int32.
_SIDE_BYTES = 4 + 1


def dtype_name(dtype: torch.dtype | str) -> str:
    """The manifest's name of a feature dtype ("float32", "bfloat16", "float16")."""
    if isinstance(dtype, str):
        if dtype not in FEATURE_DTYPES:
            raise ValueError(f"feature dtype {dtype!r} is not one of {sorted(FEATURE_DTYPES)}")
        return dtype
    for name, value in FEATURE_DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"feature dtype {dtype} is not one of {sorted(FEATURE_DTYPES)}")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def config_hash(config: Any) -> str:
    """Hash of what a (text) config says about the model's computation (not how it was saved or loaded)."""
    text = text_config_of(config)
    entries = text.to_dict() if hasattr(text, "to_dict") else dict(text)

    def clean(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: clean(v) for k, v in value.items() if k not in _VOLATILE_CONFIG_KEYS}
        return value

    return _sha256(json.dumps(clean(entries), sort_keys=True, default=str).encode())


def tensor_sample(weight: torch.Tensor) -> list[float]:
    """A small deterministic sample of a tensor's values (evenly strided, as float32 rounded to 6 digits)."""
    flat = weight.detach().reshape(-1)
    step = max(1, flat.numel() // _SAMPLE)
    return [round(float(v), 6) for v in flat[::step][:_SAMPLE].float().cpu().tolist()]


def head_checksum(embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> str:
    """Checksum of the embedding and LM head (shape and a value sample): what a draft trained on the features
    shares with the target, checkable from an `OfflineTarget` without the trunk."""
    parts = [list(embed_weight.shape), tensor_sample(embed_weight), list(lm_head_weight.shape),
             tensor_sample(lm_head_weight)]
    return _sha256(json.dumps(parts).encode())


def target_identity(target: FrozenTarget, name: str) -> dict[str, Any]:
    """Name, config hash, a hash of the weights' names and shapes with a sample of each one's values,
    and the embedding / head checksum: cheap (a few values per tensor) and deterministic."""
    weights = [[n, list(p.shape), tensor_sample(p)] for n, p in target.model.named_parameters()]
    return {
        "name": name,
        "config_hash": config_hash(target.text_config),
        "weights_hash": _sha256(json.dumps(weights).encode()),
        "head_checksum": head_checksum(target.embed_weight, target.lm_head_weight),
    }


def _num_rows(rows: Any) -> int:
    return len(rows["input_ids"]) if isinstance(rows, Mapping) else len(rows)


def _slice(rows: Any, start: int, end: int) -> Mapping[str, Sequence[Any]]:
    """Columns of rows [start, end) of a `datasets.Dataset` or a dict of columns."""
    if isinstance(rows, Mapping):
        return {k: v[start:end] for k, v in rows.items()}
    return rows[start:end]


def rows_digest(rows: Any, chunk: int = 1024) -> tuple[str, list[int]]:
    """Hash of the rows' input_ids and loss_mask (which data the features were made from), and each row's
    length; read `chunk` rows at a time."""
    h = hashlib.sha256()
    lengths: list[int] = []
    for start in range(0, _num_rows(rows), chunk):
        part = _slice(rows, start, start + chunk)
        for ids, mask in zip(part["input_ids"], part["loss_mask"], strict=True):
            h.update(json.dumps([list(ids), list(mask)]).encode())
            lengths.append(len(ids))
    return h.hexdigest(), lengths


def part_dir(root: str | os.PathLike[str], part: str) -> Path:
    """The folder of one part (`TRAIN_PART` or `HELD_OUT_PART`) of a run's feature folder `root`."""
    return Path(root) / part


def regenerate_command(out_dir: str | os.PathLike[str]) -> str:
    """The command that (re)writes a feature folder (the CLI's `dflash features`); a part folder
    (`train`, `held_out`) names the run's folder above it, the value of `data.features`."""
    path = Path(out_dir)
    root = path.parent if path.name in (TRAIN_PART, HELD_OUT_PART) else path
    return f"dflash features CONFIG data.features={root}"


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_split_record(root: str | os.PathLike[str], split: Mapping[str, Any]) -> None:
    """Record in a run's feature folder the data settings that chose its held-out rows
    (`DataSettings.held_out_split`; read by `feature_data.read_split_record`)."""
    _write_json_atomic(Path(root) / SPLIT_RECORD, split)


def _write_json_atomic(path: Path, payload: Mapping[str, Any]) -> None:
    write_atomic(path, json.dumps(payload, indent=1, sort_keys=True) + "\n")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def shard_tensors(rows: Sequence[Mapping[str, torch.Tensor]], row_start: int) -> dict[str, torch.Tensor]:
    """One shard's tensors from rows in row order, each `{"features": [L, K*H], "input_ids": [L],
    "loss_mask": [L], optional "labels": [L]}` (rows `row_start`, `row_start + 1`, ...)."""
    lengths = torch.tensor([len(r["input_ids"]) for r in rows], dtype=torch.int64)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    out = {
        "features": torch.cat([r["features"] for r in rows]).contiguous(),
        "input_ids": torch.cat([torch.as_tensor(r["input_ids"]).to(torch.int32) for r in rows]),
        "loss_mask": torch.cat([torch.as_tensor(r["loss_mask"]).to(torch.uint8) for r in rows]),
        "offsets": offsets,
        "row_ids": torch.arange(row_start, row_start + len(rows), dtype=torch.int64),
    }
    if "labels" in rows[0]:
        out["labels"] = torch.cat([torch.as_tensor(r["labels"]).to(torch.int32) for r in rows])
    return out


def header_digest(header: Mapping[str, Any]) -> str:
    """sha256 of a manifest header: what made a folder's features (target, layers, dtype, rows, ...)."""
    return _sha256(json.dumps(header, sort_keys=True).encode())


def shard_binding(header: Mapping[str, Any], rows: Sequence[int]) -> str:
    """What a shard records of its place, in its own bytes: the digest of the header it was written for and its
    rows [start, end). The manifest's sha256 of each shard says the file is the one listed, but whoever edits a
    shard can edit that hash: a shard swapped with another of the folder, or copied in from another feature
    folder (another target's features of the same rows), with its hash updated, trained. The binding is inside
    the checksummed bytes, so such a shard names another header or other rows (`feature_data.check_shards`)."""
    return json.dumps({"version": FORMAT_VERSION, "header": header_digest(header), "rows": list(rows)})


def save_shard(path: Path, tensors: Mapping[str, torch.Tensor], binding: str | None = None) -> dict[str, Any]:
    """Write a shard atomically (temporary file, then rename), with its `shard_binding` when given; its manifest
    entry (file, bytes, sha256)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        # One metadata entry: safetensors keeps metadata in a hash map whose order changes from call to call.
        save_file(dict(tensors), str(tmp), metadata={BINDING_KEY: binding or json.dumps({"version": FORMAT_VERSION})})
    except Exception as e:  # safetensors' own error for a failed write: the OS error it wraps, naming the file
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) or not (code := re.search(r"os error (\d+)", str(e))):
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None
    os.replace(tmp, path)
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": file_sha256(path)}


def estimate_bytes(num_tokens: int, feature_dim: int, dtype: torch.dtype | str, labels: bool) -> int:
    """Bytes of the feature files of `num_tokens` tokens (features, ids, mask, labels; headers not counted)."""
    item = torch.empty((), dtype=FEATURE_DTYPES[dtype_name(dtype)]).element_size()
    return num_tokens * (feature_dim * item + _SIDE_BYTES + (4 if labels else 0))


def _free_bytes(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _compute_shard(target: FrozenTarget, rows: Any, start: int, end: int, *, dtype: torch.dtype, max_length: int,
                   labels: bool, batch_size: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Features of rows [start, end) in row order: batched inside the shard, longest first."""
    chunk = _slice(rows, start, end)
    ids = [list(r)[:max_length] for r in chunk["input_ids"]]
    masks = [list(m)[:max_length] for m in chunk["loss_mask"]]
    order = sorted(range(len(ids)), key=lambda i: (-len(ids[i]), i))
    out: list[dict[str, torch.Tensor] | None] = [None] * len(ids)
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        seq = max(len(ids[i]) for i in batch)
        padded = torch.zeros((len(batch), seq), dtype=torch.long)
        for j, i in enumerate(batch):
            padded[j, : len(ids[i])] = torch.tensor(ids[i], dtype=torch.long)
        padded = padded.to(device)
        with torch.no_grad():
            if labels:
                feats, greedy = target.features_and_greedy(padded)
            else:
                feats, greedy = target(padded), None
        feats = feats.to(dtype).cpu()
        for j, i in enumerate(batch):
            n = len(ids[i])
            row = {"features": feats[j, :n].clone(), "input_ids": torch.tensor(ids[i], dtype=torch.int32),
                   "loss_mask": torch.tensor(masks[i], dtype=torch.uint8)}
            if greedy is not None:
                row["labels"] = greedy[j, :n].to(torch.int32).cpu()
            out[i] = row
    return out  # type: ignore[return-value]


def _kept_shards(out_dir: Path, header: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The shards a previous run of the same header finished (listed in its partial manifest, complete and
    with a matching checksum), in order up to the first one missing or damaged."""
    partial = out_dir / PARTIAL
    if not partial.is_file():
        return []
    previous = json.loads(partial.read_text())
    if previous.get("header") != header:
        differs = sorted(k for k in set(header) | set(previous.get("header", {}))
                         if header.get(k) != previous.get("header", {}).get(k))
        raise ValueError(f"{out_dir} holds an unfinished feature run of other settings ({', '.join(differs)} differ): "
                         "delete the folder or write to another one")
    kept: list[dict[str, Any]] = []
    for entry in previous.get("shards", []):
        path = out_dir / entry["file"]
        if not path.is_file() or path.stat().st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
            break
        kept.append(entry)
    return kept


def write_features(target: FrozenTarget, target_name: str, rows: Any, out_dir: str | os.PathLike[str], *,
                   tokenizer: Any, dtype: torch.dtype | str, max_length: int, labels: bool, shard_rows: int = 1024,
                   batch_size: int = 8, progress: bool = True, stop_after_shards: int | None = None,
                   on_shard: Callable[[int], None] | None = None) -> Path:
    """Run the frozen target once over `rows` (a `datasets.Dataset` or a dict of columns: input_ids,
    loss_mask) and write its features to `out_dir`; returns the folder.

    Rows are cut to `max_length` tokens. Shard k holds rows [k * shard_rows, (k + 1) * shard_rows). The
    estimate of the files' size is logged first, and a free disk smaller than what is left to write is
    refused with both numbers. Finished shards of an interrupted run with the same settings are kept
    (checked against their size and checksum) and the run resumes at the first missing one. A folder whose
    `manifest.json` already describes these settings is returned as is. `stop_after_shards` (tests) stops
    after writing that many shards in this call; `on_shard(k)` is called after shard k is recorded.
    """
    out = Path(out_dir)
    name = dtype_name(dtype)
    torch_dtype = FEATURE_DTYPES[name]
    if shard_rows < 1 or batch_size < 1:
        raise ValueError(f"shard_rows and batch_size must be >= 1 (got {shard_rows}, {batch_size})")
    num_rows = _num_rows(rows)
    if num_rows == 0:
        raise ValueError("no rows to compute features for")
    digest, full_lengths = rows_digest(rows)
    lengths = [min(n, max_length) for n in full_lengths]
    feature_dim = target.hidden_size * len(target.layer_ids)
    header = {
        "version": FORMAT_VERSION,
        "target": target_identity(target, target_name),
        "layer_ids": list(target.layer_ids),
        "hidden_size": target.hidden_size,
        "feature_dim": feature_dim,
        "dtype": name,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_length": max_length,
        "labels": bool(labels),
        "num_rows": num_rows,
        "num_tokens": sum(lengths),
        "rows_digest": digest,
        "shard_rows": shard_rows,
    }
    if (out / MANIFEST).is_file():
        done = json.loads((out / MANIFEST).read_text())
        if done.get("header") == header:
            logger.info("features already complete in %s", out)
            return out
        raise ValueError(f"{out} already holds features of other settings: delete the folder or write to another one")
    out.mkdir(parents=True, exist_ok=True)
    kept = _kept_shards(out, header)
    starts = list(range(0, num_rows, shard_rows))
    needed = estimate_bytes(sum(lengths), feature_dim, torch_dtype, labels)
    left = estimate_bytes(sum(lengths[len(kept) * shard_rows :]), feature_dim, torch_dtype, labels)
    logger.info("features: %d rows, %d tokens x %d (%s): about %s (%s left to write), %d shards (%d kept)",
                num_rows, sum(lengths), feature_dim, name, format_bytes(needed), format_bytes(left), len(starts), len(kept))
    free = _free_bytes(out)
    if free < left:
        raise OSError(f"not enough free disk for the features in {out}: {left} bytes ({format_bytes(left)}) needed "
                      f"({num_rows} rows, {sum(lengths)} tokens x {feature_dim} x {torch_dtype.itemsize} bytes), "
                      f"{free} bytes ({format_bytes(free)}) free")
    shards = list(kept)
    device = target.embed_weight.device
    bar = tqdm(total=num_rows, initial=min(len(kept) * shard_rows, num_rows), unit="row", desc="features",
               disable=not progress)
    written = 0
    try:
        for k in range(len(kept), len(starts)):
            if stop_after_shards is not None and written >= stop_after_shards:
                return out
            start, end = starts[k], min(starts[k] + shard_rows, num_rows)
            computed = _compute_shard(target, rows, start, end, dtype=torch_dtype, max_length=max_length,
                                      labels=labels, batch_size=batch_size, device=device)
            entry = save_shard(out / shard_name(k), shard_tensors(computed, start), shard_binding(header, (start, end)))
            entry.update(rows=[start, end], tokens=sum(lengths[start:end]))
            shards.append(entry)
            _write_json_atomic(out / PARTIAL, {"header": header, "shards": shards})
            written += 1
            bar.update(end - start)
            if on_shard is not None:
                on_shard(k)
    finally:
        bar.close()
    _write_json_atomic(out / MANIFEST, {"header": header, "shards": shards})
    (out / PARTIAL).unlink(missing_ok=True)
    logger.info("features written to %s: %s", out, format_bytes(sum(s["bytes"] for s in shards)))
    return out
