"""What a run shows on the console: the launch banner, progress bars, which ranks log, the final table.

Light on purpose (the standard library and tqdm): `import dflash` loads it in notebooks, and every
long phase (regeneration, held-out and speculative evaluation, training) draws its bar through it.

* `launch_banner(...)`: one block, printed once by rank 0 when a run starts, naming what runs where.
* `ProgressBar` / `progress(iterable, ...)`: a tqdm bar with the console log handlers redirected through
  `tqdm.write` while it is open, so log lines never tear it; shown on rank 0 only, and not at all after
  `set_progress_bars(False)` (what `progress_bar: false` does). Given a deadline (the training bar under
  `time_budget_minutes`), its ETA is the sooner of the steps' and the budget's end.
* `quiet_datasets()`: `datasets`' own map/filter bars off while dflash prepares data.
* `show_logs_in_notebook()`: under a Jupyter kernel with no logging configured, dflash's INFO lines are
  printed in the cell (Python shows only warnings by default).
* `start_of_run(...)`: what `fit` does first; it returns the run's `PhaseTimer` (`dflash.report.phases`).
* `summary_table(summary)`: the short human table `dflash train` prints at the end.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

from tqdm.contrib.logging import logging_redirect_tqdm
from tqdm.std import TqdmWarning
from tqdm.std import tqdm as std_tqdm

from dflash.report.phases import PhaseTimer

with warnings.catch_warnings():  # a notebook without ipywidgets gets text bars, which work: no warning about it
    warnings.simplefilter("ignore", TqdmWarning)
    from tqdm.auto import tqdm

log = logging.getLogger("dflash")
T = TypeVar("T")
_progress_bars = True  # `set_progress_bars`; the trainer sets it from `progress_bar`


def process_rank() -> int:
    """This process's rank: the initialized process group's, else the launcher's RANK, else 0."""
    dist = sys.modules.get("torch.distributed")  # read only when torch already loaded it (no import here)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def set_progress_bars(enabled: bool) -> None:
    """Show (True, the default) or hide every dflash progress bar of this process (like `datasets`' switch:
    each `fit` sets it from its `progress_bar`, and it holds until changed)."""
    global _progress_bars
    _progress_bars = bool(enabled)


def progress_enabled() -> bool:
    """Whether a bar is drawn here: bars are on and this is rank 0."""
    return _progress_bars and process_rank() == 0


def _is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)


class ProgressBar:
    """A tqdm bar (`tqdm.auto`: a widget in notebooks) that routes the console log handlers of the "dflash"
    and root loggers through `tqdm.write` until `close()`. Disabled on ranks other than 0 and after
    `set_progress_bars(False)`; then `update` and `set_postfix_str` do nothing.

    `deadline` (a `time.monotonic()` value: `StopRequest.deadline` under `time_budget_minutes`) ends the loop
    before `total` when the steps are slow: the bar's ETA is then `eta()`, the sooner of the two ends, marked
    "(time budget)" when the budget's is sooner. tqdm's own ETA counts steps alone, and showed 37 minutes for a
    run its 1.5-minute budget ended."""

    def __init__(self, total: int | None, *, desc: str, unit: str = "it", initial: int = 0,
                 enabled: bool = True, deadline: float | None = None) -> None:
        self.enabled = enabled and progress_enabled()
        self.total, self.n = total, initial
        self.clock: Callable[[], float] = time.monotonic  # the deadline's clock (a test sets its own)
        self.deadline = deadline if deadline is not None and math.isfinite(deadline) else None
        self._first: tuple[float, int] | None = None  # (clock, n) after the first update: see `eta`
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=not self.enabled,
                        dynamic_ncols=True)
        loggers = [lg for lg in (log, logging.root) if any(_is_console(h) for h in lg.handlers)]
        self._redirect = logging_redirect_tqdm(loggers) if self.enabled and loggers else nullcontext()
        self._redirect.__enter__()
        self._open = True

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.deadline is not None:
            now = self.clock()
            if self._first is None:
                self._first = (now, self.n)
            if self.enabled:  # the ETA goes into the format before tqdm draws this update
                seconds, by_budget = self.eta(now)
                shown = "?" if seconds is None else std_tqdm.format_interval(seconds) + (" (time budget)" if by_budget else "")
                self.bar.bar_format = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<" + shown + ", {rate_fmt}{postfix}]"
        self.bar.update(n)

    def eta(self, now: float | None = None) -> tuple[float | None, bool]:
        """(seconds left, whether the time budget ends the loop first): the steps left at the rate since the first
        update (the first step compiles: it would make every later estimate too long), or the time left before
        `deadline` when that is sooner (or no rate is known yet: it bounds the wait). (None, False) with neither."""
        now = self.clock() if now is None else now
        budget = max(self.deadline - now, 0.0) if self.deadline is not None else None
        steps = None
        if self._first is not None and self.total is not None and self.n > self._first[1] and now > self._first[0]:
            steps = (self.total - self.n) * (now - self._first[0]) / (self.n - self._first[1])
        if budget is not None and (steps is None or budget < steps):
            return budget, True
        return steps, False

    def set_postfix_str(self, text: str) -> None:
        self.bar.set_postfix_str(text)

    def close(self) -> None:
        if self._open:
            self._open = False
            self.bar.close()
            self._redirect.__exit__(None, None, None)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress(items: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """`items`, one bar step each (`total` defaults to `len(items)`). Leaving the loop early closes the bar."""
    with ProgressBar(total if total is not None else len(items), desc=desc, unit=unit) as bar:  # type: ignore[arg-type]
        for item in items:
            yield item
            bar.update(1)


@contextmanager
def quiet_datasets() -> Iterator[None]:
    """`datasets`' progress bars off for the block (dflash's own bars and log lines say what happens)."""
    import datasets  # a third-party module: imported here so that this module stays light

    was_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            datasets.enable_progress_bars()


def in_notebook() -> bool:
    """Running under a Jupyter kernel (IPython's ZMQ shell), not a terminal IPython or plain Python."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def show_logs_in_notebook() -> bool:
    """In a notebook where nothing configured logging, print dflash's INFO lines in the cell's output
    (otherwise only warnings would show). Returns whether a handler was added."""
    if not in_notebook() or log.handlers or logging.root.handlers:
        return False
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    log.addHandler(handler)
    if log.level == logging.NOTSET or log.level > logging.INFO:
        log.setLevel(logging.INFO)
    return True


# ---- what a launch runs --------------------------------------------------------------------------------

def launch_banner(config: Any, *, world_size: int, device: Any, dtype: Any, attention: str, backend: str | None = None) -> str:
    """The block rank 0 prints when a run starts: processes and their layout, distributed mode, device,
    dtypes, attention, compile / CUDA graph, and where the run writes."""
    tp = int(getattr(getattr(config, "tensor_parallel", None), "size", 1) or 1)
    if world_size > 1:
        mode = f"distributed {config.distributed}" + (f" over {backend}" if backend else "")
        layout = f"{world_size} processes: data parallel {world_size // tp} x tensor parallel {tp} | {mode}"
    else:
        layout = "1 process: data parallel 1 x tensor parallel 1 (no process group)"
    name = lambda d: str(d).replace("torch.", "")  # noqa: E731
    lines = [
        f"launch: {layout}",
        f"  device {device} | compute {name(dtype)}, draft weights {config.param_dtype} | attention {attention} | "
        f"compile {'on' if config.compile else 'off'}, CUDA graph {'on' if config.cuda_graph else 'off'}",
        f"  target {config.target} | writes to {os.path.abspath(config.output_dir)} (metrics.jsonl, checkpoints/, "
        "export/, summary.json)",
    ]
    # `accelerate launch` without GPUs (with --cpu, or without it on a machine that has none) starts ONE process
    # whatever --num_processes says, and sets no WORLD_SIZE: its own variables are the only trace of it.
    by_accelerate = os.environ.get("ACCELERATE_USE_CPU") == "True" or "ACCELERATE_MIXED_PRECISION" in os.environ
    if world_size == 1 and str(device).startswith("cpu") and by_accelerate:
        lines.append("  note: `accelerate launch` on CPUs (--cpu, or a machine without GPUs) starts ONE process whatever "
                     "--num_processes says; for N CPU processes run `torchrun --nproc_per_node N -m dflash train ...`")
    return "\n".join(lines)


def start_of_run(config: Any, *, rank: int, world_size: int, device: Any, dtype: Any, attention: str) -> PhaseTimer:
    """What `DFlashTrainer.fit` does first: the run's progress bars on or off (`progress_bar`), and rank 0
    logs the launch banner. Returns the run's `PhaseTimer`, its wall clock started (RUN/summary.json's
    `wall_seconds` and `phases`)."""
    set_progress_bars(config.progress_bar)
    if rank == 0:
        dist = sys.modules.get("torch.distributed")
        backend = None
        if world_size > 1 and dist is not None and dist.is_initialized():  # e.g. "gloo", or "cpu:gloo,cuda:nccl"
            backend = dist.get_backend()
            if backend == "undefined" and hasattr(dist, "get_backend_config"):
                backend = dist.get_backend_config()
        log.info(launch_banner(config, world_size=world_size, device=device, dtype=dtype, attention=attention,
                               backend=backend))
    return PhaseTimer()


# ---- what a run did ------------------------------------------------------------------------------------

def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def summary_table(summary: dict[str, Any], summary_path: Any = None) -> str:
    """A few lines a person reads at the end of `dflash train` (the full JSON is RUN/summary.json)."""
    rows: list[tuple[str, str]] = []
    stopped = f" (interrupted by signal {summary.get('signal')}; saved)" if summary.get("interrupted") else ""
    rows.append(("steps", f"{summary.get('steps')}{stopped}"))
    train = summary.get("train") or {}
    if train:
        rows.append(("training", f"loss {_fmt(train.get('loss'), '.4f')} | accuracy {_fmt(train.get('accuracy'), '.3f')}"
                                 f" | tau {_fmt(train.get('tau'), '.3f')} | {throughput(train)}"
                                 + (f" | peak {train['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in train else "")))
    held = summary.get("held_out")
    if held:
        rows.append(("held-out", f"loss {_fmt(held.get('loss'), '.4f')} | accuracy {_fmt(held.get('accuracy'), '.3f')}"
                                 f" | tau {_fmt(held.get('tau'), '.3f')} (uniform), {_fmt(held.get('chain_tau'), '.3f')}"
                                 " (chain)"))
    peak = summary.get("held_out_peak") or {}
    if peak.get("past_peak_warning"):  # the run trained on past its held-out best (`dflash.run.overfitting`)
        rows.append(("held-out peak", f"chain tau {peak['peak_chain_tau']:.3f} at step {peak['peak_step']}, past it since;"
                                      f" {peak['epochs']:.1f} epochs in all"))
    spec = summary.get("speculative")
    if spec:
        ties = len(spec.get("numerical_ties") or [])
        rows.append(("speculative", f"tau {spec['tau']:.3f} on {spec['num_prompts']} prompts, lossless"
                                    f"{f' ({ties} rounding ties)' if ties else ''} | speed-up x{spec['speedup']:.2f}"))
    for key in ("checkpoint", "export"):
        if summary.get(key):
            rows.append((key, str(summary[key])))
    if summary_path is not None:
        rows.append(("summary", str(summary_path)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def throughput(metrics: dict[str, Any]) -> str:
    """Input tokens per second, all ranks and per rank, as one labelled phrase."""
    total, per_rank = metrics.get("tokens_per_s"), metrics.get("tokens_per_s_per_rank")
    if total is None:
        return "tokens/s n/a"
    ranks = metrics.get("ranks", 1)
    if ranks == 1 or per_rank is None:
        return f"{total:,.0f} tokens/s"
    return f"{total:,.0f} tokens/s over {ranks} ranks ({per_rank:,.0f} per rank)"
