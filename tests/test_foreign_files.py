"""No run deletes, truncates or prunes what it does not own (issue 54), each drill through the CLI:

- a foreign folder that holds a `config.yaml` is not a dflash run (only dflash's `run.json` says so), and a
  user's `checkpoints/step-best/` or a file beside the export survives resumes, pruning and an overwrite;
- no write or prune goes through a link the run did not make (a lock file linked to a user's file, a
  `checkpoints/` linked into another run, a checkpoint folder linked to another run's);
- a launch that went back to an older checkpoint and was killed before its first checkpoint leaves the
  metrics it went back past for the next resume, which takes them back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import _args

from dflash.cli.main import main
from dflash.report.sinks import HISTORY_BACKUP
from dflash.run.folder import ENGINE_REPORT_NAME, REPORT_NAME, RUN_RECORD, new_report_path, own_export_file

ROOT = Path(__file__).resolve().parents[1]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (links followed, as a reader sees them) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def train(tiny_target_dir, conversations_file, tmp_path):
    """`train(out, *overrides)`: `dflash train` on the tiny target, in-process; the data cache outside `out`
    (so a refused folder can be compared byte for byte) and no end-of-run export or decoding unless asked."""
    def run(out: Path, *extra: str) -> int:
        return main(_args(tiny_target_dir, conversations_file, out, "spec_eval_prompts=0", "progress_bar=false",
                          "export_on_finish=false", f"data.cache_dir={tmp_path / 'cache'}", *extra))
    return run


# ---- 1. a folder is dflash's only by its run record; only dflash's names are removed ----------------------


@pytest.mark.parametrize("choice", [[], ["resume_from=latest"], ["overwrite_output_dir=true"]])
def test_a_foreign_folder_with_a_config_yaml_is_refused_and_left_byte_for_byte(train, tmp_path, capsys, choice):
    """The drill: `checkpoints/step-2000` and a `config.yaml` made the folder pass for a dflash run: a resume
    deleted the checkpoint and replaced config.yaml, an overwrite deleted both with metrics.jsonl and wandb/."""
    other = tmp_path / "o"
    (other / "checkpoints" / "step-2000").mkdir(parents=True)
    (other / "checkpoints" / "step-2000" / "model.bin").write_bytes(os.urandom(256))
    (other / "config.yaml").write_text("x\n")
    (other / "metrics.jsonl").write_text('{"step": 1}\n')
    (other / "wandb").mkdir()
    (other / "wandb" / "run.log").write_text("theirs")
    before = snapshot(other)
    assert train(other, "max_steps=2", *choice) == 2
    err = capsys.readouterr().err
    assert f"output_dir {other} is not a dflash run folder (no dflash {RUN_RECORD}; it holds checkpoints, " in err
    assert "resume_from=<its checkpoint folder>" in err  # a config.yaml: the way to continue an older dflash's run
    assert snapshot(other) == before and sorted(os.listdir(other)) == ["checkpoints", "config.yaml", "metrics.jsonl",
                                                                        "wandb"]


def test_a_users_files_in_checkpoints_and_export_survive_resume_pruning_and_overwrite(train, tmp_path, capsys):
    """`checkpoints/step-best/` matched the clean-up's `step-*` and was deleted as a half-deleted checkpoint;
    an overwrite removed `checkpoints/` and `export/` whole, a user's files with them."""
    run = tmp_path / "run"
    assert train(run, "max_steps=2", "save_interval=1", "keep_last=1") == 0
    best = run / "checkpoints" / "step-best"
    best.mkdir()
    (best / "model.bin").write_bytes(b"the user's best")
    (run / "checkpoints" / "step-1").mkdir()  # not dflash's 8-digit name either, and no COMPLETE marker
    (run / "export").mkdir()
    (run / "export" / "notes.txt").write_text("mine")
    assert train(run, "max_steps=4", "save_interval=1", "keep_last=1", "resume_from=latest") == 0
    assert (best / "model.bin").read_bytes() == b"the user's best" and (run / "checkpoints" / "step-1").is_dir()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-00000004", "step-1", "step-best"]
    capsys.readouterr()
    assert train(run, "max_steps=2", "overwrite_output_dir=true") == 0
    out = capsys.readouterr()
    assert "kept what dflash did not write: checkpoints/step-1, checkpoints/step-best, export/notes.txt" in out.err + out.out
    assert (best / "model.bin").read_bytes() == b"the user's best" and (run / "export" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-00000002", "step-1", "step-best"]


def test_a_finished_runs_export_holds_only_the_names_an_overwrite_removes(train, tmp_path):
    """`own_export_file` is what an overwrite removes from `export/` (anything else is kept as the user's): the
    draft's files and every report `dflash eval` writes beside them, eval-2.json and eval_vllm-2.json included
    (those were kept as a user's files, so the folder stayed)."""
    run = tmp_path / "run"
    assert train(run, "max_steps=2", "export_on_finish=true", "spec_eval_prompts=2") == 0
    names = set(os.listdir(run / "export"))
    assert {"model.safetensors", "config.json", "eval.json"} <= names and all(map(own_export_file, names)), names
    for report in (REPORT_NAME, ENGINE_REPORT_NAME, REPORT_NAME):  # as `dflash eval` (--engine vllm) names them
        new_report_path(run / "export", report).write_text("{}")
    assert {"eval-2.json", "eval_vllm.json", "eval-3.json"} <= set(os.listdir(run / "export"))
    assert train(run, "max_steps=2", "overwrite_output_dir=true") == 0
    assert not (run / "export").exists()  # only dflash's files were there: the folder went with them
    assert not any(map(own_export_file, ["eval-1.json", "eval-02.json", "eval_vllm-x.json", "my-eval.json", "notes"]))


# ---- 2. no write or prune through a link the run did not make --------------------------------------------


@pytest.mark.parametrize("link", ["symbolic", "hard"])
@pytest.mark.parametrize("previous", [False, True])
def test_a_lock_file_linked_to_a_users_file_is_refused_and_the_file_kept(train, tmp_path, capsys, link, previous):
    """The drill: `ln -s $PWD/victim.txt r/.dflash.lock`, then a run on `r` emptied victim.txt."""
    victim, run = tmp_path / "victim.txt", tmp_path / "r"
    victim.write_text("the user's text\n")
    if previous:  # a real run's folder whose lock file was replaced by the link
        assert train(run, "max_steps=2") == 0
        (run / ".dflash.lock").unlink()
    run.mkdir(exist_ok=True)
    (os.symlink if link == "symbolic" else os.link)(victim, run / ".dflash.lock")
    choice = ["resume_from=latest", "max_steps=4"] if previous else ["max_steps=2"]
    assert train(run, *choice) == 2
    err = capsys.readouterr().err
    assert victim.read_text() == "the user's text\n"
    if link == "symbolic":
        assert f"{run / '.dflash.lock'} is a symbolic link (to {victim}): dflash never writes" in err
    else:
        assert f"{run / '.dflash.lock'} is a hard link (2 names)" in err
    assert f"rm {run / '.dflash.lock'}" in err  # the fix, named


@pytest.mark.parametrize("choice", [["resume_from=latest"], ["overwrite_output_dir=true"]])
def test_a_checkpoints_link_into_another_run_is_refused_and_that_run_untouched(train, tmp_path, capsys, choice):
    """The drill: a `checkpoints/` link into another run: the resume pruned that run's checkpoints."""
    other, run = tmp_path / "other", tmp_path / "run"
    assert train(other, "max_steps=4", "save_interval=1", "keep_last=4") == 0
    assert train(run, "max_steps=2") == 0
    before = snapshot(other)
    os.rename(run / "checkpoints", tmp_path / "moved")
    os.symlink(other / "checkpoints", run / "checkpoints")
    assert train(run, "max_steps=6", "save_interval=1", "keep_last=1", *choice) == 2
    assert f"{run / 'checkpoints'} is a symbolic link (to {other / 'checkpoints'})" in capsys.readouterr().err
    assert snapshot(other) == before


def test_a_checkpoint_folder_linked_to_another_runs_is_not_pruned_through(train, tmp_path):
    """A `step-00000001` link to another run's checkpoint: pruning removed COMPLETE through it, so the other
    run's checkpoint read as half-deleted (and was deleted at its next start)."""
    other, run = tmp_path / "other", tmp_path / "run"
    assert train(other, "max_steps=1", "save_interval=1") == 0
    assert train(run, "max_steps=2", "save_interval=2") == 0
    before = snapshot(other)
    os.symlink(other / "checkpoints" / "step-00000001", run / "checkpoints" / "step-00000001")
    assert train(run, "max_steps=4", "save_interval=1", "keep_last=1", "resume_from=latest") == 0
    assert snapshot(other) == before and (run / "checkpoints" / "step-00000001").is_symlink()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-00000001", "step-00000004"]


# ---- 3. a killed rewind keeps the metrics it went back past ------------------------------------------------


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("rewind_to,interval,logged", [
    (2, 2, [1, 2, 3, 4]),  # the drill: killed in its first save (step 4)
    (4, 10, list(range(1, 11))),  # logged past the old end (steps 9, 10) before its first save (step 10)
])
def test_a_rewind_killed_before_its_first_checkpoint_loses_no_metrics(train, tiny_target_dir, conversations_file,
                                                                      tmp_path, rewind_to, interval, logged):
    """The drill: run to step 8, relaunch from an older checkpoint and SIGKILL it in its first save, then
    resume `latest` (the step-8 checkpoint): steps 5-8 were gone from metrics.jsonl, and the backup holding
    them deleted (by the killed launch once it logged past step 8, or by the resume once it did)."""
    run = tmp_path / "run"
    common = ["keep_last=4", "log_interval=1", "max_steps=10"]
    assert train(run, *common, "max_steps=8", "save_interval=2") == 0
    first = (run / "metrics.jsonl").read_bytes()
    assert steps(run / "metrics.jsonl") == [*range(1, 9), 8]  # and the end-of-run evaluation's line
    args = _args(tiny_target_dir, conversations_file, run, "spec_eval_prompts=0", "progress_bar=false",
                 "export_on_finish=false", f"data.cache_dir={tmp_path / 'cache'}", *common, f"save_interval={interval}",
                 f"resume_from={run / 'checkpoints' / f'step-{rewind_to:08d}'}")
    env = {**os.environ, "DFLASH_FAULT": "save-write:1", "PYTHONPATH": str(ROOT)}  # killed in its first save
    proc = subprocess.run([sys.executable, "-m", "dflash", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert steps(run / "metrics.jsonl") == logged and (run / HISTORY_BACKUP).read_bytes() == first
    assert train(run, *common, "save_interval=2", "resume_from=latest") == 0  # latest: the step-8 checkpoint
    data = (run / "metrics.jsonl").read_bytes()
    assert data.startswith(first[:first.rindex(b'{"step": 8, "eval_')])  # steps 1-8 as the first launch logged them
    assert steps(run / "metrics.jsonl") == [*range(1, 11), 10]
    assert not (run / HISTORY_BACKUP).exists()  # metrics.jsonl holds them again: the copy is no longer needed
