"""Where flushed metrics go: console, a JSONL file in the run folder, wandb, tensorboard.

Called only with host floats from `Metrics.flush()` at a log interval; nothing here sees a tensor.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("dflash")


def format_line(step: int, max_steps: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step}/{max_steps}"]
    for key, fmt in (("loss", ".4f"), ("accuracy", ".3f"), ("tau", ".3f"), ("lr", ".2e"), ("grad_norm", ".3f"),
                     ("tokens_per_s", ".0f"), ("eval_tau", ".3f"), ("eval_chain_tau", ".3f"), ("eval_accuracy", ".3f")):
        if key in metrics:
            parts.append(f"{key} {metrics[key]:{fmt}}")
    return " | ".join(parts)


class Reporter:
    """Fans one metrics dict out to every configured sink (`report_to`: wandb, tensorboard)."""

    def __init__(self, run_dir: str | Path, report_to: list[str], config: dict[str, Any], *,
                 enabled: bool = True, console: bool = True) -> None:
        self.enabled, self.console = enabled, console
        self.jsonl = Path(run_dir) / "metrics.jsonl"
        self._wandb = self._tb = None
        if not enabled:
            return
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        unknown = set(report_to) - {"wandb", "tensorboard"}
        if unknown:
            raise ValueError(f"report_to: unknown sink(s) {sorted(unknown)}; choose from wandb, tensorboard")
        if "wandb" in report_to:
            import wandb  # honours WANDB_MODE (offline / disabled)

            self._wandb = wandb.init(project="dflash", dir=str(run_dir), config=config)
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("report_to: tensorboard needs the tensorboard package: pip install tensorboard") from e

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any], max_steps: int | None = None) -> None:
        if not self.enabled:
            return
        with self.jsonl.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.console:
            log.info(format_line(step, max_steps or step, metrics))
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        for i, v in enumerate(metrics.get("per_position_accuracy", [])):
            scalars[f"per_position_accuracy/{i + 1}"] = v
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()


def read_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl as a list of dicts (for plots and tests)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
