"""The draft's optimizer and learning-rate schedule, both driven from device tensors.

AdamW is always fused: with a tensor lr it reads nothing on the host (the foreach and for-loop paths
call `.item()` on their step counters), works on FSDP2's DTensor shards, and takes clipping and the
skip flag as its `grad_scale` / `found_inf`. The schedule rewrites the lr tensor in place from a
device step counter, so it never copies a Python float to the device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from dflash.config import OptimSettings


def build_optimizer(params: Iterable[torch.nn.Parameter], settings: OptimSettings, lr: torch.Tensor, *,
                    capturable: bool) -> torch.optim.AdamW:
    """Fused AdamW over `params` reading its lr from `lr` (a `[]` fp32 device tensor the schedule
    updates in place); `capturable` keeps its step counter on the device for CUDA-graph replay."""
    return torch.optim.AdamW(list(params), lr=lr, betas=(settings.beta1, settings.beta2), eps=settings.eps,
                             weight_decay=settings.weight_decay, fused=True, capturable=capturable)


def lr_at(step: torch.Tensor, settings: OptimSettings, total_steps: int) -> torch.Tensor:
    """`[]` lr at `step` (a device tensor of completed steps): linear warmup over `warmup_ratio` of
    the run, then cosine to `min_lr_ratio` of the peak."""
    warmup = max(1, round(settings.warmup_ratio * total_steps)) if settings.warmup_ratio > 0 else 0
    progress = ((step - warmup) / max(1, total_steps - warmup)).clamp(0.0, 1.0)
    cosine = settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + torch.cos(math.pi * progress))
    factor = torch.where(step < warmup, (step + 1) / warmup, cosine) if warmup else cosine
    return settings.lr * factor
