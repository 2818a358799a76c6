"""How a run is asked to stop early: signals turned into a flag, and the non-finite stop."""

from __future__ import annotations

import signal
import threading
from typing import Any


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer updates were skipped for non-finite values."""

    def __init__(self, skipped: int, limit: int, step: int, saved: Any) -> None:
        super().__init__(f"{skipped} consecutive optimizer updates were skipped for non-finite loss or gradients "
                         f"(max_nonfinite_skips={limit}) at step {step}; the last finite weights are saved in "
                         f"{saved}. Check the data and the learning rate.")


class StopRequest:
    """Turns SIGTERM / SIGINT into a flag the loop checks between steps (main thread only), so the
    current step finishes and the run saves before it exits."""

    def __init__(self) -> None:
        self.requested, self.signal, self._previous = False, None, {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested, self.signal = True, signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
