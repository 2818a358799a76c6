"""The DFlash objective as a `transformers.Trainer` model (`DFlashTrainingModule`) and its collator.

How the Trainer path normalizes the loss, and how the pieces fit: `dflash.hf.trainer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from dflash.anchors import reseed
from dflash.config import TrainConfig
from dflash.data.loader import Collator
from dflash.embedded import EMBEDDED_TARGET_NAME, cache_root
from dflash.factory import build_objective, run_kind
from dflash.losses import BlockTargets
from dflash.metrics import Metrics
from dflash.modeling import allow_compiled_shapes
from dflash.objective import DFlashObjective
from dflash.runtime import resolve_device, resolve_dtype

_TARGET_PREFIX = "objective.target."  # state_dict keys of the frozen target (never saved)
# TrainConfig keys that the Trainer's own loop replaces on this path, with the TrainingArguments field that
# wins. A key set away from its default to another value than that field is refused (`config_conflicts`).
TRAINER_OWNS = {
    "optim.lr": "learning_rate", "optim.weight_decay": "weight_decay", "optim.beta1": "adam_beta1",
    "optim.beta2": "adam_beta2", "optim.eps": "adam_epsilon", "optim.max_grad_norm": "max_grad_norm",
    "optim.grad_accum": "gradient_accumulation_steps", "optim.warmup_ratio": "warmup_steps",
    "optim.min_lr_ratio": "lr_scheduler_kwargs", "max_steps": "max_steps", "batch_size": "per_device_train_batch_size",
    "seed": "seed", "device": "device", "optim.optimizer": "optim", "num_epochs": "num_train_epochs",
}


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
        self.train_config: TrainConfig | None = None  # set by from_config: checked against TrainingArguments
        self.target_name: str | None = None  # what the export records as the draft's target

    @classmethod
    def from_config(cls, config: TrainConfig, target_model: Any, tokenizer: Any, *, draft: nn.Module | None = None,
                    device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> DFlashTrainingModule:
        """A module for `config` (its `draft` section, `ce_chunk_size`, `seed`, `data.labels`).

        `device` / `dtype` default to `config.device` / `config.dtype` resolved as `DFlashTrainer`
        does; the Trainer later moves the module to `args.device` anyway.
        """
        dev = torch.device(device) if device is not None else resolve_device(config.device)
        config.validate()
        if config.data.features:  # the Trainer's own DataLoader and module inputs carry no feature tensors
            raise ValueError("data.features (offline target features) is supported by `dflash train` / DFlashTrainer, "
                             "not by the transformers.Trainer path: set data.features=null here, or train with "
                             "`dflash train data.features=...`")
        kind, _ = run_kind(config)
        if (why := kind.unsupported.hf_trainer) is not None:  # e.g. untested here: its export at each save, its metrics
            raise ValueError(f"draft.kind: {kind.name} does not support the transformers.Trainer path (dflash.hf): {why}")
        objective = build_objective(config, target_model, tokenizer, device=dev,
                                    dtype=dtype or resolve_dtype(config.dtype, dev), draft=draft)
        module = cls(objective, seed=config.seed)
        module.train_config, module.target_name = config, trained_for(config, target_model)
        return module

    # ---- parts -------------------------------------------------------------------------------

    @property
    def config(self) -> Any:
        """The target's HF text config: what `transformers.Trainer` reads as `model.config` (5.24 aligns the
        tokenizer's special tokens with it when `processing_class` is given). The run's settings are
        `train_config`."""
        return self.objective.target.text_config

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
        return Metrics(self.objective.metric_layout(), self.device)

    # ---- anchors -----------------------------------------------------------------------------

    def _generator_on(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        return self._generator

    def plan(self, input_ids: torch.Tensor, loss_mask: torch.Tensor,
             position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, BlockTargets]:
        """Anchors `[B, N]`, keep `[B, N]` and targets of the next micro-batch (advances the counter);
        `position_ids` `[B, S]`: packed rows (`dflash.data.packing`).

        Training: seeded by `(seed, rank, micro_step)`, as `DFlashTrainer` seeds step*accum+index.
        Eval: seeded by `(seed + 1, 0, batch index within the evaluation)`.
        """
        generator = self._generator_on(input_ids.device)
        if self.training:
            generator = reseed(generator, self.seed, self.rank, self.micro_step)
            self.micro_step += 1
        else:
            generator = reseed(generator, self.seed + 1, 0, self.eval_batches)
        return self.objective.plan(input_ids, loss_mask, generator, position_ids=position_ids)

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, dflash_plan: MicroBatchPlan | None = None,
                return_loss: bool = True, position_ids: torch.Tensor | None = None) -> DFlashModelOutput:
        """Loss of one micro-batch. input_ids `[B, S]` long, loss_mask `[B, S]` bool/int; position_ids `[B, S]`:
        packed rows (`training_rows(rows, config.data)` under `data.packing`; the collator gives them).

        Without `dflash_plan` (plain Trainer): `Σ w·CE / Σ w` of this micro-batch. With it
        (`DFlashHFTrainer`): `Σ w·CE · plan.loss_scale`, this micro-batch's share of the global mean.
        `return_loss` exists so the Trainer's evaluation asks for the loss (no `labels` column).
        """
        if dflash_plan is None:
            anchors, keep, targets = self.plan(input_ids, loss_mask, position_ids)
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


def trained_for(config: TrainConfig, target_model: Any) -> str | None:
    """The target name an export records: `config.target` when the config names one; for the default
    ("embedded") the model's own `name_or_path` ("embedded" for the cached SmolLM2 folder), or None when
    the model does not say (built from a config)."""
    if config.target != TrainConfig.target:
        return config.target
    path = getattr(target_model, "name_or_path", "") or ""
    if not path:
        return None
    return "embedded" if Path(path).resolve() == (cache_root() / EMBEDDED_TARGET_NAME).resolve() else path


def _value(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def _agrees(key: str, mine: Any, args: Any) -> bool:
    """Whether TrainConfig's `key` = `mine` says what TrainingArguments already does."""
    theirs = getattr(args, TRAINER_OWNS[key])
    if key == "device":
        wanted = torch.device(mine)
        return wanted.type == args.device.type and wanted.index in (None, args.device.index)
    if key == "optim.warmup_ratio":  # warmup_steps below 1 is a ratio of the steps, else a step count
        theirs = theirs if theirs < 1 else theirs / max(args.max_steps, 1)
    if key == "optim.min_lr_ratio":  # the stock schedule's floor: lr_scheduler_type="cosine_with_min_lr"
        theirs = (theirs or {}).get("min_lr_rate", 0.0) if "min_lr" in str(args.lr_scheduler_type) else 0.0
    if key == "optim.optimizer":  # only the default (AdamW) is what a stock TrainingArguments.optim also runs
        return mine == "adamw" and "adamw" in str(theirs)
    if isinstance(mine, float) or isinstance(theirs, float):
        return math.isclose(float(mine), float(theirs), rel_tol=1e-9, abs_tol=1e-12)
    return mine == theirs


def config_conflicts(config: TrainConfig, args: Any) -> list[str]:
    """The TrainConfig keys set (away from their defaults) to something the Trainer will not do, each as
    "key=value, but TrainingArguments.field=value": on this path TrainingArguments wins for the optimizer,
    schedule, steps, batch, seed and device (`TRAINER_OWNS`). Empty when they agree."""
    default = TrainConfig()
    return [f"{key}={_value(config, key)!r}, but TrainingArguments.{field}={getattr(args, field)!r}"
            for key, field in TRAINER_OWNS.items()
            if _value(config, key) != _value(default, key) and not _agrees(key, _value(config, key), args)]


def check_config_against_args(module: Any, args: Any) -> None:
    """Refuse a module's TrainConfig that asks for what TrainingArguments overrides (a ValueError listing
    each key and the argument to set instead); then the anchors follow `args.seed` like the rest of the run."""
    config = getattr(module, "train_config", None)
    if config is not None:
        conflicts = config_conflicts(config, args)
        if conflicts:
            raise ValueError("on the transformers.Trainer path TrainingArguments runs the optimizer, schedule, steps, "
                             "batch, seed and device; these TrainConfig values would be ignored (set them in "
                             "TrainingArguments, or leave them at their defaults):\n  " + "\n  ".join(conflicts))
    module.seed = args.seed


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
