"""`transformers.Trainer` integration: the DFlash objective as a Trainer model, and a callback.

    module = DFlashTrainingModule.from_config(config, target_model, tokenizer)   # frozen target + draft
    trainer = transformers.Trainer(model=module, args=args, train_dataset=rows,
                                   data_collator=dflash_collator(tokenizer, config),
                                   callbacks=[DFlashCallback(module)])
    trainer.train()

* `DFlashTrainingModule.forward(input_ids, loss_mask)` returns a `DFlashModelOutput` with `loss`,
  so the Trainer's own loop (accumulation, clipping, optimizer, scheduler, checkpoints) runs it.
  Only draft parameters require grad (the Trainer's optimizer takes exactly those) and only draft
  weights are in `state_dict()` (the Trainer checkpoint's `model.safetensors`).
* `DFlashCallback` keeps the DFlash metrics as device sums (`dflash.metrics.Metrics`) and adds them
  to `logs` at logging steps only (one flush per log, never per step), drives an on-device step
  counter for schedules (Domino λ), exports the draft in the published format at every save, and
  warns once per Trainer setting that adds a host-device sync to every step.
* `DFlashHFTrainer` is `transformers.Trainer` with one change, for the exact global token mean over
  gradient accumulation (the loss `dflash.trainer.DFlashTrainer` optimizes); see "Loss
  normalization" below.

Loss normalization. DFlash's loss is `Σ w·CE / Σ w` over the whole accumulation window and all
ranks (DESIGN §4), where `w` are block-slot weights that depend on the anchors sampled for each
micro-batch. The plain Trainer calls the model once per micro-batch and divides each returned loss
by `gradient_accumulation_steps` (and DDP averages ranks), so with `DFlashTrainingModule` alone the
optimized loss is the *mean of per-micro-batch weighted means*. That equals the global mean when
`gradient_accumulation_steps == 1` on one process, and is close to it when micro-batches carry
similar weight. Trainer 5.x's `num_items_in_batch` does not give the exact mean: it is computed
only when the batch has a `labels` column, as the count `labels[..., 1:] != -100` — a token count,
not the DFlash weight sum (exponential position decay, anchors sampled per micro-batch). So the
module sets `accepts_loss_kwargs = False` and never uses it. `DFlashHFTrainer` instead overrides
`get_batch_samples` (which already sees the whole window before the first forward): it samples the
anchors of every micro-batch there, sums their weights on the device (all-reduced over ranks, a
collective, not a host read), and hands each micro-batch its plan and the factor
`num_processes / Σ w`; the Trainer is told the loss is already scaled (`loss_is_scaled_for_ga`).
The gradient is then exactly that of the global token mean, as in `DFlashTrainer.train_step`.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.utils import ModelOutput

from dflash.anchors import anchor_seed
from dflash.config import TrainConfig
from dflash.losses import BlockTargets
from dflash.metrics import Metrics
from dflash.objective import DFlashObjective, build_objective

__all__ = [
    "DFlashCallback",
    "DFlashHFTrainer",
    "DFlashModelOutput",
    "DFlashSyncWarning",
    "DFlashTrainingModule",
    "MicroBatchPlan",
    "dflash_collator",
    "per_step_sync_settings",
]

log = logging.getLogger("dflash")

EXPORT_DIRNAME = "dflash-draft"  # the published-format draft inside each Trainer checkpoint folder
_TARGET_PREFIX = "objective.target."  # state_dict keys of the frozen target (never saved)
# Flushed metrics that the Trainer reports itself (grad_norm, learning_rate) or that it does not
# produce (it never skips a non-finite step): left out of the callback's logs.
_NOT_FED = ("grad_norm", "lr", "nonfinite_skips")


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
        from dflash.trainer import resolve_device, resolve_dtype

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

    def _seeded(self, device: torch.device, seed: int) -> torch.Generator:
        # manual_seed is host-side generator state: reseeding makes no device work and no sync.
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        return self._generator.manual_seed(seed)

    def plan(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, BlockTargets]:
        """Anchors `[B, N]`, keep `[B, N]` and targets of the next micro-batch (advances the counter).

        Training: seeded by `(seed, rank, micro_step)`, as `DFlashTrainer` seeds step*accum+index.
        Eval: seeded by `(seed + 1, 0, batch index within the evaluation)`.
        """
        if self.training:
            seed = anchor_seed(self.seed, self.rank, self.micro_step)
            self.micro_step += 1
        else:
            seed = anchor_seed(self.seed + 1, 0, self.eval_batches)
        return self.objective.plan(input_ids, loss_mask, self._seeded(input_ids.device, seed))

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
    from dflash.data import Collator
    from dflash.modeling import allow_compiled_shapes

    collator = Collator.for_tokenizer(tokenizer, config.data)
    allow_compiled_shapes(2 * (collator.num_lengths or 0))
    return collator


# ---- Trainer settings that sync every step ----------------------------------------------------


class DFlashSyncWarning(UserWarning):
    """A Trainer setting adds a host-device sync to every training step."""


def per_step_sync_settings(args: Any, device_type: str | None = None) -> list[str]:
    """Messages, one per `TrainingArguments` setting that makes every step wait for the device.

    `device_type` defaults to `args.device.type`; the pinned / non_blocking checks apply to CUDA
    only (on the CPU there is no copy). Measured on CPU with `forbid_syncs()`
    (tests/test_hf.py), read from the transformers / accelerate source for the CUDA-only ones;
    docs/trainer_integration.md has the table.
    """
    device_type = device_type or args.device.type
    found = []
    if args.logging_nan_inf_filter:
        found.append("logging_nan_inf_filter=True: the Trainer tests every micro-batch loss with "
                     "`torch.isnan(loss) or torch.isinf(loss)` on the host (a device read per micro-batch); "
                     "set logging_nan_inf_filter=False")
    if args.include_num_input_tokens_seen not in ("no", False, None):
        found.append(f"include_num_input_tokens_seen={args.include_num_input_tokens_seen!r}: the Trainer "
                     "adds the token count to state with `.item()` every micro-batch; set it to 'no' "
                     "(DFlashCallback logs supervised tokens at logging steps)")
    if args.torch_empty_cache_steps:
        found.append(f"torch_empty_cache_steps={args.torch_empty_cache_steps}: emptying the CUDA cache "
                     "frees memory with cudaFree, which waits for the device; leave it None")
    if args.fp16 and "fused" not in str(args.optim):
        found.append("fp16=True with a non-fused optimizer: torch's GradScaler reads found_inf with `.item()` "
                     "before every optimizer step; use bf16=True (no scaler) or a fused optimizer")
    if device_type == "cuda":
        non_blocking = bool(getattr(args.accelerator_config, "non_blocking", False))
        if not non_blocking:
            found.append("accelerator_config.non_blocking=False: accelerate copies each batch to the GPU "
                         "with a blocking copy, which waits for the queued work; pass "
                         "accelerator_config={'non_blocking': True} (with dataloader_pin_memory=True)")
        elif not args.dataloader_pin_memory:
            found.append("dataloader_pin_memory=False: a non_blocking copy from pageable memory still "
                         "blocks the host; set dataloader_pin_memory=True")
    return found


# ---- the callback -----------------------------------------------------------------------------


class DFlashCallback(TrainerCallback):
    """DFlash metrics, schedule step and export for a `transformers.Trainer` run.

    * on_train_begin: attaches `Metrics` accumulators to the module, sets its anchor counter from
      `state.global_step` (exact resume), binds a device step tensor to the objective's schedule
      (`bind_schedule(step_t, max_steps)`, e.g. Domino's λ) and warns once per sync-adding setting.
    * on_step_end: `step_t.add_(1)` and a step count, on the device (no host→device copy).
    * on_log: at a training log, one `Metrics.flush()` (the only sync this callback makes) whose
      values go into `logs` as `dflash_*` (per-position accuracy as `dflash_pos_acc_{k}`) and into
      `RUN/metrics.jsonl` in `DFlashTrainer`'s format (`dflash.plot.plot_run` reads it); at an
      evaluation log, the same for the evaluation sums as `{prefix}_dflash_*`.
    * on_save: `export_draft` into `checkpoint-N/dflash-draft` (config.json + bf16 safetensors).

    `logs` reach `state.log_history` and every callback after this one. Reporting integrations
    (TensorBoard, W&B, ...) run *before* user callbacks in the Trainer's list; to have them see the
    DFlash metrics, use `DFlashHFTrainer` or `DFlashCallback.attach(trainer)`, which put this
    callback first.
    """

    def __init__(self, module: DFlashTrainingModule | None = None, *, export: bool = True,
                 write_jsonl: bool = True, per_position_in_logs: bool = True) -> None:
        self.module = module
        self.export, self.write_jsonl, self.per_position_in_logs = export, write_jsonl, per_position_in_logs
        self.step_t: torch.Tensor | None = None  # [] fp32 device step counter bound to the schedule
        self.flushes = 0  # training metric flushes (host counter; tests count them)
        self.eval_flushes = 0
        self.exports: list[Path] = []
        self.placed_first = False
        self._steps_since_flush = 0
        self._window_start = time.perf_counter()
        self._warned: set[str] = set()
        self._reporter: Any = None

    @classmethod
    def attach(cls, trainer: Trainer, module: DFlashTrainingModule | None = None, **kwargs: Any) -> DFlashCallback:
        """Add a DFlashCallback to `trainer` right after DefaultFlowCallback, before the reporting
        integrations, so they log the DFlash metrics too. Returns the callback."""
        callback = cls(module or _unwrap(trainer.model), **kwargs)
        callbacks = trainer.callback_handler.callbacks
        callbacks.insert(min(1, len(callbacks)), callback)
        callback.placed_first = True
        return callback

    def _module(self, model: Any) -> DFlashTrainingModule:
        if self.module is None:
            self.module = _unwrap(model)
        if not isinstance(self.module, DFlashTrainingModule):
            raise TypeError(f"DFlashCallback needs a DFlashTrainingModule as the Trainer's model, got {type(self.module)}")
        return self.module

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(f"DFlashCallback: {message}", DFlashSyncWarning, stacklevel=3)

    # ---- events --------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        module = self._module(model)
        for message in per_step_sync_settings(args):
            self._warn_once(message)
        if args.report_to and args.report_to != ["none"] and not self.placed_first:
            self._warn_once(f"report_to={args.report_to} integrations run before user callbacks and will not see "
                            "the dflash_* metrics; use DFlashHFTrainer or DFlashCallback.attach(trainer)")
        module.rank = args.process_index
        module.micro_step = state.global_step * args.gradient_accumulation_steps
        module.metrics, module.eval_metrics = module.new_metrics(), module.new_metrics()
        module.eval_batches = 0
        bind = getattr(module.objective, "bind_schedule", None)
        if bind is not None:
            # Built on the device by a fill kernel: no host->device copy; then only add_(1) per step.
            self.step_t = torch.zeros((), dtype=torch.float32, device=module.device).fill_(state.global_step)
            bind(self.step_t, state.max_steps)
        if self.write_jsonl and state.is_world_process_zero:
            from dflash.reporting import Reporter

            self._reporter = Reporter(args.output_dir, [], {}, console=False)
        self._steps_since_flush, self._window_start = 0, time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        module = self.module
        if module is None or module.metrics is None:
            return
        module.metrics.add("steps", 1.0)  # Python scalar into a device buffer: no copy, no sync
        if self.step_t is not None:
            self.step_t.add_(1)
        self._steps_since_flush += 1

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        module = self.module
        if module is None or module.metrics is None or logs is None:
            return
        prefix = _eval_prefix(logs)
        if prefix is not None:
            if module.eval_batches and module.eval_metrics is not None:
                values = module.eval_metrics.flush()  # SYNC POINT: an evaluation log
                self.eval_flushes += 1
                module.eval_batches = 0
                self._publish(state, logs, values, f"{prefix}_dflash_", f"{prefix}_")
            return
        if not self._steps_since_flush:
            return
        values = module.metrics.flush()  # SYNC POINT: a logging step (or the end of training)
        self.flushes += 1
        elapsed = time.perf_counter() - self._window_start
        values["supervised_tokens_per_s"] = values["supervised_tokens"] / max(elapsed, 1e-9)
        self._steps_since_flush, self._window_start = 0, time.perf_counter()
        self._publish(state, logs, values, "dflash_", "")

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # An evaluation that was not logged (or had no DFlash batches) must not leak into the next.
        if self.module is not None and self.module.eval_metrics is not None and self.module.eval_batches:
            self.module.eval_metrics.buffer.zero_()
            self.module.eval_batches = 0

    on_predict = on_evaluate

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.export or self.module is None or not state.is_world_process_zero:
            return
        from dflash.export import export_draft

        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}" / EXPORT_DIRNAME
        self.exports.append(export_draft(self.module.draft, folder))  # SYNC POINT: a checkpoint

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._reporter is not None:
            self._reporter.close()
            self._reporter = None

    # ---- output --------------------------------------------------------------------------------

    def _publish(self, state: Any, logs: dict[str, Any], values: dict[str, Any], log_prefix: str,
                 jsonl_prefix: str) -> None:
        """Put flushed `values` into `logs` (+ the log_history entry the Trainer already appended)
        and into metrics.jsonl (unprefixed names, as DFlashTrainer writes them)."""
        scalars = {f"{log_prefix}{k}": v for k, v in values.items()
                   if k not in _NOT_FED and isinstance(v, (int, float))}
        if self.per_position_in_logs:
            for i, v in enumerate(values.get("per_position_accuracy", [])):
                scalars[f"{log_prefix}pos_acc_{i + 1}"] = v
        logs.update(scalars)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(scalars)
        if self._reporter is not None:
            kept = {f"{jsonl_prefix}{k}": v for k, v in values.items() if k not in _NOT_FED}
            if not jsonl_prefix:  # the Trainer's own step metrics, for the same plots
                kept.update({k: logs[k] for k in ("grad_norm", "learning_rate") if k in logs})
            self._reporter.log(state.global_step, kept, state.max_steps)


def _eval_prefix(logs: dict[str, Any]) -> str | None:
    """`eval` for an evaluation log (`eval_runtime` present; `test` for predict-style prefixes),
    None for a training log. The final training summary has `train_runtime`, which is not eval."""
    for key in logs:
        if key.endswith("_runtime") and key != "train_runtime":
            return key[: -len("_runtime")]
    return None


def _unwrap(model: Any) -> Any:
    """The module inside DDP / accelerate wrappers."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


# ---- exact global token mean ------------------------------------------------------------------


class DFlashHFTrainer(Trainer):
    """`transformers.Trainer` whose loss is DFlash's exact global token mean over the accumulation
    window and all ranks (module docstring), with a `DFlashCallback` placed before the reporting
    integrations (one is created if none was passed). Everything else is the stock Trainer.
    """

    # The loss of each micro-batch is already its share of the global mean: do not divide by the
    # accumulation steps (Trainer 5.x's documented switch for models that normalize themselves).
    loss_is_scaled_for_ga = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        module = _unwrap(self.model)
        if not isinstance(module, DFlashTrainingModule):
            raise TypeError(f"DFlashHFTrainer needs model=DFlashTrainingModule(...), got {type(module)}")
        callbacks = self.callback_handler.callbacks
        existing = [cb for cb in callbacks if isinstance(cb, DFlashCallback)]
        for cb in existing:
            callbacks.remove(cb)
        callback = existing[0] if existing else DFlashCallback(module)
        callbacks.insert(min(1, len(callbacks)), callback)
        callback.placed_first = True
        self.dflash_callback = callback

    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int,
                          device: torch.device) -> tuple[list[Any], torch.Tensor | int | None]:
        """The window's micro-batches, each with a `dflash_plan`; `num_items_in_batch` stays None.

        Sync-free: anchors and weights are device ops, the rank sum is a collective.
        """
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batches:
            return batches, None
        module = _unwrap(self.model)
        module.train()  # plan() seeds by the training counter
        plans = []
        for batch in batches:
            ids = batch["input_ids"].to(device, non_blocking=True)  # already there: a no-op
            mask = batch["loss_mask"].to(device, non_blocking=True)
            plans.append(module.plan(ids, mask))
        total = torch.stack([t.weights.sum() for _, _, t in plans]).sum()
        world = self.accelerator.num_processes
        if world > 1:
            total = self.accelerator.reduce(total, reduction="sum")
        # DDP averages gradients over ranks: scale by the world size so the average is the global mean.
        scale = world / total.clamp(min=1e-6)
        for batch, (anchors, keep, targets) in zip(batches, plans, strict=True):
            batch["dflash_plan"] = MicroBatchPlan(anchors, keep, targets, scale)
        return batches, None


class SyncProbe(TrainerCallback):
    """Test / measurement helper: runs every non-log, non-save, non-eval stretch of training inside
    `forbid_syncs(raise_on_first=False)` and collects the findings.

    The region opens at `on_step_begin` and stays open across steps; it closes at `on_step_end`
    when the Trainer is about to log, evaluate or save (those are sync points by design) and
    reopens at the next `on_step_begin`. So it covers the forward/backward of every micro-batch,
    the Trainer's per-micro-batch bookkeeping, clipping, the optimizer and scheduler steps, every
    callback's `on_step_end`, and the data loading between two non-log steps. Add it after
    `DFlashCallback` (the Trainer's DefaultFlowCallback, which sets should_log, runs first).
    """

    def __init__(self) -> None:
        self.findings: list[Any] = []
        self.steps_watched = 0
        self._stack: ExitStack | None = None
        self._report: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._stack is None:
            from dflash.syncs import forbid_syncs

            self._stack = ExitStack()
            self._report = self._stack.enter_context(forbid_syncs(raise_on_first=False))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps_watched += self._stack is not None
        if control.should_log or control.should_save or control.should_evaluate or control.should_training_stop:
            self.close()

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self.findings.extend(self._report.findings)
            self._stack = self._report = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()
