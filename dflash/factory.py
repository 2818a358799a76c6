"""One place that turns a `TrainConfig` into what a run trains: the draft and its objective, for every draft
kind (from its record, `dflash.kinds.registry`: this module names no kind), and the target they train against
(replicated, sharded over a tensor-parallel group: `prepare_target`, or under `data.features` only its embedding
and head: `offline_target`; read from disk by `dflash.target_model.loading`), after refusing what the launch
(`check_run_settings`) or the kind (`check_kind_support`) cannot run.

The trainer, the `transformers.Trainer` module, the dry run (on the meta device) and `dflash features` build
through here, so a draft is sized the same way everywhere (checkpoints and exports rebuild theirs from the draft
config: `registry.draft_model_for_config`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dflash.attention import resolve_attention
from dflash.config import TrainConfig
from dflash.data.feature_data import check_run_features
from dflash.embedded import EMBEDDED_MASK_TOKEN
from dflash.kinds.record import DraftKind
from dflash.kinds.registry import draft_model_for_config, kind_named
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel, text_config_of
from dflash.objective import DFlashObjective
from dflash.target_model.frozen import FrozenTarget, Target, mask_token_text, resolve_mask_token_id
from dflash.target_model.loading import load_target, load_target_config, load_tokenizer, target_location
from dflash.target_model.offline import OfflineTarget
from dflash.target_model.tensor_parallel import TensorParallelTarget, check_tp_support, tp_mesh
from dflash.target_model.tp_group import GroupBatchTarget
from dflash.target_model.tp_overlap import schedule_for

log = logging.getLogger("dflash")


def check_run_settings(config: TrainConfig, world_size: int, device: torch.device, dtype: torch.dtype) -> None:
    """Settings that this launch (its process count, device and compute dtype) cannot run, refused at start
    with the fix."""
    if config.param_dtype == "bfloat16" and dtype != torch.bfloat16:
        raise ValueError("param_dtype: bfloat16 needs dtype: bfloat16 (bf16 weights under an fp32 compute dtype)")
    if world_size > 1 and config.distributed == "fsdp2" and config.cuda_graph:
        raise ValueError("cuda_graph: true does not work with distributed: fsdp2 (FSDP2's per-layer "
                         "all-gathers and reduce-scatters are driven by host-side hooks); use "
                         "distributed: ddp or cuda_graph: false")
    if config.cuda_graph and device.type != "cuda":
        raise ValueError("cuda_graph: true needs a CUDA device")
    if config.fp8 and (device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)):
        raise ValueError("fp8: true needs a GPU with FP8 tensor cores (compute capability 8.9 or newer: L4, H100, "
                         "H200, B200); set fp8: false")
    tp = config.tensor_parallel.size
    if world_size % tp:
        raise ValueError(f"tensor_parallel.size={tp} needs a number of processes that is a multiple of it, and this "
                         f"launch has {world_size}: launch a multiple of {tp} processes (torchrun --nproc_per_node "
                         f"{tp} -m dflash train ...), or set tensor_parallel.size to a divisor of {world_size}")


def configured_mask_token(config: TrainConfig) -> int | str | None:
    """`draft.mask_token_id`, or the embedded default's reserved token when the target is embedded."""
    if config.draft.mask_token_id is not None or config.target != "embedded":
        return config.draft.mask_token_id
    return EMBEDDED_MASK_TOKEN


def run_kind(config: TrainConfig) -> tuple[DraftKind, Any]:
    """(the record of `config.draft.kind`, its settings section: `config.<section>`, None for a kind without one)."""
    kind = kind_named(config.draft.kind)
    return kind, getattr(config, kind.section) if kind.section else None


def check_kind_support(config: TrainConfig) -> None:
    """What the run's draft kind cannot do (`DraftKind.refusals`) and its own section out of range, refused before
    any weight is read (the trainer's first step, `prepare_target`, every draft build and objective, so
    `dflash train --dry-run` says it too). `TrainConfig.validate` refuses the same; this also refuses a config
    changed after it was validated. The reason, then the fix."""
    kind, settings = run_kind(config)
    checks = kind.checks(settings, config.draft) if settings is not None else []
    problems = [msg for ok, msg in checks if not ok] + kind.refusals(config.draft, config.data)
    if problems:
        raise ValueError("invalid configuration:\n  " + "\n  ".join(problems))


def draft_config_for(config: TrainConfig, target_config: Any, tokenizer: Any, vocab_rows: int) -> DFlashDraftConfig:
    """The draft's config from the `draft` section and the keys its kind adds (`DraftKind.draft_keys`, from the
    kind's own section), shaped like the target (`target_config`: its HF config; `vocab_rows`: rows of its
    embedding table)."""
    check_kind_support(config)
    kind, settings = run_kind(config)
    ds = config.draft
    mask_id = resolve_mask_token_id(tokenizer, vocab_rows, configured_mask_token(config))
    cfg = DFlashDraftConfig.for_target(
        target_config, mask_token_id=mask_id, num_hidden_layers=ds.num_layers, target_layer_ids=ds.target_layer_ids,
        block_size=ds.block_size, num_attention_heads=ds.num_attention_heads,
        num_key_value_heads=ds.num_key_value_heads, head_dim=ds.head_dim, intermediate_size=ds.intermediate_size)
    extra = {**cfg.extra, **kind.draft_keys(settings, ds)}
    if (text := mask_token_text(tokenizer, mask_id)) is not None:  # exported as dflash_config.mask_token (SGLang)
        extra["mask_token"] = text
    return dataclasses.replace(cfg, extra=extra)


def _hf_model(target_model: Any) -> Any:
    """The HF causal LM of a target: itself, or the (sharded) model a `TensorParallelTarget` holds."""
    return target_model.model if isinstance(target_model, TensorParallelTarget) else target_model


def build_draft(config: TrainConfig, target_model: Any, tokenizer: Any) -> DFlashDraftModel:
    """A freshly initialised draft (of `draft.kind`) shaped for `target_model` (an HF
    causal LM, a `TensorParallelTarget`: its embedding is whole on every rank, or an `OfflineTarget`)."""
    if isinstance(target_model, OfflineTarget):
        hf_config, vocab_rows = target_model.text_config, target_model.vocab_size
    else:
        model = _hf_model(target_model)
        hf_config, vocab_rows = model.config, model.get_input_embeddings().weight.shape[0]
    return draft_model_for_config(draft_config_for(config, hf_config, tokenizer, vocab_rows))


def target_layer_ids_for(config: TrainConfig, hf_config: Any, tokenizer: Any, vocab_rows: int) -> list[int]:
    """The target layers the configured draft reads, from its config alone (no weights, no RNG drawn)."""
    return draft_config_for(config, hf_config, tokenizer, vocab_rows).target_layer_ids


def offline_target(config: TrainConfig, target: Any, tokenizer: Any, *, dtype: torch.dtype) -> tuple[OfflineTarget, Any]:
    """`data.features`: (the target as a run from offline features sees it, tokenizer). Only its embedding
    and LM head (`OfflineTarget`: from the model passed in, else read from the checkpoint; the trunk is
    never loaded), after refusing features that another target, layer ids, tokenizer, dtype, max length or
    label setting made (`check_run_features`) and what a run without the trunk cannot do."""
    if config.tensor_parallel.size > 1:
        raise ValueError("data.features runs no target trunk, so there is nothing to shard: set tensor_parallel.size=1")
    if config.spec_eval_prompts or config.spec_eval_interval_prompts:
        raise ValueError("data.features trains without the target's trunk, so the run cannot decode speculatively: "
                         "set spec_eval_prompts=0 and spec_eval_interval_prompts=0, and evaluate the export with "
                         "`dflash eval --draft RUN/export`")
    tokenizer = tokenizer or load_tokenizer(config.target)
    if target is not None:
        rows = target.get_input_embeddings().weight.shape[0]
        offline = OfflineTarget.from_model(target, target_layer_ids_for(config, target.config, tokenizer, rows))
    else:
        hf_config = load_target_config(config.target)
        text = text_config_of(hf_config)
        layer_ids = target_layer_ids_for(config, hf_config, tokenizer, text.vocab_size)
        offline = OfflineTarget.from_pretrained(config.target, layer_ids, dtype)
    check_run_features(config.data.features, target_name=config.target, target_config=offline.text_config,
                       layer_ids=offline.layer_ids, dtype=dtype, tokenizer=tokenizer, max_length=config.data.max_length,
                       labels=config.data.labels == "target", target=offline)
    return offline, tokenizer


def prepare_target(config: TrainConfig, target: Any, tokenizer: Any, *, device: torch.device,
                   dtype: torch.dtype) -> tuple[Any, Any]:
    """(target, tokenizer) that `build_objective` takes: the model passed in, else `config.target` loaded.

    With `tensor_parallel.size` > 1 (process group initialised, world size a multiple of it) a
    `TensorParallelTarget` over this rank's group of a (dp x tp) mesh: from a checkpoint (`config.target`:
    a folder, a hub id or "embedded") each rank builds the model on the meta device and reads only its
    shards; a model passed in is sharded in place. Heads and KV heads are checked against the size
    (`check_tp_support`) before any weight is read. With `data.features` the `offline_target`."""
    check_kind_support(config)
    if config.data.features:
        return offline_target(config, target, tokenizer, dtype=dtype)
    size = config.tensor_parallel.size
    if size == 1 or isinstance(target, TensorParallelTarget):
        if target is None:
            target, loaded = load_target(config.target, dtype)
            tokenizer = tokenizer or loaded
        return target, tokenizer
    hf_config = target.config if target is not None else load_target_config(config.target)
    text = text_config_of(hf_config)
    check_tp_support(text, size)
    mesh = tp_mesh(size, device.type)
    if config.data.regenerate and config.data.regenerate_engine == "transformers":
        log.warning("tensor_parallel.size=%d: HF generate() cannot run a sharded target, so data.regenerate reads the "
                    "target's replies from the cache only (a prompt not answered there stops the run); a target this "
                    "size regenerates through an engine: `dflash generate` with data.regenerate_engine=vllm "
                    "(data.regenerate_tensor_parallel GPUs) or a server (data.regenerate_engine=openai)", size)
    schedule = schedule_for(config.tensor_parallel.overlap)
    if target is not None:
        layer_ids = target_layer_ids_for(config, hf_config, tokenizer, target.get_input_embeddings().weight.shape[0])
        return TensorParallelTarget(target, layer_ids, mesh, schedule=schedule), tokenizer
    tokenizer = tokenizer or load_tokenizer(config.target)
    layer_ids = target_layer_ids_for(config, hf_config, tokenizer, text.vocab_size)
    return TensorParallelTarget.from_pretrained(target_location(config.target), layer_ids, mesh, dtype=dtype,
                                                device=device, schedule=schedule), tokenizer


def freeze_target(config: TrainConfig, target_model: Any, layer_ids: list[int]) -> Target:
    """`FrozenTarget` of an HF model, or for a `TensorParallelTarget` the group-batch view of it: every
    rank's micro-batch is padded to `data.max_length` so that the TP group gathers one shape (sync-free;
    the draft keeps each rank's own length)."""
    if isinstance(target_model, OfflineTarget):  # data.features: the layers its files hold
        if target_model.layer_ids != list(layer_ids):
            raise ValueError(f"the draft reads target layers {list(layer_ids)}, the offline target (data.features) "
                             f"holds {target_model.layer_ids}: pass a draft of those layers, or regenerate the features")
        return target_model
    if isinstance(target_model, TensorParallelTarget):
        tp = target_model
        if tp.layer_ids != list(layer_ids):  # a draft passed in (warm start) reads its own layers
            tp = TensorParallelTarget(tp.model, layer_ids, tp.group, schedule=tp.schedule, _sharded=True)
        return GroupBatchTarget(tp, length=config.data.max_length)
    if config.tensor_parallel.size > 1:
        raise ValueError("tensor_parallel.size > 1 needs the target from dflash.factory.prepare_target (DFlashTrainer "
                         "does this); the transformers.Trainer path does not support tensor parallelism: set "
                         "tensor_parallel.size: 1 there")
    return FrozenTarget(target_model, layer_ids, config.draft.attention)  # packed rows' mask as the draft's


def build_objective(config: TrainConfig, target_model: Any, tokenizer: Any, *, device: torch.device,
                    dtype: torch.dtype, draft: nn.Module | None = None) -> DFlashObjective:
    """The objective for `config.draft.kind` around `target_model` (frozen, moved to `device` / `dtype`):
    an HF causal LM, or a `TensorParallelTarget` (`prepare_target`) run on the group's batch. The draft
    runs as itself (the `transformers.Trainer` path wraps the whole module; `DFlashTrainer` wraps the draft).

    `draft` replaces the fresh draft (a warm start, a test's own); its weights stay fp32 (AdamW master
    weights) and the forward runs under autocast below fp32."""
    draft = draft if draft is not None else build_draft(config, target_model, tokenizer)
    target = freeze_target(config, target_model, draft.config.target_layer_ids).to(device, dtype)
    return objective_for(config, target, draft.to(device, torch.float32), device=device, dtype=dtype)


def objective_for(config: TrainConfig, target: Target, draft: nn.Module, *, device: torch.device, dtype: torch.dtype,
                  draft_call: Callable[..., torch.Tensor] | None = None) -> DFlashObjective:
    """The objective of `config.draft.kind` (with the config's loss settings, then its kind's own options:
    `DraftKind.objective_options`; its CE chunks compiled under `compile: true`) around an already frozen target
    (`freeze_target`, or a stand-in with the `Target` interface) and `draft` (of that kind: `build_draft`), run by
    `draft_call` (the draft wrapped for data parallelism and compilation; default: the draft itself)."""
    check_kind_support(config)
    kind, settings = run_kind(config)
    ds = config.draft
    draft.checkpoint_layers = config.activation_checkpointing  # a run setting, read by the draft's forward
    common = dict(num_anchors=ds.num_anchors, attention=resolve_attention(ds.attention, device), dtype=dtype,
                  gamma=ds.loss_decay_gamma, ce_chunk_size=config.ce_chunk_size, labels=config.data.labels,
                  position_weights=ds.position_weights, dpace_alpha=ds.dpace_alpha, draft_call=draft_call,
                  compile_loss=config.compile, anchor_spread=ds.anchor_spread)
    return kind.objective(target, draft, **{**common, **kind.objective_options(settings)})
