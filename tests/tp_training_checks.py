"""Training and evaluation with a tensor-parallel target, run inside tests/tp_worker.py's launches (gloo, CPU).

    training_checks(mesh)   2 ranks, tp = 2: one DFlashTrainer step per rank on its half of a fixed batch
                            (fixed anchors, update held back) for `data.labels` data and target; a step
                            under forbid_syncs; per-rank target bytes; the heads error at start.
    decode_checks(mesh)     the lockstep speculative decode (rank 0 leads, rank 1 follows) against the
                            single-process decode; the no-cache forward; a leader that raises.
    fit_checks(folder)      `fit()` from a saved target folder with tensor_parallel.size=2: sharded loading,
                            rows of different lengths per rank, held-out evaluation, the lockstep speculative
                            evaluation and the export; then `run_eval` (`dflash eval`) sharded over both.
    mesh_training_checks()  4 ranks, (dp x tp) = 2 x 2: two steps (DDP, FSDP2), their losses, per-rank bytes.

The single-process references of the training step are computed by the test (tests/test_tensor_parallel.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dist_worker import fixed_plan
from helpers import DFLASH2_HEAD, continuation_batch, make_tiny_target, random_batch, save_tiny_target, tiny_config
from transformers import LlamaConfig, LlamaForCausalLM

import dflash.objective as objective_module
from dflash.config import TrainConfig
from dflash.diagnostics import forbid_syncs
from dflash.evaluation.evaluate import run_eval
from dflash.evaluation.speculative import evaluate_speculative
from dflash.target_model.tensor_parallel import TensorParallelTarget, target_parameter_bytes
from dflash.target_model.tp_decode import decode_session
from dflash.trainer import DFlashTrainer

# The equality runs, each a trainer config override: a DFlash 2 and a DSpark draft, then both `data.labels` values
# (the last run's trainer serves the checks after them).
LABELS = {"dflash2": {**DFLASH2_HEAD, "data__labels": "target"}, "dspark": {"draft__kind": "dspark", "dspark__markov_rank": 8},
          "data": {}, "target": {"data__labels": "target"}}
# The sampled-anchors run: 3 anchors per row of up to 31 valid positions, drawn by the trainer itself.
SAMPLED = {"draft__num_anchors": 3}


def one_step(overrides: dict[str, Any], *, fixed: bool = True) -> tuple[DFlashTrainer, dict[str, Any]]:
    """A tp = 2 trainer's step on this rank's 2 rows of the fixed batch, with the update held back: its
    (all-reduced) gradients, metrics and initial weights. `fixed`: the fixed anchors; else the trainer's
    own draw (seeded alike on every rank, each rank its rows of it)."""
    trainer = DFlashTrainer(tiny_config(tensor_parallel__size=2, **overrides), target=make_tiny_target())
    rank = trainer.rank
    batch, anchors, keep = fixed_plan()
    rows = slice(2 * rank, 2 * rank + 2)
    mine = {k: v[rows] for k, v in batch.items()}
    if trainer.config.draft.kind == "dflash2":  # a fresh selector's B = 0 would give A and P no gradient
        g = torch.Generator().manual_seed(0)  # every rank alike
        with torch.no_grad():
            for p in trainer.draft.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g).to(p))
    init = {n: p.detach().clone() for n, p in trainer.draft.named_parameters()}
    real = objective_module.sample_anchors, trainer.optimizer.step, trainer.optimizer.zero_grad
    if fixed:  # every kind draws through `DFlashObjective.sample`, i.e. this module's name for the sampler
        objective_module.sample_anchors = lambda loss_mask, n, generator=None, **_: (anchors[rows], keep[rows])
    trainer.optimizer.step = lambda: None
    trainer.optimizer.zero_grad = lambda set_to_none=True: None
    try:
        trainer.train_step(mine)
    finally:
        objective_module.sample_anchors, trainer.optimizer.step, trainer.optimizer.zero_grad = real
    grads = {n: p.grad.clone() for n, p in trainer.draft.named_parameters()}
    trainer.optimizer.zero_grad()
    return trainer, {"grads": grads, "metrics": trainer.metrics.flush(), "init": init}


def training_checks() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, overrides in LABELS.items():
        trainer, out[name] = one_step(overrides)
    _, out["sampled"] = one_step(SAMPLED, fixed=False)  # fewer anchors than positions, drawn by the trainer
    rank = dist.get_rank()
    out["target_type"] = type(trainer.target).__name__
    out["memory"] = {"tp": target_parameter_bytes(trainer.target), "replicated": target_parameter_bytes(make_tiny_target())}
    # Invariant 1 under TP: a non-log step (group gather, sharded trunk, all-reduces, DDP) reads nothing back.
    # Rows of different lengths on the two ranks: the group batch pads both to data.max_length.
    batch = random_batch(batch=2, seq=32 if rank == 0 else 16, seed=5 + rank)
    trainer.train_step(batch)  # warm (the first DDP step builds its buckets)
    with forbid_syncs(raise_on_first=False) as report:
        trainer.train_step(batch)
    out["syncs"] = [str(f) for f in report.findings]
    out["after_sync_check"] = trainer.metrics.flush()["loss"]
    try:  # heads not divisible by the size: refused at start, before sharding
        odd = LlamaForCausalLM(LlamaConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                                           num_key_value_heads=1, intermediate_size=96, vocab_size=128))
        DFlashTrainer(tiny_config(tensor_parallel__size=2), target=odd)
        out["heads_error"] = "no error"
    except ValueError as exc:
        out["heads_error"] = str(exc)
    return out


def decode_checks(mesh: Any) -> dict[str, Any]:
    """Rank 0 decodes with the draft of a brief (replicated, DDP) training on the target's own continuations
    and a LockstepTarget; rank 1 follows. Rank 0 also decodes with the whole target in one process."""
    rank, out = dist.get_rank(), {}
    target = make_tiny_target()
    trainer = DFlashTrainer(tiny_config(max_steps=20, optim__lr=1e-2), target=target)
    ids, loss_mask = continuation_batch(target)
    for step in range(20):
        rows = torch.arange(4) + (4 * step) % 8
        trainer.train_step({"input_ids": ids[rows], "loss_mask": loss_mask[rows]})
    draft = trainer.draft.eval()
    prompts = [ids[i, :6].tolist() for i in range(4)]
    tp = TensorParallelTarget(make_tiny_target(), draft.config.target_layer_ids, mesh)
    with decode_session(tp, rank) as model:
        if model is not None:
            sharded = evaluate_speculative(model, draft, prompts, max_new_tokens=24, return_texts=True)
            whole = evaluate_speculative(target, draft, prompts, max_new_tokens=24, return_texts=True)
            out["texts_equal"] = sharded["texts"] == whole["texts"]
            out["tau"] = (sharded["tau"], whole["tau"])
            out["per_prompt_target_forwards"] = (sharded["per_prompt_target_forwards"],
                                                 whole["per_prompt_target_forwards"])
            x = torch.tensor([prompts[0]])
            diff = (model(input_ids=x).logits - target(input_ids=x).logits).abs().max().item()
            out["no_cache_logits_diff"] = diff
    out["role"] = "leader" if rank == 0 else "follower"
    try:  # a leader that fails inside the session still releases its followers
        with decode_session(tp, rank) as model:
            if model is not None:
                model(input_ids=torch.tensor([prompts[0]]), use_cache=True)
                raise RuntimeError("planted")
    except RuntimeError as exc:
        out["raised"] = str(exc)
    dist.barrier()  # every rank is back in step
    out["released"] = True
    return out


def fit_checks(folder: Path) -> dict[str, Any]:
    """A 4-step run from a saved target folder and chat data, as `dflash train` would run it."""
    target, data, run = folder / "target", folder / "chats.jsonl", folder / "run"
    if dist.get_rank() == 0:
        save_tiny_target(target)
        with data.open("w") as f:
            for i in range(40):
                reply = f"{i} {i}. " * (1 + i % 5)  # rows of several lengths (padded 32 or 64)
                f.write(json.dumps({"messages": [{"role": "user", "content": f"Say {i} a few times"},
                                                 {"role": "assistant", "content": reply}]}) + "\n")
    dist.barrier()
    overrides = [f"target={target}", f"data.source={data}", f"output_dir={run}", "device=cpu", "dtype=float32",
                 "draft.mask_token_id=16", "draft.block_size=4", "draft.num_anchors=8", "batch_size=2",
                 "data.max_length=64", "data.bucket_multiple=32", "data.eval_size=8", "data.regenerate=false",
                 "data.num_workers=0", "log_interval=2", "ce_chunk_size=256", "spec_eval_prompts=3",
                 "spec_eval_max_new_tokens=8", f"data.cache_dir={run}/cache", "max_steps=4", "progress_bar=false",
                 "tensor_parallel.size=2"]
    trainer = DFlashTrainer(TrainConfig.from_sources(None, overrides))
    q_proj = trainer.target.model.get_decoder().layers[0].self_attn.q_proj.weight.shape
    summary = trainer.fit()
    spec = summary.get("speculative")
    out = {"steps": summary["steps"], "train_loss": summary["train"]["loss"],
           "held_out_loss": summary["held_out"]["loss"], "q_proj_shape": tuple(q_proj),
           "speculative": spec,  # rank 0's whole report (None on the follower)
           "eval_json": json.loads((run / "export" / "eval.json").read_text()) if spec is not None else None,
           "export": "export" in summary}
    # `dflash eval` under the launch: the target sharded over both processes (every rank gets the report),
    # and on rank 0 the same evaluation with the whole target in one process.
    common = dict(target=str(target), prompts=str(data), num_prompts=3, max_new_tokens=8, device="cpu",
                  dtype="float32", out=run / "eval_tp.json")
    sharded = run_eval(run / "export", **common)
    keys = ("tau", "per_prompt_tau", "per_prompt_target_forwards", "new_tokens", "lossless")
    out["eval_tp"] = {k: sharded[k] for k in keys}
    if dist.get_rank() == 0:
        whole = run_eval(run / "export", **{**common, "out": run / "eval_one.json"}, tensor_parallel=1)
        out["eval_one"] = {k: whole[k] for k in keys}
    return out


def mesh_training_checks() -> dict[str, Any]:
    """(dp x tp) = 2 x 2: two steps on each rank's own random rows, the draft under DDP and under FSDP2
    (both over all 4 ranks)."""
    rank, out = dist.get_rank(), {}
    for mode in ("ddp", "fsdp2"):
        trainer = DFlashTrainer(tiny_config(tensor_parallel__size=2, distributed=mode), target=make_tiny_target())
        losses = []
        for step in range(2):
            trainer.train_step(random_batch(batch=2, seq=32, seed=10 * rank + step))
            losses.append(trainer.metrics.flush()["loss"])
        out[f"{mode}_losses"] = losses
    group = trainer.target.target.group
    return {**out, "fsdp": trainer.fsdp, "tp_group_ranks": dist.get_process_group_ranks(group),
            "memory": {"tp": target_parameter_bytes(trainer.target), "replicated": target_parameter_bytes(make_tiny_target())}}
