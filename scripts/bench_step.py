"""Benchmark the dflash training step: ms/step, tokens/s, TFLOP/s, MFU (two countings), peak memory.

Configurations (all on random data):
  specforge  Qwen3-8B-shaped draft as in SpecForge's benchmark: hidden 4096, 5 layers, FFN 12288,
             32 heads / 8 KV heads, head_dim 128, vocab 151,936, 5 target layers of random features,
             batch 2, sequence 768, 256 anchors, block 16, bf16 parameters.
  smollm2    the embedded default's shapes with a real (randomly initialised) SmolLM2-135M-shaped
             Llama target forward: 2-layer draft, block 16, 64 anchors, batch 32, sequence 512.
  qwen3-8b   end to end: the specforge draft against a random-weight Qwen3-8B-shaped target (from its
             config, no download) whose forward runs every step (target_layer_ids [1, 9, 17, 25, 33]);
             `--kind domino` for a Domino draft. MFU counts the target's forward too; samples/s
             is per GPU, with and without the target. `--sync-check` runs extra steps under
             torch.cuda.set_sync_debug_mode("error").
  tiny       a CPU smoke configuration (CI); `--sync-check` works on it too (a real tiny target when
             `--real-target`).

`--kind domino` builds a Domino draft (the backbone above plus the published Qwen3-8B Domino head:
GRU 1024, emb_dim 256, pure_draft_prefix_len 1, shift_label true unless `--no-shift-label`; GRU 32 and
emb_dim 16 on `tiny`) in every configuration; `--kind dflash2` / `--kind dspark` the DFlash 2 / DSpark heads
at their published defaults (rank 256; the stand-in target also gives a random final hidden state for
DSpark's L1 term), with the configuration's block size. A flag that does not apply to the configuration or the
launch is an error (`check_flags`), never silently ignored.

MFU is reported against the bf16 matmul peak measured in the same run (an 8192^3 product), two ways:
  specforge  3 x forward FLOPs with dense attention and the LM head over every slot (their counting)
  needed     what the step must compute: attention at the mask's real density, no LM-head weight
             gradient, slot 0 never scored, fc (context side) without an input gradient.

`--data-latency-ms X` adds X ms of CPU work per batch in the main thread (as a collate would) and
reports the step time with that latency for the sync-free step and for `--force-sync` style steps
(one `.item()` per step, as peers do), in the same process. Ends with one summary line.

Several processes (`torchrun --nproc_per_node N` / `accelerate launch --num_processes N`): each rank
runs the step on its own GPU (cuda:LOCAL_RANK) on its own batch, with the draft under DDP or FSDP2
(`--distributed`); rank 0 prints the JSON (its own figures, plus per-rank ms/step and tokens/s and
the total tokens/s over ranks) and the one summary line.

    python scripts/bench_step.py --config specforge
    python scripts/bench_step.py --config specforge --seq 3072 --anchors 512
    python scripts/bench_step.py --config smollm2 --latency
    python scripts/bench_step.py --config specforge --compile --profile   # where memory and time go
    torchrun --nproc_per_node 2 scripts/bench_step.py --config specforge --distributed fsdp2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.config import CompileScope, Distributed, DominoSettings, Optimizer, TrainConfig  # noqa: E402
from dflash.diagnostics import forbid_syncs  # noqa: E402
from dflash.kinds.dflash2 import DFlash2HeadConfig  # noqa: E402
from dflash.kinds.domino import DominoHeadConfig  # noqa: E402
from dflash.kinds.dspark import DSparkHeadConfig  # noqa: E402
from dflash.kinds.registry import draft_model_for_config  # noqa: E402
from dflash.memory import StepShape, estimate  # noqa: E402
from dflash.modeling import DFlashDraftConfig  # noqa: E402
from dflash.runtime import DTYPES, init_distributed, shutdown_distributed  # noqa: E402
from dflash.target_model.tensor_parallel import target_parameter_bytes  # noqa: E402
from dflash.trainer import DFlashTrainer  # noqa: E402

HEADS = {"domino": DominoHeadConfig, "dflash2": DFlash2HeadConfig, "dspark": DSparkHeadConfig}  # kind -> its head keys


@dataclass
class Shape:
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    target_layers: int  # K features
    num_target_layers: int
    batch: int
    seq: int
    anchors: int
    block: int
    gru_hidden: int = 1024  # Domino head (`--kind domino`): the published Qwen3-8B config's sizes
    emb_dim: int = 256


SHAPES = {
    "specforge": Shape(4096, 5, 12288, 32, 8, 128, 151_936, 5, 36, 2, 768, 256, 16),
    "smollm2": Shape(576, 2, 1536, 9, 3, 64, 49_152, 2, 30, 32, 512, 64, 16),
    "tiny": Shape(64, 2, 128, 4, 2, 16, 512, 2, 4, 2, 64, 8, 4, gru_hidden=32, emb_dim=16),
    "qwen3-8b": Shape(4096, 5, 12288, 32, 8, 128, 151_936, 5, 36, 2, 768, 256, 16),
}


class RandomFeatureTarget(nn.Module):
    """A frozen stand-in target: fixed random features, random embedding and LM head (SpecForge's setup)."""

    def __init__(self, s: Shape, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        g = torch.Generator(device="cpu").manual_seed(0)
        self.hidden_size = s.hidden
        self.register_buffer("embed_weight", (torch.randn(s.vocab, s.hidden, generator=g) * 0.02).to(device, dtype))
        self.register_buffer("lm_head_weight", (torch.randn(s.vocab, s.hidden, generator=g) * 0.02).to(device, dtype))
        # drawn on the device: at long contexts the host's draw took most of a run's setup (2.7e9 values at 128K)
        gd = torch.Generator(device=device).manual_seed(0)
        self.register_buffer("features", torch.randn(s.batch, s.seq, s.target_layers * s.hidden, generator=gd,
                                                     device=device, dtype=dtype))
        # a final-normed last hidden state, for DSpark's L1 term (`LastHiddenTarget`)
        self.register_buffer("last_hidden", torch.randn(s.batch, s.seq, s.hidden, generator=gd, device=device, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.features[: input_ids.shape[0], : input_ids.shape[1]]

    def features_and_last_hidden(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self(input_ids), self.last_hidden[: input_ids.shape[0], : input_ids.shape[1]]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.embed_weight)


def smollm2_target(device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.target_model.frozen import FrozenTarget

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49_152, max_position_embeddings=8192, tie_word_embeddings=True,
                      rope_theta=100_000.0)
    return FrozenTarget(LlamaForCausalLM(cfg), [1, 27]).to(device, dtype)


def hf_target(s: Shape, device: torch.device, dtype: torch.dtype) -> Qwen3ForCausalLM:
    """A random-weight Qwen3 target of the shape `s` (initialised on `device` in `dtype`: no host copy)."""
    cfg = Qwen3Config(hidden_size=s.hidden, intermediate_size=s.ffn, num_hidden_layers=s.num_target_layers,
                      num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                      vocab_size=s.vocab, max_position_embeddings=40_960, rope_theta=1_000_000.0,
                      tie_word_embeddings=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def build_end_to_end(s: Shape, cfg: TrainConfig, args: argparse.Namespace, device: torch.device,
                     dtype: torch.dtype) -> DFlashTrainer:
    """The draft (`--kind`) through the trainer's own factory, against a real target forward."""
    cfg.draft.num_layers, cfg.draft.mask_token_id = s.layers, s.vocab - 2
    cfg.draft.num_attention_heads, cfg.draft.num_key_value_heads, cfg.draft.head_dim = s.heads, s.kv_heads, s.head_dim
    cfg.draft.intermediate_size, cfg.draft.anchor_widths = s.ffn, 1
    return DFlashTrainer(cfg, target=hf_target(s, device, dtype))  # param_dtype: the trainer casts the draft


def target_forward_flops(trainer: DFlashTrainer, s: Shape) -> float:
    """Forward FLOPs of the target's truncated trunk for one batch: 2 x parameters x tokens, plus causal
    attention scores and values."""
    layers = trainer.objective.target._trunk.layers  # the layers that run: up to the last feature layer
    params = sum(p.numel() for p in layers.parameters())
    attention = 2 * 2 * s.heads * s.head_dim * s.seq * s.seq / 2 * len(layers)
    return s.batch * (2 * params * s.seq + attention)


def build(name: str, s: Shape, args: argparse.Namespace, device: torch.device) -> DFlashTrainer:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = TrainConfig(device=str(device), dtype=str(dtype).replace("torch.", ""), max_steps=10_000,
                      batch_size=s.batch, param_dtype=args.param_dtype, compile=args.compile,
                      cuda_graph=args.cuda_graph, ce_chunk_size=args.ce_chunk, distributed=args.distributed,
                      fp8=args.fp8, compile_scope=args.compile_scope,
                      activation_checkpointing=args.activation_checkpointing)
    cfg.optim.optimizer = args.optimizer
    cfg.draft.kind, cfg.draft.num_anchors, cfg.draft.block_size = args.kind, s.anchors, s.block
    cfg.draft.attention = args.attention
    cfg.domino = DominoSettings(emb_dim=s.emb_dim, gru_hidden_dim=s.gru_hidden, pure_draft_prefix_len=1,
                                shift_label=args.shift_label)
    if name == "qwen3-8b" or args.real_target:
        return build_end_to_end(s, cfg, args, device, dtype)
    if name == "smollm2":
        target = smollm2_target(device, dtype)
        layer_ids = target.layer_ids
    else:
        target = RandomFeatureTarget(s, device, dtype)
        layer_ids = list(range(1, 1 + s.target_layers))
    draft_cfg = DFlashDraftConfig(hidden_size=s.hidden, vocab_size=s.vocab, num_target_layers=s.num_target_layers,
                                  target_layer_ids=layer_ids, mask_token_id=s.vocab - 1, num_hidden_layers=s.layers,
                                  num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                                  intermediate_size=s.ffn, block_size=s.block)
    if args.kind in HEADS:  # the kind's head keys from its config section (`domino`, `dflash2`, `dspark`)
        draft_cfg = dataclasses.replace(draft_cfg, extra=HEADS[args.kind].from_settings(getattr(cfg, args.kind)).to_extra())
    return DFlashTrainer(cfg, frozen_target=target, draft=draft_model_for_config(draft_cfg))


def estimated_memory(trainer: DFlashTrainer, s: Shape) -> dict[str, float]:
    """`dflash.memory.estimate` of this step (GiB): what `dflash train --dry-run` prints for the same shapes. The
    random-feature stand-in's features are the step's features (counted there), not target weights."""
    target = trainer.objective.target
    if isinstance(target, RandomFeatureTarget):
        target_bytes, layers_run = sum(_nbytes(b) for b in (target.embed_weight, target.lm_head_weight)), 0
    else:
        target_bytes, layers_run = target_parameter_bytes(target)["total"], max(trainer.draft_config.target_layer_ids) + 1
    cfg, d = trainer.config, trainer.draft_config
    shape = StepShape(target_bytes=target_bytes, target_hidden=s.hidden, target_ffn=s.ffn, target_layers_run=layers_run,
                      hidden=d.hidden_size, layers=d.num_hidden_layers, q_width=d.num_attention_heads * d.head_dim,
                      kv_width=d.num_key_value_heads * d.head_dim, ffn=d.intermediate_size, vocab=d.vocab_size,
                      feature_layers=len(d.target_layer_ids), draft_params=sum(p.numel() for p in trainer.draft.parameters()),
                      rows=s.batch, positions=s.seq, anchors=s.anchors, block_size=s.block, ce_chunk=cfg.ce_chunk_size,
                      compute_bytes=trainer.dtype.itemsize, param_bytes=DTYPES[cfg.param_dtype].itemsize,
                      optimizer_states=1 if cfg.optim.optimizer == "muon" else 2, compiled=cfg.compile,
                      checkpointing=cfg.activation_checkpointing)
    return estimate(shape)


def check_flags(p: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> None:
    """Refuse a flag that would be silently ignored by this configuration or launch (exit 2, naming it)."""
    if args.real_target and args.config in ("qwen3-8b", "smollm2"):
        p.error(f"--real-target does not apply to --config {args.config}: it always runs its own real target "
                "(--real-target swaps the random features of specforge / tiny for a Qwen3 target of their shape)")
    if not args.shift_label and args.kind != "domino":
        p.error("--no-shift-label applies to Domino drafts only: add --kind domino")
    if args.data_latency_ms is not None and not args.latency:
        p.error("--data-latency-ms applies to the latency measurement only: add --latency")
    if args.compile_loss and args.compile:
        p.error("--compile-loss is part of --compile: pass one of them")
    if args.distributed is not None and world == 1:
        p.error("--distributed applies under several processes only (torchrun / accelerate launch "
                "--num_processes N): drop it for a single process")


def random_batch(s: Shape, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, s.vocab - 2, (s.batch, s.seq), generator=g)
    mask = torch.ones(s.batch, s.seq, dtype=torch.bool)
    mask[:, : s.seq // 8] = False  # a prompt
    batch = {"input_ids": ids, "loss_mask": mask}
    if device.type == "cuda":
        batch = {k: v.pin_memory() for k, v in batch.items()}
    return batch


def flops(s: Shape, mask_density: float) -> dict[str, float]:
    """FLOPs of one step, counted SpecForge's way and as needed (see module docstring)."""
    q_tok = s.batch * s.anchors * s.block
    ctx_tok = s.batch * s.seq
    kv = s.kv_heads * s.head_dim
    layer_block = 2 * s.hidden * (s.heads * s.head_dim) * 2 + 2 * s.hidden * kv * 2 + 3 * 2 * s.hidden * s.ffn
    layer_ctx = 2 * s.hidden * kv * 2  # k_proj, v_proj of the context
    fc = 2 * s.target_layers * s.hidden * s.hidden
    attn_dense = 4 * s.heads * s.head_dim * (s.anchors * s.block) * (s.seq + s.anchors * s.block) * s.batch
    linear_fwd = q_tok * s.layers * layer_block  # layer_block: forward FLOPs per block token and layer
    ctx_fwd = ctx_tok * (s.layers * layer_ctx + fc)
    head_all = 2 * q_tok * s.vocab * s.hidden
    head_scored = 2 * s.batch * s.anchors * (s.block - 1) * s.vocab * s.hidden
    specforge = 3 * (linear_fwd + ctx_fwd + attn_dense * s.layers + head_all)
    needed = (3 * linear_fwd + 3 * ctx_tok * s.layers * layer_ctx + 2 * ctx_tok * fc
              + 3 * attn_dense * mask_density * s.layers + 2 * head_scored)
    return {"specforge": specforge, "needed": needed}


def cap_memory(device: torch.device, gib: float | None) -> None:
    """Let this process allocate at most `gib` GiB of the GPU (an H200 standing in for an 80 GB card: what fits
    is then what fits an H100). No-op without a cap or a GPU."""
    if gib and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / torch.cuda.get_device_properties(device).total_memory),
                                                   device)


def matmul_peak(device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * 8192**3 * 20 / (start.elapsed_time(end) / 1e3)


def count_syncs(trainer: DFlashTrainer, batch: dict, device: torch.device, steps: int) -> int:
    """Host-device syncs in `steps` steps: on a GPU the CUDA sync debug mode raises at the first one
    (so the count is 0 or 1); on the CPU the dispatch detector counts every one."""
    dev = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(steps):
                trainer.train_step(dev)
        except RuntimeError as e:
            print(f"sync: {e}", file=sys.stderr)
            return 1
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return 0
    with forbid_syncs(raise_on_first=False) as report:
        for _ in range(steps):
            trainer.train_step(dev)
    return len(report.findings)


def cpu_work(ms: float) -> None:
    """Busy CPU work in this thread (a collate / tokenizer stand-in)."""
    end = time.perf_counter() + ms / 1e3
    x = 0
    while time.perf_counter() < end:
        x += 1


def time_steps(trainer: DFlashTrainer, batch: dict, device: torch.device, steps: int, *, latency_ms: float = 0.0,
               force_sync: bool = False) -> float:
    """Mean wall ms/step over `steps` steps (host clock; the device is drained before and after)."""
    def one() -> None:
        if latency_ms:
            cpu_work(latency_ms)
        dev = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        trainer.train_step(dev)
        if force_sync:
            trainer.metrics.buffer[0].item()  # what a per-step log line does

    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        one()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def mask_density(trainer: DFlashTrainer, batch: dict, device: torch.device) -> float:
    from dflash.attention import dense_dflash_mask

    loss_mask = batch["loss_mask"].to(device)
    anchors, keep, _ = trainer.objective.plan(batch["input_ids"].to(device), loss_mask, None)
    m = dense_dflash_mask(anchors, keep, loss_mask.shape[1], trainer.block_size)
    return m.float().mean().item()


# Kernel / op name fragments per category, matched in this order (lower case).
CATEGORIES = (("communication", ("nccl", "all_reduce", "allreduce", "reduce_scatter", "all_gather")),
              ("attention", ("flex", "attention", "fmha", "flash")),
              ("optimizer", ("adam", "multi_tensor", "foreach")),
              ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "sm90", "cublas", "aten::mm", "aten::addmm",
                          "aten::bmm", "aten::matmul")))


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def _nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 shard counts what this rank holds
    return local.numel() * local.element_size()


def phase_peaks(trainer: DFlashTrainer, batch: dict, device: torch.device) -> tuple[float, float]:
    """(most bytes allocated up to the end of a forward pass (loss computed, its backward not begun), most
    bytes allocated in the whole step), over one more eager step: the allocator's host-side counter, read
    after each micro-batch's objective forward and after the step. NaN on a CPU or when the step
    replays a CUDA graph (no forward call to watch)."""
    if device.type != "cuda":
        return float("nan"), float("nan")
    peaks: list[int] = []
    real = trainer.objective.forward

    def watched(*args, **kwargs):
        out = real(*args, **kwargs)
        peaks.append(torch.cuda.max_memory_allocated(device))
        return out

    torch.cuda.reset_peak_memory_stats(device)
    trainer.objective.forward = watched
    try:
        time_steps(trainer, batch, device, 1)
    finally:
        del trainer.objective.forward
    return (max(peaks) if peaks else float("nan")), torch.cuda.max_memory_allocated(device)


def memory_breakdown(trainer: DFlashTrainer, batch: dict, device: torch.device) -> dict[str, float]:
    """GiB of one steady step's peak (`step_peak`, no compilation or autotuning in it) held by weights
    (draft and target), AdamW state, gradients, and the rest (activations, CE chunk, workspace, allocator
    slack) = peak minus those; and `forward_peak`, the most allocated before the first backward begins.

    Gradients count only if they exist at the peak: eager steps free them after the update
    (`zero_grad(set_to_none=True)`), so when the peak is reached in the forward pass, they are not there.
    A CUDA-graph step keeps them allocated. On a CPU the peaks are NaN."""
    forward_peak, step_peak = phase_peaks(trainer, batch, device)
    weights = sum(_nbytes(t) for t in {id(t): t for t in [*trainer.objective.parameters(),
                                                            *trainer.objective.buffers()]}.values())
    optimizer = sum(_nbytes(v) for state in trainer.optimizer.state.values() for v in state.values()
                    if torch.is_tensor(v))
    peak_in_forward = forward_peak >= 0.999 * step_peak  # False when unknown (NaN)
    grads = 0 if peak_in_forward and not trainer.config.cuda_graph else sum(
        _nbytes(p) for p in trainer.draft.parameters() if p.requires_grad)
    gib = {"weights": weights, "optimizer_state": optimizer, "gradients": grads}
    gib["activations_and_workspace"] = step_peak - sum(gib.values())
    gib.update(step_peak=step_peak, forward_peak=forward_peak)
    return {k: v / 2**30 for k, v in gib.items()}


def kernel_rows(events, kind, steps: int) -> list[tuple[str, float]]:
    """(name, ms per step) of each kernel (CPU op on a CPU) in the averaged profiler `events`.

    Skipped on a GPU: user annotations. A `record_function` range (the optimizer's
    "Optimizer.step#AdamW.step") also appears on the device with the time of the kernels inside it, so
    counting it would count those kernels twice (the `a312745` profile: "optimizer 13.5 ms" was 7.9 ms of kernels
    plus the 5.6 ms range). On a CPU a range's self time is its own Python work and is kept."""
    cuda = kind.name == "CUDA"
    rows = [(e.key, (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3 / steps)
            for e in events if e.device_type == kind and not (cuda and getattr(e, "is_user_annotation", False))]
    return [(k, ms) for k, ms in rows if ms > 0 and not k.startswith("ProfilerStep")]


def kernel_breakdown(trainer: DFlashTrainer, batch: dict, device: torch.device, steps: int = 3,
                     top: int = 20) -> dict[str, object]:
    """Where a step's time goes, from torch.profiler over `steps` steps: GPU kernel time (CPU op self time
    on a CPU) per category and the `top` kernels, in ms per step; and the share of wall time the GPU is
    busy. Profiling slows the host, so these are shares, not timings to quote."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        wall = time_steps(trainer, batch, device, steps)
    rows = kernel_rows(prof.key_averages(), DeviceType.CUDA if cuda else DeviceType.CPU, steps)
    busy = sum(ms for _, ms in rows)
    shares: dict[str, float] = {}
    for key, ms in rows:
        shares[category(key)] = shares.get(category(key), 0.0) + ms
    top_rows = sorted(rows, key=lambda r: -r[1])[:top]
    return {"busy_ms_per_step": busy, "wall_ms_per_step_profiled": wall,
            "ms_per_step_by_category": dict(sorted(shares.items(), key=lambda kv: -kv[1])),
            "top": [{"name": k[:120], "ms_per_step": ms, "category": category(k)} for k, ms in top_rows]}


def print_profile(profile: dict) -> None:
    mem = profile["memory_gib"]
    print("memory of one steady step (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in mem.items()))
    k = profile["kernels"]
    print(f"device busy {k['busy_ms_per_step']:.1f} ms of {k['wall_ms_per_step_profiled']:.1f} ms per profiled step; "
          + ", ".join(f"{c} {ms:.1f} ms" for c, ms in k["ms_per_step_by_category"].items()))
    for row in k["top"]:
        print(f"  {row['ms_per_step']:8.2f} ms  {row['category']:<13} {row['name']}")


def progress(message: str, start: float) -> None:
    """Phase marks on stderr, so a run stopped by a time limit shows how far it got."""
    print(f"[bench_step {time.perf_counter() - start:7.1f} s] {message}", file=sys.stderr, flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(SHAPES), default="specforge")
    p.add_argument("--seq", type=int)
    p.add_argument("--anchors", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "flex"])
    p.add_argument("--param-dtype", choices=["float32", "bfloat16"], help="default: bfloat16 on GPU (SpecForge's policy)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compile-loss", action="store_true",
                   help="compile the CE chunks alone (the draft eager), as a config without compile: true could")
    p.add_argument("--compile-scope", choices=typing.get_args(CompileScope), default="step",
                   help="with --compile: each decoder layer once (layers) or the whole draft call (step)")
    p.add_argument("--cuda-graph", action="store_true")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each draft layer in the backward (activation_checkpointing: true)")
    p.add_argument("--fp8", action="store_true", help="float8 GEMMs in the draft's linear layers (fp8: true; torchao)")
    p.add_argument("--optimizer", choices=typing.get_args(Optimizer), default="adamw",
                   help="muon: Muon for the layers' and fc's matrices (optim.optimizer), AdamW for the rest")
    p.add_argument("--ce-chunk", type=int, default=2048)
    p.add_argument("--latency", action="store_true", help="also measure latency hiding (sync-free vs forced sync)")
    p.add_argument("--data-latency-ms", type=float, help="CPU work per batch (default: half the measured step)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--memory-cap-gib", type=float, help="allocate at most this much GPU memory (e.g. 79 on an H200)")
    p.add_argument("--distributed", choices=typing.get_args(Distributed),
                   help="under torchrun / accelerate launch: replicate (ddp, the default) or shard (fsdp2) the draft")
    p.add_argument("--kind", choices=["dflash", *HEADS], default="dflash", help="draft kind, in every configuration")
    p.add_argument("--no-shift-label", dest="shift_label", action="store_false",
                   help="Domino: DFlash's same-position label layout instead of the published shift_label true")
    p.add_argument("--real-target", action="store_true", help="a random-weight Qwen3 target of the config's shape")
    p.add_argument("--sync-check", action="store_true",
                   help="also run steps under torch.cuda.set_sync_debug_mode('error') (GPU) and count syncs")
    p.add_argument("--profile", action="store_true",
                   help="also print where the peak memory and the step's kernel time go (after the timing)")
    args = p.parse_args()
    t0 = time.perf_counter()

    rank, world = init_distributed()  # (0, 1) in a single process
    check_flags(p, args, world)
    args.distributed = args.distributed or "ddp"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if world > 1 and device.type == "cuda":  # one GPU per rank
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    args.param_dtype = args.param_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    cap_memory(device, args.memory_cap_gib)
    s = SHAPES[args.config]
    for field in ("seq", "anchors", "batch"):
        if getattr(args, field):
            setattr(s, field, getattr(args, field))
    trainer = build(args.config, s, args, device)
    if args.compile_loss:  # `--compile` sets it through the trainer's config
        trainer.objective.compile_loss = True
    batch = random_batch(s, device, rank)  # each rank its own rows
    density = mask_density(trainer, batch, device)
    progress("built", t0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    first_step_ms = time_steps(trainer, batch, device, 1)  # compilation of this shape included
    progress(f"first step done in {first_step_ms / 1e3:.1f} s", t0)
    if args.warmup > 1:
        time_steps(trainer, batch, device, args.warmup - 1)
    progress(f"{args.warmup} warm-up steps done (compilation included)", t0)
    if world > 1:
        dist.barrier()  # every rank starts the measured steps together
    ms = time_steps(trainer, batch, device, args.steps)
    progress(f"{args.steps} timed steps done", t0)
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    peak = matmul_peak(device)
    f = flops(s, density)
    result = {
        "config": args.config, "kind": args.kind, "draft": type(trainer.draft).__name__,
        "batch": s.batch, "seq": s.seq, "anchors": s.anchors, "block": s.block,
        "attention": trainer.objective.attention, "param_dtype": args.param_dtype, "compile": args.compile,
        "compile_loss": args.compile_loss, "fp8": args.fp8, "optimizer": args.optimizer,
        "cuda_graph": args.cuda_graph, "compile_scope": args.compile_scope, "first_step_s": first_step_ms / 1e3,
        "ms_per_step": ms, "tokens_per_s": s.batch * s.seq / ms * 1e3,
        "mask_density": density, "tflops_specforge": f["specforge"] / ms / 1e9, "tflops_needed": f["needed"] / ms / 1e9,
        "matmul_peak_tflops": peak / 1e12, "peak_mem_gib": peak_mem,
        "activation_checkpointing": args.activation_checkpointing,
    }
    result["estimated_mem_gib"] = estimated_memory(trainer, s)
    result["estimate_over_measured"] = result["estimated_mem_gib"]["peak"] / peak_mem if peak_mem == peak_mem else None
    result["mfu_specforge"] = result["tflops_specforge"] * 1e12 / peak if not math.isnan(peak) else float("nan")
    result["mfu_needed"] = result["tflops_needed"] * 1e12 / peak if not math.isnan(peak) else float("nan")
    result["samples_per_s"] = s.batch / ms * 1e3
    if args.config == "qwen3-8b" or args.real_target:
        target_flops = target_forward_flops(trainer, s)
        result.update(target_tflop_per_step=target_flops / 1e12,
                      tflops_end_to_end=(f["needed"] + target_flops) / ms / 1e9)
        result["mfu_end_to_end"] = result["tflops_end_to_end"] * 1e12 / peak if not math.isnan(peak) else float("nan")
    if args.sync_check:
        result["syncs"] = count_syncs(trainer, batch, device, 5)
        progress("sync check done", t0)
    if args.latency:
        latency = args.data_latency_ms if args.data_latency_ms is not None else ms / 2
        runs = {}
        for label, lat, sync in (("free_0", 0.0, False), ("free_lat", latency, False),
                                 ("sync_0", 0.0, True), ("sync_lat", latency, True)):
            runs[label] = statistics.median(time_steps(trainer, batch, device, max(3, args.steps // 2),
                                                       latency_ms=lat, force_sync=sync) for _ in range(3))
        result.update({"latency_ms": latency, **{f"ms_{k}": v for k, v in runs.items()},
                       "latency_slowdown_sync_free": runs["free_lat"] / runs["free_0"],
                       "latency_slowdown_forced_sync": runs["sync_lat"] / runs["sync_0"]})
    if args.profile:
        result["profile"] = {"memory_gib": memory_breakdown(trainer, batch, device),
                             "kernels": kernel_breakdown(trainer, batch, device)}
        progress("profiled", t0)
    if world > 1:  # per-rank figures (each rank steps on its own batch) and the total over ranks
        per_rank = [None] * world
        dist.all_gather_object(per_rank, {"ms_per_step": ms, "tokens_per_s": result["tokens_per_s"],
                                          "peak_mem_gib": peak_mem})
        result.update({"world_size": world, "distributed": args.distributed,
                       "ms_per_step_per_rank": [r["ms_per_step"] for r in per_rank],
                       "tokens_per_s_per_rank": [r["tokens_per_s"] for r in per_rank],
                       "peak_mem_gib_per_rank": [r["peak_mem_gib"] for r in per_rank],
                       "tokens_per_s_total": sum(r["tokens_per_s"] for r in per_rank)})
        del trainer  # its DDP reducer must go before the process group (shutdown_distributed)
        shutdown_distributed()
        if rank != 0:
            return 0
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    if args.profile:
        print_profile(result["profile"])
    muon = " muon" if args.optimizer == "muon" else ""
    line = (f"bench {args.config} {args.kind}{muon} seq={s.seq} anchors={s.anchors}: {ms:.1f} ms/step, "
            f"{result['tflops_specforge']:.0f} TFLOP/s (specforge count, MFU {result['mfu_specforge']:.1%}), "
            f"{result['tflops_needed']:.0f} TFLOP/s needed (MFU {result['mfu_needed']:.1%}), peak {peak_mem:.1f} GiB "
            f"(estimated {result['estimated_mem_gib']['peak']:.1f}), "
            f"{result['samples_per_s']:.2f} samples/s")
    if "tflops_end_to_end" in result:
        line += (f"; {args.kind} end to end (target forward included): "
                 f"{result['tflops_end_to_end']:.0f} TFLOP/s, MFU {result['mfu_end_to_end']:.1%}")
    if args.sync_check:
        line += f"; syncs {result['syncs']}"
    if args.latency:
        line += (f"; latency {result['latency_ms']:.0f} ms: sync-free x{result['latency_slowdown_sync_free']:.2f}, "
                 f"forced-sync x{result['latency_slowdown_forced_sync']:.2f}")
    if world > 1:
        line += (f"; {world} ranks ({args.distributed}): {result['tokens_per_s_total']:.0f} tokens/s total, per rank "
                 + " / ".join(f"{t:.0f}" for t in result["tokens_per_s_per_rank"]))
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
