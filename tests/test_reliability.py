"""Reliability: exact resume, SIGTERM / SIGKILL during a run, non-finite guard, bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import TINY_MASK_ID, TINY_VOCAB, make_tiny_target, random_batch, tiny_config
from dflash.checkpoint import find_latest
from dflash.reporting import read_history
from dflash.stopping import NonFiniteError
from dflash.trainer import DFlashTrainer

ROOT = Path(__file__).resolve().parents[1]


def tokenized_rows(n: int = 24, seq: int = 40, seed: int = 0):
    import datasets

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY_VOCAB - 1, (n, seq), generator=g)
    mask = torch.ones(n, seq, dtype=torch.int8)
    mask[:, :6] = 0
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "loss_mask": mask.tolist()})


def run_config(out: Path, **overrides):
    base = dict(output_dir=str(out), max_steps=6, log_interval=1, data__num_workers=0, data__bucket_multiple=8,
                spec_eval_prompts=0, progress_bar=False)
    base.update(overrides)
    return tiny_config(**base)


def fresh_trainer(cfg, dataset=None):
    torch.manual_seed(123)  # same draft initialisation for every trainer of a test
    return DFlashTrainer(cfg, target=make_tiny_target(), dataset=dataset if dataset is not None else tokenized_rows())


def test_sigterm_saves_cleanly_and_resume_is_bit_identical(tmp_path, monkeypatch):
    straight = fresh_trainer(run_config(tmp_path / "a"))
    straight.fit()

    interrupted = fresh_trainer(run_config(tmp_path / "b"))
    original = interrupted.train_step

    def step_then_sigterm(batch):
        original(batch)
        if interrupted.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # a pre-emption notice mid-run

    monkeypatch.setattr(interrupted, "train_step", step_then_sigterm)
    handler_before = signal.getsignal(signal.SIGTERM)
    summary = interrupted.fit()
    assert summary["interrupted"] and summary["steps"] == 3
    assert find_latest(tmp_path / "b").name == "step-00000003"
    assert signal.getsignal(signal.SIGTERM) == handler_before  # the run's handler is removed again

    resumed = fresh_trainer(run_config(tmp_path / "b", resume_from="latest"))
    resumed.fit()
    for (name, p), q in zip(straight.draft.named_parameters(), resumed.draft.parameters(), strict=True):
        assert torch.equal(p, q), name  # bit-identical on CPU
    def losses(run):
        return [(r["step"], r["loss"]) for r in read_history(run) if "loss" in r]

    assert losses(tmp_path / "a") == losses(tmp_path / "b")  # steps 1..3 then 4..6, same values


def test_resume_restores_the_anchor_generator(tmp_path):
    """A CUDA-graph run continues its anchor stream from the saved generator state (eager steps reseed
    from (seed, rank, step); graph replays cannot), so the checkpoint carries it and resume restores it."""
    first = fresh_trainer(run_config(tmp_path / "a", max_steps=3))
    first.fit()
    saved = first.state_dict()
    second = fresh_trainer(run_config(tmp_path / "b"))
    second.anchor_generator.manual_seed(999)
    assert not torch.equal(second.anchor_generator.get_state(), saved["anchor_rng"])
    second.load_state_dict(saved)
    assert torch.equal(second.anchor_generator.get_state(), saved["anchor_rng"])
    assert torch.equal(torch.get_rng_state(), saved["torch_rng"])


def test_sigkill_during_a_save_loses_nothing_before_it(tmp_path):
    """A child process is killed with SIGKILL in the middle of writing its 3rd checkpoint."""
    child = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
        import dflash.checkpoint as ck
        from test_reliability import fresh_trainer, run_config
        calls = []
        real_save = torch.save
        def dying_save(obj, path, *a, **k):
            calls.append(path)
            if len(calls) == 3:
                open(path, "wb").write(b"half a checkpoint")
                os.kill(os.getpid(), signal.SIGKILL)
            return real_save(obj, path, *a, **k)
        ck.torch.save = dying_save
        fresh_trainer(run_config({str(tmp_path / 'run')!r}, save_interval=1)).fit()
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    root = tmp_path / "run" / "checkpoints"
    assert any(p.name.startswith(".tmp-step-00000003") for p in root.iterdir())  # the interrupted save
    latest = find_latest(tmp_path / "run")
    assert latest.name == "step-00000002"  # the previous good checkpoint
    resumed = fresh_trainer(run_config(tmp_path / "run", resume_from="latest", max_steps=4))
    resumed.fit()
    assert resumed.step == 4 and find_latest(tmp_path / "run").name == "step-00000004"


def test_nonfinite_update_is_skipped_and_reported(monkeypatch):
    trainer = DFlashTrainer(tiny_config(), target=make_tiny_target())
    batch = random_batch()
    trainer.train_step(batch)
    trainer.metrics.flush()
    before = {k: v.clone() for k, v in trainer.draft.state_dict().items()}
    adam_before = {k: v.clone() for k, v in trainer.optimizer.state[next(trainer.draft.parameters())].items()}
    real = trainer.target.forward
    monkeypatch.setattr(trainer.target, "forward", lambda ids: real(ids) * float("nan"))  # poisoned features
    trainer.train_step(batch)
    for k, v in trainer.draft.state_dict().items():
        assert torch.equal(v, before[k]), k  # that update was skipped entirely
    for k, v in trainer.optimizer.state[next(trainer.draft.parameters())].items():
        assert torch.equal(v, adam_before[k]), k  # moments and step count untouched
    metrics = trainer.metrics.flush()
    assert metrics["nonfinite_skips"] == 1 and metrics["nonfinite_run"] == 1
    assert metrics["loss"] == 0.0  # the NaN did not poison the window's loss
    monkeypatch.setattr(trainer.target, "forward", real)
    trainer.train_step(batch)
    assert not torch.equal(trainer.draft.fc.weight, before["fc.weight"])  # training goes on
    assert trainer.metrics.flush()["nonfinite_run"] == 0


def test_consecutive_nonfinite_updates_stop_the_run_with_a_checkpoint(tmp_path, monkeypatch):
    trainer = fresh_trainer(run_config(tmp_path, max_steps=20, max_nonfinite_skips=3))
    real = trainer.target.forward
    monkeypatch.setattr(trainer.target, "forward",
                        lambda ids: real(ids) * (float("nan") if trainer.step >= 2 else 1.0))
    with pytest.raises(NonFiniteError, match="3 consecutive optimizer updates were skipped"):
        trainer.fit()
    latest = find_latest(tmp_path)
    from dflash.checkpoint import load_checkpoint

    weights, _, _ = load_checkpoint(latest)
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_resume_with_a_different_configuration_lists_what_differs(tmp_path):
    fresh_trainer(run_config(tmp_path, max_steps=2)).fit()
    other = fresh_trainer(run_config(tmp_path, max_steps=4, resume_from="latest", draft__num_anchors=6))
    with pytest.raises(ValueError, match=r"draft\.num_anchors: 8 -> 6"):
        other.fit()


def test_mask_token_present_in_the_data_is_refused(tmp_path):
    rows = tokenized_rows()
    rows = rows.map(lambda r: {"input_ids": [TINY_MASK_ID] + r["input_ids"][1:]})
    with pytest.raises(ValueError, match=f"mask token id {TINY_MASK_ID}.*appears in the training data"):
        fresh_trainer(run_config(tmp_path), dataset=rows).fit()


def test_sequences_shorter_than_the_block_train_without_error():
    trainer = DFlashTrainer(tiny_config(), target=make_tiny_target())
    ids = torch.randint(0, TINY_VOCAB - 1, (4, 3))
    mask = torch.tensor([[0, 1, 1]] * 3 + [[0, 0, 1]], dtype=torch.bool)
    trainer.train_step({"input_ids": ids, "loss_mask": mask})
    metrics = trainer.metrics.flush()
    assert metrics["rows_skipped"] == 1 and metrics["supervised_tokens"] == 3


def test_warm_start_from_an_exported_draft(tmp_path):
    from dflash.export import export_draft

    source = DFlashTrainer(tiny_config(), target=make_tiny_target())
    export_draft(source.draft, tmp_path / "exported")
    warm = DFlashTrainer(tiny_config(init_from=str(tmp_path / "exported")), target=make_tiny_target())
    bf16 = source.draft.fc.weight.to(torch.bfloat16).float()
    assert torch.equal(warm.draft.fc.weight, bf16) and warm.step == 0


def test_graph_warm_up_leaves_the_optimizer_state_allocated_and_as_it_was():
    """Before a CUDA-graph capture, warm-up steps allocate gradients and AdamW's state and are then undone
    in place. The capture must find the state already there (otherwise it records its lazy creation and
    every replay zeroes the moments and the step count again) and equal to what it was: zero in a fresh
    run, the loaded values in a resumed one. The lr tensor the schedule updates must still be the group's."""
    trainer = fresh_trainer(tiny_config())
    batch = [random_batch()]
    weights = {k: v.clone() for k, v in trainer.draft.state_dict().items()}
    trainer._step_graphs().warm_up(batch)
    params = [p for p in trainer.draft.parameters() if p.requires_grad]
    for p in params:
        state = trainer.optimizer.state[p]
        assert state and all(torch.count_nonzero(v) == 0 for v in state.values() if torch.is_tensor(v))
    for k, v in trainer.draft.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert float(trainer.step_t) == 0 and trainer.optimizer.param_groups[0]["lr"] is trainer.lr

    # The first real step after warm-up equals a fresh trainer's first step: warm-up left no trace.
    reference = fresh_trainer(tiny_config())
    for t in (trainer, reference):
        t._step(batch, reseed=True)
    for (name, p), q in zip(trainer.draft.named_parameters(), reference.draft.parameters(), strict=True):
        assert torch.equal(p, q), name

    # Resumed case: non-zero state is put back exactly, in the same tensors.
    saved = {p: {k: (v, v.clone()) for k, v in trainer.optimizer.state[p].items()} for p in params}
    trainer._step_graphs().warm_up(batch)
    for p in params:
        for k, (tensor, value) in saved[p].items():
            assert trainer.optimizer.state[p][k] is tensor and torch.equal(tensor, value), k


def test_seed_fixes_the_draft_initialisation_and_leaves_the_callers_rng_alone():
    """`seed` alone decides the draft's initial weights (two launches of one config start alike; ranks
    build the same draft), and building the trainer draws nothing from the caller's RNG stream."""
    target = make_tiny_target()

    def initial(seed: int, callers_seed: int):
        torch.manual_seed(callers_seed)  # whatever the caller's stream is, it must not matter
        before = torch.get_rng_state()
        trainer = DFlashTrainer(tiny_config(seed=seed), target=target)
        assert torch.equal(torch.get_rng_state(), before)
        return trainer.draft.state_dict()

    a, b, c = initial(0, callers_seed=5), initial(0, callers_seed=6), initial(1, callers_seed=5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point() and a[k].numel() > 1)


def test_compile_true_trains_like_eager():
    """`compile: true` compiles the draft and the CE chunks; one step gives the eager step's loss and
    weights (same seed, same batch, anchors from the same (seed, rank, step))."""
    batch = random_batch()
    runs = []
    for compile_ in (False, True):
        trainer = DFlashTrainer(tiny_config(compile=compile_), target=make_tiny_target())
        assert trainer.objective.compile_loss is compile_
        trainer.train_step(batch)
        runs.append((trainer.metrics.flush()["loss"], trainer.draft.state_dict()))
    (loss0, w0), (loss1, w1) = runs
    assert loss1 == pytest.approx(loss0, rel=1e-5)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], rtol=1e-4, atol=1e-5, msg=k)


def test_clipping_folded_into_fused_adamw_equals_clip_grad_norm():
    """The step passes clipping to fused AdamW as `grad_scale` (no separate pass over the gradients). Three
    steps with clipping active must equal clip_grad_norm_ followed by the same optimizer, and differ from
    no clipping (Adam is nearly scale-invariant, so it takes steps whose clip factors differ to tell)."""
    batches = [random_batch(seed=s) for s in range(3)]

    def run(mode: str) -> dict[str, torch.Tensor]:
        trainer = DFlashTrainer(tiny_config(optim__max_grad_norm=0.05), target=make_tiny_target())
        step = trainer.optimizer.step

        def reference_step():  # what the step did before: clip the gradients in place, then update
            del trainer.optimizer.grad_scale
            params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
            if mode == "clip_grad_norm_":
                norm = torch.nn.utils.clip_grad_norm_(params, 0.05, foreach=True)
                assert norm > 0.05  # clipping is active in every step
            step()

        if mode != "folded":
            trainer.optimizer.step = reference_step
        for batch in batches:
            trainer.train_step(batch)
        return {k: v.clone() for k, v in trainer.draft.state_dict().items()}

    folded, clipped, unclipped = run("folded"), run("clip_grad_norm_"), run("none")
    for k in folded:
        torch.testing.assert_close(folded[k], clipped[k], rtol=1e-5, atol=1e-6, msg=k)
    assert max((folded[k] - unclipped[k]).abs().max().item() for k in folded) > 1e-4


def test_compiled_functions_may_keep_a_graph_for_every_batch_shape(tmp_path, monkeypatch):
    """Flex attention, the compiled draft and the CE chunks are compiled with dynamic=False: one graph per
    batch shape. Past dynamo's recompile limit (8) a new shape would run eagerly, and eager flex attention
    materializes its whole score matrix. Training batches take one of max_length / bucket_multiple padded
    lengths, and each held-out batch (every valid anchor) has its own width: the limit covers both, plus 4
    entries for what dynamo also keys on (grad mode, train / eval)."""
    import torch._dynamo.config as dynamo_config

    def limit_after(run) -> int:
        monkeypatch.setattr(dynamo_config, "recompile_limit", 8)  # dynamo's default, put back after the test
        monkeypatch.setattr(dynamo_config, "accumulated_recompile_limit", 256)
        run()
        assert dynamo_config.accumulated_recompile_limit >= dynamo_config.recompile_limit
        return dynamo_config.recompile_limit

    cfg = run_config(tmp_path, max_steps=1, batch_size=1, data__max_length=2048, data__bucket_multiple=64,
                     eval_interval=0)
    assert limit_after(lambda: fresh_trainer(cfg).fit()) == 2048 // 64 + 4
    rows = tokenized_rows(n=6)
    assert limit_after(lambda: fresh_trainer(cfg).evaluate(rows)) == 2048 // 64 + 6 + 4  # 6 held-out batches

    from dflash.hf import dflash_collator  # Trainer integration: a last, smaller batch doubles the lengths

    assert limit_after(lambda: dflash_collator(None, cfg)) == 2 * (2048 // 64) + 4
