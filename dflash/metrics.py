"""Training metrics as detached device accumulators, turned into numbers only at a log interval.

Every metric is a running *sum* in one flat float64 device buffer; `add` is an in-place device op.
`flush()` is the only sync point: one all-reduce (when distributed) and one device->host copy of the
whole buffer, then ratios are formed from the window's totals (never averaged per micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Flushed metrics that describe the optimizer update, not the blocks scored: a held-out evaluation (no
# update) and the HF Trainer's own logs (which have grad_norm and learning_rate) leave them out.
UPDATE_ONLY = ("grad_norm", "lr", "nonfinite_skips", "empty_windows")


Derive = Callable[[Mapping[str, torch.Tensor]], dict[str, float]]  # the window's sums -> an objective's own metrics


@dataclass(frozen=True)
class MetricLayout:
    """What one objective fills (`DFlashObjective.metric_layout`; this module knows no draft kind):
    `proposals` scored slots per block (the `pos_*` width), the objective's own sums (name -> width) and
    `derive`, which turns the window's totals (host tensors by name) into its own flushed metrics."""

    proposals: int
    extra: Mapping[str, int] = field(default_factory=dict)
    derive: Derive | None = None


def ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """A window's ratio of sums (0 where nothing was counted)."""
    return num / den.clamp(min=1e-12)


def _layout(layout: MetricLayout) -> dict[str, int]:
    """name -> width. Sums over the window (and ranks); ratios are formed in `flush`."""
    slots = layout.proposals
    return {
        "loss_sum": 1, "weight_sum": 1,          # loss = sum(w * CE) / sum(w)
        "correct": 1, "scored": 1,               # token accuracy over supervised slots
        "pos_correct": slots, "pos_scored": slots,  # per-position accuracy of the block's proposing slots
        "accepted": 1, "blocks": 1,              # teacher-forced tau = 1 + accepted / kept blocks
        "anchors_total": 1, "rows_total": 1, "rows_skipped": 1,
        "grad_norm": 1, "lr": 1, "steps": 1, "nonfinite_skips": 1, "micro_batches": 1,
        "nonfinite_run": 1,  # longest run of consecutive skipped updates in the window (a max, not a sum)
        "updates": 1, "empty_windows": 1,  # optimizer updates taken; windows skipped for no supervised weight
        **layout.extra,
    }


class Metrics:
    """Device-side metric sums for one log window.

    Shapes: scalar entries take `[]` tensors, `pos_*` take `[layout.proposals]`. Values must already be on
    `device`; adding never syncs.
    """

    def __init__(self, layout: MetricLayout, device: torch.device | str) -> None:
        self.layout = layout
        self._slices: dict[str, slice] = {}
        offset = 0
        for name, width in _layout(layout).items():
            self._slices[name] = slice(offset, offset + width)
            offset += width
        self.buffer = torch.zeros(offset, dtype=torch.float64, device=device)

    def add(self, name: str, value: torch.Tensor | float) -> None:
        view = self.buffer[self._slices[name]]
        view.add_(value.detach().to(torch.float64) if isinstance(value, torch.Tensor) else value)

    def max_(self, name: str, value: torch.Tensor) -> None:
        """Keep the running maximum of `value` in `name` (in place, no sync)."""
        view = self.buffer[self._slices[name]]
        torch.maximum(view, value.detach().to(torch.float64), out=view)

    def add_update(self, *, nonfinite: torch.Tensor, empty: torch.Tensor, nonfinite_run: torch.Tensor,
                   grad_norm: torch.Tensor, lr: torch.Tensor) -> None:
        """One optimizer step's values (`[]` device tensors; `nonfinite` / `empty`: 1.0 when the update was
        skipped for a non-finite gradient / an empty window). Identical on every rank, and `flush` sums over
        ranks, so one rank adds them."""
        skipped = torch.maximum(nonfinite, empty)
        self.add("nonfinite_skips", nonfinite)
        self.add("empty_windows", empty * (1 - nonfinite))
        self.max_("nonfinite_run", nonfinite_run)
        self.add("grad_norm", torch.where(skipped > 0, 0.0, grad_norm))
        self.add("updates", 1 - skipped)
        self.add("lr", lr)
        self.add("steps", 1.0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"buffer": self.buffer.detach().clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.buffer.copy_(state["buffer"])

    def flush(self) -> dict[str, float | list[float]]:
        """SYNC POINT (log interval only): reduce over ranks, copy once to the host, reset the window."""
        buf = self.buffer
        if dist.is_available() and dist.is_initialized():
            buf = buf.clone()
            dist.all_reduce(buf)
        host = buf.to("cpu", copy=True)  # the one device->host transfer (a copy even on CPU)
        self.buffer.zero_()
        t = {name: host[s] for name, s in self._slices.items()}

        steps = t["steps"]
        out: dict[str, float | list[float]] = {
            "loss": ratio(t["loss_sum"], t["weight_sum"]).item(),
            "accuracy": ratio(t["correct"], t["scored"]).item(),
            "tau": 1.0 + ratio(t["accepted"], t["blocks"]).item(),
            "anchors_kept": ratio(t["blocks"], t["anchors_total"]).item(),
            "rows_skipped": t["rows_skipped"].item(),
            "rows_skipped_frac": ratio(t["rows_skipped"], t["rows_total"]).item(),
            "grad_norm": ratio(t["grad_norm"], t["updates"]).item(),  # over the updates taken, skips left out
            "lr": ratio(t["lr"], steps).item(),
            "nonfinite_skips": t["nonfinite_skips"].item(),
            "empty_windows": t["empty_windows"].item(),
            "nonfinite_run": t["nonfinite_run"].item(),
            "supervised_tokens": t["scored"].item(),
            "steps": steps.item(),  # the window's size: a last window cut short by a stop has fewer
            "per_position_accuracy": ratio(t["pos_correct"], t["pos_scored"]).tolist(),
        }
        return out | (self.layout.derive(t) if self.layout.derive is not None else {})
