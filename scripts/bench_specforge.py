"""Benchmark SpecForge's own DFlash / Domino training step, to set our step time against theirs.

Runs the peer trainer SpecForge's code, not a re-implementation: its `DFlashDraftModel` / `DominoDraftModel`
(built from its `configs/qwen3-8b-<kind>.json`, sizes as in `bench_step.py --config specforge`) inside its
`OnlineDFlashModel` / `OnlineDominoModel` wrapper (its anchor sampling, mask, chunked loss), with a frozen random
LM head and embedding, on random data: batch 2, sequence 768, 256 anchors, block 16, loss_decay_gamma 7.0,
Domino's lambda_base 0.5, flex attention on a GPU (sdpa on a CPU: flex has no CPU backward), everything in bf16
on a GPU (SpecForge's precision policy), fp32 on a CPU. One step = their forward, `loss.backward()`, an AdamW
step over the draft's trainable parameters (`--optimizer fused`: torch's fused AdamW, as bench_step's step;
`--optimizer specforge`: their BF16Optimizer, fp32 master copies with gradient clipping, as their trainer runs)
and `zero_grad(set_to_none=True)`. Reported as bench_step.py reports ours, so the two give a ratio measured on
the same GPU: mean wall ms/step (host clock, device drained before and after), peak allocated memory,
host-device syncs per step (extra steps under torch.cuda.set_sync_debug_mode("warn"); their anchor sampling
syncs), samples/s, and the bf16 matmul peak of the same run (bench_step.matmul_peak).

SpecForge's code comes from a snapshot folder outside git (never copied into this repo): `--specforge PATH`,
the folder holding the `specforge` package and `configs/`, default `.carry/specforge-snapshot` in the repo root
(`/.carry/` is git-ignored). An optional `SNAPSHOT` file there names its commit. To prepare it:

    mkdir -p .carry/specforge-snapshot
    git -C <SpecForge checkout> archive HEAD specforge configs | tar -x -C .carry/specforge-snapshot
    git -C <SpecForge checkout> rev-parse HEAD > .carry/specforge-snapshot/SNAPSHOT

Examples:

    python scripts/bench_specforge.py                                  # Domino, Qwen3-8B shape, on the GPU
    python scripts/bench_specforge.py --kind dflash --json runs/bench_specforge_dflash.json
    python scripts/bench_specforge.py --optimizer specforge            # with their BF16Optimizer
    python scripts/bench_specforge.py --specforge /tmp/sf --config tiny --steps 2 --warmup 1   # CPU smoke

Ends with one summary line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3Config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from bench_step import SHAPES, Shape, cap_memory, flops, matmul_peak, time_steps  # noqa: E402

CONFIGS = ("specforge", "tiny")
LAMBDA_BASE = 0.5
LOSS_DECAY_GAMMA = 7.0
LR = 1e-4


def progress(message: str, start: float) -> None:
    """Phase marks on stderr, so a run stopped by a time limit shows how far it got."""
    print(f"[bench_specforge {time.perf_counter() - start:7.1f} s] {message}", file=sys.stderr, flush=True)


def load_specforge(path: Path) -> str:
    """Put the snapshot folder on sys.path; returns its commit (the `SNAPSHOT` file) or 'snapshot'."""
    if not (path / "specforge" / "__init__.py").is_file():
        sys.exit(f"bench_specforge: no SpecForge package at {path / 'specforge'}; pass --specforge PATH, the folder "
                 "holding SpecForge's `specforge` package (see this script's docstring to prepare one)")
    sys.path.insert(0, str(path))
    stamp = path / "SNAPSHOT"
    return (stamp.read_text().strip() or "snapshot") if stamp.is_file() else "snapshot"


def draft_config(path: Path, kind: str, s: Shape, attention: str) -> tuple[Qwen3Config, list[str]]:
    """SpecForge's `configs/qwen3-8b-<kind>.json` as a Qwen3Config, resized to `s` (a no-op for the specforge
    shape but for the target layer ids, kept), and the keys whose values the resizing changed."""
    file = path / "configs" / f"qwen3-8b-{kind}.json"
    if not file.is_file():
        sys.exit(f"bench_specforge: no {file}; --specforge must hold SpecForge's `configs/` folder too")
    raw = json.loads(file.read_text())
    dims = {"hidden_size": s.hidden, "num_hidden_layers": s.layers, "intermediate_size": s.ffn,
            "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
            "vocab_size": s.vocab, "num_target_layers": s.num_target_layers, "block_size": s.block,
            "layer_types": ["full_attention"] * s.layers, "max_window_layers": s.layers,
            "tie_word_embeddings": False}  # what their AutoDraftModelConfig.from_file forces
    head = dict(raw["dflash_config"])
    if len(head["target_layer_ids"]) != s.target_layers:
        head["target_layer_ids"] = list(range(1, 1 + s.target_layers))
    if head["mask_token_id"] >= s.vocab:
        head["mask_token_id"] = s.vocab - 1
    for key in ("bos_token_id", "eos_token_id"):  # Qwen3's ids fall outside a tiny vocabulary (transformers warns)
        if raw.get(key) is not None and raw[key] >= s.vocab:
            dims[key] = None
    if kind == "domino":
        head["emb_dim"], head["gru_hidden_dim"] = s.emb_dim, s.gru_hidden  # bench_step's Domino sizes
        dims["emb_dim"] = head["emb_dim"]
    dims["dflash_config"] = head
    changed = sorted(k for k, v in dims.items() if raw.get(k) != v)
    config = Qwen3Config.from_dict({**raw, **dims})
    config._attn_implementation = attention  # as SpecForge's build_dflash_draft sets it
    return config, changed


def build_model(config: Qwen3Config, kind: str, s: Shape, device: torch.device, dtype: torch.dtype, attention: str) -> nn.Module:
    """Their draft in their training wrapper, with a frozen random LM head and embedding (their benchmark's setup)."""
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel, OnlineDominoModel
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.modeling.draft.domino import DominoDraftModel

    # Initialised on the device (a ~1B-parameter fp32 init on the host takes long), then cast as their
    # build does (`.to(dtype=torch_dtype)`).
    with torch.device(device):
        draft = (DominoDraftModel if kind == "domino" else DFlashDraftModel)(config)
        lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        embed = nn.Embedding(s.vocab, s.hidden)
    for p in [*lm_head.parameters(), *embed.parameters()]:
        p.requires_grad_(False)
    common = {"draft_model": draft, "target_lm_head": lm_head, "target_embed_tokens": embed,
              "mask_token_id": config.dflash_config["mask_token_id"], "block_size": s.block,
              "attention_backend": attention, "num_anchors": s.anchors, "loss_decay_gamma": LOSS_DECAY_GAMMA}
    if kind == "domino":
        model = OnlineDominoModel(**common, shift_label=bool(draft.shift_label))  # as their build_domino_model
    else:
        model = OnlineDFlashModel(**common)
    return model.to(device=device, dtype=dtype).train()


def make_optimizer(model: nn.Module, device: torch.device, which: str) -> Callable[[], None]:
    """The update after the backward: fused AdamW + zero_grad (bench_step's step), or their BF16Optimizer
    (fp32 masters, clip 0.5, cosine schedule; its step sets the grads to None itself)."""
    draft = model.draft_model
    if which == "specforge":
        from specforge.optimizer import BF16Optimizer

        opt = BF16Optimizer(draft, lr=LR)
        return lambda: opt.step()
    params = [p for p in draft.parameters() if p.requires_grad]
    adamw = torch.optim.AdamW(params, lr=LR, **({"fused": True} if device.type == "cuda" else {"foreach": True}))

    def step() -> None:
        adamw.step()
        adamw.zero_grad(set_to_none=True)

    return step


class SpecForgeStep:
    """One SpecForge training step behind bench_step's `train_step(batch)` interface, so its `time_steps` times it."""

    def __init__(self, model: nn.Module, kind: str, update: Callable[[], None]) -> None:
        self.model, self.update = model, update
        self.kwargs = {"lambda_base": LAMBDA_BASE} if kind == "domino" else {}

    def train_step(self, batch: dict[str, torch.Tensor]) -> None:
        loss, _accuracy, _metrics = self.model(batch["input_ids"], batch["hidden_states"], batch["loss_mask"],
                                               **self.kwargs)
        loss.backward()
        self.update()


def random_batch(s: Shape, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """As bench_step's batch: ids and loss mask on the host (pinned on a GPU; copied each step), the target
    features already on the device (bench_step's RandomFeatureTarget holds them there too)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, s.vocab - 2, (s.batch, s.seq), generator=g)
    mask = torch.ones(s.batch, s.seq)  # float, as in SpecForge's benchmark; they threshold it at 0.5
    mask[:, : s.seq // 8] = 0.0  # a prompt
    # drawn on the device, as bench_step's stand-in target draws its features
    hidden = torch.randn(s.batch, s.seq, s.target_layers * s.hidden, generator=torch.Generator(device=device).manual_seed(0),
                         device=device, dtype=dtype)
    host = {"input_ids": ids, "loss_mask": mask}
    if device.type == "cuda":
        host = {k: v.pin_memory() for k, v in host.items()}
    return {**host, "hidden_states": hidden}


def syncs_per_step(step: SpecForgeStep, batch: dict, device: torch.device, steps: int) -> float | None:
    """Host-device syncs per step: CUDA's sync debug mode warns at each one, and the warnings are counted
    (`always`, or Python would show a repeated call site once). None on a CPU."""
    if device.type != "cuda" or steps <= 0:
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step.train_step({k: v.to(device, non_blocking=True) for k, v in batch.items()})
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing CUDA operation" in str(w.message) for w in caught) / steps


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--specforge", type=Path, default=REPO / ".carry" / "specforge-snapshot",
                   help="folder holding SpecForge's `specforge` package and `configs/` (default: %(default)s)")
    p.add_argument("--kind", choices=["dflash", "domino"], default="domino")
    p.add_argument("--config", choices=CONFIGS, default="specforge")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--anchors", type=int)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sync-steps", type=int, default=3, help="extra steps under the sync debug mode (GPU only)")
    p.add_argument("--attention", choices=["auto", "flex", "sdpa"], default="auto",
                   help="auto: flex on a GPU, sdpa on a CPU (flex has no CPU backward)")
    p.add_argument("--optimizer", choices=["fused", "specforge"], default="fused",
                   help="fused: torch's fused AdamW (bench_step's step); specforge: their BF16Optimizer")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--memory-cap-gib", type=float, help="allocate at most this much GPU memory (e.g. 79 on an H200)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    t0 = time.perf_counter()
    commit = load_specforge(args.specforge.resolve())
    warnings.filterwarnings("ignore", message="flash_attn is not found")  # their EAGLE module's import-time notice
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cap_memory(device, args.memory_cap_gib)
    attention = args.attention if args.attention != "auto" else ("flex" if device.type == "cuda" else "sdpa")
    backend = {"flex": "flex_attention", "sdpa": "sdpa"}[attention]
    s = replace(SHAPES[args.config], **{f: getattr(args, f) for f in ("batch", "seq", "anchors") if getattr(args, f)})

    config, changed = draft_config(args.specforge, args.kind, s, backend)
    model = build_model(config, args.kind, s, device, dtype, backend)
    step = SpecForgeStep(model, args.kind, make_optimizer(model, device, args.optimizer))
    batch = random_batch(s, device, dtype)
    progress(f"built SpecForge {commit} {args.kind} ({args.config} shape, {attention})", t0)
    time_steps(step, batch, device, args.warmup)
    progress(f"{args.warmup} warm-up steps done (compilation included)", t0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ms = time_steps(step, batch, device, args.steps)
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    progress(f"{args.steps} timed steps done", t0)
    syncs = syncs_per_step(step, batch, device, args.sync_steps)
    peak = matmul_peak(device)
    progress("sync count and matmul peak done", t0)

    # bench_step's "specforge" count (3 x forward FLOPs, dense attention, LM head over every slot), which needs no
    # mask density; the DFlash backbone only, as bench_step counts our Domino draft too (the GRU head is left out).
    work = flops(s, 1.0)["specforge"]
    result = {
        "specforge_commit": commit, "kind": args.kind, "config": args.config, "config_file_changes": changed,
        "batch": s.batch, "seq": s.seq, "anchors": s.anchors, "block": s.block, "attention": attention,
        "optimizer": args.optimizer, "dtype": str(dtype).replace("torch.", ""), "lambda_base": LAMBDA_BASE,
        "loss_decay_gamma": LOSS_DECAY_GAMMA, "warmup": args.warmup, "steps": args.steps,
        "ms_per_step": ms, "tokens_per_s": s.batch * s.seq / ms * 1e3, "samples_per_s": s.batch / ms * 1e3,
        "peak_mem_gib": peak_mem, "syncs_per_step": syncs, "matmul_peak_tflops": peak / 1e12,
        "tflops_specforge": work / ms / 1e9, "mfu_specforge": work / ms * 1e3 / peak if not math.isnan(peak) else float("nan"),
        "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    sync_text = "n/a" if syncs is None else f"{syncs:.1f}"
    extra = ", their BF16Optimizer" if args.optimizer == "specforge" else ""
    print(f"bench_specforge {args.kind} seq={s.seq} anchors={s.anchors}: {ms:.1f} ms/step, peak {peak_mem:.1f} GiB, "
          f"{sync_text} syncs/step, {result['samples_per_s']:.2f} samples/s (SpecForge {commit}, {attention}{extra})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
