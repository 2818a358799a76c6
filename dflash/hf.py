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

from collections.abc import Iterator
from typing import Any

import torch
from transformers import Trainer

from dflash.hf_callback import EXPORT_DIRNAME, DFlashCallback
from dflash.hf_module import DFlashModelOutput, DFlashTrainingModule, MicroBatchPlan, dflash_collator, unwrap_model
from dflash.losses import window_loss_scale

__all__ = [
    "EXPORT_DIRNAME",
    "DFlashCallback",
    "DFlashHFTrainer",
    "DFlashModelOutput",
    "DFlashTrainingModule",
    "MicroBatchPlan",
    "dflash_collator",
]

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
        module = unwrap_model(self.model)
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
        module = unwrap_model(self.model)
        module.train()  # plan() seeds by the training counter
        plans = []
        for batch in batches:
            ids = batch["input_ids"].to(device, non_blocking=True)  # already there: a no-op
            mask = batch["loss_mask"].to(device, non_blocking=True)
            plans.append(module.plan(ids, mask))
        scale, _ = window_loss_scale([t for _, _, t in plans], self.accelerator.num_processes)
        for batch, (anchors, keep, targets) in zip(batches, plans, strict=True):
            batch["dflash_plan"] = MicroBatchPlan(anchors, keep, targets, scale)
        return batches, None
