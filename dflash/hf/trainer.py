"""`transformers.Trainer` integration: the DFlash objective as a Trainer model, and a callback.

    module = DFlashTrainingModule.from_config(config, target_model, tokenizer)   # frozen target + draft
    trainer = transformers.Trainer(model=module, args=args, train_dataset=rows,
                                   data_collator=dflash_collator(tokenizer, config),
                                   callbacks=[DFlashCallback(module)])
    trainer.train()

* `DFlashTrainingModule.forward(input_ids, loss_mask)` returns a `DFlashModelOutput` with `loss`,
  so the Trainer's own loop (accumulation, clipping, optimizer, scheduler, checkpoints) runs it.
  Only draft parameters require grad (the Trainer's optimizer takes exactly those) and only draft
  weights are in `state_dict()` (what a plain Trainer's checkpoint holds).
* `DFlashCallback` keeps the DFlash metrics as device sums (`dflash.metrics.Metrics`) and adds them
  to `logs` at logging steps only (one flush per log, never per step), drives an on-device step
  counter for schedules (Domino λ), exports the draft in the published format at every save, and
  warns once per Trainer setting that adds a host-device sync to every step.
* `DFlashHFTrainer` is `transformers.Trainer` with the exact global token mean over gradient
  accumulation (the loss `dflash.trainer.DFlashTrainer` optimizes; "Loss normalization" below), and
  with servable saves: `save_model()`, `push_to_hub()` and every checkpoint write the published format
  (`config.json` + bf16 `model.safetensors`, the bytes `dflash export` writes) instead of the module's
  fp32 `objective.draft.*` state dict; a checkpoint also keeps the draft in its training dtype
  (`TRAINER_DRAFT_NAME`), which resuming loads, so a resumed run continues exactly.
* TrainingArguments runs the optimizer, schedule, steps, batch, seed and device; a TrainConfig that sets
  one of those to something else is refused (`config_conflicts`), not silently ignored.

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

import json
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import Trainer

from dflash.evaluation.export import CONFIG_NAME, TRAINER_DRAFT_NAME, TRAINER_PREFIX, export_state, load_exported
from dflash.hf.callback import EXPORT_DIRNAME, DFlashCallback
from dflash.hf.module import (
    DFlashModelOutput,
    DFlashTrainingModule,
    MicroBatchPlan,
    check_config_against_args,
    config_conflicts,
    dflash_collator,
    unwrap_model,
)
from dflash.losses import window_loss_scale

__all__ = [
    "EXPORT_DIRNAME",
    "TRAINER_DRAFT_NAME",
    "DFlashCallback",
    "DFlashHFTrainer",
    "DFlashModelOutput",
    "DFlashTrainingModule",
    "MicroBatchPlan",
    "config_conflicts",
    "dflash_collator",
]
log = logging.getLogger(__name__)

# ---- the Trainer: exact global token mean, servable saves ------------------------------------------


class DFlashHFTrainer(Trainer):
    """`transformers.Trainer` whose loss is DFlash's exact global token mean over the accumulation
    window and all ranks (module docstring), with a `DFlashCallback` placed before the reporting
    integrations (one is created if none was passed), and whose saves are servable drafts: `_save`
    writes the published format (plus the training-dtype draft in checkpoints), and resuming or
    `load_best_model_at_end` reads that draft back. Everything else is the stock Trainer.
    """

    # The loss of each micro-batch is already its share of the global mean: do not divide by the
    # accumulation steps (Trainer 5.x's documented switch for models that normalize themselves).
    loss_is_scaled_for_ga = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        module = unwrap_model(self.model)
        if not isinstance(module, DFlashTrainingModule):
            raise TypeError(f"DFlashHFTrainer needs model=DFlashTrainingModule(...), got {type(module)}")
        check_config_against_args(module, self.args)  # before anything runs: two configs must not disagree
        callbacks = self.callback_handler.callbacks
        existing = [cb for cb in callbacks if isinstance(cb, DFlashCallback)]
        for cb in existing:
            callbacks.remove(cb)
        callback = existing[0] if existing else DFlashCallback(module)
        callbacks.insert(min(1, len(callbacks)), callback)
        callback.placed_first = True
        callback.export = False  # every checkpoint folder is itself the published draft (`_save`)
        self.dflash_callback = callback
        self._checkpointing = False

    # ---- saves: the published draft format ------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self._checkpointing = True  # `_save` then also keeps the training-dtype draft, for an exact resume
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._checkpointing = False

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """What `save_model` (and so `push_to_hub` and every checkpoint) writes: `config.json` and bf16
        `model.safetensors` of the draft, exactly `dflash export`'s files; in a checkpoint also
        `TRAINER_DRAFT_NAME` (the draft in its training dtype); the tokenizer and training arguments as the
        stock Trainer does. `state_dict` (FSDP / DeepSpeed gathers) is the module's, `objective.draft.*`."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        module = unwrap_model(self.model)
        if state_dict is None:
            weights = module.draft.state_dict()
        else:
            weights = {k[len(TRAINER_PREFIX):]: v for k, v in state_dict.items() if k.startswith(TRAINER_PREFIX)}
        os.makedirs(output_dir, exist_ok=True)
        export_state(module.draft.config, weights, output_dir, target=module.target_name)
        if self._checkpointing:
            save_file({k: v.detach().to("cpu").contiguous() for k, v in weights.items()},
                      os.path.join(output_dir, TRAINER_DRAFT_NAME), metadata={"format": "pt"})
        log.info("saved the DFlash draft (published format) to %s", output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Resume: the draft of a checkpoint this class wrote (exact: its training-dtype weights). A folder
        with the published files only (a `save_model` output) loads its bf16 weights, with a warning; other
        checkpoints (the module's `objective.draft.*` state dict) go through the stock loader."""
        if self.is_fsdp_enabled or self.is_deepspeed_enabled or not _load_draft(
                unwrap_model(model if model is not None else self.model), Path(resume_from_checkpoint)):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if self.is_fsdp_enabled or self.is_deepspeed_enabled or best is None or not _load_draft(
                unwrap_model(self.model), Path(best)):
            super()._load_best_model()

    # ---- the exact global mean --------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int,
                          device: torch.device) -> tuple[list[Any], torch.Tensor | int | None]:
        """The window's micro-batches, each with a `dflash_plan`; `num_items_in_batch` stays None.

        Sync-free: anchors and weights are device ops, the rank sum is a collective.
        """
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batches:
            return batches, None
        module = unwrap_model(self.model)
        module.train()  # plan() seeds by the training counter
        plans = []
        for batch in batches:
            ids = batch["input_ids"].to(device, non_blocking=True)  # already there: a no-op
            mask = batch["loss_mask"].to(device, non_blocking=True)
            positions = batch.get("position_ids")  # packed rows (data.packing)
            positions = None if positions is None else positions.to(device, non_blocking=True)
            plans.append(module.plan(ids, mask, position_ids=positions))
        scale, _ = window_loss_scale([t for _, _, t in plans], self.accelerator.num_processes)
        for batch, (anchors, keep, targets) in zip(batches, plans, strict=True):
            batch["dflash_plan"] = MicroBatchPlan(anchors, keep, targets, scale)
        return batches, None


def _load_draft(module: DFlashTrainingModule, folder: Path) -> bool:
    """Load the draft of a `DFlashHFTrainer` save in `folder` into `module`; False when `folder` holds none."""
    side = folder / TRAINER_DRAFT_NAME
    if side.is_file():
        module.draft.load_state_dict(load_file(str(side)), strict=True)
        return True
    config = folder / CONFIG_NAME
    if config.is_file() and "dflash_config" in json.loads(config.read_text()):
        warnings.warn(f"{folder} holds the bf16 published draft only (no {TRAINER_DRAFT_NAME}): the resumed weights "
                      "are rounded to bf16, so the run does not continue exactly", stacklevel=3)
        exported = load_exported(folder, device=module.device, dtype=next(module.draft.parameters()).dtype)
        module.draft.load_state_dict(exported.state_dict(), strict=True)
        return True
    return False
