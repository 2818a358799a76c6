"""The DSpark block objective: CE + L1 to the target's distribution + the confidence BCE, on fixed shapes.

Layout (`dflash.kinds.dspark`): slot k = 0..bs-1 of the block anchored at a predicts y_k = input_ids[a + k + 1].
Block targets are DFlash's over bs + 1 positions (`dspark_block_targets`): index j is the token at a + j,
j = 0 the anchor (never a target), j = k + 1 slot k's label, so the trainer, the metrics, the held-out
chain and `accumulate` read them exactly as DFlash's. Validity is cut at the first invalid label
(cumprod over k: keep, a + k + 1 < S, loss_mask[a + k + 1]); weights w_k = valid_k * exp(-k / gamma).

Per micro-batch, with z_k = W_lm h_k + W2 W1[x_k] (x_k the teacher-forced token at a + k: the anchor
for k = 0, else the label of slot k - 1), p_d = softmax(z_k) and p_t = softmax(W_lm g_{a+k}) in fp32 at
T = 1, g the target's final-norm last hidden state (its next-token distribution for y_k):

    loss_sum = sum w (ce_alpha * CE(z, y) + l1_alpha * ||p_d - p_t||_1 + confidence_alpha * BCE(l, c*))

with c* = clamp(1 - ||p_d - p_t||_1 / 2, 0, 1) detached (the analytic acceptance probability) and l the
confidence logit. The trainer divides by the window's global weight sum, as for DFlash. The two
distribution terms run chunked over tokens in one pass over the vocabulary (`dspark_distribution_losses`):
no `[T, V]` tensor for all block tokens. No boolean indexing, no `.item()`, no data-dependent shape.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from dflash.anchors import GlobalRows
from dflash.kinds.dspark import DSparkDraftModel
from dflash.losses import (
    BlockTargets,
    accepted_prefix_length,
    block_labels,
    block_positions,
    block_targets,
    head_logits,
    teacher_tokens,
)
from dflash.metrics import MetricLayout, ratio
from dflash.objective import BlockOutput, DFlashObjective
from dflash.target_model.frozen import Target, greedy_labels


@runtime_checkable
class LastHiddenTarget(Protocol):
    """A target that gives its final-norm last hidden state with its features (DSpark's L1 term reads it)."""

    def features_and_last_hidden(self, input_ids: torch.Tensor,
                                 position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, S]` ids -> (features `[B, S, K*H]`, final-normed last hidden state `[B, S, H]`), no grad; packed
        rows' `position_ids` `[B, S]` (restarting per document) confine attention to each document."""


def dspark_block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                         block_size: int, gamma: float | None, position_ids: torch.Tensor | None = None) -> BlockTargets:
    """DSpark's labels, weights and validity, all `[B, N, bs + 1]` (index j: the token at a + j; module doc).

    DFlash's targets of a span of bs + 1, with validity cut at the first invalid label (DeepSpec's
    `build_eval_mask` cumprod): a decoder never verifies a slot past a rejected one."""
    t = block_targets(input_ids, loss_mask, anchors, keep, block_size + 1, gamma, position_ids)
    valid = torch.cat([t.valid[..., :1], t.valid[..., 1:].long().cumprod(dim=-1).bool()], dim=-1)
    return BlockTargets(labels=torch.where(valid, t.labels, 0), weights=torch.where(valid, t.weights, 0.0), valid=valid,
                        position_ids=position_ids)


# ---- the two distribution terms, chunked over tokens ------------------------------------------------


def _dspark_chunk(logits: torch.Tensor, target: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                  ce_alpha: float, l1_alpha: float, need_grad: bool):
    """One chunk of `c` tokens, math in fp32. `logits` `[c, V]` the draft's z (Markov bias included), `target`
    `[c, V]` the target's logits (both consumed: in fp32 their buffers are reused), labels `[c]`, weights `[c]`.

    Returns (CE `[c]`, L1 `[c]`, argmax z == label `[c]`, d loss / d z `[c, V]` fp32 or None) with
    loss = sum w (ce_alpha CE + l1_alpha L1). Two fp32 `[c, V]` buffers live at once: z's (then p_d, then the
    gradient) and p_t's (then p_d - p_t, its sign, then the L1 gradient)."""
    z = logits.float()
    hit = z.argmax(dim=-1) == labels
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    ce = (lse - z.gather(-1, labels.unsqueeze(-1))).squeeze(-1)
    p = z.sub_(lse).exp_()  # p_d
    t = target.float()
    diff = t.sub_(torch.logsumexp(t, dim=-1, keepdim=True)).exp_().neg_().add_(p)  # p_d - p_t
    l1 = torch.linalg.vector_norm(diff, ord=1, dim=-1)
    if not need_grad:
        return ce, l1, hit, None
    # d L1 / d z = p * (s - <s, p>) with s = sign(p_d - p_t): the softmax Jacobian applied to the sign
    sign = diff.sign_()
    d_l1 = sign.sub_(torch.einsum("cv,cv->c", sign, p).unsqueeze(-1)).mul_(p)
    d_ce = p.scatter_add_(-1, labels.unsqueeze(-1), torch.full_like(lse, -1.0))  # softmax - onehot
    return ce, l1, hit, d_ce.mul_((weights * ce_alpha).unsqueeze(-1)).add_(d_l1.mul_((weights * l1_alpha).unsqueeze(-1)))


@functools.cache
def _compiled_dspark_chunk():
    return torch.compile(_dspark_chunk, dynamic=False)  # built on first use, as `losses._compiled_ce_chunk`


class _DSparkDistributionLoss(torch.autograd.Function):
    """sum w (ce_alpha CE(z, y) + l1_alpha ||softmax z - softmax t||_1), z = h W^T + u W2^T, t = g W^T.

    As `losses._DominoLinearCrossEntropy`: chunked over tokens so no `[T, V]` tensor exists at once, the
    gradients formed chunk by chunk in the forward (the weights are known then) and only scaled in the
    backward. Vocabulary-sized products are 2-D GEMMs in the head's dtype; W2's gradient accumulates in fp32."""

    @staticmethod
    def forward(ctx, hidden, target_hidden, markov, w2, head, labels, weights, alphas, chunk_size, needs,
                compiled):  # noqa: D401
        need_h, need_u, need_w2 = needs
        need_any = any(needs)
        chunk = _compiled_dspark_chunk() if compiled else _dspark_chunk
        n, device = hidden.shape[0], hidden.device
        w2h = w2.to(head.dtype)
        ce, l1 = (torch.empty(n, dtype=torch.float32, device=device) for _ in range(2))
        hit, base_hit = (torch.empty(n, dtype=torch.bool, device=device) for _ in range(2))
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_u = torch.empty_like(markov) if need_u else None
        grad_w2 = torch.zeros(w2.shape, dtype=torch.float32, device=device) if need_w2 else None
        for start in range(0, n, chunk_size):
            rows = slice(start, min(start + chunk_size, n))
            u = markov[rows].to(head.dtype)  # [c, r]
            logits = head_logits(hidden[rows], head)  # [c, V] the backbone's U
            base_hit[rows] = logits.argmax(dim=-1) == labels[rows]
            logits.addmm_(u, w2h.t())  # z = U + W2 W1[x] in U's buffer: no separate [c, V] bias
            ce[rows], l1[rows], hit[rows], d = chunk(logits, head_logits(target_hidden[rows], head), labels[rows],
                                                     weights[rows], *alphas, need_any)
            if not need_any:
                continue
            d = d.to(head.dtype)  # [c, V]
            if need_h:
                grad_h[rows] = (d @ head).to(hidden.dtype)
            if need_u:
                grad_u[rows] = (d @ w2h).to(markov.dtype)
            if need_w2:
                grad_w2 += (d.t() @ u).float()
        ctx.save_for_backward(grad_h, grad_u, grad_w2)
        ctx.w2_dtype = w2.dtype
        ctx.mark_non_differentiable(ce, l1, hit, base_hit)
        return (weights * (alphas[0] * ce + alphas[1] * l1)).sum(), ce, l1, hit, base_hit

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grad_h, grad_u, grad_w2 = ctx.saved_tensors
        g = grad_loss.float()
        return (None if grad_h is None else grad_h * g.to(grad_h.dtype), None,
                None if grad_u is None else grad_u * g.to(grad_u.dtype),
                None if grad_w2 is None else (grad_w2 * g).to(ctx.w2_dtype),
                None, None, None, None, None, None, None)


@dataclass
class DSparkDistributionLosses:
    """What `dspark_distribution_losses` returns for T tokens."""

    loss_sum: torch.Tensor  # [] fp32, sum w (ce_alpha CE + l1_alpha L1), differentiable
    ce: torch.Tensor  # [T] fp32 CE of z (unweighted, detached)
    l1: torch.Tensor  # [T] fp32 ||p_d - p_t||_1 (unweighted, detached)
    correct: torch.Tensor  # [T] bool, argmax z == label (the Markov-corrected draft)
    base_correct: torch.Tensor  # [T] bool, argmax of the backbone logits alone == label


def dspark_distribution_losses(hidden: torch.Tensor, target_hidden: torch.Tensor, markov: torch.Tensor,
                               markov_w2: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                               weights: torch.Tensor, ce_alpha: float, l1_alpha: float, chunk_size: int = 4096,
                               compiled: bool = False) -> DSparkDistributionLosses:
    """The CE and L1 terms of T scored slots through the frozen head, chunked over tokens.

    Args:
        hidden: `[T, H]` draft states; target_hidden: `[T, H]` the target's last hidden state at the slot's
            position (no gradient); markov: `[T, r]` W1 of the slot's previous token; markov_w2: `[V, r]`;
        head_weight: `[V, H]` frozen; labels: `[T]` long; weights: `[T]` float (0 drops a slot);
        chunk_size: tokens per vocabulary pass; compiled: each chunk's math through torch.compile.
    """
    # Inside autograd.Function.forward grad mode is off and parameters still say requires_grad: decide
    # here which gradients to form, so no_grad evaluation does no gradient work.
    track = torch.is_grad_enabled()
    needs = (track and hidden.requires_grad, track and markov.requires_grad, track and markov_w2.requires_grad)
    out = _DSparkDistributionLoss.apply(hidden, target_hidden.detach(), markov, markov_w2, head_weight.detach(), labels,
                                        weights.float(), (ce_alpha, l1_alpha), chunk_size, needs, compiled)
    return DSparkDistributionLosses(*out)


# ---- the objective ---------------------------------------------------------------------------------


def dspark_metrics(t: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """DSpark's flushed metrics from a window's sums: accuracy / tau are the Markov-corrected drafts', loss their
    weighted CE; then the loss terms and the confidence head's calibration (mean predicted confidence against
    the mean soft acceptance 1 - L1 / 2 over the supervised slots)."""
    return {"base_accuracy": ratio(t["base_correct"], t["scored"]).item(),
            "base_tau": 1.0 + ratio(t["base_accepted"], t["blocks"]).item(),
            "dspark_loss": ratio(t["objective_sum"], t["weight_sum"]).item(),  # what is minimised: CE, L1, BCE mixed
            "l1_loss": ratio(t["l1_loss_sum"], t["weight_sum"]).item(),  # ||p_draft - p_target||_1 (2 x TV)
            "confidence_loss": ratio(t["confidence_loss_sum"], t["weight_sum"]).item(),  # BCE vs the soft target
            "mean_confidence": ratio(t["confidence_sum"], t["scored"]).item(),
            "mean_acceptance": ratio(t["acceptance_sum"], t["scored"]).item()}


class DSparkObjective(DFlashObjective):
    """DSpark block losses (module doc). Same interface as `DFlashObjective`; fills the "dspark" metrics.

    `gamma` is DSpark's decay (`dspark.loss_decay_gamma`: a number, or None for none); `ce_alpha`, `l1_alpha`,
    `confidence_alpha` weigh the three terms (the last one needs the draft's confidence head)."""


    def __init__(self, target: Target, draft: DSparkDraftModel, *, ce_alpha: float = 0.1, l1_alpha: float = 0.9,
                 confidence_alpha: float = 1.0, **kwargs: Any) -> None:
        if not isinstance(draft, DSparkDraftModel):
            raise TypeError(f"a DSpark objective needs a DSparkDraftModel, got {type(draft).__name__} (build one with "
                            "dflash.factory.build_draft and draft.kind: dspark, or load a DSpark export)")
        if not isinstance(target, LastHiddenTarget):
            raise TypeError(f"a DSpark objective reads the target's final-norm last hidden state: {type(target).__name__} "
                            "does not give it (FrozenTarget and the tensor-parallel GroupBatchTarget do; offline "
                            "features do not)")
        if kwargs.get("position_weights", "decay") not in ("decay", "none"):
            raise ValueError("DSpark's position weights are decay or none (D-PACE is not implemented for its loss)")
        super().__init__(target, draft, **kwargs)
        self.ce_alpha, self.l1_alpha, self.confidence_alpha = ce_alpha, l1_alpha, confidence_alpha

    def metric_layout(self) -> MetricLayout:
        """Every slot proposes (bs of them); the backbone-only argmax's accuracy / tau, the loss terms and the
        confidence calibration beside DFlash's."""
        return MetricLayout(self.block_size, {"base_correct": 1, "base_accepted": 1, "objective_sum": 1,
                                              "l1_loss_sum": 1, "confidence_loss_sum": 1, "confidence_sum": 1,
                                              "acceptance_sum": 1}, dspark_metrics)

    def plan(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, generator: torch.Generator | None,
             num_anchors: int | None = None, rows: GlobalRows | None = None,
             position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, BlockTargets]:
        """`DFlashObjective.plan` with DSpark's targets `[B, N, bs + 1]` (`dspark_block_targets`)."""
        anchors, keep = self.sample(loss_mask, generator, num_anchors, rows, position_ids)
        return anchors, keep, dspark_block_targets(input_ids, loss_mask, anchors, keep, self.block_size, self.gamma,
                                                   position_ids)

    def block_states(self, input_ids: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                     targets: BlockTargets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(draft states `[B, N, bs, H]`, the target's last hidden state at each slot's position a + k
        `[B, N, bs, H]`, labels `[B, N, bs + 1]`) from one run of every target layer."""
        bsz, seq_len = input_ids.shape
        position_ids = targets.position_ids  # packed rows' documents (None: one a row)
        with torch.autocast(input_ids.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            packed = {} if position_ids is None else {"position_ids": position_ids}  # stand-ins take whole rows
            features, last = self.target.features_and_last_hidden(input_ids, **packed)
            # Under labels: target the draft learns the target's greedy next tokens, read off the same state.
            labels = (block_labels(greedy_labels(input_ids, last, self.target.lm_head_weight), anchors, targets.valid)
                      if self.labels == "target" else targets.labels)
            block_ids, positions = self.block_inputs(input_ids, anchors, position_ids)
            hidden = self.draft_call(self.target.embed(block_ids), positions,
                                     self.mask(anchors, keep, seq_len, position_ids), target_hidden=features,
                                     ctx_position_ids=position_ids)  # [B, N*bs, H]
        at, _ = block_positions(anchors, self.block_size, seq_len)  # a + k, clamped: weight 0 where it is past S
        state = last.gather(1, at.flatten(1).unsqueeze(-1).expand(-1, -1, last.shape[-1]))
        shape = (bsz, anchors.shape[1], self.block_size, -1)
        return hidden.view(shape), state.view(shape), labels

    def forward(self, input_ids: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, targets: BlockTargets,
                features: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> BlockOutput:
        """One micro-batch's `BlockOutput`: loss_sum the whole DSpark loss, ce_sum its CE term unscaled
        (the reported loss); `correct` `[B, N, bs]` the Markov-corrected argmax."""
        if features is not None or labels is not None:  # config refuses data.features; a direct caller hears why
            raise ValueError("a DSpark objective runs its target (it needs the last hidden state): pass no offline "
                             "features or labels")
        draft: DSparkDraftModel = self.draft
        hidden, state, block = self.block_states(input_ids, anchors, keep, targets)
        shape = hidden.shape[:3]
        flat = hidden.reshape(-1, hidden.shape[-1])  # [T, H], T = B * N * bs
        gold, weights = block[..., 1:].reshape(-1), targets.weights[..., 1:].reshape(-1)
        valid = targets.valid[..., 1:]
        # Slot k's previous token: the token at a + k as teacher forcing reads it (slot 0: the anchor token).
        previous = teacher_tokens(input_ids, anchors, block, targets.valid, self.block_size).reshape(-1)
        with torch.autocast(input_ids.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            markov = draft.markov_head.markov_w1(previous)  # [T, r]
            dist = dspark_distribution_losses(flat, state.reshape(flat.shape), markov, draft.markov_head.markov_w2.weight,
                                              self.target.lm_head_weight, gold, weights, self.ce_alpha, self.l1_alpha,
                                              self.ce_chunk_size, self.compile_loss)
            logits = draft.confidence_head(flat, markov) if draft.confidence_head is not None else None  # [T]
        acceptance = (1 - 0.5 * dist.l1).clamp(0, 1)  # c*, detached: l1 carries no gradient
        if logits is None:  # no confidence head: no term, and no confidence to report
            bce_sum, confidence = torch.zeros_like(dist.loss_sum), torch.zeros_like(weights)
        else:
            bce_sum = (weights * F.binary_cross_entropy_with_logits(logits, acceptance, reduction="none")).sum()
            confidence = torch.sigmoid(logits.detach())
        loss_sum = dist.loss_sum + self.confidence_alpha * bce_sum
        ce_sum = (weights * dist.ce).sum()
        finite = torch.isfinite(ce_sum)  # counted with the micro-batches `accumulate` counts
        base_correct = dist.base_correct.view(shape)
        scored = valid.reshape(-1)
        extras = {
            "base_correct": (base_correct & valid).sum(),
            "base_accepted": (accepted_prefix_length(base_correct, valid) * keep).sum(),
            **{name: torch.where(finite, value, 0.0) for name, value in (
                ("objective_sum", loss_sum.detach()), ("l1_loss_sum", (weights * dist.l1).sum()),
                ("confidence_loss_sum", bce_sum.detach()),
                ("confidence_sum", torch.where(scored, confidence, 0.0).sum()),
                ("acceptance_sum", torch.where(scored, acceptance, 0.0).sum()))},
        }
        return BlockOutput(loss_sum=loss_sum, ce_sum=ce_sum, correct=dist.correct.view(shape), extras=extras)
