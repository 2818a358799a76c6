"""Every draft kind with heads of its own (`domino`, `dflash2`, `dspark`: tests/dist_worker.py's HEAD_VARIANTS) on
2 processes (`torch.distributed.run`, CPU, gloo), under DDP and under FSDP2, for each of its variants (Domino: without
and with scheduled sampling; DFlash 2: both `dflash2.selector_gold`s): two full steps (2 micro-batches each, clipped
AdamW updates applied) equal one process on the concatenated batch, with rank 0's rows nearly unsupervised (6 scored
slots against 45, DSpark's layout 58: a loss term divided by a rank's or a micro-batch's own weight sum would
differ), every weight trained (the kind's head weights too: Domino's GRU and embedding projection, DFlash 2's convs
and selector, DSpark's Markov tables and confidence projection); the variants train different things; and a step
makes no host-device sync on either rank.

One test per behaviour, parametrized over the kind (ids start with the kind's name); what differs between the kinds
is data (`KIND_CASES`: the metrics each reports, the plan's scored slots, its own checks). One launch of
tests/dist_worker.py per kind runs every (mode, variant) case of it (the module fixture `ranks`, on first use).
Plain DFlash under DDP and FSDP2 is tests/test_distributed.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

import pytest
import torch
from dist_worker import (
    HEAD_VARIANTS,
    assert_two_ranks_equal_one,
    fixed_anchors,
    head_runs,
    head_steps,
    head_trainer,
    launch_two_ranks,
    uneven_plan,
    use_anchors,
)

from dflash.kinds.registry import kind_named

# DFlash's window metrics, which every kind reports as DFlash does
COMMON_METRICS = ("loss", "accuracy", "tau", "supervised_tokens", "anchors_kept", "grad_norm")


def _domino_checks(metrics: dict) -> None:
    assert 0 < metrics["lambda"] < 1 and metrics["base_loss"] > 0  # both CE terms trained (the head and the base)


def _dflash2_checks(metrics: dict) -> None:
    assert 0 < metrics["candidate_recall"] < 1  # some gold tokens fall outside the top-K
    assert metrics["selector_loss"] > 0


def _dspark_checks(metrics: dict) -> None:
    assert metrics["dspark_loss"] > metrics["loss"] * 0.1 > 0 and metrics["l1_loss"] > 0
    assert metrics["confidence_loss"] > 0 and 0 < metrics["mean_acceptance"] < 1 and 0 < metrics["mean_confidence"] < 1


@dataclass(frozen=True)
class KindCase:
    metrics: tuple[str, ...]  # the kind's own window metrics, beside COMMON_METRICS: two ranks report them as one
    scored: tuple[int, int]  # the slots `uneven_plan` scores on rank 0 and on rank 1 (the kind's own targets)
    weight_ratio: int  # rank 1's weight sum is more than this many times rank 0's
    head_weights: int  # how many weights the kind adds to a DFlash draft (each one gets a gradient)
    checks: Callable[[dict], None]  # the kind's own expectations of one process's metrics
    by_micro_batch: tuple[str, ...] = ()  # variants whose one-process rows go in BY_MICRO_BATCH order


KIND_CASES = {
    "domino": KindCase(("base_loss", "base_accuracy", "base_tau", "lambda", "per_position_accuracy"),
                       scored=(6, 45), weight_ratio=5, head_weights=4,  # prefix_gru's two, embed_proj's two
                       checks=_domino_checks, by_micro_batch=("sampled",)),
    "dflash2": KindCase(("selector_loss", "base_accuracy", "base_tau", "candidate_recall", "selector_accuracy"),
                        scored=(6, 45), weight_ratio=5, head_weights=11,  # 2 layers x 2 convs x 2, the selector's 3
                        checks=_dflash2_checks),
    "dspark": KindCase(("dspark_loss", "l1_loss", "confidence_loss", "base_accuracy", "base_tau", "mean_confidence",
                        "mean_acceptance", "per_position_accuracy"),
                       scored=(6, 58), weight_ratio=6, head_weights=4,  # both Markov tables, the confidence weight, bias
                       checks=_dspark_checks),
}
assert KIND_CASES.keys() == HEAD_VARIANTS.keys()  # a kind added to the worker gets its case here
KINDS = list(KIND_CASES)
RUNS = [pytest.param(kind, mode, variant, id=f"{kind}-{mode}-{variant}")
        for kind in KINDS for mode, variant in head_runs(kind)]
KIND_MODES = [pytest.param(kind, mode, id=f"{kind}-{mode}") for kind in KINDS for mode in ("ddp", "fsdp2")]
# The one process's rows (and their anchors): the ranks' batch concatenated (rank 0's rows, then rank 1's), or, for a
# variant that draws per row from the anchor generator (Domino's scheduled sampling), by micro-batch: with gradient
# accumulation `GlobalRows` numbers micro-batch i's rows across the ranks (rank r's i-th row is its row r), so one
# process draws what 2 ranks draw only when its micro-batch i holds every rank's i-th row, in rank order.
CONCATENATED, BY_MICRO_BATCH = [0, 1, 2, 3], [0, 2, 1, 3]
# Kinds with several variants: they train different things (every pair's gradients differ)
MULTI_VARIANT = [kind for kind in KINDS if len(HEAD_VARIANTS[kind]) > 1]
# Kinds whose variants also train different losses: (metric, the smaller variant, the larger, by more than this factor).
# DFlash 2: strict and insert differ here (some gold tokens miss the top-K), not one case twice.
VARIANT_CONTRASTS = {"dflash2": ("selector_loss", "strict", "insert", 1.5)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Callable[[str], dict]:
    """`ranks(kind)`: rank 0's record of every (mode, variant) run of `kind`, from one launch of tests/dist_worker.py
    per kind (the first test that asks launches it; a failed launch fails every test of the kind, not relaunched)."""
    records: dict[str, dict | str] = {}

    def launched(kind: str) -> dict:
        if kind not in records:
            try:
                records[kind] = launch_two_ranks(kind, tmp_path_factory.mktemp(kind) / "ranks.pt")
            except Exception as e:  # the assertion with the workers' output, or a timeout
                records[kind] = f"{kind}: the 2-rank launch failed: {type(e).__name__}: {e}"
        record = records[kind]
        if isinstance(record, str):
            pytest.fail(record, pytrace=False)
        return record

    return launched


@pytest.mark.parametrize("kind", KINDS)
def test_the_plan_gives_the_ranks_uneven_weight_sums(kind, monkeypatch):
    """The kind's own targets of the fixed plan (DSpark's: slot k scores a + k + 1, validity cut at the first invalid
    label, its decay): rank 0 scores a few slots, rank 1 many, with a far larger weight sum."""
    case = KIND_CASES[kind]
    batch, anchors, keep = uneven_plan()
    assert keep[:2].sum() * 4 == keep[2:].sum() == 16  # rank 0: 4 anchors, rank 1: 16
    use_anchors(fixed_anchors(anchors, keep, range(4)), monkeypatch.setattr)
    trainer = head_trainer(kind, "ddp", next(iter(HEAD_VARIANTS[kind])))
    planned, _, targets = trainer.objective.plan(batch["input_ids"], batch["loss_mask"], None)
    assert torch.equal(planned, anchors)
    assert (targets.valid[:2, :, 1:].sum().item(), targets.valid[2:, :, 1:].sum().item()) == case.scored
    assert case.weight_ratio * targets.weights[:2].sum() < targets.weights[2:].sum()


@pytest.mark.parametrize("kind, mode, variant", RUNS)
def test_two_ranks_equal_one_process_on_the_concatenated_batch(ranks, monkeypatch, kind, mode, variant):
    """Gradients of every update (every weight gets one: the kind's head weights too), the weights after both
    updates and the window's metrics (the kind's loss terms, its base / corrected accuracy and tau, the grad norm that
    clipping used)."""
    case, record = KIND_CASES[kind], kind_named(kind)
    two = ranks(kind)[mode, variant]
    batch, anchors, keep = uneven_plan()
    rows = BY_MICRO_BATCH if variant in case.by_micro_batch else CONCATENATED
    batch = {k: v[rows] for k, v in batch.items()}
    use_anchors(fixed_anchors(anchors, keep, rows), monkeypatch.setattr)
    one_trainer = head_trainer(kind, mode, variant)  # one process: nothing to wrap or shard
    assert one_trainer.world_size == 1 and not one_trainer.fsdp
    assert isinstance(one_trainer.objective, record.objective) and isinstance(one_trainer.draft, record.model)
    one = head_steps(one_trainer, batch)
    heads = record.export.weight_names(one_trainer.draft.config)
    assert len(heads) == case.head_weights and heads <= one["grads"][0].keys()
    assert_two_ranks_equal_one(two, one, COMMON_METRICS + case.metrics)
    metrics = one["metrics"]
    assert metrics["supervised_tokens"] == 2 * sum(case.scored)  # the fixed plan was trained (twice), not a drawn one
    proposals = record.proposals_per_block(one_trainer.block_size)  # DSpark: every slot proposes
    assert len(metrics["per_position_accuracy"]) == proposals
    case.checks(metrics)


@pytest.mark.parametrize("kind", MULTI_VARIANT)
def test_the_variants_train_different_things(ranks, kind):
    """Each variant is a case of its own, not one case twice: its first gradients differ from every other variant's
    by more than two ranks may differ from one process; DFlash 2's strict and insert golds are two different losses
    (some gold tokens miss the top-K)."""
    runs = ranks(kind)
    for mode in ("ddp", "fsdp2"):
        for a, b in combinations(HEAD_VARIANTS[kind], 2):
            first, second = runs[mode, a]["grads"][0], runs[mode, b]["grads"][0]
            assert any(not torch.allclose(first[n], g, rtol=1e-4, atol=1e-5 * g.abs().max().item())
                       for n, g in second.items()), (mode, a, b)
        if kind in VARIANT_CONTRASTS:
            metric, smaller, larger, factor = VARIANT_CONTRASTS[kind]
            low, high = (runs[mode, variant]["metrics"][metric] for variant in (smaller, larger))
            assert high > low * factor, (mode, low, high)


@pytest.mark.parametrize("kind, mode", KIND_MODES)
def test_a_step_makes_no_sync_on_either_rank(ranks, kind, mode):
    runs = [variant for m, variant in head_runs(kind) if m == mode]
    assert runs
    for variant in runs:
        assert ranks(kind)[mode, variant]["sync_findings"] == [[], []], (kind, mode, variant)
