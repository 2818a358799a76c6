"""The tensor-parallel trunk's forward and its communication schedule (`tp_overlap`).

Each decoder layer of a sharded trunk (`dflash.target_model.tensor_parallel`) has two row-parallel outputs: the
attention output (this rank's heads through its columns of `o_proj`) and the MLP output (its slice
of the intermediate through its columns of `down_proj`). Each is a partial sum `[b, S, H]` that the
TP group all-reduces before the residual add. Schedules (`SCHEDULES`):

* ``"unsplit"``  the whole batch, each all-reduce blocking (plain tensor parallelism);
* ``"split"``    the batch in two halves A / B, stages interleaved as below, all-reduces blocking
                 (the same ops in the same order as "overlap": for benchmarking);
* ``"overlap"``  the same interleaving with every all-reduce issued asynchronously and waited only
                 right before its result is needed (the Domino TP technique, arXiv 2409.15241;
                 nanotron PRs #292 / #286).

The interleaving, per layer l (``AR`` = all-reduce issued, ``wait`` = its result consumed)::

    wait mlp(l-1, A)  attn(l, A)  AR      <- hides behind attn(l, B)
    wait mlp(l-1, B)  attn(l, B)  AR      <- hides behind mlp(l, A)
    wait attn(l, A)   mlp(l, A)   AR      <- hides behind mlp(l, B)
    wait attn(l, B)   mlp(l, B)   AR      <- hides behind attn(l + 1, A), across the layer boundary

so every all-reduce but the very last has the other half's compute issued after it and before its
wait. Waits are `Work.wait()`: on NCCL a stream wait (the compute stream waits for the NCCL stream;
the host does not block), on gloo the host waits for the collective's thread. Nothing reads a device
value on the host. Odd and size-1 batches run unsplit (equal halves keep one shape per stage).

`gather_group_batch` and `own_rows` are the group batch's collectives (used by `dflash.target_model.tp_group`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

SCHEDULES = ("unsplit", "split", "overlap")
# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; 2.11 has only the former.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Profiler range names (bench_tp.py reads them): issuing a row-parallel all-reduce, and waiting on one.
ALL_REDUCE_RANGE = "tp_all_reduce"
WAIT_RANGE = "tp_wait"
# Buffer name, on a row-parallel nn.Linear, of its bias: added once after the all-reduce (a bias inside
# the linear would be summed tp times).
REDUCED_BIAS = "reduced_bias"


def schedule_for(tp_overlap: bool) -> str:
    """The schedule a `tp_overlap` setting means: "overlap" on, plain "unsplit" tensor parallelism off."""
    return "overlap" if tp_overlap else "unsplit"


def batch_halves(batch: int, schedule: str) -> list[tuple[int, int]]:
    """Row ranges `[start, stop)` the schedule runs as separate streams of work: two equal halves
    under "split" / "overlap" for an even batch of at least 2, else the whole batch."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown tensor-parallel schedule {schedule!r}; choose one of {SCHEDULES}")
    if schedule == "unsplit" or batch < 2 or batch % 2:
        return [(0, batch)]
    return [(0, batch // 2), (batch // 2, batch)]


def attention_partial(layer: nn.Module, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                      **attention: Any) -> torch.Tensor:
    """This rank's partial sum `[b, S, H]` of layer's attention output, from the full residual stream
    `hidden` `[b, S, H]`: input norm, its q/k/v heads (per-head q_norm / k_norm where the model has
    them), causal attention with no mask (right padding is exact for every real token), its o_proj
    columns. The model's own attention module runs it, on its sharded projections. `attention`: extra
    arguments of the attention module (a mask and a KV cache, for decoding: `dflash.target_model.tp_decode`)."""
    normed = layer.input_layernorm(hidden)
    kwargs = {"attention_mask": None, **attention}
    return layer.self_attn(hidden_states=normed, position_embeddings=position_embeddings, **kwargs)[0]


def mlp_partial(layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """This rank's partial sum `[b, S, H]` of layer's MLP output (its gate/up rows, its down columns)."""
    return layer.mlp(layer.post_attention_layernorm(hidden))


@dataclass
class _Half:
    """One stream of rows: its residual stream and the all-reduce it has in flight."""

    start: int
    hidden: torch.Tensor  # [b, S, H] residual stream, complete up to the pending partial
    partial: torch.Tensor | None = None  # [b, S, H] being all-reduced in place
    bias: torch.Tensor | None = None  # the row-parallel bias to add once it is reduced
    work: dist.Work | None = None  # async handle ("overlap"), None when the reduce was blocking
    completes_layer: int | None = None  # the layer whose output the pending partial completes


class _Reducer:
    """Issues and waits the row-parallel all-reduces of one group (nothing for a group of one)."""

    def __init__(self, group: dist.ProcessGroup | None, asynchronous: bool) -> None:
        self.group = group
        self.active = group is not None and dist.get_world_size(group) > 1
        self.asynchronous = asynchronous

    def issue(self, partial: torch.Tensor) -> dist.Work | None:
        if not self.active:
            return None
        with record_function(ALL_REDUCE_RANGE):
            work = dist.all_reduce(partial, group=self.group, async_op=self.asynchronous)
        return work if self.asynchronous else None

    @staticmethod
    def wait(work: dist.Work | None) -> None:
        if work is not None:
            with record_function(WAIT_RANGE):
                work.wait()


def _finish(half: _Half, reducer: _Reducer, on_layer_output: Callable[[int, int, torch.Tensor], None]) -> None:
    """Wait for the half's pending all-reduce and add it (and its bias) to the residual stream."""
    if half.partial is None:
        return
    reducer.wait(half.work)
    update = half.partial if half.bias is None else half.partial + half.bias
    half.hidden = half.hidden + update
    if half.completes_layer is not None:
        on_layer_output(half.completes_layer, half.start, half.hidden)
    half.partial = half.bias = half.work = half.completes_layer = None


def run_trunk(layers: Sequence[nn.Module], hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
              group: dist.ProcessGroup | None, schedule: str, on_layer_output: Callable[[int, int, torch.Tensor], None],
              attention: dict[str, Any] | None = None) -> list[tuple[int, torch.Tensor]]:
    """Run sharded decoder `layers` on the replicated residual stream `hidden` `[B, S, H]` (the
    embedded input, identical on every rank of `group`) under `schedule`.

    `on_layer_output(i, start, h)` is called with layer i's output `h` `[b, S, H]` for rows
    `[start, start + b)` as soon as it is complete (the caller keeps the rows and layers it needs).
    Returns `(start, h)` of each half after the last layer (pre final norm), in row order.
    `position_embeddings`: the model's rotary (cos, sin), `[1, S, head_dim]` each, shared by all rows.
    `attention`: extra arguments for every layer's attention module (`attention_partial`).
    """
    reducer = _Reducer(group, asynchronous=schedule == "overlap")
    ranges = batch_halves(hidden.shape[0], schedule)
    halves = [_Half(start, hidden[start:stop]) for start, stop in ranges]
    for index, layer in enumerate(layers):
        for stage in ("attn", "mlp"):
            for half in halves:
                _finish(half, reducer, on_layer_output)
                if stage == "attn":
                    half.partial = attention_partial(layer, half.hidden, position_embeddings, **(attention or {}))
                    half.bias = getattr(layer.self_attn.o_proj, REDUCED_BIAS, None)
                else:
                    half.partial = mlp_partial(layer, half.hidden)
                    half.bias = getattr(layer.mlp.down_proj, REDUCED_BIAS, None)
                    half.completes_layer = index
                half.work = reducer.issue(half.partial)
    for half in halves:
        _finish(half, reducer, on_layer_output)
    return [(half.start, half.hidden) for half in halves]


# ---- the group batch: the TP group runs the target once on its ranks' concatenated micro-batches ----


def gather_group_batch(input_ids: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`[tp * b, S]`: every group rank's `input_ids` `[b, S]` concatenated in group-rank order (one
    device collective, no host read). Every rank's micro-batch must have the same shape."""
    tp = dist.get_world_size(group)
    if tp == 1:
        return input_ids
    out = input_ids.new_empty((tp * input_ids.shape[0], *input_ids.shape[1:]))
    _ALL_GATHER(out, input_ids.contiguous(), group=group)
    return out


def own_rows(batch: int, group: dist.ProcessGroup) -> slice:
    """This rank's rows of the gathered group batch, for a micro-batch of `batch` rows."""
    rank = dist.get_rank(group)
    return slice(rank * batch, (rank + 1) * batch)
