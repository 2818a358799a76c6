"""`DFlashCallback`: DFlash's sync-free metrics, schedules and published-format exports on the
`transformers.Trainer` path (`dflash.hf.trainer` explains how the pieces fit)."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from dflash.diagnostics import DFlashSyncWarning, per_step_sync_settings
from dflash.evaluation.export import export_draft
from dflash.hf.module import DFlashTrainingModule, check_config_against_args, unwrap_model
from dflash.metrics import UPDATE_ONLY
from dflash.report.sinks import Reporter

EXPORT_DIRNAME = "dflash-draft"  # the published-format draft inside each Trainer checkpoint folder


class DFlashCallback(TrainerCallback):
    """DFlash metrics, schedule step and export for a `transformers.Trainer` run.

    * on_train_begin: refuses a module TrainConfig that contradicts TrainingArguments (`config_conflicts`),
      attaches `Metrics` accumulators to the module, sets its anchor counter from `state.global_step`
      and its anchor seed from `args.seed` (exact resume), binds a device step tensor to the objective's
      schedule (`bind_schedule(step_t, max_steps)`, e.g. Domino's λ) and warns once per sync-adding setting.
    * on_step_end: `step_t.add_(1)` and a step count, on the device (no host→device copy).
    * on_log: at a training log, one `Metrics.flush()` (the only sync this callback makes) whose
      values go into `logs` as `dflash_*` (per-position accuracy as `dflash_pos_acc_{k}`) and into
      `RUN/metrics.jsonl` in `DFlashTrainer`'s format (`dflash.report.plot.plot_run` reads it); at an
      evaluation log, the same for the evaluation sums as `{prefix}_dflash_*`.
    * on_save: `export_draft` into `checkpoint-N/dflash-draft` (config.json + bf16 safetensors); off
      under `DFlashHFTrainer`, whose checkpoint folders are themselves that format.

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
        callback = cls(module or unwrap_model(trainer.model), **kwargs)
        callbacks = trainer.callback_handler.callbacks
        callbacks.insert(min(1, len(callbacks)), callback)
        callback.placed_first = True
        return callback

    def _module(self, model: Any) -> DFlashTrainingModule:
        if self.module is None:
            self.module = unwrap_model(model)
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
        check_config_against_args(module, args)
        for message in per_step_sync_settings(args):
            self._warn_once(message)
        if args.report_to and args.report_to != ["none"] and not self.placed_first:
            self._warn_once(f"report_to={args.report_to} integrations run before user callbacks and will not see "
                            "the dflash_* metrics; use DFlashHFTrainer or DFlashCallback.attach(trainer)")
        module.rank = args.process_index
        module.micro_step = state.global_step * args.gradient_accumulation_steps
        module.metrics, module.eval_metrics = module.new_metrics(), module.new_metrics()
        module.eval_batches = 0
        # Built on the device by a fill kernel: no host->device copy; then only add_(1) per step.
        self.step_t = torch.zeros((), dtype=torch.float32, device=module.device).fill_(state.global_step)
        module.objective.bind_schedule(self.step_t, state.max_steps)  # a no-op for DFlash's unscheduled loss
        if self.write_jsonl and state.is_world_process_zero:
            # Resumed (or restarted) at `global_step`: what metrics.jsonl holds past it is logged again, so
            # it is dropped first (kept in a backup), as DFlashTrainer does: every step recorded once.
            self._reporter = Reporter(args.output_dir, [], {}, console=False, resumed={"step": state.global_step})
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
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}" / EXPORT_DIRNAME
        self.exports.append(export_draft(self.module.draft, folder, target=self.module.target_name))  # SYNC POINT

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
                   if k not in UPDATE_ONLY and isinstance(v, (int, float))}
        if self.per_position_in_logs:
            for i, v in enumerate(values.get("per_position_accuracy", [])):
                scalars[f"{log_prefix}pos_acc_{i + 1}"] = v
        logs.update(scalars)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(scalars)
        if self._reporter is not None:
            kept = {f"{jsonl_prefix}{k}": v for k, v in values.items() if k not in UPDATE_ONLY}
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
