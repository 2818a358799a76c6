"""`transformers.Trainer` integration (`trainer`: `DFlashHFTrainer`; `module`: the objective as a Trainer
model; `callback`: metrics, schedule and export). The top of the stack beside the CLI: nothing below
imports it.

`from dflash.hf import DFlashHFTrainer, ...` is the public path (docs/trainer_integration.md)."""

from dflash.hf.trainer import (
    EXPORT_DIRNAME,
    TRAINER_DRAFT_NAME,
    DFlashCallback,
    DFlashHFTrainer,
    DFlashModelOutput,
    DFlashTrainingModule,
    MicroBatchPlan,
    config_conflicts,
    dflash_collator,
)

__all__ = ["EXPORT_DIRNAME", "TRAINER_DRAFT_NAME", "DFlashCallback", "DFlashHFTrainer", "DFlashModelOutput",
           "DFlashTrainingModule", "MicroBatchPlan", "config_conflicts", "dflash_collator"]
