"""The hot path's last gaps: a host-side anchor width, CUDA graphs keyed by batch shape (a stand-in graph
on CPU), no update from an empty window, grad_norm over updates only, and the position decay switch."""

from __future__ import annotations

import logging

import datasets
import pytest
import torch
import torch.nn.functional as F
from helpers import DFLASH2_HEAD, TINY_VOCAB, make_tiny_target, random_batch, tiny_config

from dflash.anchors import anchor_widths, bounded_width, valid_anchor_mask
from dflash.data.loader import Collator
from dflash.diagnostics import forbid_syncs
from dflash.factory import build_objective
from dflash.losses import block_targets
from dflash.run.graphs import StepGraphs
from dflash.trainer import DFlashTrainer

N = 8  # tiny_config's num_anchors
DOMINO = {"draft__kind": "domino", "domino__gru_hidden_dim": 32, "domino__emb_dim": 16,
          "domino__scheduled_sampling": 0.5}
HEADS = {"dflash": {}, "domino": DOMINO, "dflash2": DFLASH2_HEAD,
         "dspark": {"draft__kind": "dspark", "dspark__markov_rank": 8}}  # small heads of every draft kind


def _mask(valid_per_row: list[int], seq: int = 32) -> torch.Tensor:
    """A loss mask whose row r has exactly valid_per_row[r] valid anchors (one supervised run)."""
    mask = torch.zeros(len(valid_per_row), seq, dtype=torch.bool)
    for r, v in enumerate(valid_per_row):
        if v:
            mask[r, 3:3 + v + 1] = True  # v + 1 consecutive supervised tokens hold v valid anchors
    assert valid_anchor_mask(mask).sum(1).tolist() == valid_per_row
    return mask


CASES = {"none": [0, 0, 0, 0], "few": [0, 1, 3, 2], "exactly_n": [N, 2, 0, 5], "more_than_n": [20, 25, 1, 0]}


def _plan_forward_backward(objective, ids, mask, width):
    generator = torch.Generator().manual_seed(11)
    objective.train()
    anchors, keep, targets = objective.plan(ids, mask, generator, width)
    objective.draft.zero_grad(set_to_none=True)
    out = objective(ids, anchors, keep, targets)
    out.loss_sum.backward()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in objective.draft.named_parameters()}
    return anchors, keep, targets, out.loss_sum.detach(), grads


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", sorted(HEADS))
def test_bounded_width_keeps_the_fixed_width_anchors_losses_and_gradients(kind, case):
    objective = build_objective(tiny_config(**HEADS[kind]), make_tiny_target(), None, device=torch.device("cpu"),
                                dtype=torch.float32)
    mask = _mask(CASES[case])
    ids = torch.randint(0, TINY_VOCAB - 1, mask.shape, generator=torch.Generator().manual_seed(3))
    width = bounded_width(mask, anchor_widths(N, 4))
    assert width == N if case in ("exactly_n", "more_than_n") else width < N
    a_n, keep_n, t_n, loss_n, grads_n = _plan_forward_backward(objective, ids, mask, None)
    a_w, keep_w, t_w, loss_w, grads_w = _plan_forward_backward(objective, ids, mask, width)
    assert a_w.shape == (4, width)
    assert not keep_n[:, width:].any()  # every slot past the width was a dropped one
    assert torch.equal(a_w, a_n[:, :width]) and torch.equal(keep_w, keep_n[:, :width])
    assert torch.equal(t_w.weights, t_n.weights[:, :width]) and torch.equal(t_w.labels, t_n.labels[:, :width])
    if kind == "domino":
        assert torch.equal(t_w.sampled, t_n.sampled[:, :width])
    torch.testing.assert_close(loss_w, loss_n, rtol=1e-6, atol=1e-7)
    for name, g in grads_n.items():
        torch.testing.assert_close(grads_w[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_trainer_steps_with_bounded_widths_equal_fixed_width_steps():
    """Two steps through the trainer: batches that carry the collator's width against the same batches
    at the fixed width N end with the same weights and metrics."""
    target = make_tiny_target()
    bounded, fixed = (DFlashTrainer(tiny_config(), target=target) for _ in range(2))
    collator = Collator(0, bucket_multiple=32, max_length=32, anchor_widths=anchor_widths(N, 4))
    for seed, case in enumerate(("few", "none", "exactly_n")):
        mask = _mask(CASES[case])
        ids = torch.randint(0, TINY_VOCAB - 1, mask.shape, generator=torch.Generator().manual_seed(seed))
        batch = collator([{"input_ids": i.tolist(), "loss_mask": m.tolist()} for i, m in zip(ids, mask, strict=True)])
        assert isinstance(batch["num_anchors"], int)
        bounded.train_step(batch)
        fixed.train_step({"input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"]})
    for (name, p), q in zip(bounded.draft.named_parameters(), fixed.draft.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)
    m_b, m_f = bounded.metrics.flush(), fixed.metrics.flush()
    assert m_b["anchors_kept"] > m_f["anchors_kept"]  # the same kept blocks among fewer slots
    for key in ("loss", "accuracy", "tau", "grad_norm", "empty_windows"):
        assert m_b[key] == pytest.approx(m_f[key], rel=1e-5), key


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_steps_at_a_host_bounded_width_make_no_sync(kind):
    """The collator's width (`num_anchors` < N) changes the plan's shapes, not the step's sync-freedom."""
    trainer = DFlashTrainer(tiny_config(**HEADS[kind], optim__grad_accum=2), target=make_tiny_target())
    batch = {**random_batch(batch=4), "num_anchors": 4}
    trainer.train_step(batch)  # the first step of a shape may build caches; the region starts after it
    trainer.metrics.flush()
    with forbid_syncs(raise_on_first=False) as report:
        for _ in range(2):
            trainer.train_step(batch)
    assert report.findings == [], report
    bounded = trainer.metrics.flush()["supervised_tokens"] / 2  # per step
    full = DFlashTrainer(tiny_config(**HEADS[kind], optim__grad_accum=2), target=make_tiny_target())
    full.train_step(random_batch(batch=4))
    assert bounded < 0.6 * full.metrics.flush()["supervised_tokens"]  # 4 of the 8 anchors were planned


def test_collator_names_the_width_and_counts_its_shapes():
    collator = Collator(0, bucket_multiple=16, max_length=64, anchor_widths=[2, 4, 8])
    rows = [{"input_ids": [1] * 10, "loss_mask": [0] * 5 + [1] * 4 + [0]}]  # 3 valid anchors
    assert collator(rows)["num_anchors"] == 4
    assert collator.num_shapes == 4 * 3  # 4 padded lengths x 3 widths
    assert "num_anchors" not in Collator(0, 16, 64)(rows) and Collator(0, 16, 64).num_shapes == 4


class StandInGraph:
    """Records the step a capture was given; `replay` runs it again (what a CUDA graph replays)."""

    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self) -> None:
        self.replays += 1
        self.fn()


class StandInCapture:
    def __init__(self) -> None:
        self.graphs: list[StandInGraph] = []

    def __call__(self, fn) -> StandInGraph:
        self.graphs.append(StandInGraph(fn))
        return self.graphs[-1]


def test_step_graphs_dispatch_by_shape_key():
    seen, warmed = [], []
    capture = StandInCapture()
    graphs = StepGraphs(lambda micro: seen.append(micro[0]["input_ids"].clone()), lambda static: warmed.append(1),
                        capture=capture, max_graphs=2)
    short, long = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    for ids in (short, long, short + 5, long + 5):
        graphs.run([{"input_ids": ids, "num_anchors": 4}])
    assert len(graphs) == 2 and len(warmed) == 2 and [g.replays for g in capture.graphs] == [2, 2]
    # Each replay ran on its graph's static buffers, holding this call's batch.
    assert [int(s[0, 0]) for s in seen] == [0, 1, 5, 6] and [s.shape[1] for s in seen] == [4, 8, 4, 8]
    graphs.run([{"input_ids": short, "num_anchors": 4}])  # a known key: no new capture
    with pytest.raises(RuntimeError, match="past the 2 shapes"):  # a new width is a new key, past the bound
        graphs.run([{"input_ids": short, "num_anchors": 2}])


def test_fit_replays_one_graph_per_bucket_length(tmp_path, caplog):
    """`fit` with the graph path (a stand-in capture on CPU): two padded lengths, two captures, every step a
    replay (nothing falls back to the eager step), and a log line per capture."""
    rows = [{"input_ids": list(range(1, 1 + n)), "loss_mask": [0] * 3 + [1] * (n - 3)}
            for n in (10, 12, 30, 28) * 4]
    cfg = tiny_config(max_steps=8, log_interval=4, output_dir=str(tmp_path), spec_eval_prompts=0,
                      export_on_finish=False, data__bucket_multiple=16, data__max_length=32, data__num_workers=0,
                      draft__anchor_widths=1)
    trainer = DFlashTrainer(cfg, target=make_tiny_target(), tokenizer=None, dataset=datasets.Dataset.from_list(rows))
    trainer.config.cuda_graph = True  # the graph path, with a stand-in for torch.cuda.CUDAGraph
    trainer.graph_capture = capture = StandInCapture()
    eager = trainer._step
    trainer._step = lambda micro, *, reseed: (_ for _ in ()).throw(AssertionError("eager step")) if reseed \
        else eager(micro, reseed=False)
    before = trainer.draft.fc.weight.detach().clone()
    with caplog.at_level(logging.INFO, logger="dflash"):
        trainer.fit()
    assert len(capture.graphs) == 2, [g.replays for g in capture.graphs]
    assert sum(g.replays for g in capture.graphs) == 8
    assert sum("captured CUDA graph" in r.getMessage() for r in caplog.records) == 2
    assert not torch.equal(trainer.draft.fc.weight, before)


def test_an_empty_window_leaves_weights_and_optimizer_state_unchanged_and_is_counted():
    trainer = DFlashTrainer(tiny_config(optim__weight_decay=0.1), target=make_tiny_target())
    trainer.train_step(random_batch())  # AdamW state exists and is non-zero
    weights = {k: v.clone() for k, v in trainer.draft.state_dict().items()}
    state = {p: {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()}
    empty = random_batch()
    empty["loss_mask"] = torch.zeros_like(empty["loss_mask"])
    with forbid_syncs():
        trainer.train_step(empty)
    for k, v in trainer.draft.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for p, s in trainer.optimizer.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[p][k]), k
    flushed = trainer.metrics.flush()
    assert flushed["empty_windows"] == 1 and flushed["nonfinite_skips"] == 0
    assert float(trainer.step_t) == 2 and trainer.step == 2  # the schedule's step advances (docs/design.md)


def test_grad_norm_is_averaged_over_the_updates_taken():
    trainer = DFlashTrainer(tiny_config(), target=make_tiny_target())
    trainer.train_step(random_batch())
    alone = trainer.metrics.flush()["grad_norm"]
    reference = DFlashTrainer(tiny_config(), target=make_tiny_target())
    reference.train_step(random_batch())
    empty = random_batch(seed=1)
    empty["loss_mask"] = torch.zeros_like(empty["loss_mask"])
    reference.train_step(empty)  # skipped: adds no grad norm and no update
    window = reference.metrics.flush()
    assert window["empty_windows"] == 1
    assert window["grad_norm"] == pytest.approx(alone, rel=1e-6)


def test_decay_off_weighs_every_supervised_slot_alike_and_equals_plain_ce():
    cfg = tiny_config(draft__loss_decay_gamma=None)
    cfg.validate()
    objective = build_objective(cfg, make_tiny_target(), None, device=torch.device("cpu"), dtype=torch.float32)
    assert objective.gamma is None
    batch = random_batch()
    anchors, keep, targets = objective.plan(batch["input_ids"], batch["loss_mask"], torch.Generator().manual_seed(0))
    assert torch.equal(targets.weights, targets.valid.float())  # 1 on every supervised slot
    hidden, labels = objective.draft_hidden(batch["input_ids"], anchors, keep, targets)
    logits = hidden[:, :, 1:].float() @ objective.target.lm_head_weight.float().T
    valid = targets.valid[..., 1:]
    plain = F.cross_entropy(logits[valid], labels[..., 1:][valid], reduction="sum")
    torch.testing.assert_close(objective(batch["input_ids"], anchors, keep, targets).loss_sum, plain,
                               rtol=1e-5, atol=1e-5)
    decayed = block_targets(batch["input_ids"], batch["loss_mask"], anchors, keep, 4, 7.0)
    assert not torch.equal(decayed.weights, targets.weights)
    with pytest.raises(ValueError, match="loss_decay_gamma"):
        tiny_config(draft__loss_decay_gamma=-1.0).validate()
