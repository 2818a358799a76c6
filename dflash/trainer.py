"""The training loop. One step, top to bottom, in `train_step`; nothing in it waits on the GPU.

    anchors + labels for every micro-batch      (device ops; global denominator known up front)
    per micro-batch: target features (no grad) -> block embeddings -> draft -> chunked CE -> backward
    clip (no error_if_nonfinite) -> fused AdamW (tensor lr) -> on-device schedule -> metric sums

The only host reads happen in `Metrics.flush()` at a log interval, at checkpoints and evaluation.
"""

from __future__ import annotations

import contextlib
import copy
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
        # A prebuilt objective (benchmarks, tests) replaces the target/draft construction.
        self.objective = objective or build_objective(config, target, tokenizer, device=self.device, dtype=self.dtype,
                                                      draft=draft)
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
        # What the objective calls to run the draft: DDP across ranks (gradients all-reduced in
        # backward; only the last micro-batch of a window communicates), compiled when asked.
        self.ddp = None
        call: torch.nn.Module = self.draft
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = call = DistributedDataParallel(self.draft, device_ids=[self.device.index]
                                                      if self.device.type == "cuda" else None)
        if config.compile:
            call = torch.compile(call, dynamic=False)
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
            fused=True,  # reads lr and step from device tensors: no host read
            capturable=config.cuda_graph,  # the step counter stays on the device, so a graph can replay it
        )
        self.lr.copy_(self._lr_at(self.step_t))
        if hasattr(self.objective, "bind_schedule"):  # Domino's lambda follows the device step counter
            self.objective.bind_schedule(self.step_t, config.max_steps)
        self.metrics = Metrics(self.block_size, self.device, self.objective.metrics_variant)
        self.nonfinite_run = torch.zeros((), dtype=torch.float32, device=self.device)
        self.held_out_conversations: list[dict[str, Any]] = []  # prompts for the speculative eval
        self.data_epoch = 0  # data position (host counters): epoch and loader batches consumed in it
        self.data_batches = 0
        self.anchor_generator = torch.Generator(device=self.device)
        self.anchor_generator.manual_seed(anchor_seed(config.seed, rank, 0))
        self._graph: torch.cuda.CUDAGraph | None = None  # the captured step (cuda_graph: true)
        self._static: list[Batch] = []

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
            last = i == len(micro) - 1
            sync = contextlib.nullcontext() if self.ddp is None or last else self.ddp.no_sync()
            with sync:
                out = self.objective(mb["input_ids"], anchors, keep, targets)
                (out.loss_sum * scale).backward()
            self.objective.accumulate(m, out, keep, targets)

        # 3) Update. clip_grad_norm_ without error_if_nonfinite: that flag reads the norm to the host.
        grad_norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.config.optim.max_grad_norm, foreach=True)
        # Non-finite guard, on the device: fused AdamW skips the whole update (weights, moments and
        # its step count untouched) when `found_inf` is 1 -- the mechanism GradScaler uses.
        skipped = (~torch.isfinite(grad_norm)).float()
        self.optimizer.found_inf = skipped
        self.nonfinite_run.mul_(skipped).add_(skipped)  # consecutive skips, reset by a finite step
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

    def _replay(self, micro: list[Batch]) -> None:
        """CUDA-graph path: capture on first use, then copy inputs into static buffers and replay.

        The anchor generator is registered with the graph, so each replay draws new anchors (its
        Philox offset advances on the device); per-step reseeding is a host call and cannot be
        captured, so in this mode exact resume restores the generator state instead.
        """
        if self._graph is None:
            self._static = [{k: v.clone() for k, v in mb.items()} for mb in micro]
            # Warm up on a side stream (allocates grads, optimizer state, compiled kernels), then
            # restore weights and optimizer state so the warm-up steps leave no trace in training.
            snapshot = ({k: v.clone() for k, v in self.draft.state_dict().items()},
                        copy.deepcopy(self.optimizer.state_dict()), self.metrics.state_dict(),
                        self.step_t.clone(), self.lr.clone())
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    self._step(self._static, reseed=False)
            torch.cuda.current_stream().wait_stream(side)
            self.draft.load_state_dict(snapshot[0])
            self.optimizer.load_state_dict(snapshot[1])
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr
            self.metrics.load_state_dict(snapshot[2])
            self.step_t.copy_(snapshot[3])
            self.lr.copy_(snapshot[4])
            self._graph = torch.cuda.CUDAGraph()
            self._graph.register_generator_state(self.anchor_generator)
            with torch.cuda.graph(self._graph):
                self._step(self._static, reseed=False)
        for static, mb in zip(self._static, micro, strict=True):
            for k, v in mb.items():
                static[k].copy_(v, non_blocking=True)
        self._graph.replay()

    # ---- evaluation (a sync point by design) ------------------------------------------------

    @torch.no_grad()
    def evaluate(self, dataset: Any, *, max_batches: int | None = None) -> dict[str, Any]:
        """Teacher-forced metrics on held-out rows: loss, accuracy, tau, per-position accuracy.

        Anchors are drawn from a fixed seed, so evaluations at different steps see the same blocks.
        """
        from dflash.data import make_dataloader

        loader = make_dataloader(dataset, self.config.batch_size, self._collator(), shuffle=False,
                                 num_workers=0, drop_last=False)
        metrics = Metrics(self.block_size, self.device, self.objective.metrics_variant)
        generator = torch.Generator(device=self.device)
        self.objective.eval()
        for i, batch in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            ids = batch["input_ids"].to(self.device)
            mask = batch["loss_mask"].to(self.device)
            generator.manual_seed(anchor_seed(self.config.seed + 1, 0, i))
            anchors, keep, targets = self.objective.plan(ids, mask, generator)
            self.objective.accumulate(metrics, self.objective(ids, anchors, keep, targets), keep, targets)
        metrics.add("steps", 1.0)
        out = metrics.flush()
        return {k: v for k, v in out.items() if k not in ("grad_norm", "lr", "nonfinite_skips")}

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs besides the draft weights (anchors derive from the step)."""
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "metrics": self.metrics.state_dict(),
            "data_epoch": self.data_epoch,
            "data_batches": self.data_batches,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
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
        self.optimizer.load_state_dict(state["optimizer"])
        # load_state_dict replaces the lr tensor in param_groups by a copy: put ours back.
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        self.step_t.fill_(self.step)
        self.lr.copy_(self._lr_at(self.step_t))
        self.metrics.load_state_dict(state["metrics"])
        self.data_epoch, self.data_batches = int(state["data_epoch"]), int(state["data_batches"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])

    def save(self) -> Path:
        """SYNC POINT: an atomic checkpoint of the current step under `output_dir/checkpoints`."""
        from dflash.checkpoint import checkpoint_path, save_checkpoint

        if self.rank == 0:  # replicated draft: one writer; the others wait so nobody reads a half save
            path = save_checkpoint(self.config.output_dir, self.step, self.draft.state_dict(),
                                   self.draft_config.to_dict(), self.state_dict(), keep_last=self.config.keep_last)
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
        self.draft.load_state_dict(draft_state)
        self.load_state_dict(state)
        log.info("resumed from %s at step %d", path, self.step)

    # ---- the run ----------------------------------------------------------------------------

    def _collator(self):
        from dflash.data import Collator

        pad = getattr(self.tokenizer, "pad_token_id", None)
        pad = pad if pad is not None else getattr(self.tokenizer, "eos_token_id", None) or 0
        return Collator(pad, self.config.data.bucket_multiple, self.config.data.max_length)

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
                    and self.held_out_conversations and self.rank == 0):
                spec = self.speculative_eval(self.held_out_conversations, cfg.spec_eval_interval_prompts)
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
        if cfg.export_on_finish and self.rank == 0:
            from dflash.export import export_draft

            summary["export"] = str(export_draft(self.draft, run_dir / "export"))
        if cfg.spec_eval_prompts and self.held_out_conversations and self.rank == 0:
            summary["speculative"] = self.speculative_eval(self.held_out_conversations)
            (run_dir / "export" / "eval.json").write_text(json.dumps(summary["speculative"], indent=2))
        reporter.close()
        return summary

    def speculative_eval(self, conversations: list[dict[str, Any]], num_prompts: int | None = None) -> dict[str, Any]:
        """SYNC POINT: real speculative decoding on held-out prompts (tau, per-position acceptance, speed-up)."""
        from dflash.evaluate import format_report, speculative_report

        report = speculative_report(self.target.model, self.tokenizer, self.draft, conversations,
                                    num_prompts=num_prompts or self.config.spec_eval_prompts,
                                    max_new_tokens=self.config.spec_eval_max_new_tokens)
        log.info("speculative eval: %s", format_report(report))
        return report

    def _record(self, reporter: Any, metrics: dict[str, Any]) -> None:
        self.history.append({"step": self.step, **metrics})
        reporter.log(self.step, metrics, self.config.max_steps)
