"""The training step's peak device memory, estimated from shapes alone (no weight read, nothing allocated): what
`dflash train --dry-run` prints and `scripts/bench_step.py` sets beside the measured peak.

A step holds, on top of what lives all run long (the target's weights, the draft's weights, gradients and optimizer
state), one of three working sets, and its peak is the largest:

    target phase   the frozen target's forward over the batch (no grad): a layer's hidden states and MLP at a time,
                   the captured feature layers, then their concatenation `[B, S, K*H]`
    draft phase    after the draft's forward: the features (kept for `fc`'s backward), the context keys / values
                   every layer made, every layer's stored activations for the `Q = num_anchors x block_size` block
                   tokens of a row, and the fused CE's gradient buffer with one chunk's `[chunk, vocab]` logits
    backward       the draft phase less the CE chunk, plus the gradients; under `activation_checkpointing` each
                   layer keeps only its input, and the backward recomputes one layer at a time

Per-token byte counts of a layer's stored activations are written out term by term below (the inputs of its
matmuls and norms, flex attention's q / k / v / output / log-sum-exp); the compiled step stores less than the
eager one (Inductor fuses the fp32 norms and recomputes the SwiGLU product). They were checked against the
allocator's peak on an H100 (docs/benchmarks.md, issue 61): the estimate is meant to be within 15% of it for the
flex-attention (GPU) step. The CPU step (SDPA with a dense `[Q, S + Q]` mask) is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash.config import TrainConfig
from dflash.modeling import DFlashDraftConfig

GIB = 2**30


@dataclass(frozen=True)
class StepShape:
    """What the estimate reads. Target: its whole weights' bytes, hidden size, FFN size, the layers its truncated
    trunk runs; draft: its config's sizes and parameter count; the run: rows, positions, anchors, dtypes."""

    target_bytes: int  # the target's parameters and buffers on this rank (0: a stand-in or offline features)
    target_hidden: int
    target_ffn: int
    target_layers_run: int  # layers up to the last feature layer (0: no target forward, e.g. offline features)
    hidden: int  # the draft's (= the target's)
    layers: int
    q_width: int  # heads x head_dim
    kv_width: int  # kv heads x head_dim
    ffn: int
    vocab: int
    feature_layers: int  # K
    draft_params: int
    rows: int  # B: rows (or packed sequences) of one micro-batch
    positions: int  # S: their padded length
    anchors: int  # N
    block_size: int
    ce_chunk: int
    compute_bytes: int = 2  # bf16
    param_bytes: int = 4  # fp32 master weights (param_dtype)
    optimizer_states: int = 2  # AdamW's two moments (Muon: about one for the matrices)
    compiled: bool = True
    checkpointing: bool = False
    notes: list[str] = field(default_factory=list)


def layer_bytes_per_block_token(s: StepShape) -> int:
    """Bytes one draft layer stores for its backward per block token (`Q` of them per row)."""
    c, h, a, kv, f = s.compute_bytes, s.hidden, s.q_width, s.kv_width, s.ffn
    stored = (c * h            # the residual stream entering the layer (input norm's backward)
              + c * h          # the normed input of q / k / v_proj
              + 2 * c * a      # q before and after its norm + RoPE (q_norm's backward, flex's q)
              + 4 * c * kv     # the block's k and v, before and after k_norm + RoPE
              + 2 * c * a      # flex attention's output (and o_proj's input)
              + c * h          # the residual stream after attention (post-attention norm's backward)
              + c * h          # the normed input of gate / up_proj
              + 2 * c * f)     # gate and up (the SwiGLU product is recomputed when compiled)
    if not s.compiled:  # eager: fp32 copies inside the four RMSNorms, and the SwiGLU product stored
        stored += 2 * 4 * h + 4 * (a + 2 * kv) + 2 * c * f
    return stored


def context_bytes_per_token(s: StepShape) -> int:
    """Bytes of the context per target position, all layers: the features `[K*H]` (fc's backward), their
    projection after fc + hidden_norm, and each layer's context keys / values (also inside the concatenation
    with the block's, which flex attention keeps)."""
    c = s.compute_bytes
    return c * s.feature_layers * s.hidden + 2 * c * s.hidden + s.layers * 6 * c * s.kv_width


def estimate(s: StepShape) -> dict[str, float]:
    """GiB of each part of the step's peak and the peak itself (`peak`), see the module doc."""
    tokens, blocks = s.rows * s.positions, s.rows * s.anchors * s.block_size
    weights = s.target_bytes + s.draft_params * s.param_bytes
    optimizer = s.draft_params * s.param_bytes * s.optimizer_states
    grads = s.draft_params * s.param_bytes
    features = tokens * s.compute_bytes * s.feature_layers * s.hidden
    target_phase = 0
    if s.target_layers_run:  # one layer's hidden states and MLP at a time, the captured layers and their concatenation
        per_token = s.compute_bytes * (4 * s.target_hidden + 3 * s.target_ffn + s.feature_layers * s.target_hidden)
        target_phase = tokens * per_token + features
    layer = blocks * layer_bytes_per_block_token(s)
    context = tokens * context_bytes_per_token(s)
    scored = s.rows * s.anchors * (s.block_size - 1)
    ce_grad = scored * s.hidden * s.compute_bytes  # the fused CE's gradient w.r.t. the draft states
    ce_chunk = min(s.ce_chunk, scored) * s.vocab * (s.compute_bytes + (0 if s.compiled else 4))
    block_stream = blocks * s.hidden * s.compute_bytes  # the final states fed to the head
    if s.checkpointing:  # each layer keeps its input; the backward holds one layer's recomputed activations
        stored = s.layers * blocks * s.hidden * s.compute_bytes
        draft_phase = context + stored + block_stream + ce_grad + ce_chunk
        backward = grads + context + stored + 2 * layer + ce_grad
    else:
        stored = s.layers * layer
        draft_phase = context + stored + block_stream + ce_grad + ce_chunk
        backward = grads + context + stored + ce_grad + block_stream
    working = max(target_phase, draft_phase, backward)
    parts = {"weights": weights, "optimizer_state": optimizer, "target_phase": target_phase,
             "draft_phase": draft_phase, "backward_phase": backward, "layer_activations": stored, "context": context,
             "peak": weights + optimizer + working}
    return {k: v / GIB for k, v in parts.items()}


def describe(parts: dict[str, float]) -> str:
    """One line for the dry run."""
    phase = max(("target_phase", "draft_phase", "backward_phase"), key=parts.__getitem__)
    return (f"{parts['peak']:.1f} GiB (weights {parts['weights']:.1f}, optimizer state {parts['optimizer_state']:.1f}, "
            f"at the {phase.replace('_', ' ')} {parts[phase]:.1f}: draft layers' stored activations "
            f"{parts['layer_activations']:.1f}, context {parts['context']:.1f})")


def step_shape(config: TrainConfig, text_config: Any, draft_config: DFlashDraftConfig, draft_params: int,
               target_bytes: int, compute_bytes: int) -> StepShape:
    """The `StepShape` of a run: `text_config` the target's (HF, text part), `draft_config` / `draft_params` the
    draft's, `target_bytes` the target's weights on this rank (`dflash.cli.dry_run.target_memory`'s count),
    `compute_bytes` the compute dtype's size. A micro-batch is `batch_size` rows of `data.max_length` (packed:
    sequences of `data.pack_length`); gradient accumulation runs micro-batches one after another."""
    data = config.data
    positions = (data.pack_length or data.max_length) if data.packing else data.max_length
    return StepShape(
        target_bytes=target_bytes, target_hidden=text_config.hidden_size, target_ffn=text_config.intermediate_size,
        target_layers_run=0 if data.features else max(draft_config.target_layer_ids) + 1,
        hidden=draft_config.hidden_size, layers=draft_config.num_hidden_layers,
        q_width=draft_config.num_attention_heads * draft_config.head_dim,
        kv_width=draft_config.num_key_value_heads * draft_config.head_dim, ffn=draft_config.intermediate_size,
        vocab=draft_config.vocab_size, feature_layers=len(draft_config.target_layer_ids), draft_params=draft_params,
        rows=config.batch_size, positions=positions, anchors=config.draft.num_anchors,
        block_size=draft_config.block_size, ce_chunk=config.ce_chunk_size, compute_bytes=compute_bytes,
        param_bytes=4 if config.param_dtype == "float32" else 2,
        optimizer_states=1 if config.optim.optimizer == "muon" else 2, compiled=config.compile,
        checkpointing=config.activation_checkpointing)
