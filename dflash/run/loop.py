"""The run loop: what `DFlashTrainer.fit` drives once its run folder, data and checks are ready.

    until max_steps, a stop (signal, time budget) or the non-finite stop:
        train_step(batch)                                  no host read
        at log_interval (and max_steps):                   flush the metrics -> one log window     SYNC POINT
        at eval_interval:                                  held-out metrics, speculative decoding  SYNC POINTs
        at save_interval:                                  a checkpoint                            SYNC POINT
    the last step saved once; a stop ends the run there, else the end-of-run work (held-out metrics, the
    trainer's export and speculative decoding) under `dflash.run.ending`'s handlers; RUN/summary.json

The loop drives a `Trainee`, the trainer as the loop sees it: the run package sits below `dflash.trainer` and
never imports it, so what the loop reads and calls is declared here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from dflash.config import TrainConfig
from dflash.metrics import Metrics
from dflash.report.console import ProgressBar
from dflash.report.phases import PhaseTimer
from dflash.report.sinks import Reporter, progress_postfix, training_figures, window_metrics, write_summary
from dflash.run.checkpoint import checkpoint_path
from dflash.run.ending import finish_unless_stopped
from dflash.run.overfitting import HeldOutPeak
from dflash.run.stopping import NonFiniteError, NonFiniteWatch, StopRequest
from dflash.runtime import peak_memory_bytes

Batch = Mapping[str, Any]  # a `dflash.data.loader.Batch`: the loop reads its `input_ids` shape and passes it on


class Trainee(Protocol):
    """What the loop reads and calls of `dflash.trainer.DFlashTrainer`."""

    config: TrainConfig
    rank: int
    world_size: int
    device: torch.device
    step: int  # optimizer steps taken: a host counter, advanced by `train_step` without reading the device
    saved_step: int | None  # the step last saved or resumed from
    resumed: dict[str, Any] | None  # `dflash.run.state.resume_record` of the checkpoint resumed from
    metrics: Metrics
    nonfinite_run: torch.Tensor  # `[]` fp32 on the device: consecutive skipped updates
    history: list[dict[str, Any]]  # every log window and evaluation, as metrics.jsonl has them

    def train_step(self, batch: Batch) -> None: ...

    def save(self) -> Path: ...

    def evaluate(self, dataset: Any) -> dict[str, Any]: ...

    def consolidated_draft(self) -> nn.Module | None: ...

    def speculative_eval(self, conversations: list[dict[str, Any]], num_prompts: int | None = None, *,
                         draft: nn.Module | None = None) -> dict[str, Any] | None: ...


class RunLoop:
    """One `fit` of `trainer` in its claimed, locked `run_dir`: the steps, their log windows (`reporter`, built here
    from the config's `report_to`), the evaluation and save cadence, the stop, the end. `phases` times the run
    (`dflash.report.phases`); `train_rows` (the training set's rows, packed sequences with `data.packing`) gives
    the held-out peak's epochs; `conversations` are the held-out prompts of the speculative evaluation."""

    def __init__(self, trainer: Trainee, run_dir: Path, phases: PhaseTimer, *, train_rows: int,
                 conversations: list[dict[str, Any]]) -> None:
        cfg = trainer.config
        self.trainer, self.run_dir, self.phases, self.conversations = trainer, run_dir, phases, conversations
        self.reporter = Reporter(run_dir, cfg.report_to, cfg.to_dict(), enabled=trainer.rank == 0,
                                 resumed=trainer.resumed or {"step": trainer.step})  # drops lines logged past this step
        self.held_out_peak = HeldOutPeak(cfg.batch_size * cfg.optim.grad_accum * trainer.world_size,
                                         warn=trainer.rank == 0, train_rows=train_rows)
        self.last_held_out: tuple[int, dict[str, Any]] = (-1, {})  # (step, `evaluate`'s figures) of the last one

    def run(self, batches: Iterator[Batch], eval_data: Any, summary: dict[str, Any],
            end_of_run: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Train from `batches` (endless, on the device) and end the run. Returns its summary: the steps, the last
        checkpoint, the training figures, `summary`'s entries, and what the end added (held-out metrics of
        `eval_data`, then `end_of_run(summary)`: the trainer's export and speculative decoding); `interrupted` and
        `signal` when SIGTERM / SIGINT stopped it. Raises `NonFiniteError` at the non-finite stop, saved first."""
        t, cfg = self.trainer, self.trainer.config
        stop = StopRequest(cfg.time_budget_minutes, t.world_size, t.device)  # signals, time budget
        watch = NonFiniteWatch(t.nonfinite_run, cfg.max_nonfinite_skips, every_step=t.world_size == 1)
        try:
            last = self.phases.timed("training", self.train, batches, eval_data, stop, watch)
            # The last step is saved once: not again when it was just saved, or resumed with no step left.
            checkpoint = checkpoint_path(self.run_dir, t.step) if t.saved_step == t.step else t.save()
        finally:
            stop.restore()
        summary = {"steps": t.step, "checkpoint": str(checkpoint), "train": last, **summary}
        if watch.tripped or stop.requested:  # the checkpoint is what matters; skip the end-of-run work
            self.reporter.close()
            if watch.tripped:
                raise NonFiniteError(int(watch.value), cfg.max_nonfinite_skips, t.step, checkpoint)
            return write_summary(self.run_dir, summary, enabled=t.rank == 0, timer=self.phases, stopped_by=stop.signal)
        return finish_unless_stopped(lambda: self.finish(eval_data, summary, end_of_run), self.run_dir, summary,
                                     self.reporter, self.phases)  # a signal there: saved, the rest skipped; a full disk: exit 4

    def train(self, batches: Iterator[Batch], eval_data: Any, stop: StopRequest, watch: NonFiniteWatch) -> dict[str, Any]:
        """The steps to `max_steps` (or a stop): log, evaluate and save at their intervals. Returns the last
        full log window's metrics (the run's training summary; a shorter window is logged, marked)."""
        t, cfg = self.trainer, self.trainer.config
        progress = ProgressBar(cfg.max_steps, initial=t.step, desc="dflash train", unit="step", deadline=stop.deadline,
                               enabled=cfg.progress_bar and t.rank == 0)  # log lines print above it; ETA in budget
        window_start, window_tokens, last_flush_step = time.perf_counter(), 0, t.step
        try:
            # next_batch is None when the DataLoader workers ended with a stop request
            while (t.step < cfg.max_steps and not stop.due(t.step, at_flush=last_flush_step == t.step)
                   and (batch := stop.next_batch(batches)) is not None):
                window_tokens += batch["input_ids"].numel()  # a host-known shape, not a device read
                self.phases.first("first_step", t.train_step, batch)  # compilation included
                progress.update(1)
                watch.poll()  # one process: the device's consecutive-skip count, read as it lands (no wait)
                if t.step % cfg.log_interval == 0 or t.step == cfg.max_steps or watch.tripped:
                    window = self.window(window_start, window_tokens)
                    last_flush_step = t.step  # SYNC POINT above: the log interval
                    self.record(window)  # at max_steps off the interval: short, marked
                    progress.set_postfix_str(progress_postfix(window))
                    watch.see(window["nonfinite_run"])
                    window_start, window_tokens = time.perf_counter(), 0
                if watch.tripped:  # skipped updates left the weights at the last finite state: saved by `run`
                    break
                if cfg.eval_interval and t.step % cfg.eval_interval == 0:
                    self.interval_evaluation(eval_data)
                if cfg.save_interval and t.step % cfg.save_interval == 0:
                    t.save()
            if t.step != last_flush_step and not stop.requested:  # the time budget ended a window early
                self.record(self.window(window_start, window_tokens))  # short: logged, marked
        finally:
            progress.close()
        return training_figures(t.history)  # the last full window when there is one

    def window(self, start: float, tokens: int) -> dict[str, Any]:
        """SYNC POINT: the metrics summed since the last flush (`Metrics.flush`) as one log window begun at `start`
        (`time.perf_counter()`; its wall time includes this flush) of `tokens` input tokens (`window_metrics`)."""
        t = self.trainer
        return window_metrics(t.metrics.flush(), time.perf_counter() - start, tokens, t.world_size,
                              peak_memory_bytes(t.device), t.config.log_interval)

    def interval_evaluation(self, eval_data: Any) -> None:
        """SYNC POINTs at an `eval_interval` step: held-out metrics of `eval_data` (when there is a held-out split),
        and with `spec_eval_interval_prompts` speculative decoding of that many held-out prompts."""
        t, cfg = self.trainer, self.trainer.config
        if eval_data is not None:
            self.held_out(eval_data)
        if cfg.spec_eval_interval_prompts and self.conversations:
            draft = t.consolidated_draft()  # FSDP2: a gather every rank takes part in
            if (spec := t.speculative_eval(self.conversations, cfg.spec_eval_interval_prompts,
                                           draft=draft)) is not None:  # rank 0's report
                self.record({"spec_tau": spec["tau"], "spec_speedup": spec["speedup"],
                             "spec_per_position_acceptance": spec["per_position_acceptance"]})

    def finish(self, eval_data: Any, summary: dict[str, Any], end_of_run: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """The end of a completed run: held-out metrics, `end_of_run(summary)` (the export, speculative decoding),
        RUN/summary.json."""
        if eval_data is not None:
            summary["held_out"] = self.phases.timed("held_out_eval", self.held_out, eval_data)
            summary["held_out_peak"] = self.held_out_peak.summary()
        end_of_run(summary)
        self.reporter.close()
        return write_summary(self.run_dir, summary, enabled=self.trainer.rank == 0, timer=self.phases)  # RUN/summary.json

    def held_out(self, dataset: Any) -> dict[str, Any]:
        """SYNC POINT: `evaluate` once a step (a run's end reuses its interval's), recorded, shown to the held-out peak."""
        t = self.trainer
        if self.last_held_out[0] != t.step:
            self.last_held_out = (t.step, t.evaluate(dataset))
            self.record({f"eval_{k}": v for k, v in self.last_held_out[1].items()})
            self.held_out_peak.see(t.step, self.last_held_out[1]["chain_tau"])
        return self.last_held_out[1]

    def record(self, metrics: dict[str, Any]) -> None:
        """`metrics` at the trainer's step: into its `history` and to the reporter (console, metrics.jsonl, sinks)."""
        t = self.trainer
        t.history.append({"step": t.step, **metrics})
        self.reporter.log(t.step, metrics, t.config.max_steps)
