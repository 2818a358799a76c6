"""The draft's optimizer and learning-rate schedule, both driven from device tensors.

AdamW is always fused: with a tensor lr it reads nothing on the host (the foreach and for-loop paths
call `.item()` on their step counters), works on FSDP2's DTensor shards, and takes clipping and the
skip flag as its `grad_scale` / `found_inf`. The schedule rewrites the lr tensor in place from a
device step counter, so it never copies a Python float to the device.

`optim.optimizer: muon` gives the decoder layers' and `fc`'s matrices to Muon (the default optimizer of
vLLM speculators' DFlash recipe) and the rest (norms, the kinds' heads) to fused AdamW. torch's own
`torch.optim.Muon` reads a tensor lr on the host (its update is an `add_` whose `alpha` is the lr), so
`Muon` here is torch's algorithm with the lr, clipping and skip applied as tensors: its Newton-Schulz
iteration and lr adjustment are torch's, and a test holds its step equal to `torch.optim.Muon`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _zeropower_via_newtonschulz

from dflash.config import OptimSettings

MUON_MOMENTUM = 0.95  # torch's and Moonlight's default, Nesterov on


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters with a `[]` device lr tensor, sync-free and capturable.

    Per matrix W `[A, B]` with gradient G (divided by `grad_scale` when set): B <- lerp(B, G, 1 - mu);
    U = NS5(lerp(G, B, mu)) (Nesterov); W <- W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) U, the last factor
    Moonlight's RMS matching (torch's `adjust_lr_fn="match_rms_adamw"`), so AdamW's lr carries over.
    Where `found_inf` is 1, W and B stay as they were (selected with `torch.where`: a NaN update times
    zero would still be NaN). `grad_scale` / `found_inf` are set by the trainer before each step, as
    for fused AdamW."""

    def __init__(self, params: Iterable[nn.Parameter], lr: torch.Tensor, weight_decay: float) -> None:
        super().__init__(list(params), {"lr": lr, "weight_decay": weight_decay})
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon takes 2-D matrices, got a parameter of shape {tuple(p.shape)}")
        self.grad_scale: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError("Muon takes no closure")
        skip = None if self.found_inf is None else self.found_inf > 0  # once per step, not per matrix
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad if self.grad_scale is None else p.grad / self.grad_scale
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                new_buf = buf.lerp(grad, 1 - MUON_MOMENTUM)
                update = _zeropower_via_newtonschulz(grad.lerp(new_buf, MUON_MOMENTUM), (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                                                     DEFAULT_NS_STEPS, EPS)
                scale = lr * (0.2 * math.sqrt(max(p.shape)))
                new_p = p * (1 - lr * decay) - update.to(p.dtype) * scale
                if skip is None:
                    buf.copy_(new_buf)
                    p.copy_(new_p)
                else:
                    buf.copy_(torch.where(skip, buf, new_buf))
                    p.copy_(torch.where(skip, p, new_p))


class DraftOptimizers:
    """Muon and fused AdamW stepped as one optimizer: what the trainer, the CUDA-graph warm-up and the
    checkpoint code read (`param_groups`, `state`, `grad_scale` / `found_inf`, `step`, `zero_grad`);
    `parts` goes to `torch.distributed.checkpoint.state_dict`, which takes a list of optimizers."""

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        self.parts = parts
        self._grad_scale: torch.Tensor | None = None
        self._found_inf: torch.Tensor | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts for group in part.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {p: s for part in self.parts for p, s in part.state.items()}

    # The trainer sets `grad_scale` and `found_inf` as it sets them on a lone fused AdamW (torch's GradScaler
    # protocol: attributes the step reads); each part reads its own in its step, so setting one sets both parts'.

    @property
    def grad_scale(self) -> torch.Tensor | None:
        """`[]` fp32 on the device: every gradient is divided by it in the step (clipping), or None."""
        return self._grad_scale

    @grad_scale.setter
    def grad_scale(self, value: torch.Tensor | None) -> None:
        self._grad_scale = value
        for part in self.parts:
            part.grad_scale = value

    @property
    def found_inf(self) -> torch.Tensor | None:
        """`[]` fp32 on the device: 1 skips the step (weights and moments left as they were), or None."""
        return self._found_inf

    @found_inf.setter
    def found_inf(self, value: torch.Tensor | None) -> None:
        self._found_inf = value
        for part in self.parts:
            part.found_inf = value

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


def muon_matrices(draft: nn.Module) -> set[nn.Parameter]:
    """The weights Muon trains: every linear layer's inside the decoder layers, and `fc` (the context
    projection). Not the kinds' heads (embedding-like tables and output projections, which Muon's
    authors leave to AdamW) nor DFlash 2's convolution taps."""
    return {module.weight for name, module in draft.named_modules()
            if isinstance(module, nn.Linear) and (name == "fc" or name.startswith("layers.")) and module.weight.requires_grad}


def build_optimizer(draft: nn.Module, settings: OptimSettings, lr: torch.Tensor, *,
                    capturable: bool) -> torch.optim.AdamW | DraftOptimizers:
    """The optimizer of `draft`'s trainable parameters, reading its lr from `lr` (a `[]` fp32 device tensor
    the schedule updates in place): fused AdamW (`capturable` keeps its step counter on the device for
    CUDA-graph replay), or with `settings.optimizer == "muon"` Muon for `muon_matrices` and AdamW for the rest."""
    trainable = [p for p in draft.parameters() if p.requires_grad]
    matrices = muon_matrices(draft) if settings.optimizer == "muon" else set()
    if settings.optimizer == "muon" and not matrices:  # e.g. a wrapper's names ("module.layers.0...")
        raise ValueError("optim.optimizer: muon found no trainable linear layer under `layers.` or `fc` in the draft: "
                         "pass the draft module itself, not a wrapper, or use optim.optimizer: adamw")
    adamw = torch.optim.AdamW([p for p in trainable if p not in matrices], lr=lr, betas=(settings.beta1, settings.beta2),
                              eps=settings.eps, weight_decay=settings.weight_decay, fused=True, capturable=capturable)
    if not matrices:
        return adamw
    return DraftOptimizers([Muon([p for p in trainable if p in matrices], lr, settings.weight_decay), adamw])


def lr_at(step: torch.Tensor, settings: OptimSettings, total_steps: int) -> torch.Tensor:
    """`[]` lr at `step` (a device tensor of completed steps): linear warmup over `warmup_ratio` of
    the run, then cosine to `min_lr_ratio` of the peak."""
    warmup = max(1, round(settings.warmup_ratio * total_steps)) if settings.warmup_ratio > 0 else 0
    progress = ((step - warmup) / max(1, total_steps - warmup)).clamp(0.0, 1.0)
    cosine = settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + torch.cos(math.pi * progress))
    factor = torch.where(step < warmup, (step + 1) / warmup, cosine) if warmup else cosine
    return settings.lr * factor
