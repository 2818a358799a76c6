"""The DFlash 2 block objective: DFlash's unary CE plus the candidate selector's CE, on fixed shapes.

Layout is DFlash's: slot 0 is not scored, slot k >= 1 predicts the token at a + k, weights w and the
window denominator (the trainer divides by the window's global weight sum) unchanged. Per micro-batch

    loss_sum = sum w * CE_unary + alpha * sum w * counted * CE_selector

* CE_unary: the chunked CE of the unary logits U = W_lm h (`losses.linear_cross_entropy_topk`).
* Candidates C = top-K of U, taken (indices only) from the logits the CE's chunk loop forms anyway, so the
  head runs over the scored states once for both; their logits are then recomputed with gradient from the
  gathered head rows (`candidate_logits`), never a `[T, V]` tensor.
* S(p, c) = U(c) + sum_r A[p, r] (P h)_r B[c, r], the predecessor p teacher-forced: the anchor token for
  slot 1, else the previous slot's label (the data token where that slot is not supervised).
* CE_selector = -log softmax_K(S(p, .))[gold]. `selector_gold: strict` (SpecForge): counted = gold in C,
  no selector loss elsewhere. `insert` (vLLM speculators #1006): where the gold is missing the weakest
  candidate (rank K) is replaced by it, for the loss only (counted = 1); metrics use the strict set.

Everything has a fixed shape: no boolean indexing, no `.item()`, no nonzero; the insertion is a
`torch.where`. Metrics ("dflash2" layout): the decoded (selected) tokens are the primary accuracy and τ
(the selector's greedy choice with the teacher-forced predecessor, which along an accepted prefix is
the decoder's own walk), plus the unary argmax's (base) accuracy and τ, candidate recall and the
selector loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dflash.kinds.dflash2 import DFlash2DraftModel
from dflash.losses import BlockTargets, accepted_prefix_length, linear_cross_entropy_topk, teacher_tokens
from dflash.metrics import MetricLayout, ratio
from dflash.objective import BlockOutput, DFlashObjective
from dflash.target_model.frozen import Target


class _CandidateLogits(torch.autograd.Function):
    """Logits `[T, K]` of `hidden` `[T, H]` at `candidates` `[T, K]` through a frozen head `[V, H]`.

    The gathered rows `[T, K, H]` are formed chunk by chunk in the forward and again in the backward,
    so only the indices are saved (autograd through a gather would keep all T * K head rows)."""

    @staticmethod
    def forward(ctx, hidden, weight, candidates, chunk_size):  # noqa: D401
        out = torch.empty(candidates.shape, dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            rows = weight[candidates[start:end]]  # [c, K, H]
            out[start:end] = (rows @ hidden[start:end].to(weight.dtype).unsqueeze(-1)).squeeze(-1).float()
        ctx.save_for_backward(weight, candidates)
        ctx.chunk_size, ctx.hidden_dtype = chunk_size, hidden.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, candidates = ctx.saved_tensors
        grad = torch.empty(candidates.shape[0], weight.shape[1], dtype=ctx.hidden_dtype, device=weight.device)
        for start in range(0, candidates.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, candidates.shape[0])
            g = grad_out[start:end].to(weight.dtype).unsqueeze(1)  # [c, 1, K]
            grad[start:end] = (g @ weight[candidates[start:end]]).squeeze(1).to(ctx.hidden_dtype)
        return grad, None, None, None


def candidate_logits(hidden: torch.Tensor, weight: torch.Tensor, candidates: torch.Tensor,
                     chunk_size: int = 4096) -> torch.Tensor:
    """fp32 logits `[T, K]` of `hidden` `[T, H]` at `candidates` `[T, K]` (frozen head `[V, H]`), differentiable
    w.r.t. `hidden` only."""
    return _CandidateLogits.apply(hidden, weight.detach(), candidates, chunk_size)


def dflash2_metrics(t: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """DFlash 2's flushed metrics from a window's sums: accuracy / tau are the selected tokens', loss the unary CE."""
    return {"base_accuracy": ratio(t["base_correct"], t["scored"]).item(),
            "base_tau": 1.0 + ratio(t["base_accepted"], t["blocks"]).item(),
            "candidate_recall": ratio(t["candidate_hits"], t["scored"]).item(),  # gold among the top-K
            "selector_accuracy": ratio(t["correct"], t["candidate_hits"]).item(),  # picked it, where it could
            "selector_loss": ratio(t["selector_loss_sum"], t["weight_sum"]).item()}


class DFlash2Objective(DFlashObjective):
    """DFlash 2 block losses (module doc). Same interface as `DFlashObjective`; fills the "dflash2" metrics."""


    def __init__(self, target: Target, draft: DFlash2DraftModel, *, selector_alpha: float = 1.0,
                 selector_gold: str = "strict", **kwargs: Any) -> None:
        if not isinstance(draft, DFlash2DraftModel):
            raise TypeError(f"a DFlash 2 objective needs a DFlash2DraftModel, got {type(draft).__name__} (build one "
                            "with dflash.factory.build_draft and draft.kind: dflash2, or load a DFlash 2 export)")
        if selector_gold not in ("strict", "insert"):
            raise ValueError(f"selector_gold must be strict or insert, got {selector_gold!r}")
        super().__init__(target, draft, **kwargs)
        self.selector_alpha, self.selector_gold = selector_alpha, selector_gold

    def metric_layout(self) -> MetricLayout:
        """The unary argmax's accuracy / tau, the gold-in-top-K count and the selector loss beside DFlash's."""
        return MetricLayout(self.block_size - 1, {"base_correct": 1, "base_accepted": 1, "candidate_hits": 1,
                                                   "selector_loss_sum": 1}, dflash2_metrics)

    def selector_candidates(self, top: torch.Tensor, gold: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(candidates for the loss `[T, K]`, gold's index in them `[T]`, gold in the strict top-K `[T]` bool,
        selector loss counted `[T]` bool) from the unary top-K `top` `[T, K]` and the labels `gold` `[T]`."""
        match = top == gold.unsqueeze(-1)  # [T, K]
        found = match.any(dim=-1)
        index = match.int().argmax(dim=-1)  # gold's rank where found (0 elsewhere: not counted, or replaced below)
        if self.selector_gold == "strict":
            return top, index, found, found
        last = top.shape[-1] - 1
        weakest = torch.where(found, top[:, last], gold)  # the gold replaces the rank-K candidate where missing
        return (torch.cat([top[:, :last], weakest.unsqueeze(-1)], dim=-1), torch.where(found, index, last), found,
                torch.ones_like(found))

    def forward(self, input_ids: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, targets: BlockTargets,
                features: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> BlockOutput:
        """`DFlashObjective.forward` with the selector loss; `features` / `labels` as there."""
        draft: DFlash2DraftModel = self.draft
        hidden, labels = self.draft_hidden(input_ids, anchors, keep, targets, features, labels)
        scored = hidden[:, :, 1:]  # [B, N, P, H]: slot 0 is never scored
        shape = scored.shape[:3]
        flat = scored.reshape(-1, scored.shape[-1])  # [T, H]
        gold, weights = labels[..., 1:].reshape(-1), targets.weights[..., 1:].reshape(-1)
        valid = targets.valid[..., 1:]
        unary_sum, base_correct, top = linear_cross_entropy_topk(flat, self.target.lm_head_weight, gold, weights,
                                                                 draft.top_k, self.ce_chunk_size, self.compile_loss)
        candidates, index, found, counted = self.selector_candidates(top, gold)
        # Predecessor of slot k: the token at a + k - 1 as teacher forcing reads it (slot 1: the anchor token).
        predecessor = teacher_tokens(input_ids, anchors, labels, targets.valid, self.block_size - 1).reshape(-1)
        with torch.autocast(input_ids.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            pairwise = draft.candidate_selector.pairwise(flat, predecessor, candidates)  # [T, K]
        scores = candidate_logits(flat, self.target.lm_head_weight, candidates, self.ce_chunk_size) + pairwise.float()
        selector_ce = torch.logsumexp(scores, dim=-1) - scores.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        selector_sum = (weights * counted * selector_ce).sum()
        loss_sum = unary_sum + self.selector_alpha * selector_sum
        # What the decoder emits: the selector's choice among the strict top-K (equal to the loss's set where found).
        selected = (found & (scores.argmax(dim=-1) == index)).view(shape)
        base_correct = base_correct.view(shape)
        extras = {
            # counted with the same micro-batches as loss_sum / weight_sum (accumulate drops non-finite ones)
            "selector_loss_sum": torch.where(torch.isfinite(unary_sum), selector_sum.detach(), 0.0),
            "candidate_hits": (found.view(shape) & valid).sum(),
            "base_correct": (base_correct & valid).sum(),
            "base_accepted": (accepted_prefix_length(base_correct, valid) * keep).sum(),
        }
        return BlockOutput(loss_sum=loss_sum, ce_sum=unary_sum.detach(), correct=selected, extras=extras)
