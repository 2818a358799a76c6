"""`dflash features`: a run's rows through the frozen target once, into `data.features` (the command's
work; the file format and the writer are `dflash.data.features`)."""

from __future__ import annotations

import functools
import logging
import shlex
from pathlib import Path
from typing import Any

from dflash.config import TrainConfig
from dflash.data.corpus import prepare_corpus
from dflash.data.features import (
    HELD_OUT_PART,
    TRAIN_PART,
    dtype_name,
    estimate_bytes,
    part_dir,
    write_features,
    write_split_record,
)
from dflash.factory import target_layer_ids_for
from dflash.runtime import resolve_device, resolve_dtype
from dflash.target_model.frozen import FrozenTarget
from dflash.target_model.loading import load_target, load_tokenizer

log = logging.getLogger("dflash")
# What a run from features must leave off: each needs the target's trunk, which such a run never loads
# (`factory.offline_target` refuses them), so the printed train command sets them to these values.
WITHOUT_TRUNK = {"spec_eval_prompts": 0, "spec_eval_interval_prompts": 0, "tensor_parallel.size": 1}


def train_command(config_file: str | None, overrides: list[str], config: TrainConfig) -> str:
    """The `dflash train` line that trains from the features `dflash features` wrote, ready to paste: the
    same config file and overrides (the same target, draft and rows; features made otherwise are refused),
    `data.features` naming the folder, and `WITHOUT_TRUNK`'s settings where the config has others (later
    overrides win; `dflash eval --draft RUN/export` decodes speculatively after the run)."""
    kept = [item for item in overrides if item.split("=", 1)[0].strip() != "data.features"]
    off = [f"{key}={value}" for key, value in WITHOUT_TRUNK.items()
           if functools.reduce(getattr, key.split("."), config) != value]
    return shlex.join(["dflash", "train", *([config_file] if config_file else []), *kept,
                       f"data.features={config.data.features}", *off])


def write_run_features(config: TrainConfig, *, target: Any = None, tokenizer: Any = None) -> dict[str, Path]:
    """`dflash features`: the target's features of a run's rows, written once to `data.features`; the part
    folders written ({"train": DIR/train, "held_out": DIR/held_out}, `dflash.data.features`).

    The rows are the run's own: the corpus prepared as `dflash train` prepares it (regeneration, tokenization,
    held-out split; `corpus.prepare_corpus`), the features those of the draft's `target_layer_ids` in the run's
    compute dtype, with the target's greedy labels under `data.labels: target`. The size is logged before any
    row is computed; an interrupted run resumes and a finished one is left as it is (`write_features`)."""
    root = config.data.features
    if not root:
        raise ValueError("dflash features writes to the folder data.features names: set data.features=DIR (then "
                         "`dflash train data.features=DIR` trains from it)")
    config.validate()
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if target is None:
        target, loaded = load_target(config.target, dtype)
        tokenizer = tokenizer or loaded
    tokenizer = tokenizer or load_tokenizer(config.target)
    target.to(device)
    layer_ids = target_layer_ids_for(config, target.config, tokenizer, target.get_input_embeddings().weight.shape[0])
    corpus = prepare_corpus(config.data, tokenizer, target, config.target)
    parts = {TRAIN_PART: corpus.train, HELD_OUT_PART: corpus.eval}
    frozen = FrozenTarget(target, layer_ids).to(device, dtype)
    labels = config.data.labels == "target"
    tokens = {part: sum(min(len(ids), config.data.max_length) for ids in rows["input_ids"])
              for part, rows in parts.items() if rows is not None}
    total = estimate_bytes(sum(tokens.values()), frozen.hidden_size * len(layer_ids), dtype, labels)
    log.info("features of layers %s (%s) to %s: %s tokens, about %.2f GiB", layer_ids, dtype_name(dtype), root,
             " + ".join(f"{n} {part}" for part, n in tokens.items()), total / 2**30)
    written = {part: write_features(frozen, config.target, rows, part_dir(root, part), tokenizer=tokenizer,
                                    dtype=dtype, max_length=config.data.max_length, labels=labels,
                                    batch_size=config.batch_size, progress=config.progress_bar)
               for part, rows in parts.items() if rows is not None}
    if corpus.held_out_split is not None:  # a run from these files exports it (`dflash eval` decodes its prompts)
        write_split_record(root, corpus.held_out_split)
    return written
