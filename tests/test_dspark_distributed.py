"""`draft.kind: dspark` on 2 processes (`torch.distributed.run`, CPU, gloo), under DDP and under FSDP2: two full
steps (2 micro-batches each, clipped AdamW updates applied) equal one process on the concatenated batch, with
rank 0's rows nearly unsupervised (6 scored slots against 58: a CE, L1 or confidence term divided by a rank's
or a micro-batch's own weight sum would differ), every weight trained (the Markov head's two tables and the
confidence head's projection too); and a step makes no host-device sync.

One launch of tests/dist_worker.py (`dspark`) runs every case (module fixture); tests/test_dflash2_distributed.py
is the same for DFlash 2.
"""

from __future__ import annotations

import pytest
from dist_worker import (
    DSPARK_RUNS,
    assert_two_ranks_equal_one,
    fixed_anchors,
    head_config,
    head_steps,
    head_trainer,
    launch_two_ranks,
    uneven_plan,
    use_anchors,
)

from dflash.kinds.dspark import DSparkDraftModel, DSparkHeadConfig, dspark_weight_names
from dflash.kinds.dspark_objective import DSparkObjective, dspark_block_targets

METRICS = ("loss", "dspark_loss", "l1_loss", "confidence_loss", "accuracy", "tau", "base_accuracy", "base_tau",
           "mean_confidence", "mean_acceptance", "per_position_accuracy", "supervised_tokens", "anchors_kept",
           "grad_norm")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    return launch_two_ranks("dspark", tmp_path_factory.mktemp("dspark") / "ranks.pt")


def test_the_plan_gives_the_ranks_uneven_weight_sums():
    """DSpark's own targets (slot k scores a + k + 1, validity cut at the first invalid label, its decay)."""
    batch, anchors, keep = uneven_plan()
    config = head_config("dspark", "ddp", "vanilla")
    targets = dspark_block_targets(batch["input_ids"], batch["loss_mask"], anchors, keep, config.draft.block_size,
                                   config.dspark.loss_decay_gamma)
    assert targets.valid[:2, :, 1:].sum() == 6 and targets.valid[2:, :, 1:].sum() == 58
    assert 6 * targets.weights[:2].sum() < targets.weights[2:].sum()


@pytest.mark.parametrize("mode, variant", DSPARK_RUNS, ids=[f"{m}-{v}" for m, v in DSPARK_RUNS])
def test_two_ranks_equal_one_process_on_the_concatenated_batch(ranks, monkeypatch, mode, variant):
    """Gradients of every update (every weight gets one: markov_head.markov_w1 / markov_w2, confidence_head.proj
    too), the weights after both updates and the window's metrics (the mixed loss and each term, the Markov and
    backbone-only accuracy and tau, the confidence calibration, the grad norm that clipping used)."""
    two = ranks[mode, variant]
    batch, anchors, keep = uneven_plan()
    use_anchors(fixed_anchors(anchors, keep, range(4)), monkeypatch.setattr)
    one_trainer = head_trainer("dspark", mode, variant)  # one process: nothing to wrap or shard
    assert one_trainer.world_size == 1 and not one_trainer.fsdp
    assert isinstance(one_trainer.objective, DSparkObjective) and isinstance(one_trainer.draft, DSparkDraftModel)
    one = head_steps(one_trainer, batch)
    heads = dspark_weight_names(DSparkHeadConfig.from_draft_config(one_trainer.draft.config))
    assert len(heads) == 4 and heads <= one["grads"][0].keys()  # both Markov tables, the confidence weight and bias
    assert_two_ranks_equal_one(two, one, METRICS)
    metrics = one["metrics"]
    assert metrics["supervised_tokens"] == 2 * (6 + 58)  # the fixed plan was trained (its slots, twice), not a drawn one
    assert metrics["dspark_loss"] > metrics["loss"] * 0.1 > 0 and metrics["l1_loss"] > 0
    assert metrics["confidence_loss"] > 0 and 0 < metrics["mean_acceptance"] < 1 and 0 < metrics["mean_confidence"] < 1
    assert len(metrics["per_position_accuracy"]) == one_trainer.block_size  # every slot proposes


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_dspark_step_makes_no_sync_on_either_rank(ranks, mode):
    for m, variant in DSPARK_RUNS:
        if m == mode:
            assert ranks[mode, variant]["sync_findings"] == [[], []], (mode, variant)
