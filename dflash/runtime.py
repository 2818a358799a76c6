"""Where a run executes: its device, dtypes, CPU threads and process group (the target is loaded by
`dflash.target_model.loading`).

The low module every entry point shares (trainer, corpus, evaluation, dry run, the Trainer module),
so none of them has to import the trainer for these.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # the config's dtype names
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
log = logging.getLogger("dflash")
_CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # "QUOTA PERIOD" or "max PERIOD" (cgroup v2)
_THREADS_SAID = False


def cpu_threads() -> int:
    """torch threads for this process on a CPU: OMP_NUM_THREADS when set; else the CPUs this process may run
    on (its affinity, capped by a cgroup CPU quota) shared among the launch's local processes. torch's own
    default counts the host's cores: on shared cores that oversubscribed them, 15x slower than one thread."""
    if (env := os.environ.get("OMP_NUM_THREADS", "").strip()).isdigit() and int(env) > 0:
        return int(env)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path(_CGROUP_CPU_MAX).read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota: the affinity alone
    return max(1, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def use_cpu_threads() -> None:
    """Set `cpu_threads()` for torch, saying so once per process (and how to change it)."""
    global _THREADS_SAID
    threads = cpu_threads()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if not _THREADS_SAID:
        log.info("CPU: %d torch thread(s) per process (set OMP_NUM_THREADS to change)", threads)
        _THREADS_SAID = True


def resolve_device(name: str) -> torch.device:
    """"auto": this process's GPU (cuda:LOCAL_RANK under a launcher) when there is one, else the CPU, whose
    thread count is then chosen (`use_cpu_threads`). A named CUDA device that this machine lacks is a
    ValueError saying so (not an assertion deep in torch)."""
    if name == "auto":
        if not torch.cuda.is_available():
            use_cpu_threads()
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device={name!r} is not a device (auto, cpu, cuda, cuda:N)") from None
    if device.type == "cpu":
        use_cpu_threads()
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device visible"
            raise ValueError(f"device={name}, but this machine has no usable GPU ({build}); use device=cpu or "
                             "device=auto")
        if device.index is not None and device.index >= count:
            raise ValueError(f"device={name}, but this machine has {count} CUDA device(s): cuda:0..cuda:{count - 1}")
    return device


def peak_memory_bytes(device: torch.device) -> int | None:
    """This process's peak allocated memory on `device` since it started (None off CUDA): the caching
    allocator's own counter, read on the host, so no device sync."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bf16 on a GPU, fp32 on the CPU; else the named dtype (`DTYPES`)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def init_distributed() -> tuple[int, int]:
    """(rank, world_size). Under `accelerate launch` / torchrun (WORLD_SIZE > 1) this initialises the
    process group (through accelerate; NCCL on GPUs, gloo on CPUs); a single process gets (0, 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        stop_with_launcher()
        PartialState()
        if not dist.is_initialized():  # accelerate leaves CPU-only launches (gloo) to us
            dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def stop_with_launcher() -> None:
    """Have the kernel send this process SIGTERM when its parent, the launcher (torchrun), dies, even by
    SIGKILL: the ranks then stop together at the next log flush and save (`dflash.run.stopping`), instead of
    training on as orphans. A parent already gone (the process was reparented to init) stops it now.
    Linux only (prctl); elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("could not ask to stop with the launcher (prctl: %s)", os.strerror(ctypes.get_errno()))
    elif os.getppid() == 1:
        os.kill(os.getpid(), signal.SIGTERM)


def shutdown_distributed() -> None:
    """Destroy the process group, after a garbage collection. Trainers left in reference cycles hold
    DDP reducers on the group; destroyed at interpreter exit, after the group, they abort the process
    ("terminate called without an active exception"). Drop your references to trainers first."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def launch_process_group() -> Iterator[None]:
    """Around a command's work: destroys the process group the work initialised (a torchrun launch's), once
    it returned normally. A group that existed before is the caller's and stays; after an exception the
    traceback still holds the trainer and its DDP reducer, so the group is left to the exiting process."""
    existed = dist.is_available() and dist.is_initialized()
    yield
    if not existed:
        shutdown_distributed()
