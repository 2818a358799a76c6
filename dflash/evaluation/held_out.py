"""Teacher-forced metrics on held-out rows, and the decode-chain estimate of real τ (a sync point).

Every valid position is an anchor (no sampling), so evaluations at different steps score the same
blocks. `chain_tau` replays the acceptance along the path a real decoder takes (`dflash.evaluation.chain`);
the uniform `tau` averages over every position and overstates real τ when acceptance varies.
"""

from __future__ import annotations

from typing import Any

import datasets
import torch

from dflash.anchors import max_valid_anchors
from dflash.data.loader import Collator, make_dataloader
from dflash.evaluation.chain import chain_tau_sums
from dflash.losses import accepted_prefix_length
from dflash.metrics import UPDATE_ONLY, Metrics
from dflash.modeling import allow_compiled_shapes
from dflash.objective import DFlashObjective
from dflash.report.console import progress


@torch.no_grad()
def held_out_metrics(objective: DFlashObjective, dataset: Any, collator: Collator, *, batch_size: int,
                     device: torch.device, max_new_tokens: int, max_batches: int | None = None) -> dict[str, Any]:
    """loss, accuracy, tau, per-position accuracy and `chain_tau` (capped at `max_new_tokens` per reply)
    over `dataset` rows (`input_ids`, `loss_mask`; offline `features` / `labels` go to the objective). SYNC
    POINT: the chain reads accepted lengths."""
    loader = make_dataloader(dataset, batch_size, collator, shuffle=False, num_workers=0, drop_last=False)
    # Every valid anchor makes each held-out batch its own width: one more compiled shape per batch, on top
    # of the training shapes the same process compiles.
    allow_compiled_shapes(collator.num_shapes + len(loader))
    metrics = Metrics(objective.metric_layout(), device)
    emitted = forwards = 0
    objective.eval()
    total = len(loader) if max_batches is None else min(len(loader), max_batches)
    for i, batch in enumerate(progress(loader, desc="held-out eval", total=total, unit="batch")):
        if max_batches is not None and i >= max_batches:
            break
        ids = batch["input_ids"].to(device)
        mask = batch["loss_mask"].to(device)
        width = max(1, max_valid_anchors(batch["loss_mask"]))  # every valid anchor (host copy of the mask)
        anchors, keep, targets = objective.plan(ids, mask, None, num_anchors=width)
        offline = [batch[k].to(device) if k in batch else None for k in ("features", "labels")]  # data.features
        out = objective(ids, anchors, keep, targets, *offline)
        objective.accumulate(metrics, out, keep, targets)
        accepted = accepted_prefix_length(out.correct, targets.valid[..., 1:])
        per_position = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)
        rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(anchors)
        per_position[rows[keep], anchors[keep]] = accepted[keep]
        e, f = chain_tau_sums(per_position, mask, max_new_tokens)
        emitted, forwards = emitted + e, forwards + f
    metrics.add("steps", 1.0)
    out = metrics.flush()
    out.update(chain_tau=emitted / max(forwards, 1), chain_forwards=forwards)
    return {k: v for k, v in out.items() if k not in UPDATE_ONLY}


def output_rows(texts: list[tuple[list[int], list[int]]]) -> datasets.Dataset:
    """Rows `prompt + output` supervising the output, from (prompt ids, output ids) pairs: the decoded
    outputs of a speculative evaluation scored teacher-forced."""
    return datasets.Dataset.from_dict({"input_ids": [p + o for p, o in texts],
                                       "loss_mask": [[0] * len(p) + [1] * len(o) for p, o in texts]})
