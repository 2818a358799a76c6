"""The group batch of a tensor-parallel target: one TP forward over the group's micro-batches.

A TP group runs the sharded target (`dflash.target_model.tensor_parallel.TensorParallelTarget`) once on the
concatenation of its ranks' micro-batches, gathered on the device, and each rank keeps the features
of its own rows; the draft stays data-parallel over every rank with no repeated draft work.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash.target_model.frozen import SharedHead, refuse_packed_rows
from dflash.target_model.tensor_parallel import TensorParallelTarget
from dflash.target_model.tp_overlap import gather_group_batch, own_rows


def group_features(target: TensorParallelTarget, input_ids: torch.Tensor, *, greedy: bool = False,
                   chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(features `[b, S, K*H]`, greedy labels `[b, S]` or None) of this rank's own micro-batch
    `input_ids` `[b, S]`, from one TP forward over the whole group batch `[tp * b, S]`: only the own
    rows' features are kept, and only their logits computed (the LM head is whole on every rank)."""
    rows = own_rows(input_ids.shape[0], target.group)
    everything = gather_group_batch(input_ids, target.group)
    if greedy:
        return target.features_and_greedy(everything, chunk, rows=rows)
    return target(everything, rows=rows), None


class GroupBatchTarget(SharedHead, nn.Module):
    """`FrozenTarget`'s interface on this rank's own micro-batch, for a `TensorParallelTarget`: each
    call gathers the group's micro-batches, runs the sharded target once on them, and returns this
    rank's rows. The draft then stays data-parallel over every rank with no repeated draft work.
    Every rank of the group must call it, in the same order, with micro-batches of one row count.

    `length`: every micro-batch shorter than it is right-padded to it before the gather, and the
    results are cut back to its own length, so the ranks of a group (whose collators pad each batch
    to the bucket of its own longest row) gather one shape with no host-device sync and no
    agreement between ranks; causal attention keeps every real position exact. None: the callers
    guarantee equal lengths themselves."""

    def __init__(self, target: TensorParallelTarget, length: int | None = None) -> None:
        super().__init__()
        self.target = target
        self.length = length

    def _padded(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids` `[b, S]` right-padded (token 0) to `[b, length]` when shorter (a host-known shape)."""
        seq = input_ids.shape[1]
        if self.length is None or seq >= self.length:
            return input_ids
        return nn.functional.pad(input_ids, (0, self.length - seq))

    def train(self, mode: bool = True) -> GroupBatchTarget:
        return super().train(False)

    @property
    def model(self) -> nn.Module:  # SharedHead reads the config, embedding and head off it
        return self.target.model

    @property
    def layer_ids(self) -> list[int]:
        return self.target.layer_ids

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Features `[b, S, K*H]` of this rank's `input_ids` `[b, S]` (whole rows only)."""
        refuse_packed_rows(position_ids, "the tensor-parallel target")
        seq = input_ids.shape[1]
        return group_features(self.target, self._padded(input_ids))[0][:, :seq]

    @torch.no_grad()
    def features_and_greedy(self, input_ids: torch.Tensor, chunk: int = 1024, *,
                            position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Features `[b, S, K*H]` and greedy labels `[b, S]` of this rank's `input_ids` `[b, S]`."""
        refuse_packed_rows(position_ids, "the tensor-parallel target")
        seq = input_ids.shape[1]
        feats, greedy = group_features(self.target, self._padded(input_ids), greedy=True, chunk=chunk)
        return feats[:, :seq], greedy[:, :seq]

    @torch.no_grad()
    def features_and_last_hidden(self, input_ids: torch.Tensor,
                                 position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Features `[b, S, K*H]` and the final-normed last hidden state `[b, S, H]` of this rank's `input_ids`
        `[b, S]`, from one TP forward over the group batch (DSpark's L1 term reads it)."""
        refuse_packed_rows(position_ids, "the tensor-parallel target")
        seq = input_ids.shape[1]
        everything = gather_group_batch(self._padded(input_ids), self.target.group)
        feats, last = self.target.features_and_last_hidden(everything, own_rows(input_ids.shape[0], self.target.group))
        return feats[:, :seq], last[:, :seq]

    features = forward
