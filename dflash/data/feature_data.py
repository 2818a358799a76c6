"""Reading offline target features (written by `dflash.data.features.write_features`).

`check_manifest` refuses a feature folder made for another target, other layer ids, another tokenizer,
dtype or max length, or with a missing, truncated or corrupted shard, naming what differs and the command
that regenerates it. `FeatureDataset` serves its rows (memory-mapped safetensors shards, each column read
on access: `FeatureRow`) as a torch Dataset, and `FeatureCollator` pads them exactly as
`dflash.data.loader.Collator` pads token rows, with the features padded alongside (zeros), as CPU tensors ready
for pinning. `batch_collator` is a run's collator of either kind.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from dflash.data.features import (
    BINDING_KEY,
    FORMAT_VERSION,
    HELD_OUT_PART,
    MANIFEST,
    PARTIAL,
    SPLIT_RECORD,
    TRAIN_PART,
    config_hash,
    dtype_name,
    file_sha256,
    head_checksum,
    header_digest,
    part_dir,
    regenerate_command,
)
from dflash.data.loader import Batch, Collator
from dflash.data.tokenization import tokenizer_fingerprint


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a complete feature folder (a ValueError with the regeneration command otherwise)."""
    folder = Path(directory)
    path = folder / MANIFEST
    if not path.is_file():
        state = "an unfinished feature run (resume it)" if (folder / PARTIAL).is_file() else "no feature manifest"
        raise ValueError(f"{folder} holds {state}: {regenerate_command(folder)}")
    return json.loads(path.read_text())


def _mismatch(folder: Path, what: str, expected: Any, found: Any) -> ValueError:
    return ValueError(f"features in {folder} were made for another {what}: expected {expected}, found {found}; "
                      f"regenerate them: {regenerate_command(folder)}")


def check_manifest(directory: str | os.PathLike[str], *, target_name: str, target_config: Any,
                   layer_ids: Sequence[int], dtype: torch.dtype | str, tokenizer: Any, max_length: int,
                   labels: bool, target: Any = None, verify_checksums: bool = True) -> dict[str, Any]:
    """The folder's manifest, after refusing (ValueError naming expected vs found and the regeneration
    command) features of another target (name or config; with `target`, an object with `embed_weight` and
    `lm_head_weight` such as `OfflineTarget`, also its embedding / head), other layer ids, tokenizer, dtype
    or max length, without greedy labels when `labels` is asked for, and a missing or truncated shard
    (size) or, with `verify_checksums` (reads every shard once), a shard whose content changed."""
    folder = Path(directory)
    manifest = read_manifest(folder)
    header = manifest["header"]
    if header.get("version") != FORMAT_VERSION:
        raise _mismatch(folder, "format version", FORMAT_VERSION, header.get("version"))
    found_target = header["target"]
    if found_target["name"] != target_name:
        raise _mismatch(folder, "target", repr(target_name), repr(found_target["name"]))
    if found_target["config_hash"] != config_hash(target_config):
        raise _mismatch(folder, f"target config (target {target_name!r})", f"config hash {config_hash(target_config)}",
                        f"config hash {found_target['config_hash']}")
    if target is not None:
        checksum = head_checksum(target.embed_weight, target.lm_head_weight)
        if checksum != found_target["head_checksum"]:
            raise _mismatch(folder, "target's weights (embedding / LM head)", checksum, found_target["head_checksum"])
    if list(header["layer_ids"]) != list(layer_ids):
        raise _mismatch(folder, "set of layer ids", list(layer_ids), header["layer_ids"])
    if header["dtype"] != dtype_name(dtype):
        raise _mismatch(folder, "dtype", dtype_name(dtype), header["dtype"])
    fingerprint = tokenizer_fingerprint(tokenizer)
    if header["tokenizer"] != fingerprint:
        raise _mismatch(folder, "tokenizer", f"fingerprint {fingerprint[:16]}", f"fingerprint {header['tokenizer'][:16]}")
    if header["max_length"] != max_length:
        raise _mismatch(folder, "max length", max_length, header["max_length"])
    if labels and not header["labels"]:
        raise _mismatch(folder, "label setting (data.labels: target needs the target's greedy labels)",
                        "labels included", "no labels")
    check_shards(folder, manifest, verify_checksums=verify_checksums)
    return manifest


def run_feature_parts(root: str | os.PathLike[str]) -> tuple[Path, Path | None]:
    """(training part, held-out part or None) of a run's feature folder (`data.features`). The held-out
    part exists when the run that wrote it held rows out; either part may still be unfinished (refused by
    `read_manifest` / `check_manifest`)."""
    held_out = part_dir(root, HELD_OUT_PART)
    has_held_out = (held_out / MANIFEST).is_file() or (held_out / PARTIAL).is_file()
    return part_dir(root, TRAIN_PART), held_out if has_held_out else None


def read_split_record(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The held-out split a run's feature folder records (`features.write_split_record`), None without one."""
    path = Path(root) / SPLIT_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def check_run_features(root: str | os.PathLike[str], **expected: Any) -> dict[str, Any]:
    """`check_manifest(part, **expected)` for each part of a run's feature folder; the training part's
    manifest."""
    train, held_out = run_feature_parts(root)
    if held_out is not None:
        check_manifest(held_out, **expected)
    return check_manifest(train, **expected)


def _binding_problem(path: Path, entry: Mapping[str, Any], header: Mapping[str, Any]) -> str | None:
    """How shard `path` contradicts its manifest `entry` and `header` (None: it names both): the header digest and
    rows of its `features.shard_binding`, and the length of its `row_ids`. Reads the shard's header only."""
    try:
        with safe_open(str(path), framework="pt") as f:
            binding = json.loads((f.metadata() or {}).get(BINDING_KEY, "{}"))
            row_ids = f.get_slice("row_ids").get_shape() if "row_ids" in f.keys() else None
    except Exception as e:  # safetensors' own error type: a header that does not parse
        return f"cannot be read ({e})"
    start, end = entry["rows"]
    if not isinstance(binding, dict) or "header" not in binding:
        return "names no manifest (written before feature format 2, or not by dflash features)"
    if binding["header"] != header_digest(header):
        return "was written for another feature folder (another target, rows or settings)"
    if binding.get("rows") != [start, end] or row_ids != [end - start]:
        return f"holds rows {binding.get('rows')}, where the manifest lists rows {[start, end]} (a shard swapped in)"
    return None


def check_shards(folder: Path, manifest: Mapping[str, Any], *, verify_checksums: bool = True,
                 verify_binding: bool = True) -> None:
    """Refuse a missing, truncated (size) or, with `verify_checksums`, corrupted shard, with `verify_binding` a
    shard written for another folder or another position (`features.shard_binding`: the manifest's own hashes
    can be updated along with a swapped shard), or rows not covered."""
    covered = 0
    for entry in manifest["shards"]:
        path = folder / entry["file"]
        if not path.is_file():
            raise ValueError(f"feature shard {path} is missing; regenerate it: {regenerate_command(folder)}")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise ValueError(f"feature shard {path} is truncated or changed: expected {entry['bytes']} bytes, found "
                             f"{size}; regenerate it: {regenerate_command(folder)}")
        if verify_checksums and (digest := file_sha256(path)) != entry["sha256"]:
            raise ValueError(f"feature shard {path} is corrupted: expected sha256 {entry['sha256']}, found {digest}; "
                             f"regenerate it: {regenerate_command(folder)}")
        if verify_binding and (problem := _binding_problem(path, entry, manifest["header"])):
            raise ValueError(f"feature shard {path} {problem}: not this folder's shard for its rows, refused; "
                             f"regenerate the features: {regenerate_command(folder)}")
        if entry["rows"][0] != covered:
            raise ValueError(f"feature shards of {folder} do not cover rows {covered}..{entry['rows'][0] - 1}; "
                             f"regenerate them: {regenerate_command(folder)}")
        covered = entry["rows"][1]
    if covered != manifest["header"]["num_rows"]:
        raise ValueError(f"feature shards of {folder} hold {covered} of {manifest['header']['num_rows']} rows; "
                         f"regenerate them: {regenerate_command(folder)}")


class FeatureRow(Mapping[str, torch.Tensor]):
    """One row of a shard, tokens [a, b): `input_ids` LongTensor[L], `loss_mask` BoolTensor[L], `features`
    Tensor[L, K*H], optional `labels` LongTensor[L], each read from the memory map on first access, so what
    reads only the tokens (the mask-token check, the data fingerprint) never reads the features."""

    _COLUMNS = {"input_ids": torch.Tensor.long, "loss_mask": torch.Tensor.bool, "features": lambda t: t,
                "labels": torch.Tensor.long}

    def __init__(self, shard: Any, start: int, end: int, has_labels: bool) -> None:
        self._shard, self._start, self._end = shard, start, end
        self._keys = [k for k in self._COLUMNS if k != "labels" or has_labels]
        self._read: dict[str, torch.Tensor] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        if key not in self._read:
            self._read[key] = self._COLUMNS[key](self._shard.get_slice(key)[self._start : self._end])
        return self._read[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class FeatureDataset(Dataset):
    """Rows of a feature folder in row order, each a `FeatureRow` (`input_ids`, `loss_mask`, `features`,
    optional `labels`, read on access).

    Shards are memory-mapped (`safetensors.safe_open`) on first use in each process, so a DataLoader's
    workers each open their own; a row reads only its own slice. The manifest is read (and its shards'
    sizes checked) at construction; call `check_manifest` first to also compare the settings.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        check_shards(self.directory, self.manifest, verify_checksums=False, verify_binding=False)
        self.header = self.manifest["header"]
        self.files = [entry["file"] for entry in self.manifest["shards"]]
        self.starts = [entry["rows"][0] for entry in self.manifest["shards"]]
        self.has_labels = bool(self.header["labels"])
        self._offsets: list[list[int] | None] = [None] * len(self.files)
        self._handles: dict[int, Any] = {}
        self._pid: int | None = None

    def __len__(self) -> int:
        return self.header["num_rows"]

    @property
    def feature_dim(self) -> int:
        return self.header["feature_dim"]

    def _shard(self, k: int) -> Any:
        if self._pid != os.getpid():  # a forked worker: open its own maps
            self._handles, self._pid = {}, os.getpid()
        if k not in self._handles:
            self._handles[k] = safe_open(str(self.directory / self.files[k]), framework="pt")
            self._offsets[k] = self._handles[k].get_tensor("offsets").tolist()
        return self._handles[k]

    def __getitem__(self, index: int) -> FeatureRow:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} feature rows")
        k = bisect.bisect_right(self.starts, index) - 1
        shard = self._shard(k)
        offsets = self._offsets[k]
        assert offsets is not None
        i = index - self.starts[k]
        return FeatureRow(shard, offsets[i], offsets[i + 1], self.has_labels)

    def __getstate__(self) -> dict[str, Any]:  # picklable for spawned workers: maps are reopened there
        state = dict(self.__dict__)
        state["_handles"], state["_pid"] = {}, None
        return state


class FeatureCollator:
    """Pads feature rows like `collator` (a `dflash.data.loader.Collator`) pads their tokens: the same bucketed
    length S, and `num_anchors` when it names anchor widths. Adds `features [B, S, K*H]` (zeros on
    padding) and, for rows with labels, `labels [B, S]` (the pad token on padding). CPU tensors."""

    def __init__(self, collator: Collator) -> None:
        self.collator = collator

    @property
    def num_shapes(self) -> int:
        """The token collator's bound on batch shapes (features add no shape of their own)."""
        return self.collator.num_shapes

    def __call__(self, rows: Sequence[Mapping[str, torch.Tensor]]) -> Batch:
        batch = self.collator(rows)
        batch_size, seq = batch["input_ids"].shape
        first = rows[0]["features"]
        features = torch.zeros((batch_size, seq, first.shape[-1]), dtype=first.dtype)
        for b, row in enumerate(rows):
            n = min(len(row["features"]), seq)
            features[b, :n] = row["features"][:n]
        batch["features"] = features
        if "labels" in rows[0]:
            labels = torch.full((batch_size, seq), self.collator.pad_token_id, dtype=torch.long)
            for b, row in enumerate(rows):
                n = min(len(row["labels"]), seq)
                labels[b, :n] = row["labels"][:n]
            batch["labels"] = labels
        return batch


def batch_collator(tokenizer: Any, settings: Any, anchor_widths: Sequence[int] | None = None) -> Collator | FeatureCollator:
    """A run's collator for `settings` (a `DataSettings`): `Collator.for_tokenizer`, wrapped in a
    `FeatureCollator` when the run trains from offline features (`data.features`)."""
    collator = Collator.for_tokenizer(tokenizer, settings, anchor_widths)
    return FeatureCollator(collator) if settings.features else collator
