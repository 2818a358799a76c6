"""How long a run took, phase by phase: RUN/summary.json's `wall_seconds`, `phases` and `dflash_version`.

The README's timings used to be read off log timestamps by hand; a run now records its own. `fit` gets a
`PhaseTimer` when it starts (`dflash.report.console.start_of_run`), times its phases through it and hands it to
`dflash.report.sinks.write_summary`. The phases, in seconds of host wall clock, each present when it ran:

- `data_preparation`: `training_data(...)`: the source read, the target's replies regenerated (or read from their
  cache), tokenized and split.
- `first_step`: this launch's first optimizer step, compilation (`compile: true`) and CUDA-graph capture included:
  what a cold start costs over a warm one.
- `training`: the training loop, its first step, evaluations and checkpoints at their intervals included.
- `held_out_eval`, `export`, `speculative_eval`: the end-of-run work.

`wall_seconds` runs from the start of `fit` to the summary, so it covers what no phase names (claiming the folder,
loading a resumed checkpoint, the last save); the target's loading, before `fit`, is not in it. No device sync is
added: a phase ends when its host work does, and the syncs the phases make anyway (the log flush, the evaluation,
the save) keep that close to the device's time; on a GPU `first_step` is the host's part (compilation dominates).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from dflash.version import __version__

T = TypeVar("T")


def dflash_version() -> str:
    """The installed dflash's version (its package metadata), else the source tree's `dflash.__version__`."""
    try:
        return version("dflash")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return __version__


class PhaseTimer:
    """Named wall-clock durations from one start. `with timer("name"):` adds the block's seconds to that phase
    (a phase entered twice sums them; one left by an exception still counts); `timed` and `first` time a call.
    `record()` is what RUN/summary.json gets."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.started = clock()
        self.seconds: dict[str, float] = {}  # in the order the phases first ran

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + self.clock() - start

    def timed(self, name: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)`, its seconds added to phase `name` (a hook that costs no line of its caller)."""
        with self(name):
            return fn(*args, **kwargs)

    def first(self, name: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)`, timed as phase `name` the first time only (the first step: compilation)."""
        if name in self.seconds:
            return fn(*args, **kwargs)
        return self.timed(name, fn, *args, **kwargs)

    def record(self) -> dict[str, Any]:
        """`dflash_version`, `wall_seconds` since the start and `phases` {name: seconds}, to the millisecond."""
        return {"dflash_version": dflash_version(), "wall_seconds": round(self.clock() - self.started, 3),
                "phases": {name: round(seconds, 3) for name, seconds in self.seconds.items()}}


def format_phases(record: dict[str, Any]) -> str:
    """`record()` as one line: "73.2 s wall: data_preparation 4.1 s, first_step 2.0 s, training 60.3 s, ..."."""
    parts = [f"{name} {seconds:,.1f} s" for name, seconds in (record.get("phases") or {}).items()]
    return f"{record['wall_seconds']:,.1f} s wall" + (f": {', '.join(parts)}" if parts else "")
