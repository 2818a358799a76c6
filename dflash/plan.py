"""`dflash train --dry-run`: what a run would do, from configs alone (no weights loaded, nothing trained)."""

from __future__ import annotations

from typing import Any

import torch

from dflash.config import TrainConfig
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel, default_decay_gamma
from dflash.objective import configured_mask_token
from dflash.target import resolve_mask_token_id
from dflash.trainer import resolve_device, resolve_dtype


def target_source(name: str) -> str:
    """Folder or hub id that `from_pretrained` reads for `config.target`."""
    if name == "embedded":
        from dflash.embedded import embedded_target_dir

        return str(embedded_target_dir())
    return name


def plan(config: TrainConfig) -> dict[str, Any]:
    from transformers import AutoConfig, AutoTokenizer

    source = target_source(config.target)
    target_cfg = AutoConfig.from_pretrained(source)
    text = target_cfg.get_text_config() if hasattr(target_cfg, "get_text_config") else target_cfg
    tokenizer = AutoTokenizer.from_pretrained(source)
    ds = config.draft
    mask_id = resolve_mask_token_id(tokenizer, text.vocab_size, configured_mask_token(config))
    draft_cfg = DFlashDraftConfig.for_target(
        target_cfg, mask_token_id=mask_id, num_hidden_layers=ds.num_layers, target_layer_ids=ds.target_layer_ids,
        block_size=ds.block_size, num_attention_heads=ds.num_attention_heads,
        num_key_value_heads=ds.num_key_value_heads, head_dim=ds.head_dim, intermediate_size=ds.intermediate_size)
    with torch.device("meta"):
        params = sum(p.numel() for p in DFlashDraftModel(draft_cfg).parameters())
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
        "draft_layers": draft_cfg.num_hidden_layers,
        "draft_parameters": params,
        "block_size": draft_cfg.block_size,
        "loss_decay_gamma": ds.loss_decay_gamma or default_decay_gamma(draft_cfg.block_size),
        "anchors_per_row": ds.num_anchors,
        "rows_per_step": rows,
        "max_tokens_per_step": rows * config.data.max_length,
        "blocks_per_step": rows * ds.num_anchors,
        "steps": config.max_steps,
        "device": str(device),
        "dtype": str(resolve_dtype(config.dtype, device)).replace("torch.", ""),
        "attention": ds.attention if ds.attention != "auto" else ("flex" if device.type == "cuda" else "sdpa"),
        "data": config.data.source,
        "regenerate": config.data.regenerate,
        "labels": config.data.labels,
        "output_dir": config.output_dir,
    }


def describe_plan(p: dict[str, Any]) -> str:
    width = max(len(k) for k in p)
    return "\n".join(f"{k:<{width}}  {v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k:<{width}}  {v}"
                     for k, v in p.items())
