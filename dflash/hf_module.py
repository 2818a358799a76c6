"""The DFlash objective as a `transformers.Trainer` model (`DFlashTrainingModule`) and its collator.

How the Trainer path normalizes the loss, and how the pieces fit: `dflash.hf`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from dflash.anchors import reseed
from dflash.config import TrainConfig
from dflash.data import Collator
from dflash.factory import build_objective
from dflash.losses import BlockTargets
from dflash.metrics import Metrics
from dflash.modeling import allow_compiled_shapes
from dflash.objective import DFlashObjective
from dflash.runtime import resolve_device, resolve_dtype

_TARGET_PREFIX = "objective.target."  # state_dict keys of the frozen target (never saved)


@dataclass
class DFlashModelOutput(ModelOutput):
    """What the training module returns: only `loss` (a Trainer evaluation gathers every other
    tensor of the output as "logits", so nothing else is returned).

    loss: `[]` the weighted block CE of this micro-batch (normalization: module docstring).
    """

    loss: torch.Tensor | None = None


@dataclass
class MicroBatchPlan:
    """Anchors and block targets of one micro-batch, fixed before the window's first forward.

    anchors `[B, N]` long, keep `[B, N]` bool, targets: `BlockTargets` `[B, N, bs]`;
    loss_scale `[]` fp32 = num_processes / Σ w over the window and all ranks. A dataclass (not a
    tuple) so the Trainer's `_prepare_inputs` passes it through untouched.
    """

    anchors: torch.Tensor
    keep: torch.Tensor
    targets: BlockTargets
    loss_scale: torch.Tensor


class DFlashTrainingModule(nn.Module):
    """Frozen target + trainable draft as one `nn.Module` for `transformers.Trainer(model=...)`.

    Wraps a `DFlashObjective` (the same block loss `DFlashTrainer` uses). Anchors are drawn with a
    generator reseeded per micro-batch from `(seed, rank, micro_step)` — host state only — so a run
    is reproducible and a resumed run (the callback sets `micro_step` from `state.global_step`)
    draws the same anchors. In eval mode anchors come from a fixed seed per evaluation batch, so
    evaluations at different steps score the same blocks.

    Attributes set by `DFlashCallback` (None without it; then nothing is accumulated):
        metrics: training `Metrics` (device sums), eval_metrics: evaluation `Metrics`.
    """

    # The Trainer must not pass `num_items_in_batch` (a label count, not the DFlash weight sum) and
    # must divide the plain per-micro-batch loss by the accumulation steps: see module docstring.
    accepts_loss_kwargs = False
    main_input_name = "input_ids"

    def __init__(self, objective: DFlashObjective, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__()
        self.objective = objective
        self.seed, self.rank = seed, rank
        self.micro_step = 0  # training micro-batches drawn so far (host counter)
        self.eval_batches = 0  # evaluation micro-batches since the last eval flush (host counter)
        self.metrics: Metrics | None = None
        self.eval_metrics: Metrics | None = None
        self._generator: torch.Generator | None = None

    @classmethod
    def from_config(cls, config: TrainConfig, target_model: Any, tokenizer: Any, *, draft: nn.Module | None = None,
                    device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> DFlashTrainingModule:
        """A module for `config` (its `draft` section, `ce_chunk_size`, `seed`, `data.labels`).

        `device` / `dtype` default to `config.device` / `config.dtype` resolved as `DFlashTrainer`
        does; the Trainer later moves the module to `args.device` anyway.
        """
        dev = torch.device(device) if device is not None else resolve_device(config.device)
        config.validate()
        objective = build_objective(config, target_model, tokenizer, device=dev,
                                    dtype=dtype or resolve_dtype(config.dtype, dev), draft=draft)
        return cls(objective, seed=config.seed)

    # ---- parts -------------------------------------------------------------------------------

    @property
    def draft(self) -> nn.Module:
        return self.objective.draft

    @property
    def target(self) -> nn.Module:
        return self.objective.target

    @property
    def block_size(self) -> int:
        return self.objective.block_size

    @property
    def device(self) -> torch.device:
        return next(self.objective.draft.parameters()).device

    def new_metrics(self) -> Metrics:
        """An empty accumulator in this objective's layout, on the module's device."""
        return Metrics(self.block_size, self.device, self.objective.metrics_variant)

    # ---- anchors -----------------------------------------------------------------------------

    def _generator_on(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        return self._generator

    def plan(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, BlockTargets]:
        """Anchors `[B, N]`, keep `[B, N]` and targets of the next micro-batch (advances the counter).

        Training: seeded by `(seed, rank, micro_step)`, as `DFlashTrainer` seeds step*accum+index.
        Eval: seeded by `(seed + 1, 0, batch index within the evaluation)`.
        """
        generator = self._generator_on(input_ids.device)
        if self.training:
            generator = reseed(generator, self.seed, self.rank, self.micro_step)
            self.micro_step += 1
        else:
            generator = reseed(generator, self.seed + 1, 0, self.eval_batches)
        return self.objective.plan(input_ids, loss_mask, generator)

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, dflash_plan: MicroBatchPlan | None = None,
                return_loss: bool = True) -> DFlashModelOutput:
        """Loss of one micro-batch. input_ids `[B, S]` long, loss_mask `[B, S]` bool/int.

        Without `dflash_plan` (plain Trainer): `Σ w·CE / Σ w` of this micro-batch. With it
        (`DFlashHFTrainer`): `Σ w·CE · plan.loss_scale`, this micro-batch's share of the global mean.
        `return_loss` exists so the Trainer's evaluation asks for the loss (no `labels` column).
        """
        if dflash_plan is None:
            anchors, keep, targets = self.plan(input_ids, loss_mask)
            scale = 1.0 / targets.weights.sum().clamp(min=1e-6)
        else:
            anchors, keep, targets, scale = dflash_plan.anchors, dflash_plan.keep, dflash_plan.targets, dflash_plan.loss_scale
        out = self.objective(input_ids, anchors, keep, targets)
        metrics = self.metrics if self.training else self.eval_metrics
        if not self.training:
            self.eval_batches += 1
        if metrics is not None:
            self.objective.accumulate(metrics, out, keep, targets)  # device adds only
        return DFlashModelOutput(loss=out.loss_sum * scale)

    # ---- what is saved -----------------------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The draft's weights only (`objective.draft.*`): the target is frozen and loaded from its
        own source, and its tied / shared tensors could not go into one safetensors file anyway."""
        state = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "") + _TARGET_PREFIX
        for key in [k for k in state if k.startswith(prefix)]:
            del state[key]
        return state

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load draft weights; `strict` applies to the draft (the target's keys are never expected)."""
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if not k.startswith(_TARGET_PREFIX)]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"draft state mismatch: missing {missing}, unexpected {result.unexpected_keys}")
        return result._replace(missing_keys=missing)


def dflash_collator(tokenizer: Any, config: TrainConfig) -> Any:
    """This project's `Collator` (bucketed right padding) for `config.data`, padding with the
    tokenizer's pad token (else eos, else 0). Rows: `{"input_ids": [...], "loss_mask": [...]}`.
    Compiled functions may keep a graph for each padded length, twice (a last, smaller batch)."""
    collator = Collator.for_tokenizer(tokenizer, config.data)
    allow_compiled_shapes(2 * (collator.num_lengths or 0))
    return collator


def unwrap_model(model: Any) -> Any:
    """The module inside DDP / accelerate wrappers."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model
