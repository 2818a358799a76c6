"""The held-out peak (`dflash.run.overfitting`): a run past its held-out chain τ̂ peak is warned once, and
its summary keeps the peak."""

from __future__ import annotations

import logging

import pytest
from test_reliability import fresh_trainer, run_config, tokenized_rows

from dflash.run.overfitting import PATIENCE, HeldOutPeak

# Held-out chain τ̂ every 500 steps of the GPU preset's 9000-step run (docs/benchmarks.md, 2026-12-04 evening):
# the peak at step 3500, then below it by more than 1% from step 4000 on.
NINE_THOUSAND = [2.404, 3.024, 3.241, 3.401, 3.508, 3.586, 3.643, 3.558, 3.513, 3.507, 3.501, 3.509, 3.508, 3.445,
                 3.421, 3.411, 3.421, 3.424]
# The 3000-step Muon run of the same evening: flat within 1% of its peak at the end, no warning.
THREE_THOUSAND = [2.993, 3.466, 3.561, 3.638, 3.652, 3.646]


def feed(peak: HeldOutPeak, values: list[float], every: int = 500) -> list[tuple[int, str]]:
    return [(step, w) for step, v in zip(range(every, every * (len(values) + 1), every), values, strict=True)
            if (w := peak.see(step, v)) is not None]


def test_the_nine_thousand_step_run_is_warned_once_three_evaluations_past_its_peak():
    peak = HeldOutPeak(32, warn=False, train_rows=10_396)
    warnings = feed(peak, NINE_THOUSAND)
    assert [step for step, _ in warnings] == [5000]  # 4000, 4500, 5000 below 3.643 by more than 1%; once
    message = warnings[0][1]
    assert "3.507 at step 5000 (epoch 15.4)" in message and "3.643 at step 3500 (epoch 10.8)" in message
    assert "max_steps=3500" in message and "data.standalone_turns" in message
    assert peak.summary() == {"peak_step": 3500, "peak_chain_tau": 3.643, "last_step": 9000, "last_chain_tau": 3.424,
                              "epochs": 27.7, "past_peak_warning": True}


@pytest.mark.parametrize("values", [THREE_THOUSAND, [3.0, 2.9, 2.9, 2.98, 2.9, 2.9, 2.995, 2.9]])
def test_a_flat_end_or_a_dip_that_comes_back_is_not_warned(values):
    """Within 1% of the peak resets the count: noise around a plateau is not a decline."""
    peak = HeldOutPeak(1, warn=False, train_rows=100)
    assert feed(peak, values) == []
    assert not peak.summary()["past_peak_warning"]


def test_an_evaluation_repeated_at_the_same_step_counts_once():
    """`fit` evaluates again at the end: at an eval_interval step that is the same weights twice."""
    peak = HeldOutPeak(1, warn=False, train_rows=100)
    peak.see(1, 3.0)
    for step in range(2, PATIENCE + 1):  # PATIENCE - 1 evaluations below the peak
        peak.see(step, 2.0)
        peak.see(step, 2.0)
    assert peak.below == PATIENCE - 1


def test_fit_warns_and_summarizes_the_peak(tmp_path, monkeypatch, caplog):
    """Wired into `fit`: every interval's held-out evaluation reaches the peak, and the end of the run reuses step
    6's; epochs come from the corpus (6 steps of 4 rows over 24 training rows: 1.0)."""
    trainer = fresh_trainer(run_config(tmp_path / "run", eval_interval=1),
                            dataset=(tokenized_rows(24), tokenized_rows(8, seed=1)))
    scripted = iter([2.0, 3.0, 2.9, 2.8, 2.7, 2.6])  # steps 1..6; the end takes step 6's, not a 7th evaluation
    monkeypatch.setattr(trainer, "evaluate", lambda dataset, **kw: {"loss": 1.0, "chain_tau": next(scripted)})
    with caplog.at_level(logging.WARNING, logger="dflash"):
        summary = trainer.fit()
    warned = [r.getMessage() for r in caplog.records if "below its peak" in r.getMessage()]
    assert len(warned) == 1 and "2.700 at step 5 (epoch 0.8)" in warned[0] and "max_steps=2" in warned[0]
    assert summary["held_out_peak"] == {"peak_step": 2, "peak_chain_tau": 3.0, "last_step": 6, "last_chain_tau": 2.6,
                                        "epochs": 1.0, "past_peak_warning": True}
    assert next(scripted, None) is None and summary["held_out"]["chain_tau"] == 2.6  # all six taken, no seventh
