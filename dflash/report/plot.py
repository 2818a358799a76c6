"""Plots of a run's metrics history: loss, τ̂, per-position accuracy over time (PNG or inline).

The history is what `DFlashTrainer.fit()` keeps in `trainer.history` and writes to
`RUN/metrics.jsonl` (`DFlashCallback` writes the same file for `transformers.Trainer` runs): one
dict per log or evaluation, `{"step", "loss", "tau", "per_position_accuracy": [bs - 1], ...}` for
training logs and `{"step", "eval_loss", "eval_tau", "eval_per_position_accuracy", ...}` for
held-out evaluations. A measured speculative-decoding result (`evaluate_speculative`'s dict, or
`RUN/export/eval.json`, where `fit()` and `dflash eval --draft RUN/export` write it) adds its
per-position acceptance to the per-position plot.

    from dflash.report.plot import plot_run
    plot_run("runs/dflash")            # -> [runs/dflash/plots/loss.png, ...]

matplotlib is an optional extra (`pip install 'dflash[plot]'`). Figures are built with
`matplotlib.figure.Figure`, not pyplot, so nothing here needs a display or touches pyplot's global
state; in a notebook pass `ax=` from `plt.subplots()` or display the returned figures.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash.report.sinks import read_history

History = Sequence[dict[str, Any]]

SPECULATIVE_FILE = "export/eval.json"  # the speculative-decoding report of the run's exported draft
PLOT_NAMES = ("loss", "tau", "per_position_heatmap", "per_position")


def _require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as e:  # an optional extra: say how to get it
        raise ImportError("dflash.report.plot needs matplotlib: pip install 'dflash[plot]' (or pip install matplotlib)") from e
    return matplotlib


def load_history(run: str | Path | History) -> list[dict[str, Any]]:
    """A run's history: `run` is a run folder (its metrics.jsonl) or an already loaded list."""
    if isinstance(run, (str, Path)):
        folder = Path(run)
        if not (folder / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{folder} has no metrics.jsonl (a dflash run folder or a Trainer output_dir "
                                    "with DFlashCallback)")
        return read_history(folder)
    return list(run)


def series(history: History, key: str) -> tuple[list[int], list[Any]]:
    """(steps, values) of every entry that has `key`, in order. A partial window (`partial_window`: fewer steps
    than `log_interval`, ended by a time budget or a `max_steps` off the interval) is left out: a window of one
    or two steps would draw as a spike (it stays in metrics.jsonl, marked). A run shorter than one window
    draws its partial windows: they are all it has."""
    rows = [row for row in history if row.get(key) is not None]
    rows = [row for row in rows if not row.get("partial_window")] or rows
    return [int(row["step"]) for row in rows], [row[key] for row in rows]


def _step_axis(ax: Any) -> None:
    """Steps are whole numbers: no 2.5 ticks on a short run's axis (a single log point gets a span of
    2 steps around it, or matplotlib would tick it in hundredths)."""
    from matplotlib.ticker import MaxNLocator  # optional extra (dflash[plot]), loaded only when plotting

    lo, hi = ax.get_xlim()
    if hi - lo < 2:
        ax.set_xlim((lo + hi) / 2 - 1, (lo + hi) / 2 + 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


# ---- single plots (each draws on an Axes) --------------------------------------------------------


def plot_loss(history: History, ax: Any) -> Any:
    """Training loss per log window and held-out loss per evaluation, against the step (log scale
    when the values span more than 4x: a fresh draft starts far above where it settles)."""
    drawn: list[float] = []
    for key, label, style in (("loss", "train", "-"), ("eval_loss", "held-out", "o--"),
                              ("base_loss", "train (base logits)", ":")):
        steps, values = series(history, key)
        if steps:
            ax.plot(steps, values, style, label=label)
            drawn += values
    if drawn and min(drawn) > 0 and max(drawn) > 4 * min(drawn):
        from matplotlib.ticker import ScalarFormatter

        ax.set_yscale("log")
        for axis_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis_formatter(ScalarFormatter())  # plain numbers (4, 6, 10, 20), not 4x10^0
    ax.set(xlabel="step", ylabel="weighted block CE", title="loss")
    _step_axis(ax)
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def plot_tau(history: History, ax: Any) -> Any:
    """Teacher-forced acceptance length τ̂ (1 + mean accepted prefix per kept block)."""
    for key, label, style in (("tau", "train", "-"), ("eval_tau", "held-out", "o--"),
                              ("eval_chain_tau", "held-out chain (predicts real τ)", "s-."),
                              ("base_tau", "train (base)", ":")):
        steps, values = series(history, key)
        if steps:
            ax.plot(steps, values, style, label=label)
    ax.set(xlabel="step", ylabel="τ̂ (tokens per target forward)", title="teacher-forced acceptance length")
    _step_axis(ax)
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def plot_per_position_heatmap(history: History, ax: Any, key: str = "per_position_accuracy") -> Any:
    """Accuracy of each draft slot (rows 1..bs-1) at each log (columns): how acceptance grows
    along the block over training. Returns the image (for a colorbar)."""
    steps, rows = series(history, key)
    if not steps:
        ax.text(0.5, 0.5, f"no {key} in the history", ha="center", va="center", transform=ax.transAxes)
        return None
    width = len(rows[0])
    grid = [[row[k] for row in rows] for k in range(width)]  # [bs-1, logs]
    top = max(0.05, max(max(r) for r in rows))  # the colour scale spans 0..best seen (the colorbar says so)
    image = ax.imshow(grid, aspect="auto", origin="lower", vmin=0.0, vmax=top, cmap="viridis",
                      extent=(-0.5, len(steps) - 0.5, 0.5, width + 0.5), interpolation="nearest")
    ticks = sorted({0, len(steps) - 1, *range(0, len(steps), max(1, len(steps) // 8))})
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    ax.set(xlabel="step", ylabel="draft position k", title="per-position accuracy over training")
    return image


def plot_per_position(history: History, ax: Any, speculative: dict[str, Any] | None = None) -> Any:
    """Per-position accuracy along the block: first and last training logs, the last held-out
    evaluation (teacher-forced: each position scored on its own), and, when given, the measured
    speculative acceptance per position (the fraction of verified blocks whose first k drafts
    were all accepted, so it can only fall along the block)."""
    steps, rows = series(history, "per_position_accuracy")
    curves: list[tuple[str, list[float], str]] = []
    if steps:
        curves.append((f"train (teacher-forced), step {steps[0]}", rows[0], ":"))
        if len(steps) > 1:
            curves.append((f"train (teacher-forced), step {steps[-1]}", rows[-1], "-"))
    eval_steps, eval_rows = series(history, "eval_per_position_accuracy")
    if eval_steps:
        curves.append((f"held-out (teacher-forced), step {eval_steps[-1]}", eval_rows[-1], "o--"))
    if speculative and speculative.get("per_position_acceptance"):
        curves.append(("speculative decoding: first k accepted", speculative["per_position_acceptance"], "s-"))
    for label, values, style in curves:
        ax.plot(range(1, len(values) + 1), values, style, label=label)
    ax.set(xlabel="draft position k", ylabel="accuracy / acceptance rate", title="acceptance along the block",
           ylim=(0.0, 1.0))
    ax.grid(alpha=0.3)
    if curves:
        ax.legend()
    return ax


# ---- figures and files ---------------------------------------------------------------------------


def history_figures(history: History, speculative: dict[str, Any] | None = None) -> dict[str, Any]:
    """One `matplotlib.figure.Figure` per plot, keyed by `PLOT_NAMES`."""
    _require_matplotlib()
    from matplotlib.figure import Figure

    figures: dict[str, Any] = {}
    for name in PLOT_NAMES:
        fig = Figure(figsize=(7, 4), layout="constrained")
        ax = fig.add_subplot()
        if name == "loss":
            plot_loss(history, ax)
        elif name == "tau":
            plot_tau(history, ax)
        elif name == "per_position_heatmap":
            image = plot_per_position_heatmap(history, ax)
            if image is not None:
                fig.colorbar(image, ax=ax, label="accuracy")
        else:
            plot_per_position(history, ax, speculative)
        figures[name] = fig
    return figures


def load_speculative(run_dir: str | Path) -> dict[str, Any] | None:
    """`RUN/export/eval.json` (an `evaluate_speculative` / `dflash eval` report) if the run has one."""
    path = Path(run_dir) / SPECULATIVE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None, *, dpi: int = 110) -> list[Path]:
    """Write the run's plots as PNGs into `out_dir` (default `RUN/plots`); returns their paths.

    `run_dir`: a dflash run folder or a Trainer `output_dir` written by `DFlashCallback` (both hold
    metrics.jsonl); its export/eval.json, if any, is drawn on the per-position plot.
    """
    history = load_history(run_dir)
    if not history:
        raise ValueError(f"{Path(run_dir) / 'metrics.jsonl'} is empty: nothing to plot yet")
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in history_figures(history, load_speculative(run_dir)).items():
        path = out / f"{name}.png"
        fig.savefig(path, dpi=dpi)
        paths.append(path)
    return paths
