"""Domino (arXiv 2605.29707): the DFlash backbone plus a small causal correction head.

The backbone drafts a whole block in one parallel pass (base logits). The Domino head adds what a
parallel draft cannot see, the tokens drafted earlier in the same block:

    g_j   = GRU(emb(t_0), ..., emb(t_j))                 bias-free GRU over the target's frozen embedding
    u_j   = SiLU(embed_proj.0([h_j || g_j]))             [H + gru_hidden_dim] -> emb_dim
    final_j = h_j W_head^T + u_j embed_proj.2^T          for proposals j >= pure_draft_prefix_len

Weight names are the published ones: `prefix_gru.weight_ih_l0`, `prefix_gru.weight_hh_l0`
(torch `nn.GRU`, bias=False), `embed_proj.0.weight` `[emb_dim, H + gru_hidden_dim]`,
`embed_proj.2.weight` `[vocab, emb_dim]` (`embed_proj` = Sequential(Linear, SiLU, Linear), no biases).

Label layout (decisions, and where they come from)
--------------------------------------------------
A block of bs slots at anchor a proposes P = bs - 1 tokens; proposal j (0-based) predicts the token
at a + 1 + j. `shift_label` only says which backbone slot produces it:

    shift_label false (DFlash's same-position layout): proposal j = slot j + 1 (slot 0 is never scored)
    shift_label true  (next-token layout):             proposal j = slot j

so labels, position weights exp(-j / gamma), the loss denominator and every metric are the DFlash
ones in both layouts. `pure_draft_prefix_len` p counts proposals: proposals 0..p-1 keep their base
logits, proposals p.. are corrected. In slot units this is SpecForge's
`suffix_start = p if shift_label else p + 1` (sgl-project/SpecForge `specforge/core/domino.py`,
`OnlineDominoModel._suffix_start`). GRU input alignment (same source, and NVIDIA ModelOpt's
`hf_domino.py` `_apply_domino_head`): t_0 is the anchor token, t_j (j >= 1) the token at a + j, i.e.
the label of proposal j - 1; the correction of proposal j reads g_j, the state after the anchor and
the j tokens before its label. The reference serving code (jianuo-huang/Domino and SGLang's
`domino_greedy_rollout`) does exactly this at inference with the drafted tokens, which is what
`domino_propose` below does.

One deliberate difference: with shift_label true, SpecForge and ModelOpt also score slot bs - 1
(the token at a + bs). No server uses it (SGLang's rollout proposes block_size - 1 tokens), so it is
not scored here; training weight goes only to the proposals that are verified. With
`data.labels: target` the GRU reads the target's greedy tokens where the labels are supervised (what
it will read at inference) and the data tokens elsewhere.

Loss and schedule
-----------------
`loss_sum = (1 - lam) * sum w CE(final) + lam * sum w CE(base)` over the micro-batch; the trainer
divides by the global weight sum of the whole window, so the loss is a global token mean like
DFlash's (the peers divide by each micro-batch's own count). lam falls linearly from `lambda_start`
to 0 over `decay_steps = max(1, int(decay_ratio * max_steps))` steps (ModelOpt's
`compute_lambda_base`), computed on the device from the trainer's step tensor (`bind_schedule`);
unbound, lam stays `lambda_start`. Base and final CE come from one chunked pass over the vocabulary
(`losses.domino_linear_cross_entropy`). At lam = 1 the head's gradients are zeros rather than
missing, so distributed training needs no `find_unused_parameters`.

Scheduled sampling (beyond the peers): with `scheduled_sampling` r > 0, each GRU input t_j (j >= 1)
is replaced, with probability r, by the backbone's own base prediction of proposal j - 1, as drafted
tokens replace ground truth at inference. The draws come from the anchor generator in `plan`
(seeded per (seed, step), over the global batch's rows, so resume is exact and a CUDA graph replays them); the base
predictions cost one extra chunked pass of the LM head, only when r > 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.anchors import GlobalRows
from dflash.kinds.heads import HeadKeys
from dflash.kinds.record import SGLANG, ServingField
from dflash.losses import (
    BlockTargets,
    accepted_prefix_length,
    domino_linear_cross_entropy,
    head_logits,
    linear_argmax,
    teacher_tokens,
)
from dflash.metrics import MetricLayout, ratio
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel
from dflash.objective import BlockOutput, DFlashObjective
from dflash.target_model.frozen import Target

PROJECTOR_TYPE = "domino"
DOMINO_WEIGHT_NAMES = frozenset(
    {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"})


@dataclass
class DominoSettings:
    """Domino correction head (used when `draft.kind: domino`); names follow the published config."""

    emb_dim: int = 256  # low-rank width of [backbone hidden || GRU state] -> emb_dim -> SiLU -> vocab
    gru_hidden_dim: int = 1024  # GRU state width of the correction head
    pure_draft_prefix_len: int = 1  # slots before suffix_start get no correction
    shift_label: bool = False  # label layout of the published checkpoints (module doc)
    lambda_start: float = 1.0  # weight of the base CE at step 0; falls linearly to 0
    decay_ratio: float = 0.5  # ... over decay_ratio * max_steps
    scheduled_sampling: float = 0.0  # fraction of GRU inputs taken from the draft's own base predictions


@dataclass(frozen=True)
class DominoHeadConfig(HeadKeys):
    """The Domino keys of `dflash_config` (published names)."""

    emb_dim: int
    gru_hidden_dim: int
    pure_draft_prefix_len: int
    shift_label: bool

    @classmethod
    def from_extra(cls, extra: dict[str, Any], block_size: int) -> DominoHeadConfig:
        """Parse and check `DFlashDraftConfig.extra` (as exported under `dflash_config`)."""
        if extra.get("projector_type") != PROJECTOR_TYPE:
            raise ValueError(f"not a Domino draft config: projector_type {extra.get('projector_type')!r}")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in extra]
        if missing:
            raise ValueError(f"Domino draft config lacks {missing} (expected under dflash_config)")
        head = cls(int(extra["emb_dim"]), int(extra["gru_hidden_dim"]), int(extra["pure_draft_prefix_len"]),
                   bool(extra["shift_label"]))
        if head.emb_dim < 1 or head.gru_hidden_dim < 1:
            raise ValueError(f"Domino emb_dim and gru_hidden_dim must be >= 1, got {head}")
        if not 0 <= head.pure_draft_prefix_len < block_size - 1:
            raise ValueError(f"pure_draft_prefix_len {head.pure_draft_prefix_len} must be in [0, block_size - 1 = "
                             f"{block_size - 1}): a block has {block_size - 1} proposals and at least one is corrected")
        return head

    def to_extra(self) -> dict[str, Any]:
        return {"projector_type": PROJECTOR_TYPE, **super().to_extra()}


def is_domino(cfg: DFlashDraftConfig) -> bool:
    return cfg.extra.get("projector_type") == PROJECTOR_TYPE


# ---- export and serving (the facts of `registry.DOMINO`, read by dflash.evaluation.serving / engine_eval) ----------

# vLLM main has no Domino head: qwen3_dflash.py @036a00d1 loads `prefix_gru.*` / `embed_proj.*` as `model.*` and
# `AutoWeightsLoader` refuses them, `"method": "dflash"` builds the plain `DFlashSpeculator`, and there is no Domino
# dispatch or method (v1/worker/gpu/spec_decode/__init__.py @01af92e1, dflash/speculator.py @47bd6d7c and @00746147,
# config/speculative.py @47bd6d7c). vLLM's docs/.../dflash.md @331c781e, which says vLLM loads Domino drafts, comes
# from PR #47627, closed unmerged. Why vLLM gets no Domino line, and the sources checked for it:
VLLM_DOMINO = ("vLLM main has no Domino head: qwen3_dflash.py @036a00d1 loads prefix_gru.* / embed_proj.* as model.* "
               "and AutoWeightsLoader refuses them; dflash.md @331c781e (Domino under method dflash) is from PR #47627, "
               "closed unmerged")
VLLM_SOURCE = "vllm-project/vllm qwen3_dflash.py @036a00d1, dflash/speculator.py @47bd6d7c and @00746147: no Domino head"
# SGLang's Domino default scores a block-shared top-2048 pool of base logits, not the vocabulary the draft was trained
# over: on the same 10 prompts it lowered tau 4.331 -> 4.032 (issue 50), so the command asks for the full vocabulary.
DOMINO_POOL_FLAG = "--speculative-domino-candidate-pool-size 0"
# SGLang's Domino runtime requires bf16 (validate_domino_runtime); the vocabulary the draft was trained over
SGLANG_FLAGS = ("--dtype bfloat16", DOMINO_POOL_FLAG)
# SGLang builds with speculative/domino_utils.py @04d4c1ae read the head (strict `prefix_gru.*` / `embed_proj.*`
# loading, bf16, `pure_draft_prefix_len` 1); older ones skip unknown tensor names and would serve the backbone alone.
SERVING_FIELDS = (
    ServingField("dflash_config.projector_type", str, "domino: the draft carries the Domino correction head "
                 "(SGLang builds with domino_utils.py; vLLM main has none and refuses it)", PROJECTOR_TYPE,
                 lambda v, c: v == PROJECTOR_TYPE, read_by=(SGLANG,)),
    ServingField("dflash_config.shift_label", bool, "which backbone slot proposes token j: slot j (true) or j + 1",
                 ok=None, read_by=(SGLANG,)),
    ServingField("dflash_config.pure_draft_prefix_len", int, "proposals left uncorrected at the block start",
                 "1 (SGLang refuses other values)", lambda v, c: v == 1, read_by=(SGLANG,)),
    ServingField("dflash_config.gru_hidden_dim", int, "width of prefix_gru (the head's causal state)", read_by=(SGLANG,)),
    ServingField("dflash_config.emb_dim", int, "low-rank width of embed_proj", read_by=(SGLANG,)),
)
SERVING_NOTES = (
    "SGLang needs a build with Domino support (python/sglang/srt/speculative/domino_utils.py); an older one drops "
    "the Domino head silently and serves the backbone alone",
    f"{DOMINO_POOL_FLAG}: SGLang's default scores a top-2048 candidate pool of base logits instead of the whole "
    "vocabulary the draft was trained over; on the same 10 prompts it lowered tau from 4.331 to 4.032",
    "vLLM has Domino only in unmerged PRs (#47627 closed, #48241 open), not checked here: #47627 drafts token 0 at step "
    "pure_draft_prefix_len and #48241 leaves that step uncorrected, while dflash trains every proposal from "
    "pure_draft_prefix_len on corrected",
)


def is_domino_export(config: dict[str, Any]) -> bool:
    """Whether an export's config.json marks a Domino draft (`dflash_config.projector_type`, which the engines pick
    the head by)."""
    nested = config.get("dflash_config")
    return isinstance(nested, dict) and nested.get("projector_type") == PROJECTOR_TYPE


def domino_stray_head(config: dict[str, Any], names: set[str]) -> str | None:
    """The Domino head among an export's tensor `names` under a config.json that does not mark it (read as another
    kind: SGLang builds no head from it, vLLM main refuses the tensors), None when there is none."""
    head = sorted(DOMINO_WEIGHT_NAMES & names)
    if not head:
        return None
    nested = config.get("dflash_config")
    projector = repr(nested["projector_type"]) if isinstance(nested, dict) and "projector_type" in nested else "missing"
    return (f"the Domino head ({', '.join(head)}) but dflash_config.projector_type is {projector}, not "
            f"{PROJECTOR_TYPE!r}: SGLang builds no head from it, vLLM main refuses the tensors")


class DominoDraftModel(DFlashDraftModel):
    """DFlash backbone + Domino head. `forward` is the backbone's (hidden states `[B, Q, H]`)."""

    def __init__(self, cfg: DFlashDraftConfig) -> None:
        head = DominoHeadConfig.from_extra(cfg.extra, cfg.block_size)  # refuse a bad config before building
        super().__init__(cfg)
        self.head_config = head
        h = cfg.hidden_size
        self.prefix_gru = nn.GRU(h, head.gru_hidden_dim, batch_first=True, bias=False)
        self.embed_proj = nn.Sequential(
            nn.Linear(h + head.gru_hidden_dim, head.emb_dim, bias=False),
            nn.SiLU(),
            nn.Linear(head.emb_dim, cfg.vocab_size, bias=False),
        )
        with torch.no_grad():  # the backbone's rule (reset_parameters also covers these later)
            for p in (*self.prefix_gru.parameters(), *self.embed_proj.parameters()):
                nn.init.normal_(p, std=0.02)

    @property
    def suffix_start(self) -> int:
        """First corrected proposal (= pure_draft_prefix_len, counted in proposals, not slots)."""
        return self.head_config.pure_draft_prefix_len

    @property
    def correction_weight(self) -> torch.Tensor:
        """`[V, emb_dim]`: the trainable output matrix of the correction (`embed_proj.2.weight`)."""
        return self.embed_proj[2].weight

    def proposal_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The bs - 1 proposal states `[..., bs - 1, H]` of block states `[..., bs, H]` (layout: module doc)."""
        first = 0 if self.head_config.shift_label else 1
        return hidden[..., first:first + hidden.shape[-2] - 1, :]

    def prefix_states(self, token_embeds: torch.Tensor, state: torch.Tensor | None = None):
        """GRU states `[M, L, G]` after each of `token_embeds` `[M, L, H]`, and the last `[1, M, G]`."""
        return self.prefix_gru(token_embeds.to(self.correction_weight.dtype), state)

    def propose(self, hidden: torch.Tensor, first_token: torch.Tensor, embed_weight: torch.Tensor,
                head_weight: torch.Tensor) -> torch.Tensor:
        """The correction head's causal walk (`domino_propose`)."""
        return domino_propose(self, hidden, first_token, embed_weight, head_weight)

    def correction_input(self, proposal_hidden: torch.Tensor, prefix_state: torch.Tensor) -> torch.Tensor:
        """u = SiLU(embed_proj.0([h || g])) `[..., emb_dim]`; the correction logits are u @ W2^T."""
        return self.embed_proj[1](self.embed_proj[0](torch.cat([proposal_hidden, prefix_state], dim=-1)))


def lambda_at(step: torch.Tensor, lambda_start: float, decay_steps: int) -> torch.Tensor:
    """Base-loss weight `[]` at `step` (a device tensor): lambda_start -> 0 linearly over decay_steps."""
    return lambda_start * (1.0 - (step / decay_steps).clamp(max=1.0))


@dataclass
class DominoTargets(BlockTargets):
    """Block targets plus the scheduled-sampling draws `[B, N, bs - 1]` bool (True: GRU input j
    is the base prediction of proposal j - 1; column 0, the anchor, is never replaced)."""

    sampled: torch.Tensor | None = None


def domino_metrics(t: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Domino's flushed metrics from a window's sums (`DominoObjective.metric_layout`)."""
    return {"base_loss": ratio(t["base_loss_sum"], t["weight_sum"]).item(),
            "base_accuracy": ratio(t["base_correct"], t["scored"]).item(),
            "base_tau": 1.0 + ratio(t["base_accepted"], t["blocks"]).item(),
            "lambda": ratio(t["lambda"], t["micro_batches"]).item()}


class DominoObjective(DFlashObjective):
    """Domino block losses (module doc). Same interface as `DFlashObjective`; fills the "domino"
    metric layout (base loss / accuracy / tau and lambda)."""


    def __init__(self, target: Target, draft: DominoDraftModel, *, lambda_start: float = 1.0,
                 decay_ratio: float = 0.5, scheduled_sampling: float = 0.0, **kwargs: Any) -> None:
        if not isinstance(draft, DominoDraftModel):
            raise TypeError(f"a Domino objective needs a DominoDraftModel, got {type(draft).__name__} "
                            "(build one with dflash.factory.build_draft and draft.kind: domino, or load a "
                            "projector_type: domino export)")
        super().__init__(target, draft, **kwargs)
        self.lambda_start, self.decay_ratio, self.scheduled_sampling = lambda_start, decay_ratio, scheduled_sampling
        device = next(draft.parameters()).device
        self._lambda = torch.full((), lambda_start, dtype=torch.float32, device=device)  # unbound: constant
        self._step: torch.Tensor | None = None
        self._decay_steps = 1

    # ---- lambda ---------------------------------------------------------------------------

    def metric_layout(self) -> MetricLayout:
        """The base (uncorrected) logits' loss / accuracy / tau, and lambda, beside DFlash's metrics."""
        return MetricLayout(self.block_size - 1, {"base_loss_sum": 1, "base_correct": 1, "base_accepted": 1,
                                                   "lambda": 1}, domino_metrics)

    def bind_schedule(self, step_t: torch.Tensor, max_steps: int) -> None:
        """Follow `step_t` (completed steps, a device tensor the trainer updates in place)."""
        self._step = step_t
        self._decay_steps = max(1, int(self.decay_ratio * max_steps))

    def lambda_base(self) -> torch.Tensor:
        """The current base-loss weight `[]` fp32, on the device (no host read, no host copy)."""
        if self._step is None:
            return self._lambda
        return lambda_at(self._step, self.lambda_start, self._decay_steps)

    # ---- blocks ---------------------------------------------------------------------------

    def plan(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, generator: torch.Generator | None,
             num_anchors: int | None = None, rows: GlobalRows | None = None,
             position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, BlockTargets]:
        """DFlash's plan, plus the scheduled-sampling draws from the same generator (after the anchors; over
        the global batch's rows, like the anchors, when `rows` is given).
        Evaluation (eval mode) draws none: the GRU reads labels, which is what serving's GRU reads along
        an accepted prefix, the only part the accepted length depends on."""
        anchors, keep, targets = super().plan(input_ids, loss_mask, generator, num_anchors, rows, position_ids)
        if self.scheduled_sampling == 0 or not self.training:
            return anchors, keep, targets
        # Drawn at the full width N and cut to this batch's width, so a host-bounded width draws for each
        # kept slot what the fixed width would.
        bsz, offset = anchors.shape[0], 0 if rows is None else rows.offset
        shape = (bsz if rows is None else rows.total, max(self.num_anchors, anchors.shape[1]), self.block_size - 1)
        draws = torch.rand(shape, generator=generator, device=input_ids.device)[offset:offset + bsz, :anchors.shape[1]]
        sampled = draws < self.scheduled_sampling
        return anchors, keep, DominoTargets(**vars(targets), sampled=sampled)

    def gru_tokens(self, input_ids: torch.Tensor, anchors: torch.Tensor, labels: torch.Tensor,
                   targets: BlockTargets, proposals: torch.Tensor) -> torch.Tensor:
        """Token ids `[B, N, bs - 1]` the GRU reads: t_0 = anchor token, t_j = the label of proposal
        j - 1 where supervised, else the data token at a + j (scheduled sampling: module doc)."""
        tokens = teacher_tokens(input_ids, anchors, labels, targets.valid, self.block_size - 1)
        if not (self.draft.training and self.scheduled_sampling > 0):
            return tokens
        sampled = targets.sampled if isinstance(targets, DominoTargets) else None
        if sampled is None:  # a draw here would come from the global RNG, outside (seed, step)
            raise ValueError("Domino scheduled sampling needs targets from DominoObjective.plan (their `sampled` "
                             "draw follows the anchor generator, so resume and graph replay repeat it)")
        prev = proposals[:, :, :-1]  # proposals 0..P-2 feed GRU inputs 1..P-1
        guess = linear_argmax(prev.reshape(-1, prev.shape[-1]), self.target.lm_head_weight,
                              self.ce_chunk_size).view(prev.shape[:3])
        return torch.cat([tokens[..., :1], torch.where(sampled[..., 1:], guess, tokens[..., 1:])], dim=-1)

    def forward(self, input_ids: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, targets: BlockTargets,
                features: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> BlockOutput:
        """`DFlashObjective.forward` with the Domino head; `features` / `labels` as there (offline)."""
        draft: DominoDraftModel = self.draft
        hidden, labels = self.draft_hidden(input_ids, anchors, keep, targets, features, labels)
        proposals = draft.proposal_states(hidden)  # [B, N, P, H]
        bsz, n, num, h = proposals.shape
        s = draft.suffix_start
        tokens = self.gru_tokens(input_ids, anchors, labels, targets, proposals)
        with torch.autocast(input_ids.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            states, _ = draft.prefix_states(self.target.embed(tokens.flatten(0, 1)))  # [B*N, P, G]
            flat = proposals.reshape(bsz * n, num, h)
            correction = draft.correction_input(flat[:, s:], states[:, s:])  # [B*N, P - s, E]
        lam = self.lambda_base()
        valid = targets.valid[..., 1:]
        ce = domino_linear_cross_entropy(flat, self.target.lm_head_weight, correction, draft.correction_weight,
                                         labels[..., 1:].reshape(bsz * n, num),
                                         targets.weights[..., 1:].reshape(bsz * n, num), lam, s, self.ce_chunk_size,
                                         compiled=self.compile_loss)
        base_correct = ce.base_correct.view(bsz, n, num)
        extras = {
            # counted with the same micro-batches as loss_sum / weight_sum (accumulate drops non-finite ones)
            "base_loss_sum": torch.where(torch.isfinite(ce.final_sum), ce.base_sum, 0.0),
            "base_correct": (base_correct & valid).sum(),
            "base_accepted": (accepted_prefix_length(base_correct, valid) * keep).sum(),
            "lambda": lam,
        }
        return BlockOutput(loss_sum=ce.loss_sum, ce_sum=ce.final_sum, correct=ce.final_correct.view(bsz, n, num),
                           extras=extras)


# ---- speculative decoding ------------------------------------------------------------------------


@torch.no_grad()
def domino_propose(draft: DominoDraftModel, hidden: torch.Tensor, first_token: torch.Tensor,
                   embed_weight: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """Greedy Domino drafts `[B, bs - 1]` of one block: the head runs causally over the drafted tokens.

    Args:
        hidden: `[B, bs, H]` backbone states of the block; first_token: `[B, 1]` its slot-0 token.
        embed_weight, head_weight: `[V, H]` the target's embedding and LM head.
    Proposal j = argmax(base_j + correction(h_j, g_j)) (no correction before suffix_start), where
    g_j is the GRU state after the anchor token and drafts 0..j-1: training's alignment (module doc).
    """
    proposals = draft.proposal_states(hidden)  # [B, P, H]
    base = head_logits(proposals, head_weight).float()  # [B, P, V]
    token, state, drafts = first_token, None, []
    for j in range(proposals.shape[1]):
        out, state = draft.prefix_states(F.embedding(token, embed_weight), state)  # g_j: consumed t_j
        logits = base[:, j]
        if j >= draft.suffix_start:
            u = draft.correction_input(proposals[:, j], out[:, -1].to(proposals.dtype))
            logits = logits + (u @ draft.correction_weight.t()).float()
        token = logits.argmax(dim=-1, keepdim=True)  # [B, 1], t_{j+1}
        drafts.append(token)
    return torch.cat(drafts, dim=1)
