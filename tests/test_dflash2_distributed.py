"""`draft.kind: dflash2` on 2 processes (`torch.distributed.run`, CPU, gloo), under DDP and under FSDP2, for
both `dflash2.selector_gold` values: two full steps (2 micro-batches each, clipped AdamW updates applied)
equal one process on the concatenated batch, with rank 0's rows nearly unsupervised (4 anchors against
16: a loss divided by a rank's own weight sum would differ); and a step makes no host-device sync.

One launch of tests/dist_worker.py (`dflash2`) runs every case (module fixture).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_worker import DFLASH2_RUNS, DFLASH2_STEPS, dflash2_plan, dflash2_steps, dflash2_trainer, fixed_anchors

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("loss", "selector_loss", "accuracy", "tau", "base_accuracy", "base_tau", "candidate_recall",
           "selector_accuracy", "supervised_tokens", "anchors_kept", "grad_norm")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("dflash2") / "ranks.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "tests/dist_worker.py", str(out), "dflash2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out)


def test_the_plan_gives_the_ranks_uneven_anchor_counts():
    _, _, keep = dflash2_plan()
    assert keep[:2].sum() * 4 == keep[2:].sum() == 16  # rank 0: 4 anchors, rank 1: 16


@pytest.mark.parametrize("mode, gold", DFLASH2_RUNS, ids=[f"{m}-{g}" for m, g in DFLASH2_RUNS])
def test_two_ranks_equal_one_process_on_the_concatenated_batch(ranks, monkeypatch, mode, gold):
    """Gradients of every update (every weight gets one: the convs' and the selector's too), the weights after
    both updates and the window's metrics (loss, selector loss, recall, the grad norm that clipping used)."""
    two = ranks[mode, gold]
    batch, anchors, keep = dflash2_plan()
    monkeypatch.setattr("dflash.objective.sample_anchors", fixed_anchors(anchors, keep, range(4)))
    one_trainer = dflash2_trainer(mode, gold)  # one process: nothing to wrap or shard
    assert one_trainer.world_size == 1 and not one_trainer.fsdp
    one = dflash2_steps(one_trainer, batch)
    for name, p in one["init"].items():
        assert torch.equal(two["init"][name], p), f"{name}: the ranks did not start from the same weights"
    assert len(two["grads"]) == len(one["grads"]) == DFLASH2_STEPS
    for step, (ranked, single) in enumerate(zip(two["grads"], one["grads"], strict=True)):
        for name, g in single.items():
            top = g.abs().max()
            assert top > 0, f"step {step}: {name} got no gradient"
            # fp32 sums in another order, amplified by AdamW's first update (nearly sign(g) where g is ~0)
            torch.testing.assert_close(ranked[name], g, rtol=1e-4, atol=1e-5 * top.item(),
                                       msg=lambda m, at=f"step {step}: {name}": f"{at}: {m}")
    for name, p in one["updated"].items():
        assert not torch.equal(p, one["init"][name]), f"{name} was not updated"
        torch.testing.assert_close(two["updated"][name], p, rtol=1e-4, atol=1e-5, msg=lambda m, at=name: f"{at}: {m}")
    for key in METRICS:
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key
    assert one["metrics"]["grad_norm"] > 1.0  # clipping (max_grad_norm 1) was active
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
