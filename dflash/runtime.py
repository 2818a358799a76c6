"""Where a run executes: its device, dtypes, process group and target model.

The low module every entry point shares (trainer, corpus, evaluation, dry run, the Trainer module),
so none of them has to import the trainer for these.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
import torch.distributed as dist
from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash.embedded import load_embedded_target

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # the config's dtype names


def resolve_device(name: str) -> torch.device:
    """"auto": this process's GPU (cuda:LOCAL_RANK under a launcher) when there is one, else the CPU."""
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bf16 on a GPU, fp32 on the CPU; else the named dtype (`DTYPES`)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_target(name: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """(model, tokenizer) for "embedded" or any HF model id / local path."""
    if name == "embedded":
        return load_embedded_target(dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype), AutoTokenizer.from_pretrained(name)


def init_distributed() -> tuple[int, int]:
    """(rank, world_size). Under `accelerate launch` / torchrun (WORLD_SIZE > 1) this initialises the
    process group (through accelerate; NCCL on GPUs, gloo on CPUs); a single process gets (0, 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
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
