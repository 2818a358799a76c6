"""DFlash 2 (z-lab / Inco, 2026): the DFlash backbone plus dynamic block convolutions and a candidate selector.

Two additions, with the published parameter names (they are the export contract; docs/design.md "DFlash 2"):

* `layers.{i}.attention_conv` and `layers.{i}.mlp_conv`: a grouped dynamic causal depthwise convolution of
  T = `conv_kernel_size` taps over the positions of one block, around each sublayer (input side 0, output
  side 1). `base_kernel` `[2, T, H]` plus per-token coefficients `kernel_projection(u)` `[2, T, H / g]`
  predicted from the sublayer's normed input u, shared by g = `conv_group_size` consecutive channels:

      conv(x; side)_k[c] = sum_{t < T, k - t >= 0} (base_kernel[side, t, c] + delta_side[k, t, c // g]) * x_{k-t}[c]

  Taps never cross a block start (training packs N blocks contiguously: `[B, N * bs, H]` is viewed as
  `[B, N, bs, H]`). Identity at init (base_kernel[:, 0] = 1, other taps and kernel_projection 0), so a
  fresh DFlash 2 draft computes exactly its DFlash backbone.
* `candidate_selector`: `predecessor_codebook` A `[V, r]` and `successor_codebook` B `[V, r]` (raw
  parameters, no `.weight`) and `hidden_projection` P `[r, H]`. At slot k with candidates C_k = top-K of
  the unary logits U_k = W_lm h_k, the score of candidate c after predecessor token p is

      S_k(p, c) = U_k(c) + sum_r A[p, r] (P h_k)_r B[c, r]

  B = 0 at init, so the selector starts as the unary argmax. Decoding walks greedily: p = anchor, then
  d_k = argmax_{c in C_k} S_k(p, c), p = d_k (`dflash2_propose`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from dflash.kinds.heads import HeadKeys
from dflash.kinds.record import ServingField
from dflash.losses import head_logits
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel, DraftLayer

ARCHITECTURE = "DFlash2DraftModel"


SelectorGold = Literal["strict", "insert"]  # DFlash 2: the selector loss where the gold token is not a candidate


@dataclass
class DFlash2Settings:
    """DFlash 2 convolutions and candidate selector (used when `draft.kind: dflash2`); published key names."""

    conv_kernel_size: int = 2  # taps of the dynamic causal conv over the block positions
    conv_group_size: int = 16  # channels that share one dynamic coefficient (the hidden size must divide by it)
    selector_rank: int = 256  # rank of the selector's bilinear predecessor/successor score
    selector_top_k: int = 16  # candidates the selector ranks at each slot (top-K of the draft's logits)
    selector_alpha: float = 1.0  # weight of the selector loss next to the unary CE
    # Selector loss where the gold token is not among the top-K: strict (none, SpecForge) or insert (the
    # weakest candidate replaced by the gold, vLLM speculators #1006; for the loss only)
    selector_gold: SelectorGold = "strict"


@dataclass(frozen=True)
class DFlash2HeadConfig(HeadKeys):
    """The DFlash 2 keys of `dflash_config` (published names; their presence marks a DFlash 2 draft, as in SGLang)."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int

    @classmethod
    def from_draft_config(cls, cfg: DFlashDraftConfig) -> DFlash2HeadConfig:
        """Parse and check `cfg.extra` against the draft's hidden size, vocabulary and block size."""
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in cfg.extra]
        if missing:
            raise ValueError(f"DFlash 2 draft config lacks {missing} (expected under dflash_config)")
        head = cls(*(int(cfg.extra[f.name]) for f in dataclasses.fields(cls)))
        problems = []
        if head.conv_group_size < 1 or cfg.hidden_size % head.conv_group_size:
            problems.append(f"hidden size {cfg.hidden_size} must be a multiple of conv_group_size {head.conv_group_size}")
        if not 1 <= head.conv_kernel_size <= cfg.block_size:
            problems.append(f"conv_kernel_size {head.conv_kernel_size} must be in [1, block_size = {cfg.block_size}]")
        if head.selector_rank < 1:
            problems.append(f"selector_rank {head.selector_rank} must be >= 1")
        if not 1 <= head.selector_top_k <= cfg.vocab_size:
            problems.append(f"selector_top_k {head.selector_top_k} must be in [1, vocab_size = {cfg.vocab_size}]")
        if problems:
            raise ValueError("invalid DFlash 2 draft config: " + "; ".join(problems))
        return head


def is_dflash2(cfg: DFlashDraftConfig) -> bool:
    """Whether a draft config describes a DFlash 2 draft (its conv and selector keys are present)."""
    return any(f.name in cfg.extra for f in dataclasses.fields(DFlash2HeadConfig))


def dflash2_weight_names(num_layers: int) -> set[str]:
    """The tensor names DFlash 2 adds to a DFlash draft of `num_layers` layers (export contract)."""
    names = {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
             "candidate_selector.hidden_projection.weight"}
    for i in range(num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            names |= {f"layers.{i}.{conv}.base_kernel", f"layers.{i}.{conv}.kernel_projection.weight"}
    return names


# ---- export and serving (the facts of `registry.DFLASH2`, read by dflash.evaluation.serving / engine_eval) ---------

# DFlash 2 rides both engines' DFlash path (vLLM `"method": "dflash"`, SGLang `DFLASH`) with the DFlash counts: the
# convs run over one block, vLLM's of 1 + num_speculative_tokens query tokens, SGLang's of
# --speculative-num-draft-tokens, so both must be the trained block. Read from vLLM
# model_executor/models/qwen3_dflash2.py and v1/worker/gpu/spec_decode/dflash2/speculator.py @030da624 (PR #52816;
# the index holds no copy at @47bd6d7c); SGLang srt/models/dflash.py `DFlash2DraftModel` (PR #35371, a stored version
# the index names no commit of), speculative/dflash_utils.py @00731f0b, speculative/dflash_worker_v2.py @0057abea.
ARCHITECTURE_MEANING = ("model class: vLLM's registry maps it to qwen3_dflash2.DFlash2Qwen3ForCausalLM (and picks "
                        "DFlash2Speculator, the V2 runner); SGLang's EntryClass of models/dflash.py")
VLLM_SOURCE = "vllm-project/vllm qwen3_dflash2.py + dflash2/speculator.py @030da624, PR #52816"
SGLANG_SOURCE = "sgl-project/sglang DFlash2DraftModel, PR #35371: dflash_utils.py @00731f0b, dflash_worker_v2.py @0057abea"
VLLM_CPU_REFUSAL = '"DFlash candidate-head drafts"'  # vLLM 0.32's V1 model runner (the CPU one) refusing it
SERVING_FIELDS = (
    ServingField("is_causal", bool, "causality of the draft attention, read before layer_types (both engines): "
                 "false = non-causal over the block, as trained", "false", lambda v, c: v is False),
    ServingField("dflash_config.conv_kernel_size", int, "taps T of every attention_conv / mlp_conv (base_kernel "
                 "[2, T, H]); the taps stay inside one block", "in [1, block_size]",
                 lambda v, c: 1 <= v <= c["block_size"]),
    ServingField("dflash_config.conv_group_size", int, "channels g sharing one dynamic tap coefficient "
                 "(kernel_projection rows 2 T H / g)", "a divisor of hidden_size",
                 lambda v, c: v > 0 and c["hidden_size"] % v == 0),
    ServingField("dflash_config.selector_rank", int, "rank r of the candidate selector (codebooks [V, r], "
                 "hidden_projection [r, H])"),
    ServingField("dflash_config.selector_top_k", int, "candidates per slot: the top-k of the target head's logits",
                 "in [1, vocab_size]", lambda v, c: 1 <= v <= c["vocab_size"]),
)
SERVING_NOTES = (
    "vLLM needs a build with DFlash 2 (PR #52816: DFlash2DraftModel in its registry, served by the V2 model runner it "
    "selects for one), SGLang one with PR #35371; an older one refuses the export",
    "the selector takes its candidates from the target's LM head: vLLM needs it unquantized, SGLang dense or of a "
    "quantization it can apply; the convs run over one block of the counts above",
)


def dflash2_export_fields(cfg: DFlashDraftConfig) -> dict[str, Any]:
    """The top-level keys of a DFlash 2 config.json beyond the DFlash ones: `is_causal: false`, as z-lab's published
    config has it (vLLM lets it decide in-block causality)."""
    return {"is_causal": False}


def is_dflash2_export(config: dict[str, Any]) -> bool:
    """Whether an export's config.json describes a DFlash 2 draft: its architecture, or its selector under another."""
    nested = config.get("dflash_config")
    return ARCHITECTURE in (config.get("architectures") or []) or (isinstance(nested, dict) and "selector_rank" in nested)


def dflash2_built_shapes(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor -> (the shape both engines build it with from an export's config.json, from what): the convs of every
    layer and the selector, which they load without checking that the file has them. KeyError / TypeError: a
    broken field."""
    c, d = config, config["dflash_config"]
    h, v, t, r = c["hidden_size"], c["vocab_size"], d["conv_kernel_size"], d["selector_rank"]
    conv = {"base_kernel": ((2, t, h), "2 sides x conv_kernel_size x hidden"),
            "kernel_projection.weight": ((2 * t * (h // d["conv_group_size"]), h), "2 T H / g x hidden")}
    built = {f"layers.{i}.{m}.{p}": s for i in range(c["num_hidden_layers"])
             for m in ("attention_conv", "mlp_conv") for p, s in conv.items()}
    built |= {f"candidate_selector.{b}_codebook": ((v, r), "vocab x selector_rank") for b in ("predecessor", "successor")}
    built["candidate_selector.hidden_projection.weight"] = ((r, h), "selector_rank x hidden")
    return built


class GroupedDynamicConv(nn.Module):
    """The two-sided dynamic causal conv of one sublayer (module doc). Inputs are block streams `[B, N * bs, H]`."""

    def __init__(self, hidden: int, taps: int, group: int, block_size: int) -> None:
        super().__init__()
        self.taps, self.group, self.block_size = taps, group, block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * (hidden // group), bias=False)
        self.reset_identity()

    @torch.no_grad()
    def reset_identity(self) -> None:
        """The identity conv: tap 0 is 1 on both sides, every other tap and every dynamic coefficient 0."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, N * bs, H]` -> `[B, N, bs, H]`: the conv runs inside each block, never across."""
        return x.view(x.shape[0], -1, self.block_size, x.shape[-1])

    def _conv(self, x: torch.Tensor, side: int, delta: torch.Tensor) -> torch.Tensor:
        """conv(x; side, delta) `[B, Q, H]` of `x` `[B, Q, H]` with coefficients `delta` `[B, N, bs, T, G]`."""
        blocks = self._blocks(x)
        groups = blocks.shape[-1] // self.group
        base = self.base_kernel[side].to(x.dtype).view(self.taps, groups, self.group)  # [T, G, g]
        out = torch.zeros_like(blocks).unflatten(-1, (groups, self.group))
        for t in range(self.taps):
            # x_{k-t}: shifted t slots down inside the block, zeros at the block start (no tap crosses it)
            shifted = F.pad(blocks, (0, 0, t, 0))[:, :, :self.block_size] if t else blocks
            coef = base[t] + delta[..., t, :].unsqueeze(-1).to(x.dtype)  # [B, N, bs, G, g]
            out = out + coef * shifted.unflatten(-1, (groups, self.group))
        return out.flatten(-2).view_as(x)

    def prepare(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv(u; 0), the output side's coefficients `[B, N, bs, T, G]`) from the normed sublayer input u."""
        delta = self.kernel_projection(u)  # [B, Q, 2 * T * G]
        delta = self._blocks(delta).unflatten(-1, (2, self.taps, -1))  # [B, N, bs, 2, T, G]
        return self._conv(u, 0, delta[..., 0, :, :]), delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta_out: torch.Tensor) -> torch.Tensor:
        """conv(y; 1) of the sublayer's output `y` `[B, Q, H]` with the coefficients `prepare` returned."""
        return self._conv(y, 1, delta_out)


class DFlash2Layer(DraftLayer):
    """A DFlash decoder layer with `attention_conv` and `mlp_conv` around its two sublayers."""

    def __init__(self, cfg: DFlashDraftConfig, head: DFlash2HeadConfig) -> None:
        super().__init__(cfg)
        args = (cfg.hidden_size, head.conv_kernel_size, head.conv_group_size, cfg.block_size)
        self.attention_conv = GroupedDynamicConv(*args)
        self.mlp_conv = GroupedDynamicConv(*args)

    def forward(self, x, ctx_kv, cos, sin, mask):
        u, delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(u, ctx_kv, cos, sin, mask), delta)
        v, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(v), delta)


class CandidateSelector(nn.Module):
    """The low-rank pairwise score of adjacent slots' candidates (module doc)."""

    def __init__(self, hidden: int, vocab: int, rank: int) -> None:
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A and P ~ N(0, 0.02), B = 0: the pairwise term is 0, the selector starts as the unary argmax (SpecForge)."""
        nn.init.normal_(self.predecessor_codebook, std=0.02)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)
        self.successor_codebook.zero_()

    def pairwise(self, hidden: torch.Tensor, predecessor: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """sum_r A[p, r] (P h)_r B[c, r] `[..., K]` for states `[..., H]`, predecessors `[...]`, candidates `[..., K]`."""
        gate = self.hidden_projection(hidden) * F.embedding(predecessor, self.predecessor_codebook).to(hidden.dtype)
        succ = F.embedding(candidates, self.successor_codebook).to(hidden.dtype)  # [..., K, r]
        return (succ @ gate.unsqueeze(-1)).squeeze(-1)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash backbone with block convs in every layer, plus the candidate selector. `forward` is the
    backbone's (final-normed hidden states `[B, Q, H]`, Q a multiple of block_size)."""

    def __init__(self, cfg: DFlashDraftConfig) -> None:
        self.head_config = DFlash2HeadConfig.from_draft_config(cfg)  # refuse a bad config before building
        super().__init__(cfg)
        head = self.head_config
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, head.selector_rank)

    def make_layer(self, cfg: DFlashDraftConfig) -> DFlash2Layer:
        return DFlash2Layer(cfg, self.head_config)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The backbone's rule, then the identity convs and the unary-equivalent selector (module doc)."""
        super().reset_parameters()
        for layer in self.layers:
            layer.attention_conv.reset_identity()
            layer.mlp_conv.reset_identity()
        if "candidate_selector" in self._modules:  # built after the backbone: its own init ran then
            self.candidate_selector.reset_parameters()

    fixed_block_size = True  # its convs run over blocks of its own block_size

    @property
    def top_k(self) -> int:
        return self.head_config.selector_top_k

    def propose(self, hidden: torch.Tensor, first_token: torch.Tensor, embed_weight: torch.Tensor,
                head_weight: torch.Tensor) -> torch.Tensor:
        """The selector's greedy walk over the top-K candidates (`dflash2_propose`)."""
        return dflash2_propose(self, hidden, first_token, head_weight)


# ---- speculative decoding ------------------------------------------------------------------------


@torch.no_grad()
def dflash2_propose(draft: DFlash2DraftModel, hidden: torch.Tensor, first_token: torch.Tensor,
                    head_weight: torch.Tensor) -> torch.Tensor:
    """Greedy DFlash 2 drafts `[B, bs - 1]` of one block: the selector's walk over the top-K candidates.

    Args:
        hidden: `[B, bs, H]` final-normed draft states of the block; first_token: `[B, 1]` its slot-0 token.
        head_weight: `[V, H]` the target's LM head.
    Slot k >= 1: candidates = top-K of its unary logits; d_k = the candidate of the highest S_k(d_{k-1}, .),
    d_0 = the anchor token (what training scores with the teacher-forced predecessor).
    """
    states = hidden[:, 1:]  # [B, P, H]
    unary, candidates = head_logits(states, head_weight).float().topk(draft.top_k, dim=-1)  # [B, P, K]
    token, drafts = first_token[:, 0], []
    for k in range(states.shape[1]):
        score = unary[:, k] + draft.candidate_selector.pairwise(states[:, k], token, candidates[:, k]).float()
        token = candidates[:, k].gather(-1, score.argmax(-1, keepdim=True)).squeeze(-1)
        drafts.append(token)
    return torch.stack(drafts, dim=1)
