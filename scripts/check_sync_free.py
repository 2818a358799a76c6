"""Prove the training step is sync-free on a GPU, and that the whole step replays from a CUDA graph.

1. The real step (target forward, anchors, draft, chunked CE, backward, clip, fused AdamW, on-device
   schedule) fed by the real data path (DataLoader workers -> pinned batches -> DevicePrefetcher) runs
   `--steps` consecutive non-log steps inside `forbid_syncs(device="cuda")`, which turns on
   `torch.cuda.set_sync_debug_mode("error")` and the dispatch-level detector. Any sync raises.
   On a GPU this runs twice: the default step (compiled flex attention) under the CUDA sync debug
   mode alone, since torch.compile does not run under a user dispatch mode, then the same step with
   SDPA attention (nothing compiled) under both detectors.
2. A trainer with `cuda_graph: true` captures one whole step and replays it `--graph-steps` times; its
   per-step losses must match an eager trainer's from the same weights on the same batch (a batch
   whose rows have fewer valid anchors than N, so both draw the same anchors) within bf16 tolerance.

On a machine without CUDA only part 1 runs (the dispatch detector on CPU), on tiny shapes.
Ends with one summary line.

Several processes (`torchrun --nproc_per_node N` / `accelerate launch --num_processes N`): each rank
runs part 1 on its own GPU (cuda:LOCAL_RANK) with the draft under DDP or FSDP2 (`--distributed`) and
its share of the data; instead of stopping at the first sync (which would leave the other ranks
waiting in a collective), every rank counts its syncs (dispatch findings + CUDA sync-debug warnings)
and rank 0 prints the total over ranks. Part 2 (the CUDA graph) is single-process only.

`--packing`: rows of varied lengths packed into sequences of the same length (`data.packing`): the target's
document mask, per-document anchors and the draft's per-document context in the same checks.

    python scripts/check_sync_free.py [--kind domino|dflash2|dspark] [--optimizer muon] [--packing]
    torchrun --nproc_per_node 2 scripts/check_sync_free.py --distributed fsdp2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import typing
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.config import Distributed, TrainConfig  # noqa: E402
from dflash.data.loader import Collator, DevicePrefetcher, make_dataloader, training_rows  # noqa: E402
from dflash.diagnostics import forbid_syncs  # noqa: E402
from dflash.runtime import init_distributed, shutdown_distributed  # noqa: E402
from dflash.trainer import DFlashTrainer  # noqa: E402


def tiny_llama(cuda: bool, positions: int = 4096):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if cuda:  # SmolLM2-135M's shapes, random weights
        cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, vocab_size=49_152, max_position_embeddings=max(4096, positions))
    else:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    return LlamaForCausalLM(cfg)


def config(cuda: bool, device: torch.device | None = None, kind: str = "dflash", optimizer: str = "adamw",
           packing: bool = False, seq: int | None = None, anchors: int | None = None, **kw) -> TrainConfig:
    """The checked run's config: on a GPU 8 rows of 512 tokens and 64 anchors (`seq`, `anchors`: longer rows,
    fewer of them: 8 x 512 tokens a micro-batch at most)."""
    device = device if device is not None else torch.device("cuda" if cuda else "cpu")
    seq = seq or (512 if cuda else 64)
    batch = max(1, 8 * 512 // seq) if cuda else 2
    cfg = TrainConfig(device=str(device), max_steps=1000, batch_size=batch, log_interval=10**9, **kw)
    cfg.draft.kind, cfg.draft.num_layers, cfg.draft.block_size = kind, 2, 16 if cuda else 4
    if not cuda:  # a Domino head in proportion to the tiny target
        cfg.domino.gru_hidden_dim, cfg.domino.emb_dim = 32, 16
    cfg.draft.num_anchors = anchors or (64 if cuda else 8)
    cfg.draft.mask_token_id = 0
    cfg.optim.grad_accum, cfg.optim.optimizer = 2, optimizer
    cfg.data.packing, cfg.data.max_length = packing, seq
    return cfg


def rows(n: int, seq: int, vocab: int, prompt: int, seed: int = 0, packing: bool = False) -> list[dict[str, list[int]]]:
    """`n` rows of `seq` tokens, the first `prompt` unsupervised; packing: of 1/8 to 1/2 of `seq` tokens each
    (the prompt a quarter), so each packed sequence holds several documents."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(seq // 8, seq // 2 + 1, (), generator=g)) if packing else seq
        start = length // 4 if packing else prompt
        ids = torch.randint(1, vocab, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "loss_mask": [0] * start + [1] * (length - start)})
    return out


def detector_passes(cuda: bool) -> list[tuple[str, bool]]:
    """(attention, aten_checks) of each pass of part 1. On a GPU the default step (compiled flex attention)
    runs under the CUDA sync debug mode alone (torch.compile will not run under the dispatch detector),
    then the same step with SDPA (nothing compiled) under both detectors."""
    return [("flex", False), ("sdpa", True)] if cuda else [("auto", True)]


def detector_name(attention: str, aten_checks: bool, cuda: bool) -> str:
    parts = (["cuda debug mode"] if cuda else []) + (["dispatch detector"] if aten_checks else [])
    return f"{attention}: {' + '.join(parts)}"


def sync_free_steps(cuda: bool, steps: int, *, device: torch.device | None = None, distributed: str = "ddp",
                    rank: int = 0, world: int = 1, attention: str = "auto", aten_checks: bool = True,
                    kind: str = "dflash", optimizer: str = "adamw", packing: bool = False, seq: int | None = None,
                    anchors: int | None = None) -> tuple[int, int]:
    """Run `steps` non-log steps from the real loader inside forbid_syncs; return (steps done, syncs).

    One process: the first sync raises. Several: each sync is counted (so every rank reaches the
    end and its collectives) and reported on stderr with the rank.
    """
    device = device if device is not None else torch.device("cuda" if cuda else "cpu")
    cfg = config(cuda, device, kind, optimizer, packing, seq, anchors, distributed=distributed)
    cfg.draft.attention = attention
    seq, vocab = cfg.data.max_length, 49_152 if cuda else 256
    trainer = DFlashTrainer(cfg, target=tiny_llama(cuda, seq), tokenizer=None)
    data = training_rows(rows(64 * world * (3 if packing else 1), seq, vocab, prompt=seq // 4, packing=packing), cfg.data)
    collator = Collator.for_tokenizer(None, cfg.data) if packing else Collator(0, 64, seq)
    loader = make_dataloader(data, trainer.config.batch_size * 2, collator, num_workers=2, rank=rank,
                             world_size=world, micro_batches=2)
    batches = iter(DevicePrefetcher(loader, device))
    # Two steps outside the region: lazy allocations, kernel autotuning, caches; and DDP's one-time
    # gradient-bucket rebuild, which exchanges bucket indices through the host (pageable copies both
    # ways) in the first forward after the first synchronized backward, i.e. in step 2.
    for _ in range(2):
        trainer.train_step(next(batches))
    done = 0
    collect = world > 1
    # On a GPU forbid_syncs turns on the CUDA sync debug mode ("error"; "warn" when counting) and the
    # dispatch-level detector.
    with contextlib.ExitStack() as stack:
        caught = stack.enter_context(warnings.catch_warnings(record=True)) if collect else []
        if collect:
            warnings.simplefilter("always")
        report = stack.enter_context(forbid_syncs(device=device if cuda else None, raise_on_first=not collect,
                                                  aten_checks=aten_checks))
        for _ in range(steps):
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(DevicePrefetcher(loader, device))
                batch = next(batches)
            trainer.train_step(batch)
            done += 1
    cuda_syncs = [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
    for w in caught:  # anything else was not ours to swallow
        if w not in cuda_syncs:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    for finding in [*map(str, report.findings), *(str(w.message) for w in cuda_syncs)][:10]:
        print(f"rank {rank}: {finding}", file=sys.stderr)
    trainer.metrics.flush()  # the log flush: a sync point, outside the region
    return done, len(report.findings) + len(cuda_syncs)


def graph_vs_eager(steps: int, kind: str = "dflash", optimizer: str = "adamw",
                   packing: bool = False) -> tuple[float, list[float], list[float]]:
    """Max relative loss difference between CUDA-graph replays and eager steps (same weights, anchors)."""
    seq = 512
    if packing:  # 5 documents of 102 tokens, 2 supervised each: 5 valid anchors per packed row < N = 64
        data = [{"input_ids": r["input_ids"][:102], "loss_mask": [0] * 100 + [1, 1]} for r in rows(80, seq, 49_152, 0)]
        data = list(training_rows(data, config(True, packing=True).data))
        batch = Collator(0, seq, seq)(data[:16])
    else:
        data = rows(16, seq, 49_152, prompt=seq - 40)  # 39 valid anchors per row < N = 64: anchors are fixed
        batch = Collator(0, 64, seq)(data[:16])
    batch = {k: v.cuda() for k, v in batch.items()}
    target = tiny_llama(True)
    eager = DFlashTrainer(config(True, kind=kind, optimizer=optimizer, packing=packing), target=target, tokenizer=None)
    graph = DFlashTrainer(config(True, kind=kind, optimizer=optimizer, packing=packing, cuda_graph=True), target=target,
                          tokenizer=None, draft=None)
    graph.draft.load_state_dict(eager.draft.state_dict())
    losses = {"eager": [], "graph": []}
    for _ in range(steps):
        for name, trainer in (("eager", eager), ("graph", graph)):
            trainer.train_step(batch)
            losses[name].append(trainer.metrics.flush()["loss"])
    worst = max(abs(a - b) / abs(a) for a, b in zip(losses["eager"], losses["graph"], strict=True))
    return worst, losses["eager"], losses["graph"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--graph-steps", type=int, default=20)
    p.add_argument("--tolerance", type=float, default=5e-3, help="max relative loss difference graph vs eager")
    p.add_argument("--distributed", choices=typing.get_args(Distributed), default="ddp",
                   help="under torchrun / accelerate launch: replicate (ddp) or shard (fsdp2) the draft")
    p.add_argument("--kind", choices=["dflash", "domino", "dflash2", "dspark"], default="dflash",
                   help="draft kind (domino: the default Domino head, GRU 1024 and emb_dim 256 on a GPU)")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw", help="optim.optimizer of the step")
    p.add_argument("--packing", action="store_true", help="packed rows (data.packing)")
    p.add_argument("--seq", type=int, help="tokens per row (packed: per sequence); default 512 on a GPU, 64 on a CPU")
    p.add_argument("--anchors", type=int, help="draft.num_anchors (default 64 on a GPU, 8 on a CPU)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    label = ", ".join([args.kind] + ([args.optimizer] if args.optimizer != "adamw" else [])
                      + (["packed"] if args.packing else []) + ([f"S={args.seq}"] if args.seq else [])
                      + ([f"N={args.anchors}"] if args.anchors else []))
    rank, world = init_distributed()  # (0, 1) in a single process
    passes = detector_passes(cuda)
    if world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
        per_rank, names = [0] * world, []
        for attention, aten_checks in passes:
            done, syncs = sync_free_steps(cuda, args.steps, device=device, distributed=args.distributed, rank=rank,
                                          world=world, attention=attention, aten_checks=aten_checks, kind=args.kind,
                                          optimizer=args.optimizer, packing=args.packing, seq=args.seq,
                                          anchors=args.anchors)
            counts = [None] * world
            dist.all_gather_object(counts, syncs)
            per_rank = [a + b for a, b in zip(per_rank, counts, strict=True)]
            names.append(detector_name(attention, aten_checks, cuda))
        shutdown_distributed()  # the passes' trainers are gone: free them before the group
        if rank != 0:
            return 0 if sum(per_rank) == 0 else 1
        print(f"check_sync_free ({label}): {sum(per_rank)} syncs in {done} non-log steps per pass on each of {world} ranks "
              f"({args.distributed}; per rank {per_rank}; {'; '.join(names)}); CUDA graph: skipped (several processes)"
              + (": PASS" if sum(per_rank) == 0 else ": FAIL"))
        return 0 if sum(per_rank) == 0 else 1
    for attention, aten_checks in passes:  # the first sync raises
        done, _ = sync_free_steps(cuda, args.steps, attention=attention, aten_checks=aten_checks, kind=args.kind,
                                  optimizer=args.optimizer, packing=args.packing, seq=args.seq, anchors=args.anchors)
    names = "; ".join(detector_name(a, c, cuda) for a, c in passes)
    summary = f"check_sync_free ({label}): 0 syncs in {done} non-log steps per pass ({names})"
    ok = True
    if cuda:
        worst, eager, graph = graph_vs_eager(args.graph_steps, args.kind, args.optimizer, args.packing)
        ok = worst <= args.tolerance and eager[-1] < eager[0]
        print("eager losses:", [round(x, 4) for x in eager])
        print("graph losses:", [round(x, 4) for x in graph])
        summary += f"; CUDA graph replayed {len(graph)} steps, max loss rel diff vs eager {worst:.2e}"
    else:
        summary += "; CUDA graph: skipped (no CUDA)"
    print(summary + (": PASS" if ok else ": FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
