"""`draft.kind: dflash2` on 2 processes (`torch.distributed.run`, CPU, gloo), under DDP and under FSDP2, for
both `dflash2.selector_gold` values: two full steps (2 micro-batches each, clipped AdamW updates applied)
equal one process on the concatenated batch, with rank 0's rows nearly unsupervised (4 anchors against
16: a loss divided by a rank's own weight sum would differ); and a step makes no host-device sync.

One launch of tests/dist_worker.py (`dflash2`) runs every case (module fixture).
"""

from __future__ import annotations

import pytest
from dist_worker import (
    DFLASH2_RUNS,
    assert_two_ranks_equal_one,
    fixed_anchors,
    head_steps,
    head_trainer,
    launch_two_ranks,
    uneven_plan,
    use_anchors,
)

METRICS = ("loss", "selector_loss", "accuracy", "tau", "base_accuracy", "base_tau", "candidate_recall",
           "selector_accuracy", "supervised_tokens", "anchors_kept", "grad_norm")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    return launch_two_ranks("dflash2", tmp_path_factory.mktemp("dflash2") / "ranks.pt")


def test_the_plan_gives_the_ranks_uneven_anchor_counts():
    _, _, keep = uneven_plan()
    assert keep[:2].sum() * 4 == keep[2:].sum() == 16  # rank 0: 4 anchors, rank 1: 16


@pytest.mark.parametrize("mode, gold", DFLASH2_RUNS, ids=[f"{m}-{g}" for m, g in DFLASH2_RUNS])
def test_two_ranks_equal_one_process_on_the_concatenated_batch(ranks, monkeypatch, mode, gold):
    """Gradients of every update (every weight gets one: the convs' and the selector's too), the weights after
    both updates and the window's metrics (loss, selector loss, recall, the grad norm that clipping used)."""
    two = ranks[mode, gold]
    batch, anchors, keep = uneven_plan()
    use_anchors(fixed_anchors(anchors, keep, range(4)), monkeypatch.setattr)
    one_trainer = head_trainer("dflash2", mode, gold)  # one process: nothing to wrap or shard
    assert one_trainer.world_size == 1 and not one_trainer.fsdp
    one = head_steps(one_trainer, batch)
    assert_two_ranks_equal_one(two, one, METRICS)
    assert 0 < one["metrics"]["candidate_recall"] < 1  # some gold tokens fall outside the top-K
    assert one["metrics"]["selector_loss"] > 0


def test_the_selector_gold_changes_what_is_trained(ranks):
    """strict and insert are two different losses here (some gold tokens miss the top-K), not one case twice."""
    for mode in ("ddp", "fsdp2"):
        strict, insert = (ranks[mode, gold]["metrics"]["selector_loss"] for gold in ("strict", "insert"))
        assert insert > strict * 1.5, (mode, strict, insert)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_dflash2_step_makes_no_sync_on_either_rank(ranks, mode):
    for gold in ("strict", "insert"):
        assert ranks[mode, gold]["sync_findings"] == [[], []], (mode, gold)
