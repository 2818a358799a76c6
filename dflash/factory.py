"""One place that turns a `TrainConfig` into a draft and its objective, for DFlash and Domino drafts.

It sits above `objective.py` and `domino.py` so neither has to know the other: the trainer, the
`transformers.Trainer` module, the dry run (on the meta device) and checkpoint / export loading all
build through here, so a Domino draft is sized the same way everywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from dflash.attention import resolve_attention
from dflash.config import TrainConfig
from dflash.domino import DominoDraftModel, DominoHeadConfig, DominoObjective, is_domino
from dflash.embedded import EMBEDDED_MASK_TOKEN
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel
from dflash.objective import DFlashObjective
from dflash.target import FrozenTarget, resolve_mask_token_id


def configured_mask_token(config: TrainConfig) -> int | str | None:
    """`draft.mask_token_id`, or the embedded default's reserved token when the target is embedded."""
    if config.draft.mask_token_id is not None or config.target != "embedded":
        return config.draft.mask_token_id
    return EMBEDDED_MASK_TOKEN


def draft_config_for(config: TrainConfig, target_config: Any, tokenizer: Any, vocab_rows: int) -> DFlashDraftConfig:
    """The draft's config from the `draft` (and, for `kind: domino`, `domino`) sections, shaped like the
    target (`target_config`: its HF config; `vocab_rows`: rows of its embedding table)."""
    ds = config.draft
    mask_id = resolve_mask_token_id(tokenizer, vocab_rows, configured_mask_token(config))
    cfg = DFlashDraftConfig.for_target(
        target_config, mask_token_id=mask_id, num_hidden_layers=ds.num_layers, target_layer_ids=ds.target_layer_ids,
        block_size=ds.block_size, num_attention_heads=ds.num_attention_heads,
        num_key_value_heads=ds.num_key_value_heads, head_dim=ds.head_dim, intermediate_size=ds.intermediate_size)
    if ds.kind == "domino":
        cfg = dataclasses.replace(cfg, extra={**cfg.extra, **DominoHeadConfig.from_settings(config.domino).to_extra()})
    return cfg


def draft_model_for_config(cfg: DFlashDraftConfig) -> DFlashDraftModel:
    """A `DominoDraftModel` when the config says `projector_type: domino`, else a DFlash draft."""
    return DominoDraftModel(cfg) if is_domino(cfg) else DFlashDraftModel(cfg)


def build_draft(config: TrainConfig, target_model: Any, tokenizer: Any) -> DFlashDraftModel:
    """A freshly initialised draft (DFlash or Domino, by `draft.kind`) shaped for `target_model`."""
    vocab_rows = target_model.get_input_embeddings().weight.shape[0]
    return draft_model_for_config(draft_config_for(config, target_model.config, tokenizer, vocab_rows))


def build_objective(config: TrainConfig, target_model: Any, tokenizer: Any, *, device: torch.device,
                    dtype: torch.dtype, draft: nn.Module | None = None) -> DFlashObjective:
    """The objective for `config.draft.kind` around `target_model` (frozen, moved to `device` / `dtype`).

    `draft` replaces the fresh draft (a warm start, a test's own); its weights stay fp32 (AdamW master
    weights) and the forward runs under autocast below fp32."""
    draft = draft if draft is not None else build_draft(config, target_model, tokenizer)
    target = FrozenTarget(target_model, draft.config.target_layer_ids).to(device, dtype)
    ds = config.draft
    common = dict(num_anchors=ds.num_anchors, attention=resolve_attention(ds.attention, device), dtype=dtype,
                  gamma=ds.loss_decay_gamma, ce_chunk_size=config.ce_chunk_size, labels=config.data.labels)
    draft = draft.to(device, torch.float32)
    if ds.kind == "domino":
        d = config.domino
        return DominoObjective(target, draft, lambda_start=d.lambda_start, decay_ratio=d.decay_ratio,
                               scheduled_sampling=d.scheduled_sampling, **common)
    return DFlashObjective(target, draft, **common)
