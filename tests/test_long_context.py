"""Long-context training (issue 61): activation checkpointing of the draft's layers, the anchor spread over a
long row, and the step's memory estimate (what `--dry-run` prints)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import KIND_HEADS, make_tiny_target, random_batch, tiny_config

from dflash.anchors import sample_anchors
from dflash.diagnostics import forbid_syncs
from dflash.kinds.registry import KIND_NAMES
from dflash.trainer import DFlashTrainer


def _saved_bytes(trainer: DFlashTrainer, batch: dict[str, torch.Tensor]) -> int:
    """Bytes autograd keeps for the backward of one micro-batch's forward (each storage counted once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    objective = trainer.objective
    anchors, keep, targets = objective.plan(batch["input_ids"], batch["loss_mask"], torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        objective(batch["input_ids"], anchors, keep, targets)
    weights = {p.untyped_storage().data_ptr() for p in [*objective.parameters(), *objective.buffers()]}
    return sum(n for ptr, n in storages.items() if ptr not in weights)


@pytest.mark.parametrize("name", KIND_NAMES)
def test_activation_checkpointing_keeps_the_step_and_frees_the_layers(name):
    """Same losses and updates with and without recomputation, for every kind; the forward keeps less for the
    backward (the layers' activations are recomputed), and the step stays sync-free."""
    target, batch = make_tiny_target(), random_batch(batch=4, seq=48)
    runs = {}
    for recompute in (False, True):
        trainer = DFlashTrainer(tiny_config(**KIND_HEADS[name], activation_checkpointing=recompute, draft__num_layers=3),
                                target=copy.deepcopy(target))
        assert trainer.draft.checkpoint_layers is recompute
        saved = _saved_bytes(trainer, batch)
        with forbid_syncs(raise_on_first=False) as report:
            for _ in range(2):
                trainer.train_step(batch)
        assert report.findings == [], report
        runs[recompute] = (saved, trainer.metrics.flush()["loss"], [p.detach().clone() for p in trainer.draft.parameters()])
    (saved_plain, loss_plain, weights_plain), (saved_ckpt, loss_ckpt, weights_ckpt) = runs[False], runs[True]
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-6)
    for a, b in zip(weights_plain, weights_ckpt, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert saved_ckpt < 0.6 * saved_plain, (saved_ckpt, saved_plain)


def test_later_spread_weights_anchors_by_position_and_keeps_the_rules():
    """`spread="later"`: a position's chance grows with its place in its document (packed rows: restarting at
    each document), the draw keeps min(N, valid) distinct valid anchors, sorted, and uniform stays uniform."""
    seq, n, draws = 64, 8, 4000
    loss_mask = torch.ones(draws, seq, dtype=torch.bool)
    generator = torch.Generator().manual_seed(0)
    counts = {}
    for spread in ("uniform", "later"):
        anchors, keep = sample_anchors(loss_mask, n, generator=generator, spread=spread)
        assert keep.all() and (anchors[:, 1:] > anchors[:, :-1]).all()  # n distinct valid anchors, ascending
        counts[spread] = torch.bincount(anchors.flatten(), minlength=seq).float() / draws
    valid = seq - 1  # the last position is never an anchor
    late_share = {s: c[valid // 2:].sum().item() / n for s, c in counts.items()}
    assert late_share["uniform"] == pytest.approx(0.5, abs=0.02)
    assert late_share["later"] > 0.6, late_share  # weights i + 1: about 3/4 of the mass in the second half
    assert counts["later"][4] < counts["later"][60]

    # packed rows: the weight follows the position in the document, and no anchor crosses a document end
    position_ids = torch.cat([torch.arange(32), torch.arange(32)]).expand(draws, -1)
    anchors, keep = sample_anchors(loss_mask, n, generator=generator, spread="later", position_ids=position_ids)
    assert keep.all() and not ((anchors == 31) & keep).any()
    per_doc = torch.bincount(anchors.flatten(), minlength=seq).float()
    assert per_doc[:31].sum().item() == pytest.approx(per_doc[32:63].sum().item(), rel=0.1)  # each document alike
    assert per_doc[20:31].sum() > 2 * per_doc[:11].sum()  # within a document, later positions hold more

    # a row with fewer valid positions than N keeps them all, whatever the spread
    short = torch.zeros(1, seq, dtype=torch.bool)
    short[0, 10:14] = True
    anchors, keep = sample_anchors(short, n, generator=generator, spread="later")
    assert anchors[keep].tolist() == [10, 11, 12]


def test_a_run_with_the_later_spread_trains():
    trainer = DFlashTrainer(tiny_config(draft__anchor_spread="later"), target=make_tiny_target())
    assert trainer.objective.anchor_spread == "later"
    batch = random_batch(batch=4, seq=48)
    for _ in range(3):
        trainer.train_step(batch)
    assert math.isfinite(trainer.metrics.flush()["loss"])


def _shape(**overrides):
    from dflash.memory import StepShape

    base = dict(target_bytes=16 * 2**30, target_hidden=4096, target_ffn=12288, target_layers_run=34, hidden=4096,
                layers=5, q_width=4096, kv_width=1024, ffn=12288, vocab=151_936, feature_layers=5,
                draft_params=1_050_000_000, rows=1, positions=32768, anchors=4096, block_size=16, ce_chunk=2048,
                param_bytes=2)
    return StepShape(**{**base, **overrides})


def test_memory_estimate_follows_the_shapes():
    """The estimate's parts: the draft layers' activations grow with the block tokens (anchors x block), the context
    with the positions, recomputation keeps one layer's; the peak is what lives all run plus the largest phase."""
    from dflash.memory import estimate

    base = estimate(_shape())
    assert base["peak"] == pytest.approx(base["weights"] + base["optimizer_state"]
                                         + max(base["target_phase"], base["draft_phase"], base["backward_phase"]))
    assert estimate(_shape(anchors=2048))["layer_activations"] == pytest.approx(base["layer_activations"] / 2)
    assert estimate(_shape(positions=16384))["context"] == pytest.approx(base["context"] / 2)
    ckpt = estimate(_shape(checkpointing=True))
    assert ckpt["layer_activations"] < base["layer_activations"] / 10 and ckpt["peak"] < base["peak"] - 20
    assert estimate(_shape(compiled=False))["layer_activations"] > base["layer_activations"]
    assert estimate(_shape(target_layers_run=0))["target_phase"] == 0  # offline features: no target forward


def test_memory_estimate_of_a_config_reads_its_settings(tiny_target):
    """`step_shape` takes the micro-batch (packed: the pack length), anchors, dtypes and options of the run."""
    from dflash.memory import step_shape
    from dflash.modeling import DFlashDraftConfig

    cfg = tiny_config(batch_size=3, data__max_length=96, data__packing=True, data__pack_length=256,
                      param_dtype="float32", compile=True, activation_checkpointing=True, optim__optimizer="muon")
    draft_cfg = DFlashDraftConfig.for_target(tiny_target.config, mask_token_id=1, num_hidden_layers=2,
                                             target_layer_ids=[0, 2])
    shape = step_shape(cfg, tiny_target.config, draft_cfg, 1000, 5000, 2)
    assert (shape.rows, shape.positions, shape.anchors, shape.block_size) == (3, 256, 8, draft_cfg.block_size)
    assert (shape.param_bytes, shape.optimizer_states, shape.compiled, shape.checkpointing) == (4, 1, True, True)
    assert shape.target_layers_run == 3 and shape.feature_layers == 2
    cfg.data.packing = False
    assert step_shape(cfg, tiny_target.config, draft_cfg, 1000, 5000, 2).positions == 96


def test_the_dry_run_prints_the_step_memory_estimate(tiny_target_dir, capsys):
    """`dflash train --dry-run` says the step's estimated peak, which recomputation lowers (a 4-layer draft with
    many anchors on the tiny target)."""
    from dflash.cli.main import main

    peaks = []
    for extra in ([], ["activation_checkpointing=true"]):
        assert main(["train", f"target={tiny_target_dir}", "draft.mask_token_id=16", "draft.num_layers=4", "device=cpu",
                     "draft.num_anchors=256", "data.max_length=1024", *extra, "--dry-run"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("step_memory_estimate"))
        peaks.append(float(line.split()[1]))
        assert "draft layers' stored activations" in line
    assert peaks[1] < peaks[0], peaks
