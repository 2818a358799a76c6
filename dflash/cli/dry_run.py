"""`dflash train --dry-run`: what a run would do, from configs alone (no weights loaded, nothing trained)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from dflash.attention import resolve_attention
from dflash.config import TrainConfig
from dflash.data.corpus import (
    _regenerate_turns,
    _regenerated_file,
    _training_rows,
    asked_id,
    regenerates,
    split_conversations,
    split_warning,
)
from dflash.data.loader import pack_length
from dflash.data.repliers import target_identity
from dflash.data.reply_cache import cached_prompt_ids
from dflash.data.sources import local_source
from dflash.embedded import EMBEDDED_SOURCES, cache_root
from dflash.factory import check_run_settings, draft_config_for, offline_target, run_kind
from dflash.files import format_bytes
from dflash.kinds.registry import draft_model_for_config
from dflash.losses import decay_gamma
from dflash.memory import describe, estimate, step_shape
from dflash.modeling import text_config_of
from dflash.preflight import check_dependencies
from dflash.run.folder import check_folder
from dflash.run.stopping import epoch_steps
from dflash.runtime import resolve_device, resolve_dtype
from dflash.target_model.loading import load_target_config, load_tokenizer, target_location
from dflash.target_model.tensor_parallel import check_tp_support, shard_model_, target_parameter_bytes


def target_bytes(target_config: Any, tp: int, dtype: torch.dtype) -> tuple[dict[str, int], dict[str, int]]:
    """(this rank's, the whole model's) bytes of the target's parameters and buffers (`target_parameter_bytes`) with
    `tp` ranks per tensor-parallel group: the decoder layers 1/tp, the embedding and LM head whole (the draft reads
    them). From the config on the meta device (no weight is read); `check_tp_support` refuses a size that does not
    divide the heads."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(target_config, dtype=dtype)
    whole = target_parameter_bytes(model)
    if tp > 1:
        text = text_config_of(target_config)
        shard_model_(model, check_tp_support(text, tp), 0, tp)
    return target_parameter_bytes(model), whole


def target_memory(mine: dict[str, int], whole: dict[str, int]) -> str:
    """This rank's bytes of the target and the whole model's (`target_bytes`), described."""
    b = {key: format_bytes(n) for key, n in mine.items()}
    return (f"{b['total']} (decoder layers {b['layers']} of {format_bytes(whole['layers'])}, embedding "
            f"{b['embedding']}, LM head {b['lm_head']}{' (tied)' if not mine['lm_head'] else ''}, other {b['other']})")


def step_memory(config: TrainConfig, target_config: Any, draft_cfg: Any, draft_params: int, dtype: torch.dtype,
                mine: dict[str, int]) -> str:
    """The training step's peak device memory on one rank (`mine`: the target's bytes on it, `target_bytes`),
    estimated from the shapes (`dflash.memory`), with the options that lower it when it passes the device's memory."""
    # data.features: only the embedding and LM head are read (`OfflineTarget`)
    on_rank = mine["embedding"] + mine["lm_head"] if config.data.features else mine["total"]
    parts = estimate(step_shape(config, text_config_of(target_config), draft_cfg, draft_params, on_rank, dtype.itemsize))
    line = describe(parts)
    device = resolve_device(config.device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        if parts["peak"] > total:
            line += (f"; more than this GPU's {total:.0f} GiB: try activation_checkpointing=true, fewer draft.num_anchors "
                     "or a smaller batch_size")
    return line


def mesh(tp: int) -> str:
    """The (dp x tp) mesh of this launch (`WORLD_SIZE`; a single process when unset)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % tp:
        return f"dp (processes / {tp}) x tp {tp}: launch a multiple of {tp} processes (this launch: {world})"
    return f"dp {world // tp} x tp {tp}" + (f" ({world} processes; the draft is data-parallel over all)" if world > 1 else "")


def _cached(rows: list[dict[str, Any]], path: Path, turns: int | str) -> int:
    """How many of `rows`' prompts (whole conversations under `regenerate_turns: all`) the regenerated file `path`
    already answers."""
    if not path.is_file():
        return 0
    asked = {asked_id(row, turns) for row in rows}
    return len(cached_prompt_ids(path) & asked)  # a damaged row is not counted: the run asks its prompt again


def time_estimate(config: TrainConfig) -> str:
    """What a dry run can say of the run's time from its config alone: the training phase's bound
    (`time_budget_minutes` against the step count). No speed is measured here, so no phase is given a duration."""
    steps = f"num_epochs={config.num_epochs:g}" if config.num_epochs is not None else f"max_steps={config.max_steps:,}"
    if config.time_budget_minutes:
        bound = f"training up to {config.time_budget_minutes:g} min (time_budget_minutes), less if {steps} comes first"
    else:
        bound = f"training until {steps}, with no time bound (no time_budget_minutes)"
    return (f"{bound}; the other phases are not estimated (a dry run measures no speed): a run records each "
            "phase's seconds in RUN/summary.json (wall_seconds, phases)")


def training_steps(config: TrainConfig, train_rows: int) -> tuple[int, int | str]:
    """(the steps, as the plan shows them): `max_steps`; with num_epochs, `epoch_steps`, the trainer's own count
    (`apply_num_epochs`), over the `train_rows` counted here. The run counts the rows left after tokenization (and
    packing), never more: its steps are at most these."""
    if config.num_epochs is None:
        return config.max_steps, config.max_steps
    world = int(os.environ.get("WORLD_SIZE", "1"))  # the processes the trainer's count divides the rows among
    steps = epoch_steps(config, train_rows, world)
    capped = config.max_steps != TrainConfig.max_steps and steps == config.max_steps
    packed = f", packed into sequences of {pack_length(config.data)} tokens" if config.data.packing else ""
    return steps, (f"from num_epochs={config.num_epochs:g} over {train_rows:,} training rows"
                   + (f" on {world} processes" if world > 1 else "") + f" = {steps:,}"
                   + (f" (max_steps={config.max_steps:,} caps it)" if capped else "")
                   + f"; at most: the run counts the rows left after tokenization{packed}, and logs the steps they give")


def phases_to_run(config: TrainConfig, regeneration: str, held_out: int | None) -> str:
    """The phases the run will go through, named as RUN/summary.json's `phases` names them (`dflash.report.phases`),
    each with what decides its cost. `held_out`: the held-out conversations (None: unknown before the run loads
    the source)."""
    d = config.data
    evaluated = d.eval_size > 0 if held_out is None else held_out > 0
    names = [f"data_preparation ({regeneration})",
             "first_step (" + ("compiles the draft: compile=true" if config.compile else "no compilation") + ")",
             "training", *(["held_out_eval"] if evaluated else []), *(["export"] if config.export_on_finish else []),
             *(["speculative_eval"] if evaluated and config.spec_eval_prompts else [])]
    return ", ".join(names)


def phases(config: TrainConfig) -> dict[str, Any]:
    """The run's time budget and phases (regeneration, training, evaluation) with their sizes, counted from
    the data source and the regeneration cache (`dflash.data.corpus`'s own split and file rules; no model runs);
    the phases that will run, the time bound the config sets (`time_estimate`), and under `steps` the step count
    (`training_steps`: num_epochs makes it from the training rows counted here; `plan` shows it in its place).
    A hub dataset is not downloaded for this: its sizes are known once the run loads it."""
    d = config.data
    rows = config.batch_size * config.optim.grad_accum
    budget = (f"{config.time_budget_minutes:g} min of training, then save, evaluate and export"
              if config.time_budget_minutes else
              f"none (training runs to {'max_steps' if config.num_epochs is None else 'the steps of num_epochs'})")
    # phases_to_run is filled once the regeneration is counted; its place is here, after the time lines
    out: dict[str, Any] = {"time_budget": budget, "time_estimate": time_estimate(config), "phases_to_run": None}
    if d.source not in EMBEDDED_SOURCES and not Path(d.source).expanduser().exists():
        out["steps"] = config.max_steps if config.num_epochs is None else \
            f"from num_epochs={config.num_epochs:g} over the training rows, counted once the run loads the source"
        out["phases_to_run"] = phases_to_run(config, "read from the hub; regeneration counted once loaded"
                                             if d.regenerate and not d.features else "read from the hub", None)
        out["phase_training"] = (f"up to {config.max_steps:,} steps x {rows} rows per rank" if config.num_epochs is None
                                 else f"num_epochs={config.num_epochs:g} passes, in steps of {rows} rows per rank")
        out["phases"] = f"data.source {d.source!r} is not a local file: its sizes are counted once the run loads it"
        return out
    train, held, _, available = split_conversations(d)
    regenerated = regenerates(d, train + held)  # token rows are trained as given; tool conversations are refused
    prompts = _training_rows(train, held, d) if regenerated else train
    if d.features:  # the rows are those the features were written from (`dflash features` regenerated them)
        out["phase_regeneration"] = f"none (data.features: the target's features are read from {d.features})"
        regeneration = "the target's features read from data.features"
    elif regenerated:
        root = Path(d.cache_dir) if d.cache_dir else cache_root()
        identity = target_identity(d, config.target)  # as the run keys its cache (a server is asked what it serves)
        cached = [_cached(r, _regenerated_file(d, root, config.target, part, identity.fingerprint),
                          _regenerate_turns(d, part)) for r, part in ((prompts, "train"), (held, "eval"))]
        out["phase_regeneration"] = (f"{len(prompts):,} training prompts ({cached[0]:,} cached) and {len(held):,} held-out "
                                     f"prompts ({cached[1]:,} cached), at most {d.regenerate_max_new_tokens} new tokens "
                                     f"each, {d.regenerate_batch_size} per batch; "
                                     f"{identity.describe(config.target, d)}")
        asked, left = len(prompts) + len(held), len(prompts) + len(held) - sum(cached)
        regeneration = (f"regeneration: all {asked:,} prompts cached, none generated" if not left else
                        f"regeneration: {left:,} of {asked:,} prompts to generate"
                        + (f", {asked - left:,} cached" if left < asked else ", none cached"))
    elif d.regenerate:
        out["phase_regeneration"] = "off (token rows: trained as given, data.regenerate does not apply)"
        regeneration = "no regeneration: the token rows as given"
    else:
        out["phase_regeneration"] = "off (data.regenerate=false: the data's own replies)"
        regeneration = "no regeneration: the data's own replies"
    out["phases_to_run"] = phases_to_run(config, regeneration, len(held))
    steps, out["steps"] = training_steps(config, len(prompts))
    evals = steps // config.eval_interval if config.eval_interval else 0
    epochs = steps * rows / max(len(prompts), 1)
    out["phase_training"] = (f"up to {steps:,} steps x {rows} rows per rank, over {len(prompts):,} training conversations "
                             f"of {available:,} in the source (~{epochs:.1f} epochs on one process)"
                             + (", unless the time budget ends it first" if config.time_budget_minutes else ""))
    spec = min(config.spec_eval_prompts, len(held))
    out["phase_evaluation"] = (f"{len(held):,} held-out conversations ({evals} times during training, then at the end); "
                               f"speculative decoding of up to {spec} held-out prompts x {config.spec_eval_max_new_tokens} "
                               "new tokens at the end" + (f", {config.spec_eval_interval_prompts} at each evaluation"
                                                          if config.spec_eval_interval_prompts else ""))
    if (warning := split_warning(len(prompts), len(held))) is not None:
        out["warning"] = warning
    return out


def plan(config: TrainConfig) -> dict[str, Any]:
    """What `config` would run: target shape, layer ids, mask token, draft size (built on the meta
    device by the trainer's own factory, so a draft counts its kind's heads), tokens per step. First the
    checks the run makes before loading weights, with its messages (and so the CLI's exit codes): missing
    packages, settings this launch cannot run, a missing data file, feature folders that do not match,
    an output folder the run would refuse."""
    check_dependencies(config)
    if not config.data.features:  # a run from features reads no source rows
        local_source(config.data.source)  # a missing local file or folder: the run's FileNotFoundError
    check_folder(Path(config.output_dir), resume_from=config.resume_from, overwrite=config.overwrite_output_dir)
    # The run's own loaders: a missing folder or an unreachable hub id gives the run's one line and exit code
    # (the dry run once let transformers' OSError through: exit 4, "output not writable", with the hub's text)
    source = target_location(config.target)
    target_cfg = load_target_config(config.target)
    text = text_config_of(target_cfg)
    tokenizer = load_tokenizer(config.target)
    ds, (kind, settings) = config.draft, run_kind(config)
    draft_cfg = draft_config_for(config, target_cfg, tokenizer, text.vocab_size)
    mask_id = draft_cfg.mask_token_id
    with torch.device("meta"):  # sizes only: nothing is allocated or initialised
        params = sum(p.numel() for p in draft_model_for_config(draft_cfg).parameters())
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    check_run_settings(config, int(os.environ.get("WORLD_SIZE", "1")), device, dtype)
    if config.data.features:  # the manifests against this config, as the run checks them (embedding and head read)
        offline_target(config, None, tokenizer, dtype=dtype)
    tp = config.tensor_parallel.size
    rows = config.batch_size * config.optim.grad_accum
    stages = phases(config)  # counts the training rows the steps of num_epochs come from
    mine, whole = target_bytes(target_cfg, tp, dtype)  # from the config on the meta device
    return {
        "target": config.target,
        "target_source": source,
        "target_layers": text.num_hidden_layers,
        "hidden_size": text.hidden_size,
        "vocab_size": text.vocab_size,
        "target_layer_ids": draft_cfg.target_layer_ids,
        "mask_token_id": mask_id,
        "mask_token": tokenizer.convert_ids_to_tokens(mask_id),
        "draft_kind": ds.kind,
        "draft_layers": draft_cfg.num_hidden_layers,
        "draft_parameters": params,
        "block_size": draft_cfg.block_size,
        "position_weights": ds.position_weights if ds.position_weights != "decay" else
        (kind.describe_decay(settings) if kind.describe_decay is not None else
         f"decay, gamma {decay_gamma(ds.loss_decay_gamma, draft_cfg.block_size)}"),
        "anchors_per_row": ds.num_anchors,
        "rows_per_step": f"{rows} packed sequences of {pack_length(config.data)} tokens (data.packing)"
        if config.data.packing else rows,
        "max_tokens_per_step": rows * (pack_length(config.data) if config.data.packing else config.data.max_length),
        "blocks_per_step": rows * ds.num_anchors,
        "steps": stages.pop("steps"),
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "mesh": mesh(tp),
        "tensor_parallel_overlap": config.tensor_parallel.overlap if tp > 1 else "n/a (tensor_parallel.size 1)",
        "target_memory_per_rank": target_memory(mine, whole) if not config.data.features else
        "embedding and LM head only (data.features: the trunk is not loaded)",
        "step_memory_estimate": step_memory(config, target_cfg, draft_cfg, params, dtype, mine),
        "attention": resolve_attention(ds.attention, device),
        "data": config.data.source,
        "regenerate": config.data.regenerate,
        "labels": config.data.labels,
        "output_dir": config.output_dir,
        **stages,
    }


def describe_plan(p: dict[str, Any]) -> str:
    width = max(len(k) for k in p)
    return "\n".join(f"{k:<{width}}  {v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k:<{width}}  {v}"
                     for k, v in p.items())
