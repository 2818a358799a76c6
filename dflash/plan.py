"""`dflash train --dry-run`: what a run would do, from configs alone (no weights loaded, nothing trained)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from dflash.attention import resolve_attention
from dflash.config import TrainConfig
from dflash.embedded import embedded_target_dir
from dflash.factory import draft_config_for, draft_model_for_config
from dflash.losses import decay_gamma
from dflash.runtime import resolve_device, resolve_dtype


def target_source(name: str) -> str:
    """Folder or hub id that `from_pretrained` reads for `config.target`."""
    return str(embedded_target_dir()) if name == "embedded" else name


def plan(config: TrainConfig) -> dict[str, Any]:
    """What `config` would run: target shape, layer ids, mask token, draft size (built on the meta
    device by the trainer's own factory, so a Domino draft counts its head), tokens per step."""
    source = target_source(config.target)
    target_cfg = AutoConfig.from_pretrained(source)
    text = target_cfg.get_text_config() if hasattr(target_cfg, "get_text_config") else target_cfg
    tokenizer = AutoTokenizer.from_pretrained(source)
    ds = config.draft
    draft_cfg = draft_config_for(config, target_cfg, tokenizer, text.vocab_size)
    mask_id = draft_cfg.mask_token_id
    with torch.device("meta"):  # sizes only: nothing is allocated or initialised
        params = sum(p.numel() for p in draft_model_for_config(draft_cfg).parameters())
    device = resolve_device(config.device)
    rows = config.batch_size * config.optim.grad_accum
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
        "loss_decay_gamma": decay_gamma(ds.loss_decay_gamma, draft_cfg.block_size),
        "anchors_per_row": ds.num_anchors,
        "rows_per_step": rows,
        "max_tokens_per_step": rows * config.data.max_length,
        "blocks_per_step": rows * ds.num_anchors,
        "steps": config.max_steps,
        "device": str(device),
        "dtype": str(resolve_dtype(config.dtype, device)).replace("torch.", ""),
        "attention": resolve_attention(ds.attention, device),
        "data": config.data.source,
        "regenerate": config.data.regenerate,
        "labels": config.data.labels,
        "output_dir": config.output_dir,
    }


def describe_plan(p: dict[str, Any]) -> str:
    width = max(len(k) for k in p)
    return "\n".join(f"{k:<{width}}  {v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k:<{width}}  {v}"
                     for k, v in p.items())
