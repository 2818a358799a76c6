"""The held-out peak: a run that trains on after its held-out chain τ̂ peaked is told so, once.

More steps over a small corpus memorize it. On the GPU preset a 9000-step run (28 epochs of 10,396 rows)
peaked in held-out chain τ̂ at step 3500 and ended 6% below that peak and below the 3000-step preset in real
τ, while its training τ climbed to 13.9 (docs/benchmarks.md, 2026-12-04 evening). Nothing here stops a run:
the schedule is the user's, and the lr still decaying may lift the end. The warning names the peak, the
epochs and the two fixes; the run's summary keeps the peak. It reads only the evaluation's host values, so
it adds no sync.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("dflash")

PATIENCE = 3  # evaluations in a row below the peak: one noisy dip is not a trend
# Relative: a flat run's chain τ̂ spreads about 1% over its evaluations (the 9000-step run's last five:
# 3.445 3.421 3.411 3.421 3.424), its decline from the peak was 2.3% at the first evaluation after it.
TOLERANCE = 0.01


@dataclass
class HeldOutPeak:
    """The best held-out chain τ̂ so far and how many evaluations in a row have stayed below it.

    `rows_per_step`: training rows one optimizer step takes (all ranks); `train_rows`: the training set's rows
    (set once the corpus is known; with `data.packing` both count packed sequences), together the epochs the
    warning names. `warn`: log it (rank 0).
    """

    rows_per_step: int
    warn: bool = True
    train_rows: int = 0
    best: float = -math.inf
    best_step: int = 0
    last: float = math.nan
    last_step: int = -1
    below: int = 0
    warned: bool = False

    def see(self, step: int, chain_tau: float) -> str | None:
        """Record one evaluation at `step`; the warning the first time the chain τ̂ has stayed more than
        `TOLERANCE` below its best for `PATIENCE` evaluations in a row, else None. A second evaluation of
        the same step (the same weights) counts once."""
        if step == self.last_step:
            return None
        self.last, self.last_step = chain_tau, step
        if chain_tau > self.best:
            self.best, self.best_step, self.below = chain_tau, step, 0
            return None
        self.below = self.below + 1 if chain_tau < self.best * (1 - TOLERANCE) else 0
        if self.below < PATIENCE or self.warned:
            return None
        self.warned = True
        message = (f"held-out chain tau has stayed below its peak for {self.below} evaluations: {chain_tau:.3f} at "
                   f"step {step} (epoch {self.epochs(step):.1f}) against {self.best:.3f} at step {self.best_step} "
                   f"(epoch {self.epochs(self.best_step):.1f}). The draft is memorizing its training rows: stop near "
                   f"the peak (max_steps={self.best_step}) or train on more distinct rows (data.standalone_turns, "
                   "data.limit, another data.source)")
        if self.warn:
            log.warning(message)
        return message

    def epochs(self, step: int) -> float:
        """Passes over the training rows after `step` optimizer steps."""
        return step * self.rows_per_step / max(self.train_rows, 1)

    def summary(self) -> dict[str, Any]:
        """The run summary's `held_out_peak`: the peak, the last evaluation and whether the warning fired."""
        return {"peak_step": self.best_step, "peak_chain_tau": self.best, "last_step": self.last_step,
                "last_chain_tau": self.last, "epochs": round(self.epochs(self.last_step), 2),
                "past_peak_warning": self.warned}
