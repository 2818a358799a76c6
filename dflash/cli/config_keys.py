"""`dflash config`: every configuration key with its default, type and one-line meaning.

The meanings are the comments next to (or just above) each field in the source of its section's class
(`dflash/config.py`; a kind's own section is its settings dataclass, in that kind's module of `dflash/kinds/`),
so the listing cannot drift from the code; the few fields without a comment get theirs from `_MEANINGS` here.
Defaults are `TrainConfig()`'s; the embedded target's presets (`dflash.presets`), which fill the keys a user
leaves unset, are listed after the table.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize
import typing
from typing import Any

from dflash.config import TrainConfig
from dflash.presets import EMBEDDED_CPU, EMBEDDED_GPU

# Fields of dflash/config.py without a comment of their own.
_MEANINGS = {
    "seed": "fixes the draft's initial weights, the data order and the anchor stream",
    "max_steps": "optimizer steps to train (the cosine schedule spans them); with num_epochs, a cap when changed",
    "progress_bar": "draw progress bars (rank 0 only): training, regeneration, evaluations",
    "spec_eval_max_new_tokens": "new tokens per prompt in the speculative evaluation (and the held-out chain cap)",
    "draft.num_layers": "draft decoder layers",
    "draft.block_size": "tokens per draft block (slot 0 is the clean anchor token)",
    "draft.num_key_value_heads": "draft KV heads (None: the target's)",
    "draft.head_dim": "draft head width (None: the target's)",
    "output_dir": "the run folder: config.yaml, metrics.jsonl, checkpoints/, export/, summary.json",
    "draft.intermediate_size": "draft FFN width (None: the target's)",
    "draft.dpace_alpha": "D-PACE smoothing of the draft's confidence (position_weights: dpace)",
    "optim.lr": "peak learning rate (AdamW; Muon's matrices at the same lr, RMS-matched)",
    "optim.weight_decay": "AdamW weight decay",
    "optim.beta1": "AdamW beta1",
    "optim.beta2": "AdamW beta2",
    "optim.eps": "AdamW epsilon",
    "optim.warmup_ratio": "linear warmup over this fraction of max_steps",
    "optim.min_lr_ratio": "cosine decay down to lr * min_lr_ratio",
    "optim.max_grad_norm": "gradient clipping norm",
    "optim.grad_accum": "micro-batches per optimizer step",
    "data.split": "split of a datasets hub source",
    "data.regenerate_max_new_tokens": "longest regenerated reply (tokens)",
    "data.regenerate_batch_size": "prompts per regeneration batch",
    "data.num_workers": "DataLoader worker processes",
}


def _comments(cls: type) -> dict[str, str]:
    """field name -> its comment in the class source: the trailing `# ...` of its line, else the comment
    lines just above it."""
    source = inspect.getsource(cls)
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, str] = {}
    above: list[str] = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("#").strip())
            continue
        name = text.split(":", 1)[0].strip()
        if ":" in text and name.isidentifier() and not text.startswith(("def ", "class ", "@")):
            out[name] = trailing.get(number) or " ".join(above)
        above = []
    return out


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def key_table(config: Any = None, prefix: str = "") -> list[tuple[str, Any, str, str]]:
    """(key, default, type, meaning) for every key of `config` (default `TrainConfig()`), in field order."""
    config = TrainConfig() if config is None else config
    hints = typing.get_type_hints(type(config))
    comments = _comments(type(config))
    rows = []
    for f in dataclasses.fields(config):
        key = f"{prefix}{f.name}"
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(key_table(value, key + "."))
        else:
            rows.append((key, value, _type_name(hints[f.name]), comments.get(f.name) or _MEANINGS.get(key, "")))
    return rows


def describe_keys() -> str:
    """The `dflash config` listing: a table of every key, then the embedded target's presets."""
    rows = [(k, repr(d) if isinstance(d, str) else str(d), t, m) for k, d, t, m in key_table()]
    kw, dw, tw = (max(len(r[i]) for r in rows) for i in range(3))
    lines = [f"{'key':<{kw}}  {'default':<{dw}}  {'type':<{tw}}  meaning"]
    lines += [f"{k:<{kw}}  {d:<{dw}}  {t:<{tw}}  {m}" for k, d, t, m in rows]
    lines.append("\nSet any key in a YAML file or as key=value (`dflash train optim.lr=3e-4 draft.num_layers=2`). "
                 "With target: embedded, keys left unset take the preset of the device:")
    for name, preset in (("CPU", EMBEDDED_CPU), ("GPU", EMBEDDED_GPU)):
        lines.append(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in preset.items()))
    return "\n".join(lines)
