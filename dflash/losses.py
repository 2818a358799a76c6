"""Block labels and weights, and the DFlash loss through the frozen LM head.

Same-position layout: slot k >= 1 of the block anchored at a predicts `input_ids[a + k]`; slot 0 (the
clean anchor token) is never a target. Weight of a slot:

    w = keep * (a + k < S) * loss_mask[a + k] * exp(-(k - 1) / gamma)      (no decay factor when gamma is None)

In a packed row (`position_ids` restarting at 0 for each document) "a + k < S" reads "a + k in a's document":
a slot past its document's end is unsupervised exactly as a slot past an unpacked row's end.

The loss is `sum(w * CE) / sum(w)` over the whole accumulation window (and, distributed, all ranks):
the caller passes the denominator as a device tensor. Nothing here reads a device value.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class BlockTargets:
    """Per-slot labels of N blocks of bs slots: all `[B, N, bs]`; and the rows' document layout."""

    labels: torch.Tensor  # long, a safe index everywhere (0 where invalid)
    weights: torch.Tensor  # float32, zero where invalid and on slot 0
    valid: torch.Tensor  # bool: a supervised label exists (keep, inside S, loss_mask, slot >= 1)
    # `[B, S]` positions of packed rows, restarting at 0 for each document (`dflash.data.packing`): the target's
    # attention, the draft's positions and its context end at the document's edges. None: one document a row.
    position_ids: torch.Tensor | None = None


def block_positions(anchors: torch.Tensor, block_size: int, seq_len: int,
                    position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions `a + k` of every slot, clamped to a safe index, and whether they lie inside S (and, with packed
    rows' `position_ids` `[B, S]`, inside the anchor's document). `[B, N, bs]`."""
    slots = torch.arange(block_size, device=anchors.device)
    pos = anchors.unsqueeze(-1) + slots
    safe, inside = pos.clamp(max=seq_len - 1), pos < seq_len
    if position_ids is not None:  # the same document: its positions run on without a restart
        at = torch.gather(position_ids, 1, safe.flatten(1)).view_as(safe)
        inside = inside & (at == at[..., :1] + slots)
    return safe, inside


def block_labels(label_ids: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`label_ids[b, a + k]` for every slot (0 where not valid). `label_ids`: `[B, S]` token ids, the
    data itself or the target's greedy next tokens (`data.labels: target`)."""
    safe, _ = block_positions(anchors, valid.shape[-1], label_ids.shape[1])
    labels = torch.gather(label_ids, 1, safe.flatten(1)).view_as(safe)
    return torch.where(valid, labels, 0)


def teacher_tokens(input_ids: torch.Tensor, anchors: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                   count: int) -> torch.Tensor:
    """The token at a + j `[B, N, count]` as a teacher-forced causal head reads it: the label where slot j is
    supervised (labels `[B, N, bs]`, valid `[B, N, bs]`), else the data token (j = 0: the anchor token)."""
    positions, _ = block_positions(anchors, count, input_ids.shape[1])
    data = torch.gather(input_ids, 1, positions.flatten(1)).view_as(positions)
    return torch.where(valid[..., :count], labels[..., :count], data)


# Position decay gamma by block size: the values the design card gives (DESIGN §4).
_DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def decay_gamma(setting: float | str | None, block_size: int) -> float | None:
    """The position decay's gamma for `draft.loss_decay_gamma`: "auto" -> the design card's value for
    bs 16 / 10 / 8, else 0.45 * bs (our interpolation: gamma / bs is 0.44-0.5 for the three given
    values); a number -> itself; None -> None (no decay)."""
    if setting == "auto":
        return _DECAY_GAMMA.get(block_size, max(1.0, 0.45 * block_size))
    return None if setting is None else float(setting)


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    gamma: float | None,
    position_ids: torch.Tensor | None = None,
) -> BlockTargets:
    """Labels, weights and validity for blocks anchored at `anchors` `[B, N]` in `input_ids` `[B, S]`;
    `gamma` None: no position decay (weight 1 on every supervised slot); `position_ids` `[B, S]`: packed rows.

    Weights and validity depend only on positions and `loss_mask`, never on label values, so the
    trainer can form the loss denominator before any forward pass.
    """
    safe, inside = block_positions(anchors, block_size, input_ids.shape[1], position_ids)
    slots = torch.arange(block_size, device=input_ids.device)
    supervised = torch.gather(loss_mask.bool(), 1, safe.flatten(1)).view_as(safe)
    valid = keep.unsqueeze(-1) & inside & supervised & (slots > 0)
    weights = valid.float()
    if gamma is not None:
        weights = weights * torch.exp(-(slots.float() - 1).clamp(min=0) / gamma)
    return BlockTargets(labels=block_labels(input_ids, anchors, valid), weights=weights, valid=valid,
                        position_ids=position_ids)


def window_loss_scale(targets: Sequence[BlockTargets], world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, Σ w), both `[]` fp32. `scale` is the factor each micro-batch's `Σ w·CE` is multiplied by
    before its backward: `world_size / Σ w`, the weights summed over the accumulation window and (a
    collective, never read to the host) over every rank. DDP and FSDP2 average gradients over ranks;
    the `world_size` factor turns that average into the gradient of the global token mean. Σ w is 0
    for a window with nothing supervised (the trainer skips its update)."""
    denominator = torch.stack([t.weights.sum() for t in targets]).sum()
    if world_size > 1:
        dist.all_reduce(denominator)
    return world_size / denominator.clamp(min=1e-6), denominator


def head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits `[..., V]` of states `[..., H]` through a head `[V, H]`, as one 2-D GEMM in the head's dtype.
    A strided 3-D operand (a slice of block or sequence states) would make `@` a batched GEMM that reads
    the whole head once per leading index."""
    if hidden.dim() == 2:  # rows already: no reshape, and no view op on the vocabulary-sized result
        return hidden.to(weight.dtype) @ weight.t()
    return (hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype) @ weight.t()).view(*hidden.shape[:-1], -1)


def _ce_stats(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """(weighted CE per row `[..]`, log-sum-exp `[..]`, argmax == label `[..]`) of fp32 `logits` `[.., V]`."""
    lse = torch.logsumexp(logits, dim=-1)
    target = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return weights * (lse - target), lse, logits.argmax(dim=-1) == labels


def _ce_grad_(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """d(sum scale * CE)/d logits = scale * (softmax - onehot), written over `logits` (consumed)."""
    if torch.compiler.is_compiling():
        # Traced by torch.compile: the one-hot as a compare with the vocabulary index, so the whole
        # expression is one pointwise kernel that writes the caller's dtype. The in-place scatter below
        # makes inductor store an fp32 [c, V] buffer first (tests/test_model_loss.py checks the code).
        onehot = torch.arange(logits.shape[-1], device=logits.device) == labels.unsqueeze(-1)
        return (torch.exp(logits - lse.unsqueeze(-1)) - onehot.float()) * scale.unsqueeze(-1)
    probs = logits.sub_(lse.unsqueeze(-1)).exp_()  # softmax in place: the logits are not needed again
    probs.scatter_add_(-1, labels.unsqueeze(-1), torch.full_like(lse, -1.0).unsqueeze(-1))
    return probs.mul_(scale.unsqueeze(-1))


def _ce_chunk(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, need_grad: bool):
    """One chunk of the weighted CE on `[c, V]` logits of any float dtype, with the math in fp32:
    (weighted CE per row `[c]`, correct `[c]`, d loss / d logits `[c, V]` in the logits' dtype, or None).

    Eagerly the fp32 copy is the only extra `[c, V]` buffer (the gradient's softmax is written over it,
    `_ce_grad_`). Compiled (`_compiled_ce_chunk`), the cast, log-sum-exp, argmax and gradient fuse
    into two passes over the bf16 logits (a reduction, then one pointwise kernel that writes the
    gradient in the logits' dtype) and no fp32 `[c, V]` tensor is stored at all.
    """
    x = logits.float()
    rows, lse, correct = _ce_stats(x, labels, weights)
    if not need_grad:
        return rows, correct, None
    return rows, correct, _ce_grad_(x, lse, labels, weights).to(logits.dtype)


@functools.cache
def _compiled_ce_chunk():
    return torch.compile(_ce_chunk, dynamic=False)  # built on first use: importing dynamo costs ~1 s


class _LinearCrossEntropy(torch.autograd.Function):
    """w_t * CE(hidden_t @ W^T, y_t) per token, chunked over tokens so `[T, V]` logits never exist at once.

    The head W is frozen, so the gradient w.r.t. `hidden` is computed chunk by chunk in the forward
    pass (d loss / d logits = w * (softmax - onehot)) and the backward only scales each row of it: one
    pass over the vocabulary instead of a stored or recomputed logits tensor. Log-sum-exp in fp32.
    The per-row output lets a caller weigh rows by values known only after this forward (D-PACE).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, token_weights, chunk_size, compiled, top_k):  # noqa: D401
        needs_grad = hidden.requires_grad
        chunk = _compiled_ce_chunk() if compiled else _ce_chunk
        rows = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        top = torch.empty(hidden.shape[0], top_k, dtype=torch.long, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            logits = head_logits(hidden[start:end], weight)  # [c, V] in the head's dtype
            if top_k:  # before the chunk, which may write its softmax over these logits
                top[start:end] = logits.topk(top_k, dim=-1).indices
            rows[start:end], correct[start:end], grad_logits = chunk(logits, labels[start:end],
                                                                     token_weights[start:end], needs_grad)
            if needs_grad:
                grad_hidden[start:end] = (grad_logits @ weight).to(hidden.dtype)
        if needs_grad:
            ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct, top)
        return rows, correct, top

    @staticmethod
    def backward(ctx, grad_rows, grad_correct, grad_top):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_rows.to(grad_hidden.dtype).unsqueeze(-1), None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_weights: torch.Tensor,
    chunk_size: int = 4096,
    compiled: bool = False,
    *,
    per_row: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted CE sum through a frozen LM head, and per-token argmax correctness.

    Args:
        hidden: `[T, H]` draft states; weight: `[V, H]` frozen head; labels: `[T]` long;
        token_weights: `[T]` float (0 drops a token); chunk_size: tokens per vocabulary pass;
        compiled: run each chunk's CE through torch.compile (`compile: true`; see `_ce_chunk`);
        per_row: return the weighted CE of every token `[T]` instead of their sum.
    Returns:
        (loss_sum `[]` fp32 (or `[T]` with `per_row`), differentiable w.r.t. hidden; correct `[T]` bool,
        detached).
    """
    rows, correct, _ = _LinearCrossEntropy.apply(hidden, weight.detach(), labels, token_weights.float(), chunk_size,
                                                 compiled, 0)
    return (rows if per_row else rows.sum()), correct


def linear_cross_entropy_topk(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, token_weights: torch.Tensor,
                              k: int, chunk_size: int = 4096, compiled: bool = False
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`linear_cross_entropy`'s (loss_sum, correct) and the indices `[T, k]` of each token's k largest head
    logits, taken from the logits the CE's chunk loop forms anyway (DFlash 2's candidates): one pass of the
    head over the tokens fewer than a separate top-k."""
    rows, correct, top = _LinearCrossEntropy.apply(hidden, weight.detach(), labels, token_weights.float(), chunk_size,
                                                   compiled, k)
    return rows.sum(), correct, top


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights `[..., K]` (arXiv 2605.18810) for the per-slot CE `[..., K]` of blocks.

    From the draft's own confidence q_i = exp(-CE_i), smoothed q~_i = (1 - alpha) * q_i + alpha, slot j
    weighs w_j = sum_{m >= j} prod_{i <= m} q~_i: the expected accepted length that slot j's correctness
    is part of, so the signal goes to the positions that currently end acceptance. An invalid slot ends
    its block's chain (q~ = 0 there: a decoder's block does not run past it) and weighs 0. The weights
    are detached: they rescale the CE, they are not trained through."""
    q = torch.exp(-ce.detach().float())
    chain = torch.cumprod(torch.where(valid, (1 - alpha) * q + alpha, 0.0), dim=-1)
    weights = chain.flip(-1).cumsum(-1).flip(-1)
    return torch.where(valid, weights, 0.0)


def accepted_prefix_length(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Teacher-forced acceptance per block: the number of leading slots that are valid and correct.

    `correct`, `valid`: `[B, N, bs - 1]` bool for slots 1..bs-1 (slot 0 is never scored). Returns `[B, N]` long.
    """
    return (correct & valid).long().cumprod(dim=-1).sum(dim=-1)


# ---- Domino: base and corrected logits in one pass over the vocabulary ------------------------


@dataclass
class DominoCrossEntropy:
    """What `domino_linear_cross_entropy` returns for M blocks of P scored proposals."""

    loss_sum: torch.Tensor  # [] fp32, (1 - lam) * final_sum + lam * base_sum, differentiable
    final_sum: torch.Tensor  # [] fp32, weighted CE of the corrected logits (detached)
    base_sum: torch.Tensor  # [] fp32, weighted CE of the base logits (detached)
    final_correct: torch.Tensor  # [M, P] bool, argmax of the corrected logits == label
    base_correct: torch.Tensor  # [M, P] bool, argmax of the base logits == label


def _domino_ce_chunk(base: torch.Tensor, delta: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                     lam: torch.Tensor, suffix_start: int, need_grad: bool):
    """One chunk of Domino's mixed CE, math in fp32 over logits of any float dtype.

    Args:
        base: `[c, P, V]` base logits (consumed: eagerly in fp32 its buffer holds a softmax afterwards);
        delta: `[c, P - s, V]` correction logits of the proposals from `suffix_start` s on;
        labels: `[c, P]` long; weights: `[c, P]` fp32; lam: `[]` the base-loss weight.
    Returns:
        (weighted CE of the final logits `[c, P]`, of the base logits `[c, P]`, final argmax == label `[c, P]`,
        base argmax == label `[c, P]`, d loss / d base `[c, P, V]` and d loss / d delta `[c, P - s, V]` in the
        logits' dtypes, or None, None), where loss = (1 - lam) * CE(final) + lam * CE(base) and
        final = base + delta on the corrected proposals. Compiled (`_compiled_domino_ce_chunk`), the casts,
        both log-sum-exps and argmaxes and both gradients fuse into passes over the low-precision logits.
    """
    s = suffix_start
    b = base.float()
    final = torch.cat([b[:, :s], b[:, s:] + delta.float()], dim=1)
    f_rows, f_lse, f_hit = _ce_stats(final, labels, weights)
    b_rows, b_lse, b_hit = _ce_stats(b, labels, weights)
    if not need_grad:
        return f_rows, b_rows, f_hit, b_hit, None, None
    d_final = _ce_grad_(final, f_lse, labels, weights * (1 - lam))
    # The correction logits enter the final logits only. A copy: d_final is added to in place next.
    d_delta = d_final[:, s:].to(delta.dtype, copy=True)
    # The base logits feed both terms: d loss / d base = d final + lam * d CE(base).
    d_base = d_final.add_(_ce_grad_(b, b_lse, labels, weights * lam))
    return f_rows, b_rows, f_hit, b_hit, d_base.to(base.dtype), d_delta


@functools.cache
def _compiled_domino_ce_chunk():
    return torch.compile(_domino_ce_chunk, dynamic=False)  # built on first use, as `_compiled_ce_chunk`


class _DominoLinearCrossEntropy(torch.autograd.Function):
    """Mixed Domino CE of base logits `h W^T` and final logits `h W^T + u W2^T` (suffix proposals).

    Chunked over blocks so no `[M, P, V]` tensor exists at once. As in `_LinearCrossEntropy`, the
    gradients are formed chunk by chunk in the forward pass (one pass over the vocabulary): the mix
    weight lam is known then, so one `[M * P, H]` buffer holds d loss / d h for both terms. Every
    vocabulary-sized product is a plain 2-D GEMM in the head's (compute) dtype, W2 cast to it as
    autocast casts a Linear's weight; W2's gradient is accumulated over chunks in fp32.
    """

    @staticmethod
    def forward(ctx, hidden, head, correction, corr_weight, labels, token_weights, lam, suffix_start, block_chunk,
                needs, compiled):  # noqa: D401
        need_h, need_u, need_w2 = needs
        need_any = need_h or need_u or need_w2
        (m, p), s, device = labels.shape, suffix_start, hidden.device
        q = p - s  # corrected proposals per block
        lam = lam.float()
        chunk = _compiled_domino_ce_chunk() if compiled else _domino_ce_chunk
        w2 = corr_weight.to(head.dtype)
        final_sum = torch.zeros((), dtype=torch.float32, device=device)
        base_sum = torch.zeros((), dtype=torch.float32, device=device)
        final_correct = torch.empty(labels.shape, dtype=torch.bool, device=device)
        base_correct = torch.empty(labels.shape, dtype=torch.bool, device=device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_u = torch.empty_like(correction) if need_u else None
        grad_w2 = torch.zeros(corr_weight.shape, dtype=torch.float32, device=device) if need_w2 else None
        for start in range(0, m, block_chunk):
            end = min(start + block_chunk, m)
            rows, corrected = slice(start * p, end * p), slice(start * q, end * q)  # this chunk's rows
            u = correction[corrected].to(head.dtype)  # [c * q, E]
            base = head_logits(hidden[rows], head).view(end - start, p, -1)  # [c, P, V]
            delta = (u @ w2.t()).view(end - start, q, -1)  # [c, q, V]
            f_rows, b_rows, f_hit, b_hit, d_base, d_delta = chunk(base, delta, labels[start:end],
                                                                 token_weights[start:end], lam, s, need_any)
            del base, delta
            final_sum += f_rows.sum()
            base_sum += b_rows.sum()
            final_correct[start:end], base_correct[start:end] = f_hit, b_hit
            if not need_any:
                continue
            d_delta = d_delta.flatten(0, 1)  # [c * q, V]
            if need_u:
                grad_u[corrected] = (d_delta @ w2).to(correction.dtype)
            if need_w2:
                grad_w2 += (d_delta.t() @ u).float()
            if need_h:
                grad_h[rows] = (d_base.flatten(0, 1) @ head).to(hidden.dtype)
        ctx.save_for_backward(grad_h, grad_u, grad_w2)
        ctx.w2_dtype = corr_weight.dtype
        ctx.mark_non_differentiable(final_sum, base_sum, final_correct, base_correct)
        return (1 - lam) * final_sum + lam * base_sum, final_sum, base_sum, final_correct, base_correct

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grad_h, grad_u, grad_w2 = ctx.saved_tensors
        g = grad_loss.float()
        return (
            None if grad_h is None else grad_h * g.to(grad_h.dtype),
            None,
            None if grad_u is None else grad_u * g.to(grad_u.dtype),
            None if grad_w2 is None else (grad_w2 * g).to(ctx.w2_dtype),
            None, None, None, None, None, None, None,
        )


def domino_linear_cross_entropy(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    correction: torch.Tensor,
    correction_weight: torch.Tensor,
    labels: torch.Tensor,
    token_weights: torch.Tensor,
    lam: torch.Tensor,
    suffix_start: int,
    chunk_size: int = 4096,
    compiled: bool = False,
) -> DominoCrossEntropy:
    """Domino's loss `(1 - lam) * CE(final) + lam * CE(base)` through the frozen LM head, chunked.

    base logits  = hidden @ head_weight^T                        (all P proposals)
    final logits = base logits + correction @ correction_weight^T (proposals suffix_start..P-1;
                   the first `suffix_start` keep their base logits)

    Args:
        hidden: `[M, P, H]` backbone states, one per scored proposal (any strides: a view of the draft's
            `[M, bs, H]` states is copied once into `[M * P, H]` rows, so every product is a 2-D GEMM).
        head_weight: `[V, H]` frozen LM head (no gradient); its dtype is the vocabulary GEMMs' dtype.
        correction: `[M, P - suffix_start, E]` correction features (after the SiLU).
        correction_weight: `[V, E]` the trainable low-rank output matrix (Domino's `embed_proj.2`).
        labels: `[M, P]` long; token_weights: `[M, P]` float (0 drops a proposal).
        lam: `[]` device tensor, the base-loss weight (read on the device, never on the host).
        suffix_start: proposals before it get no correction; chunk_size: tokens per vocabulary pass;
        compiled: run each chunk's CE math through torch.compile (`compile: true`; `_domino_ce_chunk`).
    Returns:
        `DominoCrossEntropy`; `loss_sum` is differentiable w.r.t. hidden, correction and
        correction_weight, the sums and correctness are detached.
    """
    m, p = labels.shape
    if hidden.shape[:2] != (m, p) or correction.shape[:2] != (m, p - suffix_start):
        raise ValueError(f"shapes disagree: hidden {tuple(hidden.shape)}, correction {tuple(correction.shape)}, "
                         f"labels {tuple(labels.shape)}, suffix_start {suffix_start}")
    # Inside autograd.Function.forward grad mode is off and parameters still say requires_grad:
    # decide here which gradients to form, so no_grad evaluation does no gradient work.
    track = torch.is_grad_enabled()
    needs = (track and hidden.requires_grad, track and correction.requires_grad,
             track and correction_weight.requires_grad)
    # Rows, not [M, P, H] views: a strided 3-D operand would make `@` a batched GEMM that reads the whole
    # head once per block (the 155 ms kernel of docs/benchmarks.md, 2026-12-03).
    out = _DominoLinearCrossEntropy.apply(hidden.reshape(m * p, hidden.shape[-1]), head_weight.detach(),
                                          correction.reshape(m * (p - suffix_start), correction.shape[-1]),
                                          correction_weight, labels, token_weights.float(), lam, suffix_start,
                                          max(1, chunk_size // p), needs, compiled)
    return DominoCrossEntropy(*out)


@torch.no_grad()
def linear_argmax(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int = 4096) -> torch.Tensor:
    """Greedy tokens `[T]` of `hidden` `[T, H]` through a head `[V, H]`, in chunks of tokens."""
    out = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        end = min(start + chunk_size, hidden.shape[0])
        out[start:end] = head_logits(hidden[start:end], weight).argmax(dim=-1)
    return out
