"""How a run is asked to stop early: signals and the time budget turned into a decision between steps,
the non-finite stop, and the exit codes that tell a scheduler which of them ended a run (README).

Signals. SIGTERM / SIGINT set a flag; the loop finishes its step, saves, and `dflash train` exits with
128 + the signal number (143 for SIGTERM, 130 for SIGINT): "interrupted, checkpoint saved, resume me".
DataLoader workers ignore both (`dflash.data.loader.make_dataloader`), so a signal sent to the whole process
group (`scancel`, preemption, `systemctl stop`, Ctrl-C) reaches the main process alone in effect.

Epochs. `num_epochs` becomes a step count once the training set's size is known (`apply_num_epochs`, called by
`fit`): `config.max_steps` is set to it, so the loop, the logs and the lr and Domino schedules all end there.

Non-finite stop. The consecutive-skip counter lives on the device. With one process, `NonFiniteWatch`
copies it to the host after each step without waiting (CPU: a host read; CUDA: an asynchronous 4-byte
copy into pinned memory, read once its event reports it landed), so the run stops at the step that
reaches `max_nonfinite_skips` on the CPU and, on a GPU, as soon as that step's copy has landed (the
host runs ahead of the device by the queue's depth, typically a step or two) -- and never later than
the next log flush. With several processes the decision is taken at the log flush, from the all-reduced
metrics, so that every rank stops at the same step (a per-rank lagged read could differ between ranks
and leave one waiting in a collective). Skipped updates leave the weights and AdamW state as they were,
so the checkpoint written at the stop holds the last finite state whichever step it is.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from dflash.config import TrainConfig
from dflash.optim import lr_at

log = logging.getLogger("dflash")

# `dflash train` exit codes (README, "Exit codes"); an interrupted run exits with 128 + the signal number.
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_WRITE = 0, 1, 2, 3, 4


def interrupted_exit_code(signal_name: str | None) -> int:
    """128 + the signal's number (143 for SIGTERM, 130 for SIGINT), the shell's code for a signalled process."""
    return 128 + signal.Signals[signal_name or "SIGTERM"].value


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer updates were skipped for non-finite values."""

    def __init__(self, skipped: int, limit: int, step: int, saved: Any) -> None:
        super().__init__(f"{skipped} consecutive optimizer updates were skipped for non-finite loss or gradients "
                         f"(max_nonfinite_skips={limit}) at step {step}; the last finite weights are saved in "
                         f"{saved}. Check the data and the learning rate.")


class NonFiniteWatch:
    """The host's view of the device's consecutive-skip counter (`tripped` once it reaches `limit`).
    `poll()` after every step (one process); `see(value)` with a flushed window's maximum (any mode)."""

    def __init__(self, counter: torch.Tensor, limit: int, *, every_step: bool) -> None:
        self.counter, self.limit, self.value = counter, limit, 0.0
        self.every_step = every_step and counter.device.type in ("cpu", "cuda")
        self._copy: torch.Tensor | None = None
        self._event: Any = None
        self._pending = False
        if self.every_step and counter.device.type == "cuda":
            self._copy = torch.zeros((), dtype=counter.dtype, pin_memory=True)
            self._event = torch.cuda.Event()

    @property
    def tripped(self) -> bool:
        return self.value >= self.limit

    def see(self, value: float) -> None:
        self.value = max(self.value, float(value))

    def poll(self) -> None:
        """Read the latest landed copy of the counter and start the next one; never waits on the device."""
        if not self.every_step:
            return
        if self._copy is None:  # CPU: the counter is host memory already
            self.see(self.counter.item())
            return
        if self._pending and self._event.query():  # the copy started after an earlier step has landed
            self.see(self._copy.item())  # pinned host memory: no device read
            self._pending = False
        if not self._pending:
            self._copy.copy_(self.counter, non_blocking=True)
            self._event.record()
            self._pending = True


class StopRequest:
    """Turns SIGTERM / SIGINT (main thread only) and the time budget into `due()`, asked between steps,
    so the current step finishes and the run saves before it exits."""

    def __init__(self, budget_minutes: float | None = None, world_size: int = 1, device: Any = "cpu") -> None:
        self.requested, self.signal, self._previous = False, None, {}
        self.budget_minutes, self.world_size, self.device = budget_minutes, world_size, device
        self.deadline = time.monotonic() + 60 * budget_minutes if budget_minutes else math.inf
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested, self.signal = True, signal.Signals(signum).name

    def due(self, step: int, *, at_flush: bool) -> bool:
        """Whether to stop before the next step. One process: a signal or the deadline (host state, no
        sync). Several: decided at log flushes only, by all ranks together (any rank's signal or clock
        stops every rank at the same step; the all-reduce joins the flush's own sync)."""
        late = time.monotonic() > self.deadline
        requested = self.requested
        if self.world_size > 1:
            if not at_flush:
                return False
            flags = torch.tensor([float(requested), float(late)], device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            # The decision is the reduced one only: a signal that lands on this rank after the reduction
            # sets `self.requested` now, but every rank acts on it together at the next flush. Reading
            # the flag again here made one rank stop alone and the others wait in a collective.
            requested, late = (bool(v) for v in flags.tolist())
            if requested and not self.requested:
                self.requested, self.signal = True, "SIGTERM"  # another rank's signal
        if late and not requested:
            log.info("time budget of %s minutes reached at step %d", self.budget_minutes, step)
        return requested or late

    def next_batch(self, batches: Iterator[Any]) -> Any:
        """The next batch, or None when DataLoader workers died after a stop request (their deaths
        then belong to the same shutdown: the run saves the step it finished)."""
        try:
            return next(batches)
        except RuntimeError as e:
            if not self.requested or "DataLoader worker" not in str(e):
                raise
            log.warning("DataLoader workers ended with the stop request (%s)", e)
            return None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def _passes(config: TrainConfig, train_rows: int, world_size: int) -> tuple[int, int]:
    """(full batches an epoch, steps of `num_epochs` passes uncapped) for each of `world_size` processes."""
    per_epoch = (train_rows // world_size) // (config.batch_size * config.optim.grad_accum)
    return per_epoch, max(1, math.floor(config.num_epochs * per_epoch + 1e-9))  # 0.29 * 100 is 28.999...: 29


def epoch_steps(config: TrainConfig, train_rows: int, world_size: int = 1) -> int | None:
    """The optimizer steps of `config.num_epochs` passes over `train_rows` training rows (None without num_epochs):
    each process plays `train_rows // world_size` rows an epoch in batches of `batch_size * grad_accum` rows, its last
    partial batch dropped (`dflash.data.loader.ResumableSampler`, `make_dataloader`), so an epoch is that many full
    batches; a fraction of an epoch rounds down, to 1 step at least. A `max_steps` changed from its default caps the
    count (whichever comes first); left at its default it does not, so `num_epochs=3` alone trains 3 passes."""
    if config.num_epochs is None:
        return None
    steps = _passes(config, train_rows, world_size)[1]
    return min(steps, config.max_steps) if config.max_steps != TrainConfig.max_steps else steps


def apply_num_epochs(trainer: Any, train_rows: int) -> None:
    """With `num_epochs`: set `trainer.config.max_steps` (what the loop, the progress bar and the log lines read) to
    `epoch_steps`, and restart the schedules built from the old count at the trainer's current step, so the lr's
    warmup and cosine (`dflash.optim.lr_at`) and the objective's own (Domino's λ) end where training ends. `fit`
    calls it once the training rows are known, before the first step (a CUDA graph captures the schedule later)."""
    config = trainer.config
    steps = epoch_steps(config, train_rows, trainer.world_size)
    if steps is None:
        return
    per_epoch, passes = _passes(config, train_rows, trainer.world_size)
    if trainer.rank == 0:
        shared = f" over {trainer.world_size} processes" if trainer.world_size > 1 else ""
        capped = f"; max_steps={config.max_steps} stops it first" if steps < passes else ""
        log.info("num_epochs=%g: %d steps (%d training rows%s: %d full batches of %d rows an epoch%s)", config.num_epochs,
                 steps, train_rows, shared, per_epoch, config.batch_size * config.optim.grad_accum, capped)
    config.max_steps = steps
    trainer.lr.copy_(lr_at(trainer.step_t, config.optim, steps))
    trainer.objective.bind_schedule(trainer.step_t, steps)
