"""The DFlash draft model: Qwen3-style decoder layers with the target's features injected as keys/values.

The draft owns no embedding and no LM head (it uses the target's, frozen). Its inputs are
    noise_embeds  `[B, Q, H]`   the target's embedding of each block (slot 0 clean, the rest mask tokens)
    target_hidden `[B, S, K*H]` the target's hidden states of `target_layer_ids`, concatenated
Target features go through `fc` (K*H -> H) and `hidden_norm` once; in every layer the layer's own
k_proj/v_proj (+ k_norm, RoPE at context positions) turn them into keys/values placed before the
block's own keys/values. Queries come only from the block. Parameter names follow the published
checkpoint format (DESIGN §5) so export is a rename-free dtype cast.

In training each layer projects the context keys/values inside its own forward (from a
`ContextFeatures` it is handed), so every weight of a layer is used only while that layer runs: FSDP2
shards each layer separately and gathers its weights just for its forward and backward. Speculative
decoding instead caches `context_kv(...)` and passes the projected keys/values.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch._dynamo.config as dynamo_config
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention
from torch.utils.checkpoint import checkpoint

from dflash.losses import head_logits


def default_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """Published default: one id -> [L // 2]; n ids -> round(1 + j * (L - 4) / (n - 1))."""
    if num_ids < 1:
        raise ValueError(f"need at least one target layer id, got {num_ids}")
    if num_ids == 1:
        return [num_target_layers // 2]
    if num_target_layers < 5:  # tiny targets: spread over 0..L-2 (layer L-1's HF hidden state is post-norm)
        return [round(j * max(0, num_target_layers - 2) / (num_ids - 1)) for j in range(num_ids)]
    return [round(1 + j * (num_target_layers - 4) / (num_ids - 1)) for j in range(num_ids)]


def cache_kwarg(forward: Callable[..., Any]) -> str:
    """The KV-cache argument of an HF forward (a model's or an attention module's): `cache` in transformers
    5.24 (`past_key_values` deprecated there), `past_key_values` in 5.17."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def text_config_of(config: Any) -> Any:
    """The text part of an HF config (a multimodal model's language model; the config itself otherwise)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass
class DFlashDraftConfig:
    """Shape of a DFlash draft. `hidden_size` and `vocab_size` must equal the target's."""

    hidden_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_hidden_layers: int = 1
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    block_size: int = 16
    extra: dict[str, Any] = field(default_factory=dict)  # variant keys (Domino), exported under dflash_config

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (slot 0 is the anchor), got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad or not self.target_layer_ids:
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} must be non-empty and within "
                f"[0, {self.num_target_layers - 1}] (the target has {self.num_target_layers} layers)"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is not a row of the target's embedding table "
                f"(vocab_size {self.vocab_size}); choose an id in [0, {self.vocab_size - 1}]"
            )

    @classmethod
    def for_target(cls, target_config: Any, *, mask_token_id: int, num_hidden_layers: int = 1,
                   target_layer_ids: list[int] | None = None, **overrides: Any) -> DFlashDraftConfig:
        """A draft shaped like the target's layers (heads, head_dim, FFN), as published drafts are."""
        text = text_config_of(target_config)
        num_layers = text.num_hidden_layers
        heads = text.num_attention_heads
        fields: dict[str, Any] = dict(
            hidden_size=text.hidden_size,
            vocab_size=text.vocab_size,
            num_target_layers=num_layers,
            target_layer_ids=list(target_layer_ids or default_target_layer_ids(num_layers, num_hidden_layers)),
            mask_token_id=mask_token_id,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            intermediate_size=text.intermediate_size,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(text),
            max_position_embeddings=getattr(text, "max_position_embeddings", 32768),
        )
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlashDraftConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _rope_theta(cfg: Any) -> float:
    theta = getattr(cfg, "rope_theta", None)
    params = getattr(cfg, "rope_parameters", None)  # transformers 5 keeps it here
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    return float(theta or 10_000.0)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back (as Qwen3 does), so bf16 training matches serving."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin `[B, T, head_dim]` for integer positions `[B, T]` (rotate-half convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    freqs = position_ids.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[B, heads, T, D]`, cos/sin `[B, T, D]`."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled once: eager flex materializes the whole score matrix (slow, large)."""
    return torch.compile(flex_attention, dynamic=False)


def allow_compiled_shapes(count: int) -> None:
    """Let every compiled function here (flex attention, the draft under `compile: true`, a CE chunk)
    keep graphs for `count` batch shapes. They are compiled with `dynamic=False`, one graph per shape;
    past dynamo's recompile limit (8 by default) a new shape runs eagerly, and eager flex attention
    materializes the whole score matrix: many times slower, and out of memory at long contexts.
    Four more entries cover what dynamo also keys on (grad mode, train / eval)."""
    # torch 2.7 renamed cache_size_limit to recompile_limit (the old names stay as aliases).
    per_function, overall = (("recompile_limit", "accumulated_recompile_limit") if hasattr(dynamo_config, "recompile_limit")
                             else ("cache_size_limit", "accumulated_cache_size_limit"))
    limit = count + 4
    if getattr(dynamo_config, per_function) < limit:
        setattr(dynamo_config, per_function, limit)
        setattr(dynamo_config, overall, max(getattr(dynamo_config, overall), 8 * limit))


class ContextFeatures(NamedTuple):
    """Target features after `fc` + `hidden_norm` `[B, S, H]` and their RoPE; a layer turns them into its
    context keys/values with its own k_proj/v_proj inside its forward."""

    hidden: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashDraftConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)  # [B, n, T, D]

    def key_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values `[B, kv_heads, T, D]` of inputs `[B, T, H]` (context features or block states)."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(self, x: torch.Tensor, ctx_kv: tuple[torch.Tensor, torch.Tensor] | ContextFeatures,
                cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
        if isinstance(ctx_kv, ContextFeatures):  # training: project the context here (see module doc)
            ctx_kv = self.key_values(*ctx_kv)
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
        k_blk, v_blk = self.key_values(x, cos, sin)
        k = torch.cat([ctx_kv[0], k_blk], dim=2)
        v = torch.cat([ctx_kv[1], v_blk], dim=2)
        if isinstance(mask, torch.Tensor) or mask is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:  # flex-attention BlockMask (GPU)
            out = compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class DraftMLP(nn.Module):
    def __init__(self, cfg: DFlashDraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if torch.compiler.is_compiling():
            # Compiled, silu(gate) * up is recomputed in the backward instead of stored. down_proj's weight
            # gradient needs it; the backward keeps gate and up anyway, so it costs one elementwise pass
            # and saves a [tokens, FFN] tensor per layer (0.94 GiB for the 1B benchmark draft).
            # tests/test_model_loss.py counts what the compiled layer saves.
            hidden = checkpoint(_swiglu, gate, up, use_reentrant=False,
                                preserve_rng_state=False)  # no RNG state to save: capturable in a CUDA graph
        else:
            hidden = _swiglu(gate, up)
        return self.down_proj(hidden)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashDraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def forward(self, x, ctx_kv, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx_kv, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """DFlash draft backbone. `forward` returns final-normed hidden states `[B, Q, H]` for the LM head."""

    def __init__(self, cfg: DFlashDraftConfig) -> None:
        super().__init__()
        self.config = cfg
        num_feats = len(cfg.target_layer_ids)
        self.fc = nn.Linear(num_feats * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.make_layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.reset_parameters()

    def make_layer(self, cfg: DFlashDraftConfig) -> DraftLayer:
        """One decoder layer (a variant with its own layer, DFlash 2, overrides this)."""
        return DraftLayer(cfg)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=std)
                if name.endswith(("o_proj.weight", "down_proj.weight")):  # scaled residual branches
                    p.mul_(1 / math.sqrt(2 * self.config.num_hidden_layers))
            else:
                nn.init.ones_(p)

    # ---- the proposal rule (speculative decoding asks the draft, never its kind) ----

    fixed_block_size = False  # True: it decodes blocks of its trained block_size only (DFlash 2's convs)
    # `activation_checkpointing`: each layer's activations are recomputed in the backward instead of stored. A run
    # setting (the trainer sets it), not part of the published config.
    checkpoint_layers = False

    @classmethod
    def proposals_per_block(cls, block_size: int) -> int:
        """Draft tokens one block proposes: slot 0 holds the verified token, slots 1..bs-1 propose. A class rule, so
        the engines' counts are read from the kind's model class without building a draft (`DraftKind`)."""
        return block_size - 1

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, first_token: torch.Tensor, embed_weight: torch.Tensor,
                head_weight: torch.Tensor) -> torch.Tensor:
        """Greedy drafts `[B, proposals_per_block]` of one block from its final-normed states `hidden` `[B, bs, H]`,
        `first_token` `[B, 1]` (slot 0's token) and the target's embedding / LM head `[V, H]`: DFlash takes the
        argmax of each proposing slot."""
        return head_logits(hidden[:, 1:], head_weight).argmax(-1)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, dtype)

    def context_features(self, target_hidden: torch.Tensor, ctx_position_ids: torch.Tensor) -> ContextFeatures:
        """Target features `[B, S, K*H]` at positions `[B, S]` through `fc` + `hidden_norm`, with their RoPE."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        return ContextFeatures(ctx, *self.rope(ctx_position_ids, ctx.dtype))

    def context_kv(self, target_hidden: torch.Tensor, ctx_position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context keys/values from target features `[B, S, K*H]` at positions `[B, S]`."""
        features = self.context_features(target_hidden, ctx_position_ids)
        return [layer.self_attn.key_values(*features) for layer in self.layers]

    def forward(
        self,
        noise_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        mask: Any,
        *,
        target_hidden: torch.Tensor | None = None,
        ctx_position_ids: torch.Tensor | None = None,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Draft hidden states for block inputs.

        Args:
            noise_embeds: `[B, Q, H]` embedded block tokens (Q = N * bs in training).
            position_ids: `[B, Q]` positions of the block slots (anchor + slot).
            mask: `[B, 1, Q, S + Q]` bool (SDPA), a flex `BlockMask`, or None (see all).
            target_hidden, ctx_position_ids: `[B, S, K*H]`, `[B, S]` context features; or
            ctx_kv: precomputed `context_kv(...)` (speculative decoding caches it).
        """
        if ctx_kv is None:
            if target_hidden is None:
                raise ValueError("pass target_hidden (with ctx_position_ids) or precomputed ctx_kv")
            if ctx_position_ids is None:
                ctx_position_ids = torch.arange(target_hidden.shape[1], device=target_hidden.device).expand(
                    target_hidden.shape[0], -1)
            # each layer projects its own context keys/values in its forward (module doc: FSDP2)
            ctx_kv = [self.context_features(target_hidden, ctx_position_ids)] * len(self.layers)
        x = noise_embeds
        cos, sin = self.rope(position_ids, x.dtype)
        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        for layer, kv in zip(self.layers, ctx_kv, strict=True):
            if recompute:  # only the layer's input stays alive; no RNG in a layer, so none is saved (graph-capturable)
                x = checkpoint(layer, x, kv, cos, sin, mask, use_reentrant=False, preserve_rng_state=False)
            else:
                x = layer(x, kv, cos, sin, mask)
        return self.norm(x)
