"""Invariant 1 on CPU: consecutive training steps run inside forbid_syncs() with zero findings."""

from __future__ import annotations

import pytest

from conftest import make_tiny_target, random_batch, tiny_config
from dflash.diagnostics import SyncError, forbid_syncs
from dflash.trainer import DFlashTrainer


def test_five_steps_with_grad_accumulation_make_no_sync():
    trainer = DFlashTrainer(tiny_config(optim__grad_accum=2), target=make_tiny_target(), tokenizer=None)
    batch = random_batch(batch=4)
    with forbid_syncs(raise_on_first=False) as report:
        for _ in range(5):
            trainer.train_step(batch)
    assert report.findings == [], report
    assert trainer.step == 5
    metrics = trainer.metrics.flush()  # the log flush is the sync point, outside the region
    assert metrics["loss"] > 0 and metrics["accuracy"] >= 0


def test_a_planted_sync_in_the_step_is_caught(monkeypatch):
    trainer = DFlashTrainer(tiny_config(), target=make_tiny_target(), tokenizer=None)
    original = trainer.objective.forward

    def leaky(*args, **kwargs):
        out = original(*args, **kwargs)
        out.loss_sum.item()  # what a per-step log line would do
        return out

    monkeypatch.setattr(trainer.objective, "forward", leaky)
    with pytest.raises(SyncError, match="_local_scalar_dense"), forbid_syncs():
        trainer.train_step(random_batch())
