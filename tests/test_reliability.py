"""Reliability: exact resume, SIGTERM / SIGKILL during a run, non-finite guard, bad input."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import TINY_MASK_ID, TINY_VOCAB, make_tiny_target, random_batch, tiny_config
from safetensors.torch import load_file
from test_cli import _args
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from dflash.cli.main import main
from dflash.report.sinks import read_history
from dflash.run.checkpoint import find_latest, load_checkpoint
from dflash.run.compiling import INDUCTOR_CACHE_ENV, compile_draft_call, keep_compile_cache
from dflash.run.stopping import NonFiniteError
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


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])  # muon: its momentum buffers are saved and restored too
def test_sigterm_saves_cleanly_and_resume_is_bit_identical(tmp_path, monkeypatch, optimizer):
    straight = fresh_trainer(run_config(tmp_path / "a", optim__optimizer=optimizer))
    straight.fit()

    interrupted = fresh_trainer(run_config(tmp_path / "b", optim__optimizer=optimizer))
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

    resumed = fresh_trainer(run_config(tmp_path / "b", resume_from="latest", optim__optimizer=optimizer))
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


def test_sigkill_during_a_save_loses_nothing_before_it(tmp_path, caplog):
    """A child process is SIGKILLed in the middle of writing its 3rd checkpoint (the crash-injection hook
    of dflash.run.checkpoint: the 8th file a save writes is the 2nd of the 3rd checkpoint)."""
    child = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
        from test_reliability import fresh_trainer, run_config
        fresh_trainer(run_config({str(tmp_path / 'run')!r}, save_interval=1)).fit()
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DFLASH_FAULT": "save-write:8"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    root = tmp_path / "run" / "checkpoints"
    orphan = [p for p in root.iterdir() if p.name.startswith(".tmp-step-00000003")]
    assert orphan  # the interrupted save
    latest = find_latest(tmp_path / "run")
    assert latest.name == "step-00000002"  # the previous good checkpoint
    resumed = fresh_trainer(run_config(tmp_path / "run", resume_from="latest", max_steps=4))
    with caplog.at_level("WARNING"):
        resumed.fit()
    assert resumed.step == 4 and find_latest(tmp_path / "run").name == "step-00000004"
    assert not orphan[0].exists() and f"removing {orphan[0]}, left by an interrupted save" in caplog.text


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
    """The stop is checked every step, not at the log flush: with log_interval=10 and a limit of 3 the run
    stops at the step that makes the third consecutive skip (step 5), not at step 10 after 8 skips. The
    window's loss then counts only its finite steps, and a window of skipped steps logs no loss."""
    trainer = fresh_trainer(run_config(tmp_path, max_steps=20, max_nonfinite_skips=3, log_interval=10))
    real = trainer.target.forward
    monkeypatch.setattr(trainer.target, "forward",
                        lambda ids: real(ids) * (float("nan") if trainer.step >= 2 else 1.0))
    with pytest.raises(NonFiniteError, match="3 consecutive optimizer updates were skipped .* at step 5"):
        trainer.fit()
    assert trainer.step == 5
    latest = find_latest(tmp_path)
    assert latest.name == "step-00000005"
    weights, _, _ = load_checkpoint(latest)
    assert all(torch.isfinite(w).all() for w in weights.values())
    (row,) = [r for r in read_history(tmp_path) if "loss" in r]
    assert row["step"] == 5 and row["nonfinite_skips"] == 3 and row["loss"] > 0  # steps 1-2 only


def test_a_window_of_skipped_steps_logs_no_loss(tmp_path, monkeypatch, caplog):
    """Skipped updates add no supervised weight; a window with no finite step has no loss (not 0.0)."""
    trainer = fresh_trainer(run_config(tmp_path, max_steps=4, max_nonfinite_skips=5, log_interval=2))
    real = trainer.target.forward
    monkeypatch.setattr(trainer.target, "forward",
                        lambda ids: real(ids) * (float("nan") if trainer.step >= 2 else 1.0))
    with caplog.at_level("INFO", logger="dflash"):
        trainer.fit()
    losses = {r["step"]: r["loss"] for r in read_history(tmp_path) if "loss" in r}
    assert losses[2] > 0 and losses[4] is None, losses
    assert "step 4/4 | loss n/a" in caplog.text and "nonfinite_skips 2" in caplog.text


def test_the_last_step_is_saved_once(tmp_path, monkeypatch):
    """When the last step is also a save step it is not saved again at the end, and a resume with no step
    left saves nothing (each re-save of a step is a window in which the only checkpoint is rewritten)."""
    import dflash.trainer as trainer_module

    saved = []
    real = trainer_module.save_checkpoint
    monkeypatch.setattr(trainer_module, "save_checkpoint", lambda *a, **k: saved.append(a[1]) or real(*a, **k))
    fresh_trainer(run_config(tmp_path, max_steps=6, save_interval=3)).fit()
    assert saved == [3, 6]
    again = fresh_trainer(run_config(tmp_path, max_steps=6, save_interval=3, resume_from="latest"))
    summary = again.fit()
    assert saved == [3, 6] and again.step == 6 and summary["checkpoint"].endswith("step-00000006")


class _Crash(Exception):
    pass


def _crash_at(monkeypatch, point: str) -> None:
    """Make dflash.run.checkpoint stop at a named point as a kill would (nothing after it runs)."""
    import dflash.run.checkpoint as ck

    def fault(name: str) -> None:
        if name == point:
            raise _Crash(point)

    monkeypatch.setattr(ck, "_fault", fault)


@pytest.mark.parametrize("point", ["save-write", "save-complete", "save-aside", "save-installed", "save-pointer",
                                   "delete"])
def test_saving_a_step_again_never_leaves_it_without_a_complete_copy(tmp_path, monkeypatch, point):
    """Re-saving an existing step (a resume from an older checkpoint reaches it again) renames the old copy
    aside and deletes it only once the new one is in place; interrupted anywhere, the next start has a
    complete checkpoint of that step (the old copy put back, or the new one)."""
    from dflash.run.checkpoint import damage, prepare_run_dir, save_checkpoint

    def save(value: float):
        save_checkpoint(tmp_path, 3, {"w": torch.full((4,), value)}, {"kind": "x"}, {"step": 3}, keep_last=1)

    save(1.0)
    _crash_at(monkeypatch, point)
    with pytest.raises(_Crash):
        save(2.0)
    monkeypatch.undo()
    prepare_run_dir(tmp_path)
    latest = find_latest(tmp_path)
    assert latest is not None and latest.name == "step-00000003" and damage(latest) is None
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")] == []
    # the weights file itself: `load_checkpoint` refuses this stand-in's draft_config.json (it describes no draft)
    value = load_file(str(latest / "draft.safetensors"))["w"][0].item()
    assert value == (1.0 if point in ("save-write", "save-complete", "save-aside") else 2.0)


def test_a_save_killed_before_it_moved_latest_is_still_the_newest(tmp_path, monkeypatch):
    """The newest checkpoint is the last save completed (a counter in COMPLETE), not the one `latest`
    names: a kill between the rename and the pointer update must not send the resume back a save."""
    import dflash.run.checkpoint as ck

    ck.save_checkpoint(tmp_path, 3, {"w": torch.ones(2)}, {}, {"step": 3}, keep_last=2)
    _crash_at(monkeypatch, "save-installed")
    with pytest.raises(_Crash):
        ck.save_checkpoint(tmp_path, 6, {"w": torch.ones(2)}, {}, {"step": 6}, keep_last=2)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000003"
    assert find_latest(tmp_path).name == "step-00000006"


def test_a_deletion_removes_the_complete_marker_first(tmp_path, monkeypatch):
    """Pruning deletes COMPLETE (made durable) before any file, so a kill part way through never leaves
    a folder that claims to be complete; the next start removes the remains."""
    import dflash.run.checkpoint as ck

    seen = []
    real_rmtree = ck.shutil.rmtree
    monkeypatch.setattr(ck.shutil, "rmtree", lambda path, **k: seen.append((path / "COMPLETE").exists())
                        or real_rmtree(path, **k))
    for step in (1, 2):
        ck.save_checkpoint(tmp_path, step, {"w": torch.ones(2)}, {}, {"step": step}, keep_last=1)
    assert seen == [False]  # the marker was gone when the files went
    monkeypatch.undo()
    _crash_at(monkeypatch, "delete")
    with pytest.raises(_Crash):
        ck.save_checkpoint(tmp_path, 3, {"w": torch.ones(2)}, {}, {"step": 3}, keep_last=1)
    half = tmp_path / "checkpoints" / "step-00000002"
    assert half.exists() and not (half / "COMPLETE").exists()
    ck.prepare_run_dir(tmp_path)
    assert not half.exists() and find_latest(tmp_path).name == "step-00000003"


@pytest.mark.parametrize("how", ["truncate-draft", "truncate-state", "missing-file", "broken-header",
                                 "same-size-state", "same-size-draft"])
def test_a_damaged_newest_checkpoint_falls_back_and_says_why(tmp_path, caplog, how):
    from dflash.run.checkpoint import CheckpointError, resolve_resume

    fresh_trainer(run_config(tmp_path, max_steps=4, save_interval=2)).fit()
    newest = tmp_path / "checkpoints" / "step-00000004"
    name = {"truncate-draft": "draft.safetensors", "truncate-state": "trainer_state.pt",
            "missing-file": "draft_config.json", "broken-header": "draft.safetensors",
            "same-size-state": "trainer_state.pt", "same-size-draft": "draft.safetensors"}[how]
    data = (newest / name).read_bytes()
    if how == "missing-file":
        (newest / name).unlink()
    elif how == "broken-header":
        (newest / name).write_bytes(data[:8] + b"{nonsense" + data[17:])
    elif how.startswith("same-size"):  # tensor bytes overwritten in place (NaNs): size and headers still whole
        middle = len(data) // 2
        (newest / name).write_bytes(data[:middle] + b"\xff" * 64 + data[middle + 64:])
        assert (newest / name).stat().st_size == len(data)
    else:
        (newest / name).write_bytes(data[: len(data) - 64])
    with caplog.at_level("WARNING"):
        assert resolve_resume("latest", tmp_path).name == "step-00000002"
    assert f"checkpoint {newest} is damaged ({name}" in caplog.text and "falling back" in caplog.text
    with pytest.raises(CheckpointError, match=f"checkpoint {newest} cannot be used: {name}"):
        resolve_resume(str(newest), tmp_path)  # named explicitly: one clear error naming the file
    (tmp_path / "checkpoints" / "step-00000002" / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no intact checkpoint"):  # never a silent restart at step 0
        resolve_resume("latest", tmp_path)


def test_a_full_disk_names_the_path_and_keeps_the_earlier_checkpoints(tmp_path, monkeypatch):
    import errno

    import dflash.run.checkpoint as ck

    trainer = fresh_trainer(run_config(tmp_path, max_steps=6, save_interval=3))
    real_write = ck._write

    def full(path, data):
        if trainer.step == 6 and path.name == "trainer_state.pt":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, data)

    monkeypatch.setattr(ck, "_write", full)
    with pytest.raises(ck.CheckpointWriteError) as caught:
        trainer.fit()
    message = str(caught.value)
    assert "step-00000006" in message and "trainer_state.pt: No space left on device" in message, message
    assert "\n" not in message
    names = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert "step-00000006" not in names and not [n for n in names if n.startswith(".tmp")]  # nothing half-written
    assert find_latest(tmp_path).name == "step-00000003" and ck.damage(find_latest(tmp_path)) is None


def test_a_pickled_callable_in_trainer_state_is_refused_and_never_runs(tmp_path):
    import pathlib

    from dflash.run.checkpoint import CheckpointError

    class Payload:  # what a malicious checkpoint carries: unpickling calls Path.touch(marker)
        def __reduce__(self):
            return (pathlib.Path.touch, (marker,))

    marker = tmp_path / "the-payload-ran"
    fresh_trainer(run_config(tmp_path / "run", max_steps=2)).fit()
    folder = tmp_path / "run" / "checkpoints" / "step-00000002"
    state = torch.load(folder / "trainer_state.pt", weights_only=True)
    torch.save({**state, "extra": Payload()}, folder / "trainer_state.pt")
    (folder / "COMPLETE").write_text("2")  # an older marker: no recorded sizes
    with pytest.raises(CheckpointError, match="trainer_state.pt holds objects other than tensors.*refused"):
        load_checkpoint(folder)
    with pytest.raises(CheckpointError, match="refused"):
        fresh_trainer(run_config(tmp_path / "run", max_steps=4, resume_from="latest")).fit()
    assert not marker.exists()


def test_a_refused_resume_leaves_config_yaml_alone_and_data_content_is_compared(tmp_path):
    fresh_trainer(run_config(tmp_path, max_steps=2)).fit()
    before = (tmp_path / "config.yaml").read_text()
    with pytest.raises(ValueError, match=r"batch_size: 4 -> 2"):
        fresh_trainer(run_config(tmp_path, max_steps=4, resume_from="latest", batch_size=2)).fit()
    assert (tmp_path / "config.yaml").read_text() == before
    with pytest.raises(ValueError, match=r"training data differs from what checkpoint .*step-00000002"):
        fresh_trainer(run_config(tmp_path, max_steps=4, resume_from="latest"), dataset=tokenized_rows(seed=1)).fit()
    assert (tmp_path / "config.yaml").read_text() == before


def test_schedule_changes_on_resume_are_accepted_and_logged(tmp_path, caplog):
    fresh_trainer(run_config(tmp_path, max_steps=2)).fit()
    resumed = fresh_trainer(run_config(tmp_path, max_steps=4, resume_from="latest", optim__lr=1e-3,
                                       optim__max_grad_norm=0.5))
    with caplog.at_level("INFO", logger="dflash"):
        resumed.fit()
    assert resumed.step == 4
    for change in ("max_steps: 2 -> 4", "optim.lr: 0.003 -> 0.001", "optim.max_grad_norm: 1.0 -> 0.5"):
        assert f"resume: {change} (accepted" in caplog.text, change
    assert "resume: resume_from" not in caplog.text  # differs by nature between launches: not reported


@pytest.mark.parametrize(("saved", "asked"), [("adamw", "muon"), ("muon", "adamw")])
def test_a_resume_under_another_optimizer_names_both_and_the_ways_on(tiny_target_dir, conversations_file, tmp_path,
                                                                    capsys, saved, asked):
    """Through the CLI: AdamW's state resumed under Muon ended in `error: 'state.fc.weight.step'`, and Muon's
    under AdamW loaded half a state silently (the CPU default is Muon, the GPU's AdamW)."""
    out = tmp_path / "run"
    args = _args(tiny_target_dir, conversations_file, out, "spec_eval_prompts=0", "progress_bar=false",
                 "export_on_finish=false")
    assert main([*args, "max_steps=2", f"optim.optimizer={saved}"]) == 0
    capsys.readouterr()
    assert main([*args, "max_steps=4", f"optim.optimizer={asked}", "resume_from=latest"]) == 2
    err = capsys.readouterr().err
    assert (f"checkpoint {out / 'checkpoints' / 'step-00000002'} holds {saved} optimizer state and this run asks "
            f"for optim.optimizer={asked}: one optimizer's state cannot continue another's. Resume with "
            f"optim.optimizer={saved}, or start a new run from its weights") in err
    assert "state.fc.weight" not in err and "Traceback" not in err


def test_metrics_jsonl_drops_what_was_logged_after_the_checkpoint(tmp_path):
    """A run killed after logging steps past its last checkpoint logs them again when it resumes: the
    lines (and a half-written last one) logged after that checkpoint's save are dropped first."""
    from dflash.report.sinks import truncate_history

    fresh_trainer(run_config(tmp_path, max_steps=4, save_interval=2, log_interval=1)).fit()
    jsonl = tmp_path / "metrics.jsonl"
    complete = jsonl.read_text()
    with jsonl.open("a") as f:
        f.write('{"step": 5, "loss": 1.0}\n{"step": 6, "lo')  # a kill mid-line
    resumed = fresh_trainer(run_config(tmp_path, max_steps=6, save_interval=2, log_interval=1,
                                       resume_from="latest"))
    resumed.fit()
    assert [r["step"] for r in read_history(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert jsonl.read_text().startswith(complete)
    jsonl.write_text(complete + '{"step": 5}\n{"step": 6, "lo')
    assert truncate_history(jsonl, 4) == 2 and jsonl.read_text() == complete  # without a saved length


def test_dataloader_workers_leave_sigterm_and_sigint_to_the_main_process():
    """A signal to the whole process group (scancel, preemption, Ctrl-C) reaches the workers too; they
    ignore it, so the main process can finish its step and save instead of dying of a worker's death."""
    import time

    from dflash.data.loader import Collator, make_dataloader

    loader = make_dataloader(tokenized_rows(n=64), 4, Collator(0, 8, 64), num_workers=2)
    batches = iter(loader)
    # One batch from each worker first: a worker has then run its init (the signal setting). In `fit` the
    # workers start after the trainer's own handler is installed, so they are never without one.
    next(batches), next(batches)
    for sig, worker in zip((signal.SIGTERM, signal.SIGINT), batches._workers, strict=True):
        os.kill(worker.pid, sig)
    time.sleep(0.5)
    assert sum(1 for _ in batches) == 64 // 4 - 2  # the rest of the epoch, from the same workers
    assert all(worker.exitcode in (None, 0) for worker in batches._workers)


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
    from dflash.evaluation.export import export_draft

    source = DFlashTrainer(tiny_config(), target=make_tiny_target())
    export_draft(source.draft, tmp_path / "exported")
    warm = DFlashTrainer(tiny_config(init_from=str(tmp_path / "exported")), target=make_tiny_target())
    bf16 = source.draft.fc.weight.to(torch.bfloat16).float()
    assert torch.equal(warm.draft.fc.weight, bf16) and warm.step == 0


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_graph_warm_up_leaves_the_optimizer_state_allocated_and_as_it_was(optimizer):
    """Before a CUDA-graph capture, warm-up steps allocate gradients and AdamW's state and are then undone
    in place. The capture must find the state already there (otherwise it records its lazy creation and
    every replay zeroes the moments and the step count again) and equal to what it was: zero in a fresh
    run, the loaded values in a resumed one. The lr tensor the schedule updates must still be the group's."""
    trainer = fresh_trainer(tiny_config(optim__optimizer=optimizer))
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
    reference = fresh_trainer(tiny_config(optim__optimizer=optimizer))
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
    lengths times the allowed anchor widths (4 by default), and each held-out batch (every valid anchor) has
    its own width: the limit covers both, plus 4 entries for what dynamo also keys on (grad mode, train / eval)."""
    import torch._dynamo.config as dynamo_config

    def limit_after(run) -> int:
        # Set and put back by hand: monkeypatch's undo deletes the attribute from dynamo's config module,
        # which breaks every later compile in the same process.
        saved = dynamo_config.recompile_limit, dynamo_config.accumulated_recompile_limit
        dynamo_config.recompile_limit, dynamo_config.accumulated_recompile_limit = 8, 256  # dynamo's defaults
        try:
            run()
            assert dynamo_config.accumulated_recompile_limit >= dynamo_config.recompile_limit
            return dynamo_config.recompile_limit
        finally:
            dynamo_config.recompile_limit, dynamo_config.accumulated_recompile_limit = saved

    cfg = run_config(tmp_path, max_steps=1, batch_size=1, data__max_length=2048, data__bucket_multiple=64,
                     eval_interval=0)
    shapes = 2048 // 64 * cfg.draft.anchor_widths
    assert limit_after(lambda: fresh_trainer(cfg).fit()) == shapes + 4
    rows = tokenized_rows(n=6)
    assert limit_after(lambda: fresh_trainer(cfg).evaluate(rows)) == shapes + 6 + 4  # 6 held-out batches

    from dflash.hf.trainer import dflash_collator  # Trainer integration: a last, smaller batch doubles the lengths

    assert limit_after(lambda: dflash_collator(None, cfg)) == 2 * (2048 // 64) + 4


@pytest.mark.parametrize(("scope", "seq"), [("layers", 24), ("step", 40)])
def test_compile_scopes_train_like_eager_keep_their_cache_and_log_each_new_shape(scope, seq, tmp_path, monkeypatch,
                                                                                   caplog):
    """`compile: true` in both scopes (the draft, and the CE chunks) gives the eager step's loss and weights
    (same seed, batch and anchors); the compiled code lands under the dflash
    cache (`$DFLASH_CACHE/inductor`) even after Inductor wrote its /tmp default into the environment; the first
    step of each batch shape is logged with its seconds, and a repeated shape is not. (Each case its own
    length: a shape another test compiled in this process is reused from memory and writes nothing.)"""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, default_cache_dir())  # what Inductor leaves there once asked
    batch = random_batch(seq=seq)
    runs = []
    for compile_ in (False, True):
        trainer = DFlashTrainer(tiny_config(compile=compile_, compile_scope=scope), target=make_tiny_target())
        assert trainer.objective.compile_loss is compile_  # the CE chunks too
        with caplog.at_level(logging.INFO, logger="dflash"):
            trainer.train_step(batch)
        runs.append((trainer.metrics.flush()["loss"], trainer.draft.state_dict()))
    (loss0, w0), (loss1, w1) = runs
    assert loss1 == pytest.approx(loss0, rel=1e-5)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], rtol=1e-4, atol=1e-5, msg=k)
    assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "inductor")
    assert any((tmp_path / "inductor").rglob("*.py")), "no compiled code written under the dflash cache"
    with caplog.at_level(logging.INFO, logger="dflash"):
        trainer.train_step(batch)  # a shape seen before: no log line
        trainer.train_step(random_batch(seq=seq - 8))
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling for shape")]
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled for shape")]
    assert started == [f"compiling for shape [4 x {seq}] ...", f"compiling for shape [4 x {seq - 8}] ..."], started
    assert len(done) == 2 and all(m.endswith(" s") for m in done) and len(trainer.shape_log.seconds) == 2


def test_a_chosen_inductor_cache_folder_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    assert keep_compile_cache(tmp_path / "dflash") == tmp_path / "mine"
    with pytest.raises(ValueError, match="compile_scope 'everything'"):
        compile_draft_call(lambda: None, [], "everything")


def test_a_short_last_window_is_logged_marked_and_kept_out_of_the_summary_and_plots(tmp_path, monkeypatch):
    """A time budget ending 2 steps into a 4-step window: that window is logged with its 2 steps and
    `partial_window`, the summary's training metrics are the last full window's, and the plots leave it out."""
    monkeypatch.setattr("dflash.run.stopping.StopRequest.due", lambda self, step, at_flush: step >= 6)
    trainer = fresh_trainer(run_config(tmp_path / "run", max_steps=20, log_interval=4))
    summary = trainer.fit()
    train_rows = [row for row in trainer.history if "loss" in row]
    assert [row["step"] for row in train_rows] == [4, 6] and summary["steps"] == 6
    assert train_rows[-1]["partial_window"] is True and train_rows[-1]["steps"] == 2
    assert "partial_window" not in train_rows[0] and train_rows[0]["steps"] == 4
    assert summary["train"]["loss"] == train_rows[0]["loss"] and "partial_window" not in summary["train"]
    assert read_history(tmp_path / "run")[-1]["partial_window"] is True  # kept in metrics.jsonl, marked
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    from dflash.report.plot import history_figures  # the optional extra

    axes = history_figures(trainer.history)["loss"].axes[0]
    assert list(axes.lines[0].get_xdata()) == [4]
    assert all(float(t).is_integer() for t in axes.get_xticks())  # no 3.5 on a short run's step axis
