"""What a run saves and restores besides its data position: the draft's weights, the optimizer's state,
and the guard that refuses to resume a checkpoint under a configuration that would not continue it.

Weights and optimizer state go through `torch.distributed.checkpoint.state_dict` with full,
CPU-offloaded state: under FSDP2 every sharded tensor is gathered (a collective every rank joins) and
rank 0 holds the consolidated values; in one process or under DDP it is the plain state. Either way
the checkpoint has one layout (optimizer state keyed by parameter name), so a run may resume under
another `distributed` mode at the same world size and `dflash export` reads every checkpoint alike.
On load each rank passes the full state it read and keeps its own shard (no communication).
"""

from __future__ import annotations

import copy
import hashlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dflash.config import TrainConfig, flatten
from dflash.kinds.registry import KINDS, draft_model_for_config
from dflash.modeling import DFlashDraftConfig
from dflash.optim import DraftOptimizers
from dflash.run.checkpoint import CheckpointError
from dflash.run.safe_load import shape_problems

_SAVE = StateDictOptions(full_state_dict=True, cpu_offload=True)
_LOAD = StateDictOptions(full_state_dict=True)
log = logging.getLogger("dflash")

# The resume guard (docs/design.md, "Checkpoints and faults"). Settings that define what a run computes
# (the model, the data and its order, the batch geometry, the seed): resuming with any of them changed is
# refused, and so is training data whose content differs (`data_fingerprint`). Every other difference is
# accepted and logged key by key: the schedule and optimizer values (optim.lr, warmup_ratio, min_lr_ratio,
# max_grad_norm, weight decay, betas; max_steps, which rescales the cosine from the resumed step on) are
# what one changes on purpose to extend a run or calm a diverging one, and the rest (intervals, budgets,
# reporting, compile, distributed mode) does not change what a step computes. `tensor_parallel.size` is
# run-defining (the sharded target sums its matmuls in another order); `tensor_parallel.overlap` is not (the
# overlapped schedule computes the same features as the unsplit one, tests/test_tensor_parallel.py). Every
# draft kind's own section is run-defining, as the draft section is.
RUN_DEFINING = ("target", "draft.", *(f"{kind.section}." for kind in KINDS if kind.section), "seed", "batch_size",
                "optim.grad_accum", "param_dtype", "data.source", "data.split", "data.limit", "data.eval_size",
                "data.max_length", "data.bucket_multiple", "data.packing", "data.pack_length", "data.labels",
                "data.regenerate", "tensor_parallel.size")
NOT_COMPARED = ("resume_from",)  # differs by nature between a run's first launch and its resumes
_ACCEPTED = "resume: %s (accepted: it does not change what the run trains on)"


def _not_yet_known(current: dict[str, Any]) -> tuple[str, ...]:
    """Keys the current config does not hold the run's value of at the resume: with num_epochs, max_steps (its
    default or a cap) is set from the training rows later (`dflash.run.stopping.apply_num_epochs`), so the
    checkpoint's, which holds the count its run set, is compared with that one then (`log_resolved_steps`)."""
    return ("max_steps",) if current.get("num_epochs") is not None else ()


def _differences(saved: dict[str, Any], current: dict[str, Any], defining: bool) -> list[str]:
    a, b = dict(flatten(saved)), dict(flatten(current))
    skipped = (*NOT_COMPARED, *_not_yet_known(current))
    keys = sorted(k for k in set(a) | set(b) if k not in skipped
                  and (k.startswith(RUN_DEFINING) or k in RUN_DEFINING) == defining)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Run-defining settings that differ between a checkpoint's config and the current one,
    as `"key: saved -> current"` lines."""
    return _differences(saved, current, defining=True)


def accepted_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The other settings that differ (accepted on resume, and logged), as `"key: saved -> current"` lines."""
    return _differences(saved, current, defining=False)


def check_resume_config(path: Any, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse a resume whose run-defining settings differ (listing them) or whose optimizer differs (naming
    both and the ways on); log every accepted change."""
    check_same_optimizer(path, saved, current)
    refused = config_differences(saved, current)
    if refused:
        raise ValueError(f"checkpoint {path} was written with a different configuration; resuming would not "
                         "continue the same run. Differences (checkpoint -> now):\n  " + "\n  ".join(refused))
    for change in accepted_changes(saved, current):
        log.info(_ACCEPTED, change)


def log_resolved_steps(resumed: dict[str, Any] | None, config: TrainConfig) -> None:
    """Once num_epochs has set `config.max_steps` from the training rows: log its change from the resumed
    checkpoint's as `check_resume_config` logs the others (`_not_yet_known`: it left max_steps out then)."""
    if resumed is None or config.num_epochs is None:
        return
    if (saved := resumed.get("max_steps")) != config.max_steps:
        log.info(_ACCEPTED, f"max_steps: {saved!r} -> {config.max_steps!r}, from num_epochs={config.num_epochs:g}")


def check_same_optimizer(path: Any, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume one optimizer's state into another (`optim.optimizer`): AdamW's moments and Muon's
    momentum are different tensors under the same parameter names, and loading one into the other failed
    deep in torch with `error: 'state.fc.weight.step'` (AdamW into Muon) or loaded half a state (Muon into
    AdamW). Checkpoints from before the setting are AdamW's."""
    was, now = ((config.get("optim") or {}).get("optimizer", "adamw") for config in (saved, current))
    if was != now:
        raise ValueError(f"checkpoint {path} holds {was} optimizer state and this run asks for optim.optimizer={now}: "
                         f"one optimizer's state cannot continue another's. Resume with optim.optimizer={was}, or "
                         f"start a new run from its weights with {now}: dflash export {path} DRAFT_DIR, then "
                         f"init_from=DRAFT_DIR optim.optimizer={now} in a new output_dir")


def data_fingerprint(dataset: Any, max_rows: int = 20_000) -> str:
    """A hash of the training rows' content (`input_ids`, `loss_mask`) and their count: every row up to
    `max_rows`, beyond that an evenly spaced sample of `max_rows` rows."""
    n = len(dataset)
    h = hashlib.sha256(str(n).encode())
    for i in range(0, n, max(1, -(-n // max_rows))):
        row = dataset[i]
        for key in ("input_ids", "loss_mask"):
            h.update(np.asarray(row[key], dtype=np.int64).tobytes() + b"|")
    return h.hexdigest()[:16]


def resume_record(path: Any, state: dict[str, Any], run_dir: Any) -> dict[str, Any]:
    """What `fit` checks after a resume: the step, the data fingerprint and max_steps saved with it, and the length
    and CRC-32 metrics.jsonl had at that save (only when the checkpoint belongs to this run folder)."""
    own = Path(path).resolve().parent.parent == Path(run_dir).resolve()
    return {"path": str(path), "step": int(state["step"]), "data_fingerprint": state.get("data_fingerprint"),
            "max_steps": (state.get("config") or {}).get("max_steps"),  # the count its run trained to
            "metrics_bytes": state.get("metrics_bytes") if own else None,
            "metrics_crc32": state.get("metrics_crc32") if own else None,
            "data_position": (int(state["data_epoch"]), int(state["data_batches"])),
            "world_size": int(state.get("world_size", 1))}


def check_training_data(corpus: Any, config: Any, resumed: dict[str, Any] | None) -> str:
    """The training rows' fingerprint (`corpus`: `dflash.data.corpus.Corpus`), after refusing a held-out split
    that leaves too few rows for one step (naming data.eval_size) and a resume on rows whose content
    differs from the checkpoint's."""
    dataset, held_out = corpus.train, corpus.description.get("held_out_conversations", 0)
    rows = config.batch_size * config.optim.grad_accum
    if held_out and len(dataset) < rows:
        raise ValueError(f"data.eval_size={config.data.eval_size} holds out {held_out} conversations and leaves "
                         f"{len(dataset)} training rows, fewer than one step needs ({rows}): lower data.eval_size "
                         "or add data")
    fingerprint = data_fingerprint(dataset)
    saved = (resumed or {}).get("data_fingerprint")
    if saved and saved != fingerprint:
        raise ValueError(f"the training data differs from what checkpoint {resumed['path']} was trained on "
                         f"(content fingerprint {saved} -> {fingerprint}); resuming would not continue the same "
                         "run. Restore that data, or start a new run (init_from=an export warm-starts it)")
    if resumed and resumed.get("data_position") is not None and len(dataset) // resumed.get("world_size", 1) >= rows:
        check_data_position(resumed, len(dataset) // resumed.get("world_size", 1) // rows)
    return fingerprint


def check_data_position(resumed: dict[str, Any], most_per_epoch: int) -> None:
    """Refuse a resumed data position (`resume_record`'s (epoch, batches)) that no run of this data reaches: more
    batches into an epoch than its rows make (`most_per_epoch`: rows per rank // rows per step, what unpacked rows
    give; packed ones give fewer), or more epochs and batches than steps taken (a run takes one batch a step and
    every epoch at least one; steps on batches of one's own, `train_step` in a notebook, take none). Such a position
    (a crafted or damaged trainer_state.pt) was accepted, and the loader silently skipped to another epoch. Bounds
    that hold whatever the loader's layout, so a real position is never refused."""
    (epoch, batches), step = resumed["data_position"], resumed["step"]
    if batches > most_per_epoch or epoch + batches > step:
        raise CheckpointError(f"checkpoint {resumed['path']} holds a data position no run of this data reaches "
                              f"(epoch {epoch}, batch {batches}, after {step} steps; an epoch of these rows is at most "
                              f"{most_per_epoch} batches), not resumed: its trainer_state.pt was changed. Resume from "
                              "another checkpoint, or start a new run (init_from=an export warm-starts it)")


def full_draft_state(draft: nn.Module) -> dict[str, torch.Tensor]:
    """The draft's full weights on the CPU (trainer names). SYNC POINT; under FSDP2 a collective that
    every rank calls: rank 0 gets the consolidated tensors, the other ranks an empty dict."""
    return get_model_state_dict(draft, options=_SAVE)


def _parts(optimizer: torch.optim.Optimizer | DraftOptimizers) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
    """What `torch.distributed.checkpoint.state_dict` takes: one optimizer, or Muon's and AdamW's as a list."""
    return optimizer.parts if isinstance(optimizer, DraftOptimizers) else optimizer


def full_optimizer_state(draft: nn.Module, optimizer: torch.optim.Optimizer | DraftOptimizers) -> dict[str, Any]:
    """The optimizer's full state on the CPU, keyed by parameter name (a collective, as above)."""
    return get_optimizer_state_dict(draft, _parts(optimizer), options=_SAVE)


# AdamW's and Muon's per-parameter tensors, each the parameter's shape
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def check_loaded_state(path: Any, draft: nn.Module, draft_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
    """Refuse (`CheckpointError` naming the tensor) checkpoint `path`'s weights or AdamW state that do not fit this draft,
    before any of it is loaded: a missing or unknown name, another shape or dtype, a value that is not finite,
    a negative second moment. A wrong-shaped moment once crashed the fused AdamW kernel (a segfault) and
    non-finite values train to NaN weights. SYNC POINT (reads every value once, at resume only)."""
    problems: list[str] = []
    expected = draft.state_dict()  # under FSDP2 DTensors of the full shape
    for name in sorted(set(expected) ^ set(draft_state)):
        problems.append(f"weight {name} is {'missing' if name in expected else 'not in this draft'}")
    for name in sorted(set(expected) & set(draft_state)):
        got, want = draft_state[name], expected[name]
        if not torch.is_tensor(got) or got.shape != want.shape:
            problems.append(f"weight {name} has shape {tuple(getattr(got, 'shape', ()))}, the draft {tuple(want.shape)}")
        elif got.is_floating_point() and not torch.isfinite(got).all():
            problems.append(f"weight {name} holds non-finite values")
    params = dict(draft.named_parameters())
    for name, entry in optimizer_state.get("state", {}).items():
        param = params.get(name)
        if param is None or not isinstance(entry, dict):
            problems.append(f"optimizer state for {name}, which is not a parameter of this draft")
            continue
        for key in _MOMENTS:
            moment = entry.get(key)
            if moment is None:
                continue
            if not torch.is_tensor(moment) or moment.shape != param.shape or moment.dtype != param.dtype:
                problems.append(f"optimizer {key} of {name} is {tuple(getattr(moment, 'shape', ()))} "
                                f"{getattr(moment, 'dtype', type(moment).__name__)}, the parameter "
                                f"{tuple(param.shape)} {param.dtype}")
            elif not torch.isfinite(moment).all():
                problems.append(f"optimizer {key} of {name} holds non-finite values")
            elif key in ("exp_avg_sq", "max_exp_avg_sq") and (moment < 0).any():  # second moments only
                problems.append(f"optimizer {key} of {name} holds negative values")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(f"checkpoint {path} does not fit this draft, not resumed: {shown}")


def load_init_from(draft: nn.Module, exported: nn.Module, path: Any) -> None:
    """Warm-start `draft` with the weights of `exported` (`init_from`'s export, read by `load_exported`), after
    refusing an export of another draft: a ValueError naming the settings and tensors that differ and the fix.
    torch's own error was a traceback of size mismatches."""
    want, have = draft.state_dict(), exported.state_dict()
    problems = shape_problems({k: ("", tuple(v.shape)) for k, v in have.items()},
                              {k: tuple(v.shape) for k, v in want.items()})
    if problems:
        ours, theirs = draft.config.to_dict(), exported.config.to_dict()
        settings = [f"{k} {theirs.get(k)!r} (this run: {ours.get(k)!r})" for k in sorted(set(ours) | set(theirs))
                    if ours.get(k) != theirs.get(k) and not k.startswith("_")]
        raise ValueError(f"init_from={path} is a draft of another shape than this run's, not loaded: "
                         f"{'; '.join(problems[:4])}{'; ...' if len(problems) > 4 else ''}"
                         + (f". The export has {'; '.join(settings[:6])}" if settings else "")
                         + ". Set the draft settings (draft.*) of the export's run, or drop init_from")
    draft.load_state_dict(have)


def load_draft_state(draft: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load full weights (every rank passes the same full state; FSDP2 keeps its own shard)."""
    set_model_state_dict(draft, state, options=_LOAD)


def load_optimizer_state(draft: nn.Module, optimizer: torch.optim.Optimizer | DraftOptimizers, state: dict[str, Any]) -> None:
    """Load a full optimizer state written by `full_optimizer_state`, then give every param group back
    its own lr tensor: loading replaces it by a copy, and the trainer's schedule writes the original
    in place (so the step reads its lr from the device, never from the host)."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    set_optimizer_state_dict(draft, _parts(optimizer), state, options=_LOAD)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def rebuild_draft(draft_config: DFlashDraftConfig, state: dict[str, torch.Tensor], device: torch.device) -> nn.Module:
    """A plain (unsharded) draft with the weights `state`, on `device`; built on the meta device, so no
    initialisation work is spent on weights that are assigned next."""
    with torch.device("meta"):
        model = draft_model_for_config(copy.deepcopy(draft_config))
    model.load_state_dict(state, assign=True)
    return model.to(device)


def consolidated_draft(draft: nn.Module, draft_config: DFlashDraftConfig, *, fsdp: bool, rank: int,
                       device: torch.device) -> nn.Module | None:
    """The draft as one plain module with full weights (export, speculative decoding): `draft` itself
    without FSDP2; under FSDP2 a collective (call it on every rank) returning a rebuilt unsharded copy on
    `device` on rank 0 and None on the other ranks."""
    if not fsdp:
        return draft
    state = full_draft_state(draft)
    return rebuild_draft(draft_config, state, device) if rank == 0 else None


def check_world_size(state: dict[str, Any], world_size: int) -> None:
    """Refuse to resume a checkpoint written by another number of processes."""
    saved = int(state.get("world_size", 1))
    if saved != world_size:
        raise ValueError(f"the checkpoint was written by {saved} process(es) and this run has {world_size}: the "
                         "data position and per-rank anchors would not continue the same run. Resume with the same "
                         "number of processes, or warm-start a new run from an export (init_from=...)")


def rng_state(anchor_generator: torch.Generator) -> dict[str, Any]:
    """The RNG states a resumed run continues from. Eager steps reseed anchors from (seed, rank, step);
    a CUDA graph advances the anchor generator on the device instead, so its state is what continues the
    anchor stream."""
    return {"torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "anchor_rng": anchor_generator.get_state()}


def restore_rng(state: dict[str, Any], anchor_generator: torch.Generator) -> None:
    """Set the states `rng_state` saved (loaded with map_location=device: made CPU byte tensors again)."""
    torch.set_rng_state(state["torch_rng"].cpu())
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])
    if state.get("anchor_rng") is not None:
        anchor_generator.set_state(state["anchor_rng"].cpu())
