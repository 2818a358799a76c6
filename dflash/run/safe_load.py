"""What a checkpoint's files declare, checked before anything they declare is allocated or trusted.

A safetensors file opens with an 8-byte length and a JSON header naming each tensor's dtype, shape and byte
range. Loading allocates what the header declares, so a crafted header (a tensor of 10^10 elements in a file
made that large, sparse, so that sizes and checksums agree) allocated all of it before `check_loaded_state`
compared a single shape. `header_problem` checks the header against the file (bounds, each range the size of
its shape and dtype, ranges back to back) and `declared_tensors` reads what it declares, without reading any
tensor, so the callers compare it with what the checkpoint's draft must hold first (`dflash.run.checkpoint`,
`dflash.run.state.check_checkpoint_header`).

`trainer_state_problems` does the same for `trainer_state.pt`'s values: a step or a data position that no
run writes (`step: -5`, a position of 10^12 batches) was accepted and trained on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from dflash.kinds.registry import draft_model_for_config
from dflash.modeling import DFlashDraftConfig

# safetensors' dtype names and their sizes in bytes
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the header's length


class HeaderError(ValueError):
    """A safetensors header that does not describe its file (the message says what is wrong)."""


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of safetensors file `path` (tensors and `__metadata__`), after checking it against the
    file: its length, each tensor's dtype, shape and byte range (inside the file, the size its shape and
    dtype need, ranges back to back from 0 to the file's end). Reads the header only; `HeaderError` says
    what does not fit."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size or n > _MAX_HEADER:
            raise HeaderError(f"{path.name} is truncated ({size} bytes, shorter than its header)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise HeaderError(f"{path.name} has a damaged header") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{path.name} has a damaged header")
    ranges = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = dtype in _ITEM_BYTES and all(isinstance(d, int) and d >= 0 for d in shape)
            ok = ok and isinstance(start, int) and isinstance(end, int) and 0 <= start <= end
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise HeaderError(f"{path.name} has a damaged header (tensor {name})")
        if end - start != math.prod(shape) * _ITEM_BYTES[dtype]:
            raise HeaderError(f"{path.name} declares tensor {name} of shape {shape} {dtype} in {end - start} bytes")
        ranges.append((start, end))
    ranges.sort()
    if any(a[1] != b[0] for a, b in zip(ranges, ranges[1:], strict=False)) or (ranges and ranges[0][0] != 0):
        raise HeaderError(f"{path.name} has a damaged header (tensor data overlaps or leaves gaps)")
    end = ranges[-1][1] if ranges else 0
    if 8 + n + end != size:
        raise HeaderError(f"{path.name} is truncated ({size} of {8 + n + end} bytes)")
    return header


def header_problem(path: Path) -> str | None:
    """Why `read_header` refuses `path` (None: its header describes the file)."""
    try:
        read_header(path)
    except HeaderError as e:
        return str(e)
    return None


def declared_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every tensor `path` declares (`read_header`'s checks first)."""
    return {name: (entry["dtype"], tuple(entry["shape"])) for name, entry in read_header(path).items()
            if name != "__metadata__"}


def config_shapes(draft_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor of the draft `draft_config` (a checkpoint's draft_config.json) describes,
    built on the meta device: nothing is allocated, whatever the config says."""
    with torch.device("meta"):
        draft = draft_model_for_config(DFlashDraftConfig.from_dict(draft_config))
    return {name: tuple(tensor.shape) for name, tensor in draft.state_dict().items()}


def shape_problems(declared: dict[str, tuple[str, tuple[int, ...]]], expected: dict[str, tuple[int, ...]]) -> list[str]:
    """How the tensors a header declares differ from `expected` (name -> shape): missing names, names not
    expected, other shapes; each a short phrase."""
    problems = [f"weight {name} is {'missing' if name in expected else 'not in this draft'}"
                for name in sorted(set(expected) ^ set(declared))]
    problems += [f"weight {name} has shape {declared[name][1]}, the draft {tuple(expected[name])}"
                 for name in sorted(set(expected) & set(declared)) if declared[name][1] != tuple(expected[name])]
    return problems


def weights_problem(weights: Path, draft_config: dict[str, Any], draft: Any = None) -> str | None:
    """Why a checkpoint's weights file `weights` may not be loaded, from its header alone (None: it may): tensors
    the draft its `draft_config` (draft_config.json) describes does not hold, or with `draft` (the module a resume
    loads into) tensors that draft does not hold (a draft_config.json crafted to match the header tells nothing)."""
    try:
        declared = declared_tensors(weights)
    except (HeaderError, OSError) as e:
        return f"{weights} cannot be read: {e}"
    ours = {name: tuple(tensor.shape) for name, tensor in draft.state_dict().items()} if draft is not None else {}
    if draft is not None and (problems := shape_problems(declared, ours)):
        return f"checkpoint {weights.parent} does not fit this draft, not resumed: {_shown(problems)}"
    try:
        expected = config_shapes(draft_config)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        return f"{weights.parent / 'draft_config.json'} does not describe a draft: {e}"
    problems = [f"{'missing' if name in expected else 'unexpected'} {name}" for name in sorted(set(expected) ^ set(declared))]
    problems += [f"size mismatch for {name}: {declared[name][1]} in the file, {tuple(expected[name])} in the config"
                 for name in sorted(set(expected) & set(declared)) if declared[name][1] != tuple(expected[name])]
    if problems:  # the wording of `checkpoint.draft_from_checkpoint`'s refusal, which once came after the load
        return f"{weights} does not fit the checkpoint's draft_config.json: {_shown(problems)} (its header: not loaded)"
    return None


def _shown(problems: list[str]) -> str:
    return "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def trainer_state_problems(state: Any) -> list[str]:
    """The values of a loaded `trainer_state.pt` that no run writes: a step, a data epoch or a batch count
    that is missing, not a whole number or negative, a world size below 1. (Whether the data position fits
    the data is known once the data is: `dflash.run.state.check_training_data`.)"""
    if not isinstance(state, dict):
        return [f"it holds a {type(state).__name__}, not the dict of a run's state"]
    problems = []
    for key in ("step", "data_epoch", "data_batches"):
        value = state.get(key)
        if not _whole(value) or value < 0:
            problems.append(f"{key} {value!r} (a whole number >= 0)")
    world = state.get("world_size", 1)
    if not _whole(world) or world < 1:
        problems.append(f"world_size {world!r} (a whole number >= 1)")
    return problems
