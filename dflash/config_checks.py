"""Config checks that need more than one key's range: what `dflash.config` refuses and suggests beyond `validate`'s
list of ranges (kept here so config.py stays a list of settings).

* `unknown_key_hint`: the "did you mean" of an unknown key, from the synonyms users of the HF Trainer and of
  SpecForge type (`learning_rate`, `per_device_train_batch_size`, `num_train_epochs`, ...), else the closest key.
* `section_error`: a whole section (`draft`, `optim`, ...) given a value instead of a mapping (`draft: 2`).
* `other_kind_error`: keys of another draft kind's section than the run's `draft.kind` (that kind never reads
  them), refused instead of silently ignored.
* `target_layer_errors`: `draft.target_layer_ids` out of order, repeated or negative (the serving engines read the
  target's layers in ascending order; `dflash export` would only warn after the run).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from typing import Any

import yaml

# Names other trainers use for a dflash key: HF `TrainingArguments`, SpecForge's and EAGLE's scripts (their dashes
# read as underscores), common shorthands. Only a suggestion in the unknown-key error: never an alias that is
# accepted, so one name keeps one meaning in configs, checkpoints and `dflash config`.
SYNONYMS: dict[str, str] = {
    "lr": "optim.lr",
    "learning_rate": "optim.lr",
    "per_device_train_batch_size": "batch_size",
    "train_batch_size": "batch_size",
    "micro_batch_size": "batch_size",
    "batch": "batch_size",
    "bs": "batch_size",
    "gradient_accumulation_steps": "optim.grad_accum",
    "grad_accum": "optim.grad_accum",
    "accumulation_steps": "optim.grad_accum",
    "num_train_epochs": "num_epochs",
    "epochs": "num_epochs",
    "epoch": "num_epochs",
    "total_steps": "max_steps",
    "train_steps": "max_steps",
    "steps": "max_steps",
    "num_steps": "max_steps",
    "warmup_ratio": "optim.warmup_ratio",
    "warmup_steps": "optim.warmup_ratio",
    "weight_decay": "optim.weight_decay",
    "max_grad_norm": "optim.max_grad_norm",
    "grad_clip": "optim.max_grad_norm",
    "clip_grad_norm": "optim.max_grad_norm",
    "adam_beta1": "optim.beta1",
    "adam_beta2": "optim.beta2",
    "adam_epsilon": "optim.eps",
    "optimizer": "optim.optimizer",
    "max_seq_length": "data.max_length",
    "max_seq_len": "data.max_length",
    "max_length": "data.max_length",
    "seq_length": "data.max_length",
    "model_name_or_path": "target",
    "target_model_path": "target",
    "target_model": "target",
    "model": "target",
    "dataset": "data.source",
    "dataset_name": "data.source",
    "train_data_path": "data.source",
    "data_path": "data.source",
    "logging_steps": "log_interval",
    "log_steps": "log_interval",
    "eval_steps": "eval_interval",
    "save_steps": "save_interval",
    "save_total_limit": "keep_last",
    "resume_from_checkpoint": "resume_from",
    "dataloader_num_workers": "data.num_workers",
    "num_draft_layers": "draft.num_layers",
    "num_hidden_layers": "draft.num_layers",
    "block_size": "draft.block_size",
    "num_anchors": "draft.num_anchors",
    "kind": "draft.kind",
    "bf16": "dtype",
    "torch_dtype": "dtype",
}


def yaml_problem(error: Exception) -> str:
    """One line for a YAML error: what is wrong and where (PyYAML's own message spans several lines)."""
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(error, 'problem', None) or error}{where}"


def value_at(obj: Any, dotted: str) -> Any:
    """The value at dotted key `dotted` of a (nested) settings dataclass."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def unknown_key_hint(dotted: str, keys: Iterable[str]) -> str:
    """` (did you mean KEY?)` for an unknown `dotted` key, or "": a synonym of the whole key or of its last part
    (`optim.learning_rate` -> optim.lr; dashes as underscores), else the closest valid key by spelling."""
    keys = list(keys)
    name = dotted.strip().lstrip("-").replace("-", "_").lower()
    for candidate in (name, name.rsplit(".", 1)[-1]):
        if (known := SYNONYMS.get(candidate)) is not None and known in keys and known != dotted:
            return f" (did you mean {known}?)"
    close = difflib.get_close_matches(dotted, keys, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def section_error(key: str, value: Any, section: Any) -> str:
    """The message for a section (`draft`, `optim`, ...) given `value`, not a mapping of its keys; `section` is
    its current settings dataclass (its first key makes the example)."""
    first = dataclasses.fields(section)[0].name
    example = yaml.safe_dump(getattr(section, first), default_flow_style=True).strip().removesuffix("...").strip()
    return (f"config key {key!r} is a section of settings, not a value (got {value!r}): set its keys, e.g. "
            f"{key}.{first}={example} on the command line, or in YAML `{key}:` with `{first}: {example}` indented "
            f"below it (`dflash config` lists the {key}.* keys)")


def other_kind_error(config: Any, from_file: list[tuple[str, Any]], typed: list[tuple[str, Any]],
                     kind_sections: tuple[str, ...], *, kind_source: str = "") -> str | None:
    """One line refusing the keys the user set in another draft kind's section than `config.draft.kind`'s (that
    kind never reads them), or None. `kind_sections` are the kinds' sections, each named as its kind (the caller
    reads them from the registry, which sits above this module). `typed` (key=value overrides) all count;
    `from_file` (a YAML file's keys) only away from their defaults, since a run's own config.yaml lists every
    section's keys and must load again. `kind_source` says where the kind came from when the user did not set it
    (the preset's, the default)."""
    kind, defaults = config.draft.kind, type(config)()
    settings = {k: v for k, v in from_file if value_at(config, k) != value_at(defaults, k)} | dict(typed)
    foreign: dict[str, list[str]] = {}
    for key, value in settings.items():
        section = key.split(".", 1)[0]
        if "." in key and section in kind_sections and section != kind:
            foreign.setdefault(section, []).append(f"{key}={value}")
    if not foreign:
        return None
    parts = [f"{' and '.join(items)} {'is a setting' if len(items) == 1 else 'are settings'} of draft.kind={section}, "
             f"which this run does not train (draft.kind={kind}{kind_source} reads no {section}.* key)"
             for section, items in foreign.items()]
    fixes = " or ".join(f"draft.kind={section}" for section in foreign)
    count = sum(len(items) for items in foreign.values())
    return f"{'; '.join(parts)}: set {fixes} to train that draft, or drop {'the key' if count == 1 else 'those keys'}"


def target_layer_errors(ids: list[int] | None) -> list[str]:
    """Why `draft.target_layer_ids` cannot train a servable draft (none for null, the default rule): the engines
    concatenate the target's captured layers in ascending order, so a draft trained on `[3, 1]` would read its
    features swapped; a repeated id feeds one layer twice; a negative one is no layer index there."""
    if not ids:
        return []
    fixed = sorted(set(ids))
    if any(i < 0 for i in ids):
        return [f"draft.target_layer_ids={list(ids)} holds a negative id: give layer indices from 0 (the first decoder "
                "layer) up to the target's depth - 1"]
    if list(ids) != fixed:
        why = "repeats a layer" if len(set(ids)) < len(ids) else "is not in ascending order"
        return [f"draft.target_layer_ids={list(ids)} {why} (the serving engines concatenate the target's layers in "
                f"ascending order, so the draft must train on them that way): use draft.target_layer_ids={fixed}"]
    return []
