"""The trainer. One step, top to bottom, in `train_step`; nothing in it waits on the GPU.

    anchors + labels for every micro-batch      (device ops; global denominator known up front)
    per micro-batch: target features (no grad; data.features: the batch's) -> block embeddings -> draft -> chunked CE
      -> backward
    global grad norm -> fused AdamW (clipping as its grad_scale, tensor lr) -> on-device schedule -> metric sums

The only host reads happen in `Metrics.flush()` at a log interval, at checkpoints and evaluation. `fit` resumes,
prepares and checks the data, then hands the run to its loop (`dflash.run.loop`: steps, log windows, the evaluation
and save cadence, the stop, the end).
Below the trainer: `data/`, `target_model/`, `run/` (state, checkpoints, graphs, the loop), `evaluation/`, `factory`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash.anchors import GlobalRows, anchor_seed, anchor_widths
from dflash.anchors import reseed as reseed_anchors
from dflash.attention import resolve_attention
from dflash.config import TrainConfig
from dflash.data.corpus import Corpus, check_corpus, training_data
from dflash.data.feature_data import FeatureCollator, batch_collator
from dflash.data.loader import Batch, Collator, DataPosition, device_batches, micro_batches, padding_of, training_rows
from dflash.embedded import cache_root
from dflash.evaluation.evaluate import held_out_speculative_eval
from dflash.evaluation.export import export_draft, load_exported
from dflash.evaluation.held_out import held_out_metrics, output_rows
from dflash.factory import build_draft, check_run_settings, freeze_target, objective_for, prepare_target
from dflash.losses import window_loss_scale
from dflash.metrics import Metrics
from dflash.modeling import DFlashDraftModel, allow_compiled_shapes
from dflash.optim import build_optimizer, lr_at
from dflash.precision import convert_to_fp8
from dflash.preflight import check_dependencies
from dflash.report.console import quiet_datasets, start_of_run
from dflash.report.phases import PhaseTimer
from dflash.report.sinks import history_record
from dflash.run.checkpoint import checkpoint_path, load_checkpoint, resolve_resume, save_checkpoint, write_run_config
from dflash.run.compiling import ShapeLog, batch_shape, compile_draft_call, keep_compile_cache
from dflash.run.data_parallel import DataParallelDraft
from dflash.run.folder import REPORT_NAME, RunFolder
from dflash.run.graphs import Capture, StepGraphs, step_graphs
from dflash.run.loop import RunLoop
from dflash.run.state import (
    check_loaded_state,
    check_resume_config,
    check_training_data,
    check_world_size,
    consolidated_draft,
    full_draft_state,
    full_optimizer_state,
    load_draft_state,
    load_init_from,
    load_optimizer_state,
    log_resolved_steps,
    restore_rng,
    resume_record,
    rng_state,
)
from dflash.run.stopping import apply_num_epochs
from dflash.runtime import DTYPES, init_distributed, resolve_device, resolve_dtype
from dflash.target_model.frozen import Target

log = logging.getLogger("dflash")

class DFlashTrainer:
    """Trains a DFlash draft against a frozen target.

    Pass an already loaded `target` model and `tokenizer` (notebooks), or let the trainer load
    `config.target`. `train_step(batch)` performs exactly one optimizer step.
    """

    def __init__(self, config: TrainConfig | None = None, *, target: Any = None, tokenizer: Any = None,
                 dataset: Any = None, draft: DFlashDraftModel | None = None, frozen_target: Target | None = None) -> None:
        """`target`: an HF causal LM (else `config.target` is loaded); `draft`: instead of a fresh one;
        `frozen_target`: a target already frozen (benchmarks' `Target` stand-ins), which then needs `draft`."""
        self.config = config = config or TrainConfig()
        config.validate()
        rank, self.world_size = init_distributed()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        check_run_settings(config, self.world_size, self.device, self.dtype)  # before any weight is read
        check_dependencies(config, target_given=target is not None or frozen_target is not None,
                           dataset_given=dataset is not None)
        if frozen_target is not None and draft is None:
            raise ValueError("DFlashTrainer(frozen_target=...) needs draft=: a stand-in target has no HF config to "
                             "shape a fresh draft from")
        if frozen_target is None:  # loaded unless passed in; under tensor_parallel this rank's shard (dflash.factory)
            target, tokenizer = prepare_target(config, target, tokenizer, device=self.device, dtype=self.dtype)
        self.tokenizer, self.dataset, self.rank = tokenizer, dataset, rank
        if draft is None:  # `seed` fixes the initialisation (the same on every rank); the caller's RNG is left as it was
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(config.seed)
                draft = build_draft(config, target, tokenizer)
        self.draft = draft.to(self.device, DTYPES[config.param_dtype])
        self.draft_config = self.draft.config
        self.block_size = self.draft_config.block_size
        if config.init_from:  # warm start from an exported draft: weights only, a fresh run otherwise
            load_init_from(self.draft, load_exported(config.init_from, device=self.device), config.init_from)
        if config.fp8:  # before wrapping and compiling: they see the Float8Linear modules
            log.info("fp8: float8 GEMMs in %d linear layers of the draft", len(convert_to_fp8(self.draft)))
        # What the objective calls to run the draft across ranks (DDP or FSDP2; either way only the last
        # micro-batch of a window communicates gradients), compiled when asked.
        self.parallel = DataParallelDraft(self.draft, mode=config.distributed, world_size=self.world_size,
                                          device=self.device)
        self.fsdp = self.parallel.fsdp
        call = self.parallel.call
        if config.compile:  # compiled code kept on disk beside the data caches: a second run does not compile again
            keep_compile_cache(config.data.cache_dir or cache_root())
            call = compile_draft_call(call, self.draft.layers, config.compile_scope)
        self.shape_log = ShapeLog(enabled=config.compile and rank == 0)  # "compiling for shape ..." and its seconds
        self.target = frozen_target if frozen_target is not None else freeze_target(
            config, target, self.draft_config.target_layer_ids).to(self.device, self.dtype)
        self.objective = objective_for(config, self.target, self.draft, device=self.device, dtype=self.dtype,
                                       draft_call=call)

        # Schedule state lives on the device: the lr tensor is shared with the optimizer and updated
        # in place, so changing it never copies a Python float to the device.
        self.step = 0  # host mirror, advanced without reading the device
        self.step_t = torch.zeros((), dtype=torch.float32, device=self.device)
        self.lr = torch.full((), config.optim.lr, dtype=torch.float32, device=self.device)
        self.optimizer = build_optimizer(self.draft, config.optim, self.lr, capturable=config.cuda_graph)
        self.lr.copy_(lr_at(self.step_t, config.optim, config.max_steps))
        self.objective.bind_schedule(self.step_t, config.max_steps)  # Domino's lambda follows the device counter
        self.metrics = Metrics(self.objective.metric_layout(), self.device)
        self.nonfinite_run = torch.zeros((), dtype=torch.float32, device=self.device)
        # Step-level values are the same on every rank and flush() sums over ranks: one process adds them
        # (or 2 ranks would report one skipped update as 2 and stop after half the allowed consecutive skips).
        self._adds_replicated_metrics = rank == 0
        self.data_position = DataPosition()
        self.anchor_generator = torch.Generator(device=self.device)
        self.anchor_generator.manual_seed(anchor_seed(config.seed, 0, 0))  # alike on every rank: see _step
        self.graphs: StepGraphs | None = None  # the captured steps, one per batch shape (cuda_graph: true)
        self.graph_capture: Capture | None = None  # None: torch.cuda graphs (tests pass a stand-in)
        self.history: list[dict[str, Any]] = []  # what `fit` logged and evaluated, also in metrics.jsonl
        self.resumed: dict[str, Any] | None = None  # `state.resume_record` of the checkpoint `resume` loaded
        self.saved_step: int | None = None  # the step last saved or resumed from (the last step is saved once)
        self.data_fingerprint: str | None = None  # the training rows' content hash, saved with checkpoints

    # ---- the step ---------------------------------------------------------------------------

    def train_step(self, batch: Batch | list[Batch]) -> None:
        """One optimizer step over `grad_accum` micro-batches. Makes no host-device sync.

        With `cuda_graph: true` the first call captures the whole step and later calls copy the batch
        into the graph's static inputs and replay it (shapes must repeat: fixed N, bucketed S).
        """
        micro = batch if isinstance(batch, list) else micro_batches(batch, self.config.optim.grad_accum)
        with self.shape_log.first_step(batch_shape(micro)):
            if self.config.cuda_graph:
                # Per-step reseeding is a host call a graph cannot capture: the anchor generator is registered
                # with every graph and advances on the device, and checkpoints keep its state for resume.
                self._step_graphs().run(micro)
            else:
                self._step(micro, reseed=True)
        self.step += 1

    def _step(self, micro: list[Batch], *, reseed: bool) -> None:
        self.objective.train()
        # 1) Anchors and labels for the whole window first, so the loss denominator (the global
        #    supervised-weight sum) is a device tensor before the first backward. Every rank seeds alike and
        #    keeps its rows of one draw over all ranks' rows: the process layout does not change what is trained.
        plans = []
        for i, mb in enumerate(micro):
            generator = (reseed_anchors(self.anchor_generator, self.config.seed, 0, self.step * len(micro) + i)
                         if reseed else self.anchor_generator)
            rows = GlobalRows.of_rank(self.rank, self.world_size, *mb["input_ids"].shape, self.config.data.max_length)
            plans.append(self.objective.plan(mb["input_ids"], mb["loss_mask"], generator, mb.get("num_anchors"), rows,
                                             mb.get("position_ids")))  # packed rows' documents (data.packing)
        scale, total_weight = window_loss_scale([t for _, _, t in plans], self.world_size)

        # 2) Forward/backward per micro-batch; the loss of each is its share of the global mean.
        m = self.metrics
        for i, (mb, (anchors, keep, targets)) in enumerate(zip(micro, plans, strict=True)):
            with self.parallel.gradient_sync(last=i == len(micro) - 1):
                out = self.objective(mb["input_ids"], anchors, keep, targets, mb.get("features"), mb.get("labels"))
                (out.loss_sum * scale).backward()
            self.objective.accumulate(m, out, keep, targets)

        # 3) Update. The global gradient norm stays on the device (an error_if_nonfinite check would read it).
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if self.fsdp:  # a DTensor (the norm over all shards, replicated): its local tensor, no host read
            grad_norm = grad_norm.full_tensor()
        grad_norm = grad_norm.float()  # fused AdamW reads grad_scale and found_inf as fp32
        # Skips, on the device: fused AdamW leaves weights, moments and its own step count untouched when
        # `found_inf` is 1 (GradScaler's mechanism): a non-finite update, or a window with nothing supervised
        # (its zero gradients would still move the weights through the moments and the weight decay).
        nonfinite = (~torch.isfinite(grad_norm)).float()
        empty = (total_weight == 0).float()
        skipped = torch.maximum(nonfinite, empty)
        self.optimizer.found_inf = skipped
        # Clipping folded into the update: fused AdamW divides every gradient by `grad_scale` in its kernel, the
        # factor of clip_grad_norm_ (max_norm / (norm + 1e-6), capped at 1) without its extra pass over the gradients.
        self.optimizer.grad_scale = ((grad_norm + 1e-6) / self.config.optim.max_grad_norm).clamp(min=1.0)
        # Consecutive non-finite skips: reset by an update, left as it was by an empty window.
        self.nonfinite_run.copy_(torch.where(empty > 0, self.nonfinite_run, self.nonfinite_run * nonfinite + nonfinite))
        if self._adds_replicated_metrics:  # identical on every rank; flush() sums over ranks: count them once
            m.add_update(nonfinite=nonfinite, empty=empty, nonfinite_run=self.nonfinite_run, grad_norm=grad_norm, lr=self.lr)
        self.optimizer.step()
        # A captured graph needs its gradient buffers to stay put: zero them instead of freeing them.
        self.optimizer.zero_grad(set_to_none=not self.config.cuda_graph)
        self.step_t.add_(1)
        self.lr.copy_(lr_at(self.step_t, self.config.optim, self.config.max_steps))

    def _step_graphs(self) -> StepGraphs:
        """The captured steps (`cuda_graph: true`), one per shape the collator can produce."""
        if self.graphs is None:
            self.graphs = step_graphs(lambda micro: self._step(micro, reseed=False), draft=self.draft,
                                      optimizer=self.optimizer, metrics=self.metrics, tensors=(self.step_t, self.lr),
                                      generator=self.anchor_generator, device=self.device, capture=self.graph_capture,
                                      max_graphs=self._collator().num_shapes)
        return self.graphs

    # ---- evaluation (a sync point by design) ------------------------------------------------

    def evaluate(self, dataset: Any, *, max_batches: int | None = None) -> dict[str, Any]:
        """Teacher-forced held-out metrics and the decode-chain estimate of real tau (`dflash.evaluation.held_out`),
        the chain capped at `spec_eval_max_new_tokens`. A SYNC POINT."""
        return held_out_metrics(self.objective, dataset, self._collator(), batch_size=self.config.batch_size,
                                device=self.device, max_new_tokens=self.config.spec_eval_max_new_tokens,
                                max_batches=max_batches)

    # ---- state ------------------------------------------------------------------------------

    def draft_state_dict(self) -> dict[str, torch.Tensor]:
        """The draft's full weights on the CPU (trainer names); under FSDP2 a collective (rank 0 gets them, others {})."""
        return full_draft_state(self.draft)

    def consolidated_draft(self) -> torch.nn.Module | None:
        """`dflash.run.state.consolidated_draft`: the draft whole; under FSDP2 a collective (rank 0 gets it)."""
        return consolidated_draft(self.draft, self.draft_config, fsdp=self.fsdp, rank=self.rank, device=self.device)

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs besides the draft weights. Under FSDP2 a collective (sharded moments
        gathered to rank 0): one consolidated layout whether the run used DDP, FSDP2 or one process."""
        return {"step": self.step, "optimizer": full_optimizer_state(self.draft, self.optimizer),
                "metrics": self.metrics.state_dict(), "data_epoch": self.data_position.epoch,
                "data_batches": self.data_position.batches, **rng_state(self.anchor_generator),
                "config": self.config.to_dict(), "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s values (the draft's weights are loaded separately, by `resume`)."""
        check_world_size(state, self.world_size)
        self.step = int(state["step"])
        load_optimizer_state(self.draft, self.optimizer, state["optimizer"])
        self.step_t.fill_(self.step)
        self.lr.copy_(lr_at(self.step_t, self.config.optim, self.config.max_steps))
        self.metrics.load_state_dict(state["metrics"])
        self.data_position = DataPosition(int(state["data_epoch"]), int(state["data_batches"]))
        restore_rng(state, self.anchor_generator)

    def save(self) -> Path:
        """SYNC POINT: an atomic checkpoint of the current step under `output_dir/checkpoints`."""
        # Consolidated state (FSDP2: gathered to rank 0); one writer, the others wait for it. The data's fingerprint
        # and metrics.jsonl's length and CRC-32 let a resume refuse other data and cut (or restore) its history.
        draft_state, state = self.draft_state_dict(), self.state_dict()
        state.update(data_fingerprint=self.data_fingerprint, **history_record(self.config.output_dir))
        if self.rank == 0:
            path = save_checkpoint(self.config.output_dir, self.step, draft_state,
                                   self.draft_config.to_dict(), state, keep_last=self.config.keep_last)
            log.info("saved checkpoint %s", path)
        if self.world_size > 1:
            dist.barrier()
        self.saved_step = self.step
        return checkpoint_path(self.config.output_dir, self.step)

    def resume(self, path: str | Path) -> None:
        """Continue from checkpoint `path`; refused when a run-defining setting differs, every accepted change
        logged (`dflash.run.state`). `fit` then checks the training data against the fingerprint saved with it."""
        draft_state, _, state = load_checkpoint(path, self.device, self.draft)  # header checked first; weights_only
        check_resume_config(path, state.get("config", {}), self.config.to_dict())
        check_loaded_state(path, self.draft, draft_state, state.get("optimizer", {}))  # before anything is loaded
        load_draft_state(self.draft, draft_state)
        self.load_state_dict(state)
        self.resumed, self.saved_step = resume_record(path, state, self.config.output_dir), self.step
        log.info("resumed from %s at step %d", path, self.step)

    # ---- the run ----------------------------------------------------------------------------

    def _collator(self) -> Collator | FeatureCollator:
        """Bucketed right padding for `config.data` (with the features under `data.features`); compiled
        functions may keep a graph for each of its padded lengths (`allow_compiled_shapes`)."""
        widths = anchor_widths(self.config.draft.num_anchors, self.config.draft.anchor_widths)
        collator = batch_collator(self.tokenizer, self.config.data, widths)
        allow_compiled_shapes(collator.num_shapes)
        return collator

    def _device_batches(self, dataset: Any) -> Iterator[Batch]:
        """Endless training batches on the device, continuing from `data_position`."""
        return device_batches(dataset, self.config.batch_size * self.config.optim.grad_accum, self._collator(),
                              self.device, self.data_position, seed=self.config.seed,
                              num_workers=self.config.data.num_workers, rank=self.rank, world_size=self.world_size,
                              micro_batches=self.config.optim.grad_accum)

    def fit(self) -> dict[str, Any]:
        """Train to `max_steps`: log at `log_interval`, evaluate at `eval_interval`, save at `save_interval`.

        Returns a summary (final train metrics, held-out metrics, paths; `interrupted` and `signal` when SIGTERM /
        SIGINT stopped it, the step saved). Syncs happen only at the log flush, evaluation and checkpoints. The run
        folder is claimed and locked first (`dflash.run.folder`); a damaged newest checkpoint is passed over, and
        what this run's interrupted saves left is removed. Here: resume, the data and its checks; then the loop
        (`dflash.run.loop.RunLoop`)."""
        cfg = self.config
        phases = start_of_run(cfg, rank=self.rank, world_size=self.world_size, device=self.device, dtype=self.dtype,
                              attention=resolve_attention(cfg.draft.attention, self.device))  # bars, banner, clock
        with RunFolder(cfg.output_dir, resume_from=cfg.resume_from, overwrite=cfg.overwrite_output_dir,
                       rank=self.rank, world_size=self.world_size) as run_dir:
            if (resume := resolve_resume(cfg.resume_from, run_dir)) is not None:  # `latest`: the newest intact one
                self.resume(resume)
            with quiet_datasets(), phases("data_preparation"):  # dflash's own bars and log lines tell it
                corpus = training_data(self.dataset, cfg.data, self.tokenizer, self.target.model, cfg.target,
                                       rank=self.rank, world_size=self.world_size)
            check_corpus(corpus, self.draft_config.mask_token_id, self.tokenizer, warn=self.rank == 0)
            self.data_fingerprint = check_training_data(corpus, cfg, self.resumed)  # refuses a resume on other data
            corpus.train = training_rows(corpus.train, cfg.data)  # data.packing: the rows as packed sequences
            apply_num_epochs(self, len(corpus.train))  # num_epochs: max_steps and the schedules from the rows
            log_resolved_steps(self.resumed, cfg)  # a resume's max_steps change, known only now with num_epochs
            padding = padding_of(corpus.train, cfg.batch_size * cfg.optim.grad_accum, self._collator(), seed=cfg.seed)
            if padding is not None and self.rank == 0:  # what every step pays for its buckets, known before the first
                log.info(padding.describe())
            write_run_config(run_dir, cfg.to_dict())  # only now: a refused resume leaves the run's config.yaml as it was
            loop = RunLoop(self, run_dir, phases, train_rows=len(corpus.train), conversations=corpus.held_out_conversations)
            return loop.run(self._device_batches(corpus.train), corpus.eval,
                            {"padding": padding.to_dict()} if padding is not None else {},
                            end_of_run=lambda summary: self._export_and_decode(run_dir, corpus, phases, summary))

    def _export_and_decode(self, run_dir: Path, corpus: Corpus, phases: PhaseTimer, summary: dict[str, Any]) -> None:
        """The end of a completed run after its held-out metrics (`RunLoop.finish`): the export and speculative
        decoding on the held-out prompts, into `summary`."""
        cfg = self.config
        spec_eval = bool(cfg.spec_eval_prompts and corpus.held_out_conversations)
        # One full draft for export and speculative decoding (FSDP2: gathered to rank 0 by every rank).
        final_draft = self.consolidated_draft() if cfg.export_on_finish or spec_eval else None
        if cfg.export_on_finish and self.rank == 0:
            summary["export"] = str(phases.timed("export", export_draft, final_draft, run_dir / "export",
                                                 target=cfg.target, held_out=corpus.held_out_split))
        if spec_eval and (report := phases.timed("speculative_eval", self.speculative_eval,
                                                 corpus.held_out_conversations, draft=final_draft)) is not None:
            summary["speculative"] = report  # rank 0 (under tensor_parallel its TP group decoded with it)
            (run_dir / "export" / REPORT_NAME).write_text(json.dumps(report, indent=2))

    def speculative_eval(self, conversations: list[dict[str, Any]], num_prompts: int | None = None, *,
                         draft: torch.nn.Module | None = None) -> dict[str, Any] | None:
        """SYNC POINT: real speculative decoding on held-out prompts (tau, per-position acceptance, speed-up;
        `dflash.evaluation.evaluate.held_out_speculative_eval`): the report on rank 0, None on the other ranks, so call it
        on every rank. `draft` defaults to the trained draft; under FSDP2 pass `consolidated_draft()` (sharded
        weights cannot run in one process alone). One process: with `teacher_forced_chain_tau`."""
        if draft is None and self.fsdp and self.rank == 0:  # the other ranks report nothing (None)
            raise ValueError("under distributed: fsdp2 pass draft=trainer.consolidated_draft() (called on every rank)")
        return held_out_speculative_eval(self.target, self.tokenizer, self.draft if draft is None else draft,
                                         conversations, rank=self.rank, num_prompts=num_prompts or self.config.spec_eval_prompts,
                                         max_new_tokens=self.config.spec_eval_max_new_tokens,
                                         max_prompt_tokens=max(512, self.config.data.max_length),  # a token row's history
                                         chain_tau=self._chain_tau_on if self.world_size == 1 else None)

    def _chain_tau_on(self, texts: list[tuple[list[int], list[int]]]) -> float:
        """`evaluate`'s chain tau over rows `prompt + output`, supervising the output."""
        return self.evaluate(output_rows(texts))["chain_tau"]
