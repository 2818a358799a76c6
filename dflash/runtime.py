"""Where a run executes: its device, dtypes, process group and target model.

The low module every entry point shares (trainer, corpus, evaluation, dry run, the Trainer module),
so none of them has to import the trainer for these.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from accelerate import PartialState
from huggingface_hub import snapshot_download
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dflash.embedded import embedded_target_dir, load_embedded_target
from dflash.modeling import text_config_of

if TYPE_CHECKING:  # annotations only
    from dflash.config import TrainConfig

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


def target_location(name: str) -> str:
    """What `from_pretrained` reads for `config.target`: the embedded target's converted folder, a local
    folder or a hub id. A path that names no folder is a FileNotFoundError (not a hub lookup)."""
    if name == "embedded":
        return str(embedded_target_dir())
    path = Path(name).expanduser()
    if not path.is_dir() and (path.exists() or path.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1):
        raise FileNotFoundError(f"target={name}: no such model folder")  # a path, not a hub id
    return name


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Files up to 1 GiB are hashed whole; larger ones by a 64 KiB block every 16 MiB, with their head and tail.
_WHOLE_FILE, _SAMPLE_BYTES, _SAMPLE_EVERY = 1 << 30, 1 << 16, 1 << 24


def weights_fingerprint(name: str) -> str:
    """12 hex digits that change when the weights behind target `name` change, read from its files without
    loading them (so a dry run and the run agree): every weight file's name, size and bytes (a file over
    1 GiB: its head with the safetensors header, its tail and a 64 KiB block every 16 MiB, so a change
    confined to a few small tensors of a huge file can escape it). A retrained model saved to the same
    folder, another hub revision, another project's `./model` get another fingerprint. "unknown" when the
    files are not on this machine (a hub id not yet downloaded).

    The embedded target's folder once also held the GGUF reference logits (`embedded.GGUF_REFERENCE`), and
    they were hashed here like weights; `target_location` moves them out before this reads the folder, so
    that target's fingerprint changed once, and a corpus regenerated before is regenerated once more.
    Accepted rather than kept by special-casing the old file: the logits are not weights, and their bytes
    can depend on the converting CPU's float summation order, so the old key could differ between machines
    holding the same weights; the new one hashes the weights alone."""
    location = target_location(name)
    folder = Path(location).expanduser()
    if not folder.is_dir():
        try:  # a hub id: the local snapshot only, never a download here
            folder = Path(snapshot_download(location, local_files_only=True))
        except Exception:  # not cached (or the hub client's own errors): nothing to read
            return "unknown"
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.suffix in _WEIGHT_SUFFIXES and p.is_file()):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(folder)}:{size}".encode())
        with path.open("rb") as f:
            if size <= _WHOLE_FILE:
                while block := f.read(1 << 24):
                    digest.update(block)
                continue
            for offset in [*range(0, size, _SAMPLE_EVERY), size - _SAMPLE_BYTES]:
                f.seek(offset)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:12]


def _from_pretrained(name: str, load: Callable[[str], Any]) -> Any:
    """`load(location)` of `config.target`, transformers' OSError for a missing folder or an unreachable hub
    id turned into a one-line FileNotFoundError."""
    location = target_location(name)
    try:
        return load(location)
    except OSError as e:  # keep its first line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = "the model folder" if Path(location).expanduser().is_dir() else "not a local folder, and the hub"
        raise FileNotFoundError(f"target={name} could not be loaded ({where}: {reason})") from None


def load_target(name: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """(model, tokenizer) for "embedded" or any HF model id / local path."""
    if name == "embedded":
        return load_embedded_target(dtype=dtype)
    return _from_pretrained(name, lambda where: (AutoModelForCausalLM.from_pretrained(where, dtype=dtype),
                                                 AutoTokenizer.from_pretrained(where)))


def load_target_config(name: str) -> Any:
    """The HF config of `config.target` (no weights read)."""
    return _from_pretrained(name, AutoConfig.from_pretrained)


def target_positions(name: str) -> int | None:
    """The positions `config.target` was built for (its text config's `max_position_embeddings`; None when it
    names none): an engine refuses a longer `max_model_len`. No weights read."""
    return getattr(text_config_of(load_target_config(name)), "max_position_embeddings", None)


def load_tokenizer(name: str) -> Any:
    """The tokenizer of `config.target` (no weights read)."""
    return _from_pretrained(name, AutoTokenizer.from_pretrained)


def check_run_settings(config: TrainConfig, world_size: int, device: torch.device, dtype: torch.dtype) -> None:
    """Settings that this launch (its process count, device and compute dtype) cannot run, refused at start
    with the fix."""
    if config.param_dtype == "bfloat16" and dtype != torch.bfloat16:
        raise ValueError("param_dtype: bfloat16 needs dtype: bfloat16 (bf16 weights under an fp32 compute dtype)")
    if world_size > 1 and config.distributed == "fsdp2" and config.cuda_graph:
        raise ValueError("cuda_graph: true does not work with distributed: fsdp2 (FSDP2's per-layer "
                         "all-gathers and reduce-scatters are driven by host-side hooks); use "
                         "distributed: ddp or cuda_graph: false")
    if config.cuda_graph and device.type != "cuda":
        raise ValueError("cuda_graph: true needs a CUDA device")
    if config.fp8 and (device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)):
        raise ValueError("fp8: true needs a GPU with FP8 tensor cores (compute capability 8.9 or newer: L4, H100, "
                         "H200, B200); set fp8: false")
    tp = config.tensor_parallel.size
    if world_size % tp:
        raise ValueError(f"tensor_parallel.size={tp} needs a number of processes that is a multiple of it, and this "
                         f"launch has {world_size}: launch a multiple of {tp} processes (torchrun --nproc_per_node "
                         f"{tp} -m dflash train ...), or set tensor_parallel.size to a divisor of {world_size}")


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
