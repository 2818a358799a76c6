"""Invariant 1 on CPU: consecutive training steps run inside forbid_syncs() with zero findings."""

from __future__ import annotations

import pytest
from helpers import DFLASH2_HEAD, make_tiny_target, random_batch, tiny_config

from dflash.diagnostics import SyncError, forbid_syncs
from dflash.kinds.registry import kind_named
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


def _dflash2_metrics(m: dict) -> bool:
    return 0 < m["candidate_recall"] <= 1 and m["selector_loss"] > 0 and {
        "base_tau", "base_accuracy", "selector_accuracy", "tau"} <= set(m)


def _dspark_metrics(m: dict) -> bool:
    return m["dspark_loss"] > 0 and m["l1_loss"] > 0 and m["confidence_loss"] > 0 and {
        "base_tau", "base_accuracy", "mean_confidence", "mean_acceptance", "tau"} <= set(m)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("head, metrics_ok", [(DFLASH2_HEAD, _dflash2_metrics),
                                              ({"draft__kind": "dspark", "dspark__markov_rank": 8}, _dspark_metrics)],
                         ids=["dflash2", "dspark"])
def test_the_newer_kinds_steps_make_no_sync(head, metrics_ok, compiled):
    """DFlash 2 (top-K, gold insertion) and DSpark (Markov head, chunked L1, confidence BCE), eager and compiled."""
    trainer = DFlashTrainer(tiny_config(**head, optim__grad_accum=2, compile=compiled), target=make_tiny_target())
    assert type(trainer.objective) is kind_named(head["draft__kind"]).objective
    batch = random_batch(batch=4)
    trainer.train_step(batch)  # compiles outside the region (the first step builds the graphs)
    with forbid_syncs(raise_on_first=False) as report:
        for _ in range(3):
            trainer.train_step(batch)
    assert report.findings == [], report
    metrics = trainer.metrics.flush()
    assert metrics_ok(metrics), metrics


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
