"""The training loop. One step, top to bottom, in `train_step`; nothing in it waits on the GPU.

    anchors + labels for every micro-batch      (device ops; global denominator known up front)
    per micro-batch: target features (no grad) -> block embeddings -> draft -> chunked CE -> backward
    clip (no error_if_nonfinite) -> fused AdamW (tensor lr) -> on-device schedule -> metric sums

The only host reads happen in `Metrics.flush()` at a log interval, at checkpoints and evaluation.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dflash.anchors import anchor_seed, sample_anchors
from dflash.attention import dense_dflash_mask, flex_dflash_mask
from dflash.config import TrainConfig
from dflash.losses import BlockTargets, accepted_prefix_length, block_targets, linear_cross_entropy
from dflash.metrics import Metrics
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel, default_decay_gamma
from dflash.target import FrozenTarget, resolve_mask_token_id

Batch = dict[str, torch.Tensor]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def configured_mask_token(config: TrainConfig) -> int | str | None:
    """`draft.mask_token_id`, or the embedded default's reserved token when the target is embedded."""
    if config.draft.mask_token_id is not None or config.target != "embedded":
        return config.draft.mask_token_id
    from dflash.embedded import EMBEDDED_MASK_TOKEN

    return EMBEDDED_MASK_TOKEN


def load_target(name: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """(model, tokenizer) for "embedded" or any HF model id / local path."""
    if name == "embedded":
        from dflash.embedded import load_embedded_target

        return load_embedded_target(dtype=dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype), AutoTokenizer.from_pretrained(name)


class DFlashTrainer:
    """Trains a DFlash draft against a frozen target.

    Pass an already loaded `target` model and `tokenizer` (notebooks), or let the trainer load
    `config.target`. `train_step(batch)` performs exactly one optimizer step.
    """

    def __init__(
        self,
        config: TrainConfig | None = None,
        *,
        target: Any = None,
        tokenizer: Any = None,
        dataset: Any = None,
        draft: DFlashDraftModel | None = None,
        rank: int = 0,
    ) -> None:
        self.config = config = config or TrainConfig()
        config.validate()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if target is None:
            target, loaded_tok = load_target(config.target, self.dtype)
            tokenizer = tokenizer or loaded_tok
        self.tokenizer, self.dataset, self.rank = tokenizer, dataset, rank
        ds = config.draft

        if draft is None:
            vocab_rows = target.get_input_embeddings().weight.shape[0]
            mask_id = resolve_mask_token_id(tokenizer, vocab_rows, configured_mask_token(config))
            draft_cfg = DFlashDraftConfig.for_target(
                target.config,
                mask_token_id=mask_id,
                num_hidden_layers=ds.num_layers,
                target_layer_ids=ds.target_layer_ids,
                block_size=ds.block_size,
                num_attention_heads=ds.num_attention_heads,
                num_key_value_heads=ds.num_key_value_heads,
                head_dim=ds.head_dim,
                intermediate_size=ds.intermediate_size,
            )
            draft = DFlashDraftModel(draft_cfg)
        self.draft_config = draft.config
        self.target = FrozenTarget(target, self.draft_config.target_layer_ids).to(self.device, self.dtype)
        if self.target.hidden_size != self.draft_config.hidden_size:
            raise ValueError(
                f"draft hidden_size {self.draft_config.hidden_size} != target hidden_size {self.target.hidden_size}: "
                "a DFlash draft shares the target's embedding and LM head, so they must match"
            )
        # Draft weights stay fp32 (AdamW master weights); on GPU the forward runs under bf16 autocast.
        self.draft = draft.to(self.device, torch.float32)
        self.block_size = self.draft_config.block_size
        self.num_anchors = ds.num_anchors
        self.gamma = ds.loss_decay_gamma or default_decay_gamma(self.block_size)
        attention = ds.attention if ds.attention != "auto" else ("flex" if self.device.type == "cuda" else "sdpa")
        self.attention = attention

        # Schedule state lives on the device: the lr tensor is shared with the optimizer and updated
        # in place, so changing it never copies a Python float to the device.
        self.step = 0  # host mirror, advanced without reading the device
        self.step_t = torch.zeros((), dtype=torch.float32, device=self.device)
        self.lr = torch.full((), config.optim.lr, dtype=torch.float32, device=self.device)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.draft.parameters() if p.requires_grad],
            lr=self.lr,
            betas=(config.optim.beta1, config.optim.beta2),
            eps=config.optim.eps,
            weight_decay=config.optim.weight_decay,
            fused=True,  # reads lr and step from device tensors: no host read, graph-capturable
        )
        self.lr.copy_(self._lr_at(self.step_t))
        self.metrics = Metrics(self.block_size, self.device)
        self.anchor_generator = torch.Generator(device=self.device)

    # ---- schedule ---------------------------------------------------------------------------

    def _lr_at(self, step: torch.Tensor) -> torch.Tensor:
        """Linear warmup then cosine to `min_lr_ratio`, computed on the device from a step tensor."""
        o = self.config.optim
        total = self.config.max_steps
        warmup = max(1, round(o.warmup_ratio * total)) if o.warmup_ratio > 0 else 0
        if warmup:
            warm = (step + 1) / warmup
        progress = ((step - warmup) / max(1, total - warmup)).clamp(0.0, 1.0)
        cosine = o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + torch.cos(math.pi * progress))
        factor = torch.where(step < warmup, warm, cosine) if warmup else cosine
        return o.lr * factor

    # ---- the step ---------------------------------------------------------------------------

    def _micro_batches(self, batch: Batch | list[Batch]) -> list[Batch]:
        if isinstance(batch, list):
            return batch
        n = self.config.optim.grad_accum
        if batch["input_ids"].shape[0] % n:
            raise ValueError(f"batch of {batch['input_ids'].shape[0]} rows does not split into grad_accum={n}")
        ids, mask = batch["input_ids"].chunk(n), batch["loss_mask"].chunk(n)
        return [{"input_ids": i, "loss_mask": m} for i, m in zip(ids, mask, strict=True)]

    def _anchors(self, loss_mask: torch.Tensor, micro_index: int, num_micro: int):
        # Reseeding is host-side state only (no device read); (seed, rank, step) makes resume exact.
        self.anchor_generator.manual_seed(anchor_seed(self.config.seed, self.rank, self.step * num_micro + micro_index))
        return sample_anchors(loss_mask, self.num_anchors, generator=self.anchor_generator)

    def _mask(self, anchors: torch.Tensor, keep: torch.Tensor, seq_len: int):
        if self.attention == "flex":
            return flex_dflash_mask(anchors, keep, seq_len, self.block_size)
        return dense_dflash_mask(anchors, keep, seq_len, self.block_size)

    def block_inputs(self, input_ids: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block token ids and positions, both `[B, N*bs]`: slot 0 = token at the anchor, then mask tokens."""
        slots = torch.arange(self.block_size, device=input_ids.device)
        first = torch.gather(input_ids, 1, anchors).unsqueeze(-1)  # [B, N, 1]
        ids = torch.where(slots == 0, first, self.draft_config.mask_token_id)
        return ids.flatten(1), (anchors.unsqueeze(-1) + slots).flatten(1)

    def block_loss(self, input_ids: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                   targets: BlockTargets) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of weighted CE over the blocks (differentiable) and per-slot correctness `[B, N, bs-1]`."""
        bsz, seq_len = input_ids.shape
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            features = self.target(input_ids)  # [B, S, K*H], no grad
            block_ids, positions = self.block_inputs(input_ids, anchors)
            hidden = self.draft(self.target.embed(block_ids), positions, self._mask(anchors, keep, seq_len),
                                target_hidden=features)  # [B, N*bs, H]
        # Slot 0 is never scored: drop it before the LM head (1/bs of the head's FLOPs).
        scored = hidden.view(bsz, self.num_anchors, self.block_size, -1)[:, :, 1:]
        loss_sum, correct = linear_cross_entropy(
            scored.reshape(-1, scored.shape[-1]),
            self.target.lm_head_weight,
            targets.labels[..., 1:].reshape(-1),
            targets.weights[..., 1:].reshape(-1),
            self.config.ce_chunk_size,
        )
        return loss_sum, correct.view(bsz, self.num_anchors, self.block_size - 1)

    def train_step(self, batch: Batch | list[Batch]) -> None:
        """One optimizer step over `grad_accum` micro-batches. Makes no host-device sync."""
        micro = self._micro_batches(batch)
        self.draft.train()

        # 1) Anchors and labels for the whole window first, so the loss denominator (the global
        #    supervised-weight sum) is a device tensor before the first backward.
        plans = []
        for i, mb in enumerate(micro):
            anchors, keep = self._anchors(mb["loss_mask"], i, len(micro))
            targets = block_targets(mb["input_ids"], mb["loss_mask"], anchors, keep, self.block_size, self.gamma)
            plans.append((anchors, keep, targets))
        denominator = torch.stack([t.weights.sum() for _, _, t in plans]).sum().clamp(min=1e-6)

        # 2) Forward/backward per micro-batch; the loss of each is its share of the global mean.
        m = self.metrics
        for mb, (anchors, keep, targets) in zip(micro, plans, strict=True):
            loss_sum, correct = self.block_loss(mb["input_ids"], anchors, keep, targets)
            (loss_sum / denominator).backward()

            valid = targets.valid[..., 1:]
            hits = correct & valid
            m.add("loss_sum", loss_sum)
            m.add("weight_sum", targets.weights.sum())
            m.add("correct", hits.sum())
            m.add("scored", valid.sum())
            m.add("pos_correct", hits.sum(dim=(0, 1)))
            m.add("pos_scored", valid.sum(dim=(0, 1)))
            m.add("accepted", (accepted_prefix_length(correct, valid) * keep).sum())
            m.add("blocks", keep.sum())
            m.add("anchors_total", float(keep.numel()))
            m.add("rows_total", float(keep.shape[0]))
            m.add("rows_skipped", (~keep.any(dim=1)).sum())

        # 3) Update. clip_grad_norm_ without error_if_nonfinite: that flag reads the norm to the host.
        grad_norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.config.optim.max_grad_norm, foreach=True)
        m.add("grad_norm", grad_norm)
        m.add("lr", self.lr)
        m.add("steps", 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_t.add_(1)
        self.lr.copy_(self._lr_at(self.step_t))
        self.step += 1
