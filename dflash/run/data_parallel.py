"""How the draft is spread over the processes of a launch: DDP (replicated, gradients all-reduced in
backward) or FSDP2 (`fully_shard`: parameters, gradients and AdamW state sharded on dim 0, each
group's weights gathered only around its forward and backward). The target is not touched here.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel


class DataParallelDraft:
    """The draft as the step runs it across `world_size` ranks (`mode`: "ddp" or "fsdp2").

    `call` is the module the objective runs (DDP's wrapper, or the sharded draft itself); `draft` keeps
    its parameter names either way. Every rank starts from rank 0's weights.
    """

    def __init__(self, draft: nn.Module, *, mode: str, world_size: int, device: torch.device) -> None:
        self.draft = draft
        self.fsdp = world_size > 1 and mode == "fsdp2"
        self.ddp: DistributedDataParallel | None = None
        self.call: nn.Module = draft
        if self.fsdp:
            self._shard(world_size, device)
        elif world_size > 1:  # DDP broadcasts rank 0's weights in its constructor
            self.ddp = self.call = DistributedDataParallel(draft, device_ids=[device.index]
                                                           if device.type == "cuda" else None)

    def _shard(self, world_size: int, device: torch.device) -> None:
        """Every decoder layer, then the draft itself (fc, norms, a Domino head), becomes one `fully_shard`
        group over a 1-D mesh of all ranks."""
        with torch.no_grad():
            for p in self.draft.parameters():
                dist.broadcast(p, src=0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        mesh = init_device_mesh(device.type, (world_size,))
        for layer in self.draft.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.draft, mesh=mesh)

    def gradient_sync(self, *, last: bool) -> contextlib.AbstractContextManager:
        """Gradients cross ranks only in the last micro-batch's backward; earlier ones accumulate locally
        (DDP's no_sync, FSDP2's requires_gradient_sync flag: host-side state, no device work)."""
        if self.fsdp:
            self.draft.set_requires_gradient_sync(last)
        elif self.ddp is not None and not last:
            return self.ddp.no_sync()
        return contextlib.nullcontext()
