"""The block objective: frozen target + trainable draft -> weighted block CE for one micro-batch.

`DFlashObjective` is the piece every entry point shares: `DFlashTrainer.train_step`, the
`transformers.Trainer` module (`dflash.hf.trainer`) and evaluation. It owns the frozen target, the draft,
how blocks are built and how their loss is computed; the trainer owns the loop and the optimizer. The
target's features come from its forward or, under `data.features`, with the batch (`target_outputs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dflash.anchors import GlobalRows, sample_anchors
from dflash.attention import dense_dflash_mask, document_starts, flex_dflash_mask
from dflash.losses import (
    BlockTargets,
    accepted_prefix_length,
    block_labels,
    block_targets,
    decay_gamma,
    dpace_weights,
    linear_cross_entropy,
)
from dflash.metrics import MetricLayout, Metrics
from dflash.modeling import DFlashDraftModel
from dflash.target_model.frozen import Target


@dataclass
class BlockOutput:
    """What one micro-batch's forward produces. `loss_sum` is the differentiable numerator of the
    global token mean; everything else is detached and only feeds metric sums."""

    loss_sum: torch.Tensor  # [] fp32, sum of weighted CE (Domino: the lambda mix)
    ce_sum: torch.Tensor  # [] weighted CE of the final logits, for the reported loss
    correct: torch.Tensor  # [B, N, P] bool: argmax == label of the P scored slots (bs - 1; DSpark: bs)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # variant metric sums (Domino)


class DFlashObjective(nn.Module):
    """Block losses of a DFlash draft against a frozen target.

    Args:
        target: the frozen target (features, embedding, LM head).
        draft: the trainable draft; its config fixes block size and mask token.
        num_anchors: N, anchors per row (the widest plan; `plan` may take a narrower host-chosen width).
        attention: "sdpa" (dense boolean mask) or "flex" (BlockMask; GPU).
        dtype: compute dtype; below fp32 the forward runs under autocast, the draft stays fp32.
        gamma: the loss's position decay ("auto", a number, or None: off; `losses.decay_gamma`).
        position_weights: "decay" (by `gamma`), "dpace" (`losses.dpace_weights`, smoothed by `dpace_alpha`;
            the window's denominator is then its supervised-slot count, known before the first backward
            and global over micro-batches and ranks) or "none".
    """

    def __init__(self, target: Target, draft: DFlashDraftModel, *, num_anchors: int, attention: str = "sdpa",
                 dtype: torch.dtype = torch.float32, gamma: float | str | None = "auto", ce_chunk_size: int = 4096,
                 labels: str = "data", position_weights: str = "decay", dpace_alpha: float = 0.5,
                 draft_call: Callable[..., torch.Tensor] | None = None, compile_loss: bool = False,
                 anchor_spread: str = "uniform") -> None:
        super().__init__()
        if target.hidden_size != draft.config.hidden_size:
            raise ValueError(
                f"draft hidden_size {draft.config.hidden_size} != target hidden_size {target.hidden_size}: "
                "a DFlash draft shares the target's embedding and LM head, so they must match"
            )
        self.target, self.draft = target, draft
        self.block_size = draft.config.block_size
        self.num_anchors = num_anchors
        self.anchor_spread = anchor_spread
        self.attention = attention
        self.dtype = dtype
        # D-PACE and "none" plan unit weights: the denominator is the supervised-slot count.
        self.gamma = decay_gamma(gamma, self.block_size) if position_weights == "decay" else None
        self.position_weights, self.dpace_alpha = position_weights, dpace_alpha
        self.ce_chunk_size = ce_chunk_size
        self.labels = labels
        self.compile_loss = compile_loss  # torch.compile each CE chunk (`compile: true`)
        # What runs the draft: the draft itself, or the trainer's wrapper of it (DDP / FSDP2, torch.compile).
        # Held as a bound method, not a module, so the wrapper's copy of the draft's parameters is not
        # registered a second time under this module (state_dict keys stay `draft.*`).
        self.draft_call: Callable[..., torch.Tensor] = (draft if draft_call is None else draft_call).__call__

    def bind_schedule(self, step_t: torch.Tensor, max_steps: int) -> None:
        """Follow `step_t` (completed steps `[]`, a device tensor the training loop advances in place) over
        `max_steps`. DFlash's loss has no schedule: nothing to bind (Domino's λ overrides this)."""

    # ---- blocks ---------------------------------------------------------------------------

    def plan(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, generator: torch.Generator | None,
             num_anchors: int | None = None, rows: GlobalRows | None = None,
             position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, BlockTargets]:
        """Anchors `[B, N]`, keep `[B, N]` and block targets for one micro-batch (no forward pass).
        `num_anchors` overrides the training width N (evaluation scores every valid position); `rows`: the
        micro-batch's place in the batch of all ranks (`anchors.GlobalRows`); `position_ids` `[B, S]`: packed
        rows' positions, restarting per document (the targets carry them to the forward)."""
        anchors, keep = self.sample(loss_mask, generator, num_anchors, rows, position_ids)
        return anchors, keep, block_targets(input_ids, loss_mask, anchors, keep, self.block_size, self.gamma,
                                            position_ids)

    def sample(self, loss_mask: torch.Tensor, generator: torch.Generator | None, num_anchors: int | None = None,
               rows: GlobalRows | None = None, position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Anchors `[B, N]` and keep `[B, N]` of one micro-batch (`anchors.sample_anchors` at this objective's width
        and spread; `num_anchors` overrides the width): the one draw every kind's `plan` makes."""
        return sample_anchors(loss_mask, num_anchors or self.num_anchors, generator=generator, rows=rows,
                              position_ids=position_ids, spread=self.anchor_spread)

    def mask(self, anchors: torch.Tensor, keep: torch.Tensor, seq_len: int,
             position_ids: torch.Tensor | None = None) -> Any:
        """The draft's attention mask (`dflash.attention`); a packed row's block sees its own document only."""
        starts = None if position_ids is None else document_starts(anchors, position_ids)
        if self.attention == "flex":
            return flex_dflash_mask(anchors, keep, seq_len, self.block_size, starts)
        return dense_dflash_mask(anchors, keep, seq_len, self.block_size, starts)

    def block_inputs(self, input_ids: torch.Tensor, anchors: torch.Tensor,
                     position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Block token ids and positions, both `[B, N*bs]`: slot 0 = token at the anchor, then mask tokens;
        slot k at the anchor's position + k (in a packed row its position in its document)."""
        slots = torch.arange(self.block_size, device=input_ids.device)
        first = torch.gather(input_ids, 1, anchors).unsqueeze(-1)  # [B, N, 1]
        ids = torch.where(slots == 0, first, self.draft.config.mask_token_id)
        start = anchors if position_ids is None else torch.gather(position_ids, 1, anchors)
        return ids.flatten(1), (start.unsqueeze(-1) + slots).flatten(1)

    def target_outputs(self, input_ids: torch.Tensor, features: torch.Tensor | None = None,
                       labels: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's features `[B, S, K*H]` (no grad) and, under `labels: target`, its greedy next tokens
        `[B, S]` (else None): the batch's own when it brings them (offline features, `dflash.data.feature_data`:
        `features`, and `labels` written by the same target), else computed by running the frozen target
        (packed rows: `position_ids`, each document on its own)."""
        if features is None:
            # Packed rows only: a target of whole rows (a stand-in, a test's) is called as before.
            packed = {} if position_ids is None else {"position_ids": position_ids}
            if self.labels == "target":
                return self.target.features_and_greedy(input_ids, **packed)
            return self.target(input_ids, **packed), None
        if self.labels != "target":
            return features, None
        if labels is None:  # a host-side check on the batch's keys: no device read
            raise ValueError("data.labels: target with offline features needs the target's greedy labels in the "
                             "batch: write the features with data.labels=target (dflash features)")
        return features, labels

    def draft_hidden(self, input_ids: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, targets: BlockTargets,
                     features: torch.Tensor | None = None,
                     labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft states `[B, N, bs, H]` of every block and the labels `[B, N, bs]` they are scored on;
        `features` / `labels`: offline target outputs (`target_outputs`)."""
        bsz, seq_len = input_ids.shape
        position_ids = targets.position_ids  # packed rows' documents (None: one a row)
        with torch.autocast(input_ids.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            features, greedy = self.target_outputs(input_ids, features, labels, position_ids)
            # Under labels: target the draft learns the target's greedy next token at each position.
            block = targets.labels if greedy is None else block_labels(greedy, anchors, targets.valid)
            block_ids, positions = self.block_inputs(input_ids, anchors, position_ids)
            hidden = self.draft_call(self.target.embed(block_ids), positions,
                                     self.mask(anchors, keep, seq_len, position_ids), target_hidden=features,
                                     ctx_position_ids=position_ids)  # [B, N*bs, H]
        return hidden.view(bsz, anchors.shape[1], self.block_size, -1), block

    def forward(self, input_ids: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, targets: BlockTargets,
                features: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> BlockOutput:
        """One micro-batch's `BlockOutput`; `features` `[B, S, K*H]` / `labels` `[B, S]`: the target's
        outputs from offline feature files instead of running it (`target_outputs`)."""
        hidden, labels = self.draft_hidden(input_ids, anchors, keep, targets, features, labels)
        # Slot 0 is never scored: drop it before the LM head (1/bs of the head's FLOPs).
        scored = hidden[:, :, 1:]
        dpace = self.position_weights == "dpace"
        ce, correct = linear_cross_entropy(
            scored.reshape(-1, scored.shape[-1]),
            self.target.lm_head_weight,
            labels[..., 1:].reshape(-1),
            targets.weights[..., 1:].reshape(-1),
            self.ce_chunk_size,
            compiled=self.compile_loss,
            per_row=dpace,
        )
        correct = correct.view(*scored.shape[:3])
        if not dpace:
            return BlockOutput(loss_sum=ce, ce_sum=ce.detach(), correct=correct)
        # The slots' CE are known only now: D-PACE weighs them by the draft's own confidence (detached).
        weights = dpace_weights(ce.view(*scored.shape[:3]), targets.valid[..., 1:], self.dpace_alpha)
        return BlockOutput(loss_sum=(weights.flatten() * ce).sum(), ce_sum=ce.sum().detach(), correct=correct)

    # ---- metrics --------------------------------------------------------------------------

    def metric_layout(self) -> MetricLayout:
        """The `Metrics` layout this objective fills: the block's bs - 1 proposing slots, no sums of its own (a
        kind with its own metrics overrides this)."""
        return MetricLayout(self.block_size - 1)

    @staticmethod
    def accumulate(m: Metrics, out: BlockOutput, keep: torch.Tensor, targets: BlockTargets) -> None:
        """Add one micro-batch's sums to `m` (device ops only)."""
        valid = targets.valid[..., 1:]
        hits = out.correct & valid
        # A non-finite loss (its update is skipped by the trainer) must not poison the window's mean.
        finite = torch.isfinite(out.ce_sum)
        m.add("loss_sum", torch.where(finite, out.ce_sum, 0.0))
        m.add("weight_sum", torch.where(finite, targets.weights.sum(), 0.0))
        m.add("correct", hits.sum())
        m.add("scored", valid.sum())
        m.add("pos_correct", hits.sum(dim=(0, 1)))
        m.add("pos_scored", valid.sum(dim=(0, 1)))
        m.add("accepted", (accepted_prefix_length(out.correct, valid) * keep).sum())
        m.add("blocks", keep.sum())
        m.add("anchors_total", float(keep.numel()))
        m.add("rows_total", float(keep.shape[0]))
        m.add("rows_skipped", (~keep.any(dim=1)).sum())
        m.add("micro_batches", 1.0)
        for name, value in out.extras.items():
            m.add(name, value)
