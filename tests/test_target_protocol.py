"""The four targets an objective can hold implement one declared interface (`dflash.target_model.Target`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import make_tiny_target, random_batch

from dflash.target_model import FrozenTarget, Target, hf_model_of
from dflash.target_model.offline import OfflineTarget
from dflash.target_model.tensor_parallel import TensorParallelTarget
from dflash.target_model.tp_group import GroupBatchTarget


def test_every_target_implements_the_declared_protocol_and_computes_the_same_features():
    model = make_tiny_target()
    frozen, offline = FrozenTarget(model, [1, 2]), OfflineTarget.from_model(model, [1, 2])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = TensorParallelTarget(make_tiny_target(), [1, 2], dist.group.WORLD)
        group = GroupBatchTarget(sharded)
        assert all(isinstance(t, Target) for t in (frozen, offline, sharded, group))
        ids = random_batch(batch=2, seq=16)["input_ids"]
        with torch.no_grad():
            expected = frozen(ids)
            for target in (sharded, group):
                torch.testing.assert_close(target(ids), expected)
                assert torch.equal(target.lm_head_weight, frozen.lm_head_weight)
        assert hf_model_of(frozen) is model and hf_model_of(model) is model and hf_model_of(sharded) is sharded.model
    finally:
        dist.destroy_process_group()


def test_an_object_without_the_features_call_is_not_a_target():
    class HeadOnly:
        layer_ids, text_config, hidden_size, lm_head_weight, vocab_size = [1], None, 4, None, 8

        def embed(self, ids):
            return ids

        def __call__(self, input_ids):
            return input_ids

    assert not isinstance(HeadOnly(), Target)
