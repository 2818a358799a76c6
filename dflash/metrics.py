"""Training metrics as detached device accumulators, turned into numbers only at a log interval.

Every metric is a running *sum* in one flat float64 device buffer; `add` is an in-place device op.
`flush()` is the only sync point: one all-reduce (when distributed) and one device->host copy of the
whole buffer, then ratios are formed from the window's totals (never averaged per micro-batch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Flushed metrics that describe the optimizer update, not the blocks scored: a held-out evaluation (no
# update) and the HF Trainer's own logs (which have grad_norm and learning_rate) leave them out.
UPDATE_ONLY = ("grad_norm", "lr", "nonfinite_skips", "empty_windows")


# name -> width. Sums over the window (and ranks); ratios are formed in `flush`.
def _layout(block_size: int, variant: str) -> dict[str, int]:
    slots = block_size if variant == "dspark" else block_size - 1  # DSpark: every slot proposes (anchor-as-first-prediction)
    layout = {
        "loss_sum": 1, "weight_sum": 1,          # loss = sum(w * CE) / sum(w)
        "correct": 1, "scored": 1,               # token accuracy over supervised slots
        "pos_correct": slots, "pos_scored": slots,  # per-position accuracy, slots 1..bs-1 (DSpark: its bs proposals)
        "accepted": 1, "blocks": 1,              # teacher-forced tau = 1 + accepted / kept blocks
        "anchors_total": 1, "rows_total": 1, "rows_skipped": 1,
        "grad_norm": 1, "lr": 1, "steps": 1, "nonfinite_skips": 1, "micro_batches": 1,
        "nonfinite_run": 1,  # longest run of consecutive skipped updates in the window (a max, not a sum)
        "updates": 1, "empty_windows": 1,  # optimizer updates taken; windows skipped for no supervised weight
    }
    if variant == "domino":  # the base (uncorrected) logits' loss / accuracy / tau, and lambda
        layout.update({"base_loss_sum": 1, "base_correct": 1, "base_accepted": 1, "lambda": 1})
    if variant == "dflash2":  # the unary argmax's accuracy / tau, gold-in-top-K count, selector loss
        layout.update({"base_correct": 1, "base_accepted": 1, "candidate_hits": 1, "selector_loss_sum": 1})
    if variant == "dspark":  # the backbone-only argmax's accuracy / tau, the loss terms, the confidence calibration
        layout.update({"base_correct": 1, "base_accepted": 1, "objective_sum": 1, "l1_loss_sum": 1,
                       "confidence_loss_sum": 1, "confidence_sum": 1, "acceptance_sum": 1})
    return layout


class Metrics:
    """Device-side metric sums for one log window.

    Shapes: scalar entries take `[]` tensors, `pos_*` take `[bs - 1]` (`[bs]` for "dspark"). Values must already be on
    `device`; adding never syncs.
    """

    def __init__(self, block_size: int, device: torch.device | str, variant: str = "dflash") -> None:
        self.block_size = block_size
        self._slices: dict[str, slice] = {}
        offset = 0
        for name, width in _layout(block_size, variant).items():
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

        def ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
            return num / den.clamp(min=1e-12)

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
        if "lambda" in t:
            out["base_loss"] = ratio(t["base_loss_sum"], t["weight_sum"]).item()
            out["base_accuracy"] = ratio(t["base_correct"], t["scored"]).item()
            out["base_tau"] = 1.0 + ratio(t["base_accepted"], t["blocks"]).item()
            out["lambda"] = ratio(t["lambda"], t["micro_batches"]).item()
        if "candidate_hits" in t:  # DFlash 2: accuracy / tau are the selected tokens', loss the unary CE
            out["base_accuracy"] = ratio(t["base_correct"], t["scored"]).item()
            out["base_tau"] = 1.0 + ratio(t["base_accepted"], t["blocks"]).item()
            out["candidate_recall"] = ratio(t["candidate_hits"], t["scored"]).item()  # gold among the top-K
            out["selector_accuracy"] = ratio(t["correct"], t["candidate_hits"]).item()  # picked it, where it could
            out["selector_loss"] = ratio(t["selector_loss_sum"], t["weight_sum"]).item()
        if "acceptance_sum" in t:  # DSpark: accuracy / tau are the Markov-corrected drafts', loss their weighted CE
            out["base_accuracy"] = ratio(t["base_correct"], t["scored"]).item()
            out["base_tau"] = 1.0 + ratio(t["base_accepted"], t["blocks"]).item()
            out["dspark_loss"] = ratio(t["objective_sum"], t["weight_sum"]).item()  # what is minimised: CE, L1, BCE mixed
            out["l1_loss"] = ratio(t["l1_loss_sum"], t["weight_sum"]).item()  # ||p_draft - p_target||_1 (2 x TV)
            out["confidence_loss"] = ratio(t["confidence_loss_sum"], t["weight_sum"]).item()  # BCE vs the soft target
            # calibration: mean predicted confidence vs mean soft acceptance 1 - L1 / 2 over the supervised slots
            out["mean_confidence"] = ratio(t["confidence_sum"], t["scored"]).item()
            out["mean_acceptance"] = ratio(t["acceptance_sum"], t["scored"]).item()
        return out
