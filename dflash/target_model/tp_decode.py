"""Speculative decoding against a tensor-parallel target: the ranks of a TP group decode in lockstep.

`dflash.evaluation.speculative` decodes with an HF causal LM: `model(input_ids, past_key_values, use_cache,
logits_to_keep)`, forward hooks on `model.get_decoder().layers` for the target features, and the
embedding and LM head for the draft. `LockstepTarget` gives a `TensorParallelTarget` that interface
on the group's first rank (the leader), which runs the whole evaluation unchanged: the draft, the
plain greedy baseline, the lossless check and the report. Each target forward the leader runs is
announced to the other ranks of its group (a header and the input ids: two broadcasts on the group),
and every rank runs the sharded forward on the same ids, with its own KV cache of its own KV heads
(`LockstepTarget.follow`); the row-parallel all-reduces make each layer's output whole on every rank.
Only the leader computes logits (the LM head is whole on every rank) and draft tokens. A follower's
cache is cut to the leader's length when the next forward is announced, so the leader's
`crop_cache` needs no message of its own; `release` ends the followers' loop.

`decode_session` gives each rank its role; `dflash eval` under a launcher shards the target over the
launched processes (`eval_tensor_parallel`, `load_sharded_target`, `decode_report`). Evaluation is a
sync point by design (the followers read every header to the host); nothing here runs inside a
training step.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dflash.modeling import cache_kwarg, text_config_of
from dflash.runtime import init_distributed
from dflash.target_model.loading import load_target_config, load_tokenizer, target_location
from dflash.target_model.tensor_parallel import TensorParallelTarget, check_tp_support, tp_mesh
from dflash.target_model.tp_group import GroupBatchTarget
from dflash.target_model.tp_overlap import run_trunk

_STOP, _FORWARD = 0, 1
_NO_CACHE, _NEW_CACHE, _SAME_CACHE = 0, 1, 2  # the header's cache modes


class ShardKVCache:
    """This rank's keys / values `[1, kv_heads / tp, T, head_dim]` per layer, grown by concatenation: the
    `update` HF attention modules call (5.17 and 5.24 signatures), and `get_seq_length` / `crop` as
    `dflash.evaluation.speculative.crop_cache` uses them."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self.keys:
            key = torch.cat([self.keys[layer_idx], key], dim=-2)
            value = torch.cat([self.values[layer_idx], value], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = key, value
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return next(iter(self.keys.values())).shape[-2] if self.keys else 0

    def crop(self, count: int) -> None:
        """Remove `-count` positions (a negative count, what `crop_cache` passes), or keep `count`."""
        self.keep(self.get_seq_length() + count if count < 0 else count)

    def keep(self, length: int) -> None:
        for store in (self.keys, self.values):
            for index, tensor in store.items():
                store[index] = tensor[..., :length, :]


class _Output(dict):
    """What `dflash.evaluation.speculative` reads from a forward: `.logits` and `["past_key_values"]`."""

    @property
    def logits(self) -> torch.Tensor:
        return self["logits"]


class _Taps(nn.Module):
    """`get_decoder()` of a `LockstepTarget`: one identity module per decoder layer, called with that
    layer's output, so forward hooks on `layers[i]` (`dflash.target_model.frozen.LayerCapture`) see the features."""

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Identity() for _ in range(num_layers))


class LockstepTarget(nn.Module):
    """An HF-causal-LM-shaped view of a `TensorParallelTarget` for batch-1 decoding, every rank of the
    group in lockstep (module doc). The leader (group rank 0) calls it like the HF model; the other
    ranks call `follow()` at the same time, and the leader's `release()` ends their loop."""

    def __init__(self, target: TensorParallelTarget) -> None:
        super().__init__()
        self.target = target
        self.group = target.group
        self.leader = dist.get_global_rank(self.group, 0)
        self.is_leader = target.tp_rank == 0
        self.taps = _Taps(target.num_layers)
        decoder = target.model.get_decoder()
        self._cache_kwarg = cache_kwarg(decoder.layers[0].self_attn.forward)
        self._sdpa = decoder.config._attn_implementation == "sdpa"  # flash kernels align causal bottom-right
        self._cache: ShardKVCache | None = None  # a follower's own cache

    # ---- what dflash.evaluation.speculative uses of an HF causal LM ----

    @property
    def config(self) -> Any:
        return self.target.model.config

    @property
    def generation_config(self) -> Any:
        return getattr(self.target.model, "generation_config", None)

    @property
    def name_or_path(self) -> str:
        return getattr(self.target.model, "name_or_path", "")

    @property
    def device(self) -> torch.device:
        return self.target.embed_weight.device

    def get_decoder(self) -> nn.Module:
        return self.taps

    def get_input_embeddings(self) -> nn.Module:
        return self.target.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.target.model.get_output_embeddings()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, past_key_values: ShardKVCache | None = None, use_cache: bool = False,
                logits_to_keep: int = 0, **kwargs: Any) -> _Output:
        """Logits `[1, T, V]` (the last `logits_to_keep` positions when > 0) of `input_ids` `[1, T]`
        after the cache's positions; the leader's call, announced to the group first."""
        if not self.is_leader:
            raise RuntimeError("only the group's first rank calls a LockstepTarget; the others call follow()")
        cache = past_key_values
        mode = _SAME_CACHE if cache is not None else _NEW_CACHE if use_cache else _NO_CACHE
        if mode == _NEW_CACHE:
            cache = ShardKVCache()
        past = cache.get_seq_length() if cache is not None else 0
        self._announce([_FORWARD, mode, past, input_ids.shape[1]])
        ids = input_ids.to(torch.long).contiguous()
        dist.broadcast(ids, src=self.leader, group=self.group)
        logits = self._run(ids, cache, logits=True, keep=logits_to_keep)
        return _Output(logits=logits, past_key_values=cache)

    # ---- the lockstep protocol ----

    def _announce(self, header: list[int]) -> None:
        dist.broadcast(torch.tensor(header, dtype=torch.long).to(self.device), src=self.leader, group=self.group)

    def release(self) -> None:
        """The leader's last message: the followers leave `follow()`."""
        if self.is_leader and dist.get_world_size(self.group) > 1:
            self._announce([_STOP, 0, 0, 0])

    @torch.inference_mode()
    def follow(self) -> None:
        """A follower's loop: run every forward the leader announces, until it releases the group."""
        while True:
            header = torch.empty(4, dtype=torch.long, device=self.device)
            dist.broadcast(header, src=self.leader, group=self.group)
            op, mode, past, length = header.tolist()  # a host read: evaluation is a sync point
            if op == _STOP:
                return
            ids = torch.empty((1, length), dtype=torch.long, device=self.device)
            dist.broadcast(ids, src=self.leader, group=self.group)
            if mode == _NEW_CACHE:
                self._cache = ShardKVCache()
            elif mode == _SAME_CACHE:
                self._cache.keep(past)  # the leader cropped its own after the last forward
            self._run(ids, self._cache if mode != _NO_CACHE else None, logits=False)

    def _run(self, ids: torch.Tensor, cache: ShardKVCache | None, *, logits: bool, keep: int = 0) -> torch.Tensor | None:
        """The sharded forward of every layer on `ids` `[1, T]` at positions past..past+T-1 (all-reduced
        in the group), each layer's output through its tap; the logits on the leader."""
        decoder = self.target.model.get_decoder()
        past, length = (cache.get_seq_length() if cache is not None else 0), ids.shape[1]
        hidden = decoder.embed_tokens(ids)
        rotary = decoder.rotary_emb(hidden, torch.arange(past, past + length, device=ids.device).unsqueeze(0))
        attention: dict[str, Any] = {self._cache_kwarg: cache} if cache is not None else {}
        if past and length > 1 and self._sdpa:  # new position i sees the cache and new positions <= i
            visible = torch.ones(length, past + length, dtype=torch.bool, device=ids.device).tril(past)
            attention["attention_mask"] = visible[None, None]
        finals = run_trunk(decoder.layers, hidden, rotary, self.group, "unsplit",
                           lambda index, _, h: self.taps.layers[index](h), attention)
        if not logits:
            return None
        last = decoder.norm(finals[0][1])
        last = last[:, -keep:] if keep else last
        return last @ self.target.lm_head_weight.t()


def tensor_parallel_target(target: nn.Module) -> TensorParallelTarget | None:
    """The `TensorParallelTarget` behind a training target (a `GroupBatchTarget` or itself), else None."""
    if isinstance(target, GroupBatchTarget):
        return target.target
    return target if isinstance(target, TensorParallelTarget) else None


@contextlib.contextmanager
def decode_session(target: nn.Module, rank: int) -> Iterator[nn.Module | None]:
    """The model this rank runs the speculative evaluation with, or None where it does not report.

    A replicated target (`FrozenTarget`): its HF model on rank 0, None on the others. A tensor-parallel
    one: on rank 0 a `LockstepTarget`, released to its group when the block ends (also when the decode
    raises); the other ranks of rank 0's TP group follow its decode on entering the block, then get
    None; every other rank gets None at once (its group has nothing to decode)."""
    tp = tensor_parallel_target(target)
    if tp is None:
        yield target.model if rank == 0 else None
        return
    lockstep = LockstepTarget(tp)
    if rank == 0:
        try:
            yield lockstep
        finally:
            lockstep.release()
        return
    if lockstep.leader == 0:
        lockstep.follow()
    yield None


# ---- `dflash eval` with a sharded target ----


def eval_tensor_parallel(requested: int | None = None) -> int:
    """`dflash eval`'s tensor-parallel size: the one asked for, else every launched process (`WORLD_SIZE`
    under torchrun / accelerate launch; 1 in a single process). Only rank 0 reports, so a launch of
    several processes serves to shard the target."""
    return requested or int(os.environ.get("WORLD_SIZE", "1"))


def load_sharded_target(name: str, layer_ids: list[int], tp: int, *, device: torch.device,
                        dtype: torch.dtype) -> tuple[TensorParallelTarget, Any]:
    """(this rank's `TensorParallelTarget` of `config.target` over groups of `tp` ranks, its tokenizer):
    the process group initialised, heads checked against `tp` before any weight is read, only this
    rank's shards read (`TensorParallelTarget.from_pretrained`)."""
    init_distributed()
    config = load_target_config(name)
    check_tp_support(text_config_of(config), tp)
    target = TensorParallelTarget.from_pretrained(target_location(name), layer_ids, tp_mesh(tp, device.type),
                                                  dtype=dtype, device=device, schedule="unsplit")
    return target, load_tokenizer(name)


def decode_report(target: nn.Module, run: Callable[[nn.Module], dict[str, Any]]) -> dict[str, Any]:
    """`run(model)` on rank 0 with a `LockstepTarget` of `target` (rank 0's TP group following it), and
    its report sent to every rank (so every process of a launch returns the same report)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    with decode_session(target, rank) as model:
        report = run(model) if model is not None else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [report]
        dist.broadcast_object_list(box, src=0)
        report = box[0]
    return report
