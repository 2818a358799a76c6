"""`SyncProbe`: a `transformers.TrainerCallback` that runs a Trainer's non-log steps under `forbid_syncs()`.

    probe = SyncProbe()
    trainer = Trainer(..., callbacks=[DFlashCallback(module), probe])
    trainer.train()
    assert probe.findings == [], "\n".join(map(str, probe.findings))
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from transformers import TrainerCallback

from dflash.diagnostics.syncs import Finding, SyncReport, forbid_syncs

__all__ = ["SyncProbe"]


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
        self.findings: list[Finding] = []
        self.steps_watched = 0
        self._stack: ExitStack | None = None
        self._report: SyncReport | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._stack is None:
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
