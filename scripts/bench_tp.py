"""Benchmark the tensor-parallel frozen target's forward: plain TP ("unsplit"), the batch split in two
halves without async all-reduces ("split"), and the halves with overlapped all-reduces ("overlap",
`tp_overlap`); the fraction of all-reduce time hidden behind compute; per-rank parameter memory.

Shapes (random weights built sharded from a config: no rank ever holds the whole trunk):
  qwen3-32b  hidden 5120, 64 layers, 64 heads / 8 KV heads, head_dim 128, FFN 25600, vocab 151,936, qk-norm
  llama-70b  hidden 8192, 80 layers, 64 heads / 8 KV heads, head_dim 128, FFN 28672, vocab 128,256
  tiny       a 4-layer Llama of hidden 64 (CPU smoke, CI)
Features: the draft's default 5 target layers (2 for a trunk under 8 layers) (`default_target_layer_ids`), so the forward runs
layers 0..max(ids). `--batch` is the TP group's batch (the concatenation of its ranks' micro-batches).

Hidden fraction = 1 - (all-reduce time not covered by compute) / (all-reduce time), from a
torch.profiler trace of the "overlap" forward, worst (lowest) rank. On GPUs: NCCL kernels against
the other GPU kernels. On CPUs (gloo) there are no device kernels: the trace's "gloo:all_reduce"
ranges (gloo's own thread) against the CPU ops of the main thread; on a machine with fewer cores
than threads that concurrency is not free, so only the GPU figure means "hidden".

Each rank is one TP rank (`--tp` defaults to the world size; a larger world runs dp groups side by
side). Rank 0 prints the JSON and one summary line.

    python scripts/bench_tp.py --shape tiny                                  # one process, tp=1
    torchrun --nproc_per_node 2 scripts/bench_tp.py --shape tiny             # CPU: gloo
    torchrun --nproc_per_node 8 scripts/bench_tp.py --shape llama-70b --seq 2048 --batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.diagnostics import SyncError, forbid_syncs  # noqa: E402
from dflash.modeling import default_target_layer_ids  # noqa: E402
from dflash.runtime import init_distributed, shutdown_distributed  # noqa: E402
from dflash.target_model.tensor_parallel import TensorParallelTarget, target_parameter_bytes, tp_mesh  # noqa: E402
from dflash.target_model.tp_overlap import SCHEDULES  # noqa: E402

SHAPES: dict[str, tuple[type, dict[str, Any], int, int]] = {  # name: (config class, hyper-parameters, batch, seq)
    "qwen3-32b": (Qwen3Config, dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                                    head_dim=128, intermediate_size=25600, vocab_size=151_936, rope_theta=1e6,
                                    max_position_embeddings=40_960, tie_word_embeddings=False), 8, 2048),
    "llama-70b": (LlamaConfig, dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                    head_dim=128, intermediate_size=28672, vocab_size=128_256, rope_theta=5e5,
                                    max_position_embeddings=131_072, tie_word_embeddings=False), 8, 2048),
    "tiny": (LlamaConfig, dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=128, vocab_size=512, max_position_embeddings=512,
                               tie_word_embeddings=False), 4, 64),
}
COMM_KEYS = ("nccl", "gloo", "all_reduce", "allreduce", "all_gather", "allgather", "c10d")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(target: TensorParallelTarget, ids: torch.Tensor, device: torch.device, steps: int) -> float:
    """Mean wall ms per forward over `steps` (every rank starts together; the device drained around)."""
    sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        target(ids)
    sync(device)
    return (time.perf_counter() - start) / steps * 1e3


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def hidden_fraction(events: list[dict[str, Any]], cuda: bool) -> tuple[float, float]:
    """(fraction of all-reduce time covered by compute, all-reduce ms) of chrome-trace `events`."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if cuda:
        kernels = [e for e in spans if e.get("cat") == "kernel"]
        comm = [e for e in kernels if "nccl" in e["name"].lower()]
        compute = [e for e in kernels if "nccl" not in e["name"].lower()]
    else:
        comm = [e for e in spans if e["name"] == "gloo:all_reduce"]
        main = {e["tid"] for e in spans if e["name"] == "tp_all_reduce"}
        compute = [e for e in spans if e.get("cat") == "cpu_op" and e["tid"] in main
                   and not any(k in e["name"].lower() for k in COMM_KEYS)]
    busy = _merge([(e["ts"], e["ts"] + e["dur"]) for e in compute])
    total = covered = 0.0
    for e in comm:
        lo, hi = e["ts"], e["ts"] + e["dur"]
        total += hi - lo
        covered += sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in busy if a < hi and b > lo)
    return (covered / total if total else float("nan")), total / 1e3


def profile_hidden(target: TensorParallelTarget, ids: torch.Tensor, device: torch.device, steps: int) -> tuple[float, float]:
    """`hidden_fraction` of `steps` forwards under the target's current schedule (all-reduce ms per forward)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    dist.barrier()  # outside the trace: on NCCL a barrier is an all-reduce kernel
    with profile(activities=activities) as prof:
        for _ in range(steps):
            target(ids)
        sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    fraction, comm_ms = hidden_fraction(events, cuda)
    return fraction, comm_ms / steps


def replicated_layer_bytes(target: TensorParallelTarget) -> int:
    """Bytes the decoder layers would take unsharded: every Linear's weight / bias is 1/tp here."""
    total = 0
    for module in target.model.get_decoder().layers.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        factor = target.tp_size if isinstance(module, nn.Linear) else 1
        total += sum(t.numel() * t.element_size() for t in own) * factor
    return total


def find_syncs(target: TensorParallelTarget, ids: torch.Tensor) -> list[str]:
    """The schedules whose forward syncs under `forbid_syncs()` (the dispatch checks, and on a GPU the
    CUDA sync debug mode in "error"), each with the first line of its error; gloo / NCCL calls included."""
    found = []
    schedule = target.schedule
    for name in SCHEDULES:
        target.schedule = name
        try:
            with forbid_syncs():
                target(ids)
        except (SyncError, RuntimeError) as exc:  # RuntimeError: the CUDA sync debug mode
            found.append(f"{name}: {str(exc).splitlines()[0]}")
    target.schedule = schedule
    return found


def schedule_difference(target: TensorParallelTarget, ids: torch.Tensor) -> float:
    """Max |overlap - unsplit| of the features (read after timing; 0.0 on CPU fp32)."""
    schedule = target.schedule
    target.schedule = "unsplit"
    plain = target(ids)
    target.schedule = "overlap"
    diff = (target(ids) - plain).abs().max().item()
    target.schedule = schedule
    return diff


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-32b")
    p.add_argument("--tp", type=int, help="ranks per TP group (default: the world size)")
    p.add_argument("--batch", type=int, help="the TP group's batch (default per shape)")
    p.add_argument("--seq", type=int)
    p.add_argument("--layers", type=int, help="override the number of decoder layers (a shorter trunk)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--device", choices=["auto", "cpu"], default="auto", help="cpu: gloo on the CPU even with GPUs")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()

    cuda = torch.cuda.is_available() and args.device == "auto"
    if not cuda and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")  # init_distributed would pick NCCL on a GPU machine
    rank, world = init_distributed()
    if world == 1:  # a single process: a group of one (no collectives)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    tp = args.tp or world
    cls, hyper, batch, seq = SHAPES[args.shape]
    batch, seq = args.batch or batch, args.seq or seq
    config = cls(**{**hyper, **({"num_hidden_layers": args.layers} if args.layers else {})})
    layer_ids = default_target_layer_ids(config.num_hidden_layers, 5 if config.num_hidden_layers >= 8 else 2)
    mesh = tp_mesh(tp, device.type)
    target = TensorParallelTarget.from_config(config, layer_ids, mesh, dtype=dtype, device=device)
    # Every rank of a group must see the same batch: seed by the dp index.
    g = torch.Generator().manual_seed(mesh.get_local_rank("dp"))
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)

    ms: dict[str, float] = {}
    for schedule in SCHEDULES:
        target.schedule = schedule
        time_forward(target, ids, device, args.warmup)
        ms[schedule] = time_forward(target, ids, device, args.steps)
    target.schedule = "overlap"
    hidden, comm_ms = profile_hidden(target, ids, device, args.profile_steps)
    target.schedule = "split"
    hidden_split, comm_ms_split = profile_hidden(target, ids, device, args.profile_steps)
    syncs = find_syncs(target, ids)
    difference = schedule_difference(target, ids)
    mem = target_parameter_bytes(target)
    replicated = replicated_layer_bytes(target)
    mine = {"ms": ms, "hidden": hidden, "hidden_split": hidden_split, "comm_ms": comm_ms, "comm_ms_split": comm_ms_split,
            "syncs": syncs, "difference": difference, "param_gib": mem["total"] / 2**30, "layers_gib": mem["layers"] / 2**30,
            "layers_ratio": mem["layers"] / replicated,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")}
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    shutdown_distributed()
    if rank != 0:
        return 0
    worst = {s: max(r["ms"][s] for r in ranks) for s in SCHEDULES}  # a group moves at its slowest rank
    result = {"shape": args.shape, "tp": tp, "world_size": world, "batch": batch, "seq": seq,
              "layers": config.num_hidden_layers, "layer_ids": layer_ids, "dtype": str(dtype).removeprefix("torch."),
              "device": device.type, "ms_per_forward": worst,
              "hidden_fraction_worst_rank": min(r["hidden"] for r in ranks),
              "hidden_fraction_split_worst_rank": min(r["hidden_split"] for r in ranks),
              "hidden_method": "nccl kernels vs other GPU kernels" if device.type == "cuda" else
                               "cpu host estimate: gloo thread vs main-thread CPU ops (no GPU kernels)",
              "all_reduce_ms_per_forward": {"overlap": max(r["comm_ms"] for r in ranks),
                                            "split": max(r["comm_ms_split"] for r in ranks)},
              "syncs_found": [s for r in ranks for s in r["syncs"]],
              "max_abs_diff_overlap_vs_unsplit": max(r["difference"] for r in ranks),
              "param_gib_per_rank": [r["param_gib"] for r in ranks], "layers_gib_per_rank": [r["layers_gib"] for r in ranks],
              "layers_ratio_of_replicated": max(r["layers_ratio"] for r in ranks),
              "peak_gib_per_rank": [r["peak_gib"] for r in ranks]}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"bench_tp {args.shape} tp={tp} batch={batch} seq={seq} layers={config.num_hidden_layers}: "
          + ", ".join(f"{s} {worst[s]:.2f} ms" for s in SCHEDULES)
          + f" (overlap x{worst['unsplit'] / worst['overlap']:.2f} vs unsplit); all-reduce hidden "
          f"{result['hidden_fraction_worst_rank']:.0%} (split {result['hidden_fraction_split_worst_rank']:.0%}, worst rank, "
          f"{'GPU kernels' if device.type == 'cuda' else 'CPU host estimate'}); trunk/rank "
          f"{result['layers_ratio_of_replicated']:.3f} of replicated, params/rank {max(result['param_gib_per_rank']):.3f} GiB; "
          f"syncs {len(result['syncs_found'])}; overlap-unsplit max diff {result['max_abs_diff_overlap_vs_unsplit']:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
