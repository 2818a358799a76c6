"""Block labels and weights, and the DFlash loss through the frozen LM head.

Same-position layout: slot k >= 1 of the block anchored at a predicts `input_ids[a + k]`; slot 0 (the
clean anchor token) is never a target. Weight of a slot:

    w = keep * (a + k < S) * loss_mask[a + k] * exp(-(k - 1) / gamma)

The loss is `sum(w * CE) / sum(w)` over the whole accumulation window (and, distributed, all ranks):
the caller passes the denominator as a device tensor. Nothing here reads a device value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockTargets:
    """Per-slot labels of N blocks of bs slots: all `[B, N, bs]`."""

    labels: torch.Tensor  # long, a safe index everywhere (0 where invalid)
    weights: torch.Tensor  # float32, zero where invalid and on slot 0
    valid: torch.Tensor  # bool: a supervised label exists (keep, inside S, loss_mask, slot >= 1)


def block_positions(anchors: torch.Tensor, block_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions `a + k` of every slot, clamped to a safe index, and whether they lie inside S. `[B, N, bs]`."""
    pos = anchors.unsqueeze(-1) + torch.arange(block_size, device=anchors.device)
    return pos.clamp(max=seq_len - 1), pos < seq_len


def block_labels(label_ids: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`label_ids[b, a + k]` for every slot (0 where not valid). `label_ids`: `[B, S]` token ids, the
    data itself or the target's greedy next tokens (`data.labels: target`)."""
    safe, _ = block_positions(anchors, valid.shape[-1], label_ids.shape[1])
    labels = torch.gather(label_ids, 1, safe.flatten(1)).view_as(safe)
    return torch.where(valid, labels, 0)


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    gamma: float,
) -> BlockTargets:
    """Labels, weights and validity for blocks anchored at `anchors` `[B, N]` in `input_ids` `[B, S]`.

    Weights and validity depend only on positions and `loss_mask`, never on label values, so the
    trainer can form the loss denominator before any forward pass.
    """
    safe, inside = block_positions(anchors, block_size, input_ids.shape[1])
    slots = torch.arange(block_size, device=input_ids.device)
    supervised = torch.gather(loss_mask.bool(), 1, safe.flatten(1)).view_as(safe)
    valid = keep.unsqueeze(-1) & inside & supervised & (slots > 0)
    decay = torch.exp(-(slots.float() - 1).clamp(min=0) / gamma)
    return BlockTargets(labels=block_labels(input_ids, anchors, valid), weights=valid.float() * decay, valid=valid)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_t w_t * CE(hidden_t @ W^T, y_t), chunked over tokens so `[T, V]` logits never exist at once.

    The head W is frozen, so the gradient w.r.t. `hidden` is computed chunk by chunk in the forward
    pass (d loss / d logits = w * (softmax - onehot)) and the backward only scales it: one pass over
    the vocabulary instead of a stored or recomputed logits tensor. Log-sum-exp in fp32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, token_weights, chunk_size):  # noqa: D401
        needs_grad = hidden.requires_grad
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            logits = (hidden[start:end].to(weight.dtype) @ weight.t()).float()  # [c, V]
            y, w = labels[start:end], token_weights[start:end]
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, y.unsqueeze(1)).squeeze(1)
            total = total + (w * (lse - target_logit)).sum()
            correct[start:end] = logits.argmax(dim=-1) == y
            if needs_grad:
                probs = torch.softmax(logits, dim=-1)  # reuse: d/dlogits = w * (p - onehot)
                probs.scatter_add_(1, y.unsqueeze(1), -torch.ones_like(target_logit).unsqueeze(1))
                probs.mul_(w.unsqueeze(1))
                grad_hidden[start:end] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)
        if needs_grad:
            ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_weights: torch.Tensor,
    chunk_size: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted CE sum through a frozen LM head, and per-token argmax correctness.

    Args:
        hidden: `[T, H]` draft states; weight: `[V, H]` frozen head; labels: `[T]` long;
        token_weights: `[T]` float (0 drops a token); chunk_size: tokens per vocabulary pass.
    Returns:
        (loss_sum `[]` fp32, differentiable w.r.t. hidden; correct `[T]` bool, detached).
    """
    return _LinearCrossEntropy.apply(hidden, weight.detach(), labels, token_weights.float(), chunk_size)


def accepted_prefix_length(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Teacher-forced acceptance per block: the number of leading slots that are valid and correct.

    `correct`, `valid`: `[B, N, bs - 1]` bool for slots 1..bs-1 (slot 0 is never scored). Returns `[B, N]` long.
    """
    return (correct & valid).long().cumprod(dim=-1).sum(dim=-1)
