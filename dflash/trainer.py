"""The training loop. One step, top to bottom, in `train_step`; nothing in it waits on the GPU.

    anchors + labels for every micro-batch      (device ops; global denominator known up front)
    per micro-batch: target features (no grad) -> block embeddings -> draft -> chunked CE -> backward
    global grad norm -> fused AdamW (clipping as its grad_scale, tensor lr) -> on-device schedule -> metric sums

The only host reads happen in `Metrics.flush()` at a log interval, at checkpoints and evaluation.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from dflash.anchors import anchor_seed
from dflash.config import TrainConfig
from dflash.metrics import Metrics
from dflash.modeling import DFlashDraftModel
from dflash.objective import DFlashObjective, build_objective

Batch = dict[str, torch.Tensor]
log = logging.getLogger("dflash")


def resolve_device(name: str) -> torch.device:
    """"auto": this process's GPU (cuda:LOCAL_RANK under a launcher) when there is one, else the CPU."""
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


def init_distributed() -> tuple[int, int]:
    """(rank, world_size). Under `accelerate launch` / torchrun (WORLD_SIZE > 1) this initialises the
    process group (through accelerate; NCCL on GPUs, gloo on CPUs); a single process gets (0, 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        from accelerate import PartialState

        PartialState()
        if not dist.is_initialized():  # accelerate leaves CPU-only launches (gloo) to us
            dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shutdown_distributed() -> None:
    """Destroy the process group, after a garbage collection. Trainers left in reference cycles hold
    DDP reducers on the group; destroyed at interpreter exit, after the group, they abort the process
    ("terminate called without an active exception"). Drop your references to trainers first."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def load_target(name: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """(model, tokenizer) for "embedded" or any HF model id / local path."""
    if name == "embedded":
        from dflash.embedded import load_embedded_target

        return load_embedded_target(dtype=dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype), AutoTokenizer.from_pretrained(name)


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer updates were skipped for non-finite values."""


# Settings that define what a run computes; resuming with any of them changed is refused.
_RUN_DEFINING = ("target", "draft.", "domino.", "seed", "batch_size", "optim.grad_accum", "param_dtype",
                 "data.source", "data.split", "data.limit", "data.eval_size", "data.max_length",
                 "data.bucket_multiple", "data.labels", "data.regenerate")


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Run-defining settings that differ between a checkpoint's config and the current one."""
    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(saved), flat(current)
    keys = sorted(k for k in set(a) | set(b) if k.startswith(_RUN_DEFINING) or k in _RUN_DEFINING)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


class _StopRequest:
    """Turns SIGTERM / SIGINT into a flag the loop checks between steps (main thread only)."""

    def __init__(self) -> None:
        self.requested, self.signal, self._previous = False, None, {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested, self.signal = True, signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


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
        objective: DFlashObjective | None = None,
        rank: int | None = None,
    ) -> None:
        self.config = config = config or TrainConfig()
        config.validate()
        dist_rank, self.world_size = init_distributed()
        rank = dist_rank if rank is None else rank
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if target is None and objective is None:
            target, loaded_tok = load_target(config.target, self.dtype)
            tokenizer = tokenizer or loaded_tok
        self.tokenizer, self.dataset, self.rank = tokenizer, dataset, rank
        # A prebuilt objective (benchmarks, tests) replaces the target/draft construction. `seed` fixes
        # the draft's initialisation (the same on every rank); the caller's RNG stream is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(config.seed)
            self.objective = objective or build_objective(config, target, tokenizer, device=self.device,
                                                          dtype=self.dtype, draft=draft)
        self.target, self.draft = self.objective.target, self.objective.draft
        self.draft_config = self.draft.config
        self.block_size = self.objective.block_size
        self.num_anchors = config.draft.num_anchors
        if config.param_dtype == "bfloat16" and self.dtype != torch.bfloat16:
            raise ValueError("param_dtype: bfloat16 needs dtype: bfloat16 (bf16 weights under an fp32 compute dtype)")
        self.draft.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[config.param_dtype])
        if config.init_from:  # warm start from an exported draft: weights only, a fresh run otherwise
            from dflash.export import load_exported

            self.draft.load_state_dict(load_exported(config.init_from, device=self.device).state_dict())
        # What the objective calls to run the draft across ranks: DDP (replicated; gradients all-reduced
        # in backward) or FSDP2 (`fully_shard`: parameters, gradients and AdamW state sharded, the
        # draft's own module runs the gathers); either way only the last micro-batch of a window
        # communicates gradients. Compiled when asked.
        self.ddp = None
        self.fsdp = self.world_size > 1 and config.distributed == "fsdp2"
        call: torch.nn.Module = self.draft
        if self.fsdp:
            if config.cuda_graph:
                raise ValueError("cuda_graph: true does not work with distributed: fsdp2 (FSDP2's per-layer "
                                 "all-gathers and reduce-scatters are driven by host-side hooks); use "
                                 "distributed: ddp or cuda_graph: false")
            self._shard_draft()
        elif self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = call = DistributedDataParallel(self.draft, device_ids=[self.device.index]
                                                      if self.device.type == "cuda" else None)
        if config.compile:
            call = torch.compile(call, dynamic=False)
            self.objective.compile_loss = True
        self.objective.use_draft_call(call)
        if config.cuda_graph and self.device.type != "cuda":
            raise ValueError("cuda_graph: true needs a CUDA device")

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
            # Reads lr and step from device tensors: no host read. Under FSDP2 the parameters are DTensors;
            # fused AdamW runs on their local shards (lr and found_inf stay plain tensors).
            fused=True,
            capturable=config.cuda_graph,  # the step counter stays on the device, so a graph can replay it
        )
        self.lr.copy_(self._lr_at(self.step_t))
        if hasattr(self.objective, "bind_schedule"):  # Domino's lambda follows the device step counter
            self.objective.bind_schedule(self.step_t, config.max_steps)
        self.metrics = Metrics(self.block_size, self.device, self.objective.metrics_variant)
        self.nonfinite_run = torch.zeros((), dtype=torch.float32, device=self.device)
        # Step-level values (grad norm, lr, skip counts) are the same on every rank and Metrics.flush sums
        # the buffer over ranks, so only the first process adds them (or 2 ranks would report one skipped
        # update as 2 and stop after max_nonfinite_skips / 2 consecutive skips).
        self._adds_replicated_metrics = dist_rank == 0
        self.held_out_conversations: list[dict[str, Any]] = []  # prompts for the speculative eval
        self.data_epoch = 0  # data position (host counters): epoch and loader batches consumed in it
        self.data_batches = 0
        self.anchor_generator = torch.Generator(device=self.device)
        self.anchor_generator.manual_seed(anchor_seed(config.seed, rank, 0))
        self._graph: torch.cuda.CUDAGraph | None = None  # the captured step (cuda_graph: true)
        self._static: list[Batch] = []

    def _shard_draft(self) -> None:
        """FSDP2: every decoder layer, then the draft itself (fc, norms, a Domino head), becomes one
        `fully_shard` group; its parameters turn into DTensors sharded on dim 0 over the ranks, gathered
        for that group's forward / backward only. Every rank starts from rank 0's weights, as under DDP."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        with torch.no_grad():
            for p in self.draft.parameters():
                dist.broadcast(p, src=0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        for layer in self.draft.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.draft, mesh=mesh)

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

    def _anchor_generator(self, micro_index: int, num_micro: int) -> torch.Generator:
        # Reseeding is host-side state only (no device read); (seed, rank, step) makes resume exact.
        self.anchor_generator.manual_seed(anchor_seed(self.config.seed, self.rank, self.step * num_micro + micro_index))
        return self.anchor_generator

    def train_step(self, batch: Batch | list[Batch]) -> None:
        """One optimizer step over `grad_accum` micro-batches. Makes no host-device sync.

        With `cuda_graph: true` the first call captures the whole step and later calls copy the batch
        into the graph's static inputs and replay it (shapes must repeat: fixed N, bucketed S).
        """
        micro = self._micro_batches(batch)
        if self.config.cuda_graph:
            self._replay(micro)
        else:
            self._step(micro, reseed=True)
        self.step += 1

    def _step(self, micro: list[Batch], *, reseed: bool) -> None:
        self.objective.train()
        # 1) Anchors and labels for the whole window first, so the loss denominator (the global
        #    supervised-weight sum) is a device tensor before the first backward.
        plans = []
        for i, mb in enumerate(micro):
            generator = self._anchor_generator(i, len(micro)) if reseed else self.anchor_generator
            plans.append(self.objective.plan(mb["input_ids"], mb["loss_mask"], generator))
        denominator = torch.stack([t.weights.sum() for _, _, t in plans]).sum()
        if self.world_size > 1:  # the global token count: summed over ranks on the device, never read
            dist.all_reduce(denominator)
        # DDP averages gradients over ranks; scaling by world_size turns that into the global sum.
        scale = self.world_size / denominator.clamp(min=1e-6)

        # 2) Forward/backward per micro-batch; the loss of each is its share of the global mean.
        m = self.metrics
        for i, (mb, (anchors, keep, targets)) in enumerate(zip(micro, plans, strict=True)):
            with self._gradient_sync(last=i == len(micro) - 1):
                out = self.objective(mb["input_ids"], anchors, keep, targets)
                (out.loss_sum * scale).backward()
            self.objective.accumulate(m, out, keep, targets)

        # 3) Update. The global gradient norm stays on the device (no error_if_nonfinite-style check: that
        #    reads it to the host).
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if self.fsdp:  # a DTensor (the norm over all shards, replicated): its local tensor, no host read
            grad_norm = grad_norm.full_tensor()
        grad_norm = grad_norm.float()  # fused AdamW reads grad_scale and found_inf as fp32
        # Non-finite guard, on the device: fused AdamW skips the whole update (weights, moments and
        # its step count untouched) when `found_inf` is 1 -- the mechanism GradScaler uses.
        skipped = (~torch.isfinite(grad_norm)).float()
        self.optimizer.found_inf = skipped
        # Clipping folded into the update: fused AdamW divides every gradient by `grad_scale` inside its
        # kernel. The same factor as clip_grad_norm_ (max_norm / (norm + 1e-6), capped at 1), without
        # that function's separate read-and-write pass over all gradients (2.1 GB a step for the 1B draft).
        self.optimizer.grad_scale = ((grad_norm + 1e-6) / self.config.optim.max_grad_norm).clamp(min=1.0)
        self.nonfinite_run.mul_(skipped).add_(skipped)  # consecutive skips, reset by a finite step
        if self._adds_replicated_metrics:  # identical on every rank; flush() sums over ranks: count them once
            m.add("nonfinite_skips", skipped)
            m.max_("nonfinite_run", self.nonfinite_run)
            m.add("grad_norm", torch.where(skipped > 0, 0.0, grad_norm))
            m.add("lr", self.lr)
            m.add("steps", 1.0)
        self.optimizer.step()
        # A captured graph needs its gradient buffers to stay put: zero them instead of freeing them.
        self.optimizer.zero_grad(set_to_none=not self.config.cuda_graph)
        self.step_t.add_(1)
        self.lr.copy_(self._lr_at(self.step_t))

    def _gradient_sync(self, *, last: bool) -> contextlib.AbstractContextManager:
        """Gradients cross ranks only in the last micro-batch's backward; earlier ones accumulate locally
        (DDP's no_sync, FSDP2's requires_gradient_sync flag: host-side state, no device work)."""
        if self.fsdp:
            self.draft.set_requires_gradient_sync(last)
        elif self.ddp is not None and not last:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def _replay(self, micro: list[Batch]) -> None:
        """CUDA-graph path: capture on first use, then copy inputs into static buffers and replay.

        The anchor generator is registered with the graph, so each replay draws new anchors (its
        Philox offset advances on the device); per-step reseeding is a host call and cannot be
        captured, so in this mode exact resume restores the generator state instead.
        """
        if self._graph is None:
            self._static = [{k: v.clone() for k, v in mb.items()} for mb in micro]
            generator_state = self._warm_up(self._static)
            self._graph = torch.cuda.CUDAGraph()
            self._graph.register_generator_state(self.anchor_generator)
            with torch.cuda.graph(self._graph):
                self._step(self._static, reseed=False)
            # Replays continue the anchor stream from where it stood before warm-up and capture, so a
            # resumed run (which captures again) draws the same anchors as an uninterrupted one.
            self.anchor_generator.set_state(generator_state)
        for static, mb in zip(self._static, micro, strict=True):
            for k, v in mb.items():
                static[k].copy_(v, non_blocking=True)
        self._graph.replay()

    def _warm_up(self, static: list[Batch], steps: int = 3) -> torch.Tensor:
        """Run `steps` real steps on `static` (on a side stream on CUDA) so that gradients, optimizer state
        and compiled kernels exist before a capture, then put back the weights, the optimizer state, the
        metrics and the schedule as they were. Returns the anchor generator's state from before.

        The optimizer state is restored IN PLACE (a fresh run's is zeroed: AdamW's initial state).
        Replacing it by `optimizer.load_state_dict` would leave a fresh run with no state, and the
        capture would then record its lazy creation: every replay would zero the moments and the step
        count again (Adam reduced to its first step).
        """
        weights = {k: v.clone() for k, v in self.draft.state_dict().items()}
        before = {p: {k: v.clone() for k, v in s.items()} for p, s in self.optimizer.state.items()}
        metrics, step_t, lr = self.metrics.state_dict(), self.step_t.clone(), self.lr.clone()
        generator_state = self.anchor_generator.get_state()
        side = torch.cuda.Stream() if self.device.type == "cuda" else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for _ in range(steps):
                self._step(static, reseed=False)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():
            self.draft.load_state_dict(weights)
            for p, state in self.optimizer.state.items():
                for k, v in state.items():
                    if not torch.is_tensor(v):
                        continue
                    if p in before:
                        v.copy_(before[p][k])
                    else:
                        v.zero_()
        self.metrics.load_state_dict(metrics)
        self.step_t.copy_(step_t)
        self.lr.copy_(lr)
        return generator_state

    # ---- evaluation (a sync point by design) ------------------------------------------------

    @torch.no_grad()
    def evaluate(self, dataset: Any, *, max_batches: int | None = None) -> dict[str, Any]:
        """Teacher-forced metrics on held-out rows: loss, accuracy, tau, per-position accuracy, and
        `chain_tau` (dflash.chain: the acceptance replayed along a real decoder's path, capped at
        `spec_eval_max_new_tokens`, the estimate of real tau; `tau` averages over every position).

        Every valid position is an anchor (no sampling), so evaluations at different steps score the
        same blocks. A SYNC POINT (the chain reads accepted lengths to the host).
        """
        from dflash.chain import chain_tau_sums
        from dflash.data import make_dataloader, max_valid_anchors
        from dflash.losses import accepted_prefix_length
        from dflash.modeling import allow_compiled_shapes

        collator = self._collator()
        loader = make_dataloader(dataset, self.config.batch_size, collator, shuffle=False, num_workers=0,
                                 drop_last=False)
        # Every valid anchor makes each held-out batch its own width: one more compiled shape per batch.
        allow_compiled_shapes((collator.num_lengths or 0) + len(loader))
        metrics = Metrics(self.block_size, self.device, self.objective.metrics_variant)
        emitted = forwards = 0
        self.objective.eval()
        for i, batch in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            ids = batch["input_ids"].to(self.device)
            mask = batch["loss_mask"].to(self.device)
            width = max(1, max_valid_anchors(batch["loss_mask"]))  # every valid anchor (host copy of the mask)
            anchors, keep, targets = self.objective.plan(ids, mask, None, num_anchors=width)
            out = self.objective(ids, anchors, keep, targets)
            self.objective.accumulate(metrics, out, keep, targets)
            accepted = accepted_prefix_length(out.correct, targets.valid[..., 1:])
            per_position = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)
            rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(anchors)
            per_position[rows[keep], anchors[keep]] = accepted[keep]
            e, f = chain_tau_sums(per_position, mask, self.config.spec_eval_max_new_tokens)
            emitted, forwards = emitted + e, forwards + f
        metrics.add("steps", 1.0)
        out = metrics.flush()
        out.update(chain_tau=emitted / max(forwards, 1), chain_forwards=forwards)
        return {k: v for k, v in out.items() if k not in ("grad_norm", "lr", "nonfinite_skips")}

    # ---- state ------------------------------------------------------------------------------

    def _full(self, tree: Any) -> Any:
        """`tree` with every DTensor (FSDP2 shards) replaced by its full value on the CPU on rank 0 and by
        None on the other ranks. SYNC POINT and a collective: every rank calls it on the same structure."""
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_map

        def full(t: Any) -> Any:
            if not isinstance(t, DTensor):
                return t
            whole = t.full_tensor()  # all-gather, one tensor at a time
            return whole.cpu() if self.rank == 0 else None

        return tree_map(full, tree)

    def draft_state_dict(self) -> dict[str, torch.Tensor]:
        """The draft's full weights (trainer names). Under FSDP2 a collective: call it on every rank;
        rank 0 gets the consolidated tensors (on the CPU), the others None values."""
        return self._full(self.draft.state_dict()) if self.fsdp else self.draft.state_dict()

    def consolidated_draft(self) -> torch.nn.Module | None:
        """The draft as one plain module with full weights, for export and speculative decoding: the
        draft itself without FSDP2; under FSDP2 a collective (call it on every rank) that returns a
        rebuilt unsharded copy on this device on rank 0 and None on the other ranks."""
        if not self.fsdp:
            return self.draft
        state = self.draft_state_dict()
        if self.rank != 0:
            return None
        from dflash.domino import draft_model_for_config

        with torch.device("meta"):  # no initialisation work: the weights are assigned next
            model = draft_model_for_config(copy.deepcopy(self.draft_config))
        model.load_state_dict(state, assign=True)
        return model.to(self.device)

    def _shard_like(self, full: dict[Any, Any], like: dict[Any, Any]) -> dict[Any, Any]:
        """FSDP2 resume: each full tensor of `full` whose counterpart in `like` is a DTensor of the same
        shape becomes a DTensor with that counterpart's mesh and placements, built from this rank's own
        chunk of the full tensor (every rank read the same file: no communication)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        out = dict(full)
        for key, value in full.items():
            ref = like.get(key)
            if isinstance(ref, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                    and tuple(value.shape) == tuple(ref.shape):
                out[key] = distribute_tensor(value.to(ref.device), ref.device_mesh, ref.placements, src_data_rank=None)
        return out

    def _shard_optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A consolidated optimizer state dict with each moment sharded like its parameter (FSDP2 resume)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        per_param = {i: self._shard_like(entry, {k: params[int(i)] for k in entry})
                     for i, entry in state["state"].items()}
        return {**state, "state": per_param}

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs besides the draft weights (anchors derive from the step).

        Under FSDP2 a collective (the optimizer's sharded moments are gathered; full values on rank 0), so
        the checkpoint has the same consolidated layout whether the run used DDP, FSDP2 or one process."""
        optimizer = self.optimizer.state_dict()
        return {
            "step": self.step,
            "optimizer": self._full(optimizer) if self.fsdp else optimizer,
            "metrics": self.metrics.state_dict(),
            "data_epoch": self.data_epoch,
            "data_batches": self.data_batches,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            # Eager steps reseed anchors from (seed, rank, step); a CUDA graph advances this generator
            # on the device instead, so its state is what continues the anchor stream on resume.
            "anchor_rng": self.anchor_generator.get_state(),
            "config": self.config.to_dict(),
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved_world = int(state.get("world_size", 1))
        if saved_world != self.world_size:
            raise ValueError(f"the checkpoint was written by {saved_world} process(es) and this run has "
                             f"{self.world_size}: the data position and per-rank anchors would not continue the "
                             "same run. Resume with the same number of processes, or warm-start a new run "
                             "from an export (init_from=...)")
        self.step = int(state["step"])
        optimizer = state["optimizer"]
        self.optimizer.load_state_dict(self._shard_optimizer_state(optimizer) if self.fsdp else optimizer)
        # load_state_dict replaces the lr tensor in param_groups by a copy: put ours back.
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        self.step_t.fill_(self.step)
        self.lr.copy_(self._lr_at(self.step_t))
        self.metrics.load_state_dict(state["metrics"])
        self.data_epoch, self.data_batches = int(state["data_epoch"]), int(state["data_batches"])
        # The checkpoint is loaded with map_location=device: RNG states must be CPU byte tensors again.
        torch.set_rng_state(state["torch_rng"].cpu())
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])
        if state.get("anchor_rng") is not None:
            self.anchor_generator.set_state(state["anchor_rng"].cpu())

    def save(self) -> Path:
        """SYNC POINT: an atomic checkpoint of the current step under `output_dir/checkpoints`."""
        from dflash.checkpoint import checkpoint_path, save_checkpoint

        # Consolidated state (under FSDP2 gathered from every rank to rank 0); one writer, and the others
        # wait so nobody reads a half save.
        draft_state, state = self.draft_state_dict(), self.state_dict()
        if self.rank == 0:
            path = save_checkpoint(self.config.output_dir, self.step, draft_state,
                                   self.draft_config.to_dict(), state, keep_last=self.config.keep_last)
            log.info("saved checkpoint %s", path)
        if self.world_size > 1:
            dist.barrier()
        return checkpoint_path(self.config.output_dir, self.step)

    def resume(self, path: str | Path) -> None:
        from dflash.checkpoint import load_checkpoint

        draft_state, _, state = load_checkpoint(path, self.device)
        differences = config_differences(state.get("config", {}), self.config.to_dict())
        if differences:
            raise ValueError(f"checkpoint {path} was written with a different configuration; resuming would not "
                             "continue the same run. Differences (checkpoint -> now):\n  " + "\n  ".join(differences))
        self.draft.load_state_dict(self._shard_like(draft_state, self.draft.state_dict()) if self.fsdp else draft_state)
        self.load_state_dict(state)
        log.info("resumed from %s at step %d", path, self.step)

    # ---- the run ----------------------------------------------------------------------------

    def _collator(self):
        """Bucketed right padding for `config.data`; compiled functions may keep a graph for each of
        its padded lengths (`allow_compiled_shapes`)."""
        from dflash.data import Collator
        from dflash.modeling import allow_compiled_shapes

        collator = Collator.for_tokenizer(self.tokenizer, self.config.data)
        allow_compiled_shapes(collator.num_lengths or 0)
        return collator

    def _datasets(self) -> tuple[Any, Any]:
        """(train, held-out) tokenized datasets: the user's `dataset`, or the configured recipe."""
        from dflash.corpus import prepare_corpus
        from dflash.data import build_dataset

        if self.dataset is None:
            if self.world_size > 1 and self.rank != 0:
                dist.barrier()  # rank 0 regenerates and tokenizes first; the others then read its caches
            corpus = prepare_corpus(self.config.data, self.tokenizer, self.target.model, self.config.target)
            if self.world_size > 1 and self.rank == 0:
                dist.barrier()
            self.held_out_conversations = corpus.held_out_conversations
            return corpus.train, corpus.eval
        if isinstance(self.dataset, tuple):
            return self.dataset
        columns = getattr(self.dataset, "column_names", None) or []
        if "input_ids" in columns:
            return self.dataset, None
        return build_dataset(self.dataset, self.tokenizer, self.config.data.max_length), None

    def _check_mask_token_absent(self, dataset: Any, max_rows: int = 20_000) -> None:
        """The mask token must never be a real token of the data (the draft could not tell them apart)."""
        mask_id = self.draft_config.mask_token_id
        for i in range(min(len(dataset), max_rows)):
            if mask_id in dataset[i]["input_ids"]:
                name = self.tokenizer.convert_ids_to_tokens(mask_id) if self.tokenizer is not None else mask_id
                raise ValueError(f"the mask token id {mask_id} ({name!r}) appears in the training data (row {i}): "
                                 "set draft.mask_token_id to a token that never occurs in the data")

    def _device_batches(self, dataset: Any) -> Iterator[Batch]:
        """Endless device batches, epoch after epoch, resuming at (data_epoch, data_batches).

        Batches come pinned from DataLoader workers and are copied one ahead (`non_blocking`).
        """
        from dflash.data import DevicePrefetcher, make_dataloader

        rows = self.config.batch_size * self.config.optim.grad_accum
        if len(dataset) < rows:
            raise ValueError(f"the training set has {len(dataset)} rows, fewer than one step needs ({rows}): "
                             "lower batch_size / optim.grad_accum or add data")
        while True:
            loader = make_dataloader(dataset, rows, self._collator(), seed=self.config.seed, epoch=self.data_epoch,
                                     skip_batches=self.data_batches, num_workers=self.config.data.num_workers,
                                     rank=self.rank, world_size=self.world_size)
            for batch in DevicePrefetcher(loader, self.device):
                self.data_batches += 1
                yield batch
            self.data_epoch, self.data_batches = self.data_epoch + 1, 0

    def fit(self) -> dict[str, Any]:
        """Train to `max_steps`: log at `log_interval`, evaluate at `eval_interval`, save at `save_interval`.

        Returns a summary (final train metrics, held-out metrics, paths). Syncs happen only at the
        log flush, evaluation and checkpoints.
        """
        from tqdm.auto import tqdm

        from dflash.checkpoint import resolve_resume
        from dflash.reporting import Reporter

        cfg = self.config
        run_dir = Path(cfg.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        resume = resolve_resume(cfg.resume_from, run_dir)
        if resume is not None:
            self.resume(resume)
        train_ds, eval_ds = self._datasets()
        self._check_mask_token_absent(train_ds)
        reporter = Reporter(run_dir, cfg.report_to, cfg.to_dict(), enabled=self.rank == 0)
        self.history: list[dict[str, Any]] = []
        batches = self._device_batches(train_ds)
        progress = tqdm(total=cfg.max_steps, initial=self.step, disable=not cfg.progress_bar or self.rank != 0,
                        desc="dflash train", dynamic_ncols=True)
        window_start, window_tokens, last, last_flush_step = time.perf_counter(), 0, {}, self.step
        deadline = time.monotonic() + 60 * cfg.time_budget_minutes if cfg.time_budget_minutes else math.inf
        stop = _StopRequest()  # SIGTERM / SIGINT: finish the current step, save, exit cleanly
        while self.step < cfg.max_steps and not stop.requested:
            if time.monotonic() > deadline:  # a host clock: checking it costs no sync
                log.info("time budget of %s minutes reached at step %d", cfg.time_budget_minutes, self.step)
                break
            batch = next(batches)
            window_tokens += batch["input_ids"].numel()  # a host-known shape, not a device read
            self.train_step(batch)
            progress.update(1)
            if self.step % cfg.log_interval == 0 or self.step == cfg.max_steps:
                last, last_flush_step = self.metrics.flush(), self.step  # SYNC POINT: the log interval
                elapsed = time.perf_counter() - window_start
                last["tokens_per_s"] = window_tokens / elapsed
                last["supervised_tokens_per_s"] = last["supervised_tokens"] / elapsed
                self._record(reporter, last)
                progress.set_postfix(loss=f"{last['loss']:.3f}", tau=f"{last['tau']:.2f}",
                                     tok_s=f"{last['tokens_per_s']:.0f}")
                if last["nonfinite_run"] >= cfg.max_nonfinite_skips:
                    path = self.save()  # skipped updates left the weights at the last finite state
                    stop.restore()
                    raise NonFiniteError(
                        f"{int(last['nonfinite_run'])} consecutive optimizer updates were skipped for non-finite "
                        f"loss or gradients (max_nonfinite_skips={cfg.max_nonfinite_skips}) at step {self.step}; "
                        f"the last finite weights are saved in {path}. Check the data and the learning rate.")
                window_start, window_tokens = time.perf_counter(), 0
            if eval_ds is not None and cfg.eval_interval and self.step % cfg.eval_interval == 0:
                self._record(reporter, {f"eval_{k}": v for k, v in self.evaluate(eval_ds).items()})
            if (cfg.eval_interval and self.step % cfg.eval_interval == 0 and cfg.spec_eval_interval_prompts
                    and self.held_out_conversations):
                draft = self.consolidated_draft()  # FSDP2: a gather every rank takes part in
                if self.rank == 0:
                    spec = self.speculative_eval(self.held_out_conversations, cfg.spec_eval_interval_prompts,
                                                 draft=draft)
                    self._record(reporter, {"spec_tau": spec["tau"], "spec_speedup": spec["speedup"],
                                            "spec_per_position_acceptance": spec["per_position_acceptance"]})
            if cfg.save_interval and self.step % cfg.save_interval == 0:
                self.save()
        progress.close()
        stop.restore()
        checkpoint = self.save()
        summary: dict[str, Any] = {"steps": self.step, "checkpoint": str(checkpoint), "train": last}
        if stop.requested:  # interrupted: the checkpoint is what matters; skip the end-of-run work
            log.info("stopped by signal %s at step %d; saved %s", stop.signal, self.step, checkpoint)
            reporter.close()
            return {**summary, "interrupted": True}
        if self.step != last_flush_step:  # the time budget ended a window early: report it
            last = self.metrics.flush()
            self._record(reporter, last)
            summary["train"] = last
        if eval_ds is not None:
            held_out = self.evaluate(eval_ds)
            self._record(reporter, {f"eval_{k}": v for k, v in held_out.items()})
            summary["held_out"] = held_out
        spec_eval = bool(cfg.spec_eval_prompts and self.held_out_conversations)
        # One full draft for export and speculative decoding (FSDP2: gathered to rank 0 by every rank).
        final_draft = self.consolidated_draft() if cfg.export_on_finish or spec_eval else None
        if cfg.export_on_finish and self.rank == 0:
            from dflash.export import export_draft

            summary["export"] = str(export_draft(final_draft, run_dir / "export"))
        if spec_eval and self.rank == 0:
            summary["speculative"] = self.speculative_eval(self.held_out_conversations, draft=final_draft)
            (run_dir / "export" / "eval.json").write_text(json.dumps(summary["speculative"], indent=2))
        reporter.close()
        return summary

    def speculative_eval(self, conversations: list[dict[str, Any]], num_prompts: int | None = None, *,
                         draft: torch.nn.Module | None = None) -> dict[str, Any]:
        """SYNC POINT: real speculative decoding on held-out prompts (tau, per-position acceptance, speed-up).

        `draft` defaults to the trained draft; under FSDP2 pass `consolidated_draft()` (sharded weights
        cannot run in one process alone)."""
        from dflash.evaluate import format_report, speculative_report

        if draft is None:
            if self.fsdp:
                raise ValueError("under distributed: fsdp2 pass draft=trainer.consolidated_draft() (called on every rank)")
            draft = self.draft
        report = speculative_report(self.target.model, self.tokenizer, draft, conversations,
                                    num_prompts=num_prompts or self.config.spec_eval_prompts,
                                    max_new_tokens=self.config.spec_eval_max_new_tokens, return_texts=True)
        texts = report.pop("texts")
        if self.world_size == 1:  # evaluate() takes every rank; these texts exist on rank 0 only
            # The held-out chain estimate on exactly these prompts and outputs: what separates it from the
            # real tau is then numerics alone, and from eval_chain_tau the choice of held-out rows.
            report["teacher_forced_chain_tau"] = self._chain_tau_on(texts)
        log.info("speculative eval: %s", format_report(report))
        return report

    def _chain_tau_on(self, texts: list[tuple[list[int], list[int]]]) -> float:
        """`evaluate`'s chain tau over rows `prompt + output`, supervising the output."""
        import datasets

        rows = {"input_ids": [p + o for p, o in texts], "loss_mask": [[0] * len(p) + [1] * len(o) for p, o in texts]}
        return self.evaluate(datasets.Dataset.from_dict(rows))["chain_tau"]

    def _record(self, reporter: Any, metrics: dict[str, Any]) -> None:
        self.history.append({"step": self.step, **metrics})
        reporter.log(self.step, metrics, self.config.max_steps)
