"""No run destroys another's files (`dflash.run.folder`): dangerous and foreign folders are refused before
anything is written, a previous run is continued or replaced only when asked, one run holds the folder at
a time, and the metrics a resume goes back past are kept until it ends past them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli import _args

from dflash.cli.main import main
from dflash.report.sinks import HISTORY_BACKUP, Reporter, last_step
from dflash.run.folder import LOCK_NAME, RUN_ENTRIES, RUN_RECORD, RunFolderError, RunLock, claim

ROOT = Path(__file__).resolve().parents[1]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("path", ["/", "/tmp", "~"])
def test_system_and_home_folders_are_refused(path):
    with pytest.raises(RunFolderError, match="system or home folder"):
        claim(Path(path).expanduser(), resume_from=None, overwrite=True)


@pytest.mark.parametrize("resume_from,overwrite", [(None, False), ("latest", False), (None, True)])
def test_a_foreign_folder_is_refused_and_left_byte_for_byte(tmp_path, resume_from, overwrite):
    """Another trainer's folder, with a checkpoint that has no COMPLETE marker: the cleaning of interrupted
    saves used to delete it. Refused whatever is asked, and nothing is written into it (not even a lock)."""
    other = tmp_path / "other"
    (other / "checkpoints" / "step-2000").mkdir(parents=True)
    (other / "checkpoints" / "step-2000" / "model.bin").write_bytes(os.urandom(1024))
    (other / "notes.txt").write_text("mine")
    before = snapshot(other)
    with pytest.raises(RunFolderError, match="not a dflash run folder .*checkpoints, notes.txt"):
        claim(other, resume_from=resume_from, overwrite=overwrite)
    assert snapshot(other) == before and sorted(os.listdir(other)) == ["checkpoints", "notes.txt"]


def previous_run(folder: Path) -> dict[str, bytes]:
    lock = claim(folder, resume_from=None, overwrite=False)
    lock.release()
    (folder / "config.yaml").write_text("max_steps: 40\n")
    (folder / "metrics.jsonl").write_text('{"step": 10, "loss": 2.0}\n{"step": 40, "loss": 1.0}\n')
    ckpt = folder / "checkpoints" / "step-00000040"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("{}")
    (folder / "notes.txt").write_text("the user's own")
    return snapshot(folder)


def test_a_previous_run_is_refused_naming_the_choices_then_continued_or_replaced(tmp_path):
    run = tmp_path / "run"
    before = previous_run(run)
    with pytest.raises(RunFolderError, match="holds a previous run \\(checkpoints up to step-00000040, metrics "
                                             "logged to step 40\\): continue it with resume_from=latest, replace "
                                             "it with overwrite_output_dir=true"):
        claim(run, resume_from=None, overwrite=False)
    assert snapshot(run) == before  # refused: nothing touched
    claim(run, resume_from="latest", overwrite=False).release()  # its own run: continued
    assert snapshot(run) == before
    record = json.loads((run / RUN_RECORD).read_text())
    claim(run, resume_from=None, overwrite=True).release()  # replaced: only what dflash writes goes
    assert sorted(os.listdir(run)) == [LOCK_NAME, "notes.txt", RUN_RECORD]
    assert json.loads((run / RUN_RECORD).read_text())["run_id"] != record["run_id"]


def test_a_second_run_on_a_locked_folder_fails_naming_the_holder_and_a_stale_lock_is_taken_over(tmp_path, caplog):
    run = tmp_path / "run"
    lock = claim(run, resume_from=None, overwrite=False)
    with pytest.raises(RunFolderError, match=f"in use by another dflash run \\(pid {os.getpid()} on "):
        claim(run, resume_from="latest", overwrite=False)
    lock.release()
    claim(run, resume_from="latest", overwrite=False).release()  # released: free again
    (run / LOCK_NAME).write_text(json.dumps({"pid": 999999, "host": "gone", "since": "earlier"}))  # a killed holder
    with caplog.at_level("WARNING", logger="dflash"):
        RunLock(run).release()
    assert "ended without releasing it (pid 999999 on gone" in caplog.text


def test_two_dflash_train_processes_on_one_folder(tmp_path, tiny_target_dir, conversations_file):
    """The first holds the folder until its SIGTERM save; the second fails at start (exit 2) and leaves the
    first's files alone; a third, run again without a choice, is refused; with overwrite it replaces the run."""
    out = tmp_path / "run"
    args = _args(tiny_target_dir, conversations_file, out, "spec_eval_prompts=0", "progress_bar=false")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    first = subprocess.Popen([sys.executable, "-m", "dflash", *args, "max_steps=100000"], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.5)
        second = subprocess.run([sys.executable, "-m", "dflash", *args, "max_steps=2", "resume_from=latest"],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"is in use by another dflash run (pid {first.pid} on " in second.stderr
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=240) == 143
    finally:
        first.kill()
    first_ckpt = json.loads((out / "summary.json").read_text())["checkpoint"]
    assert Path(first_ckpt).is_dir()
    assert main([*args, "max_steps=2"]) == 2 and Path(first_ckpt).is_dir()  # no choice made: refused
    assert main([*args, "max_steps=2", "overwrite_output_dir=true"]) == 0
    assert not Path(first_ckpt).exists() and (out / "checkpoints" / "step-00000002").is_dir()
    assert set(os.listdir(out)) <= RUN_ENTRIES | {"cache"}  # everything a run writes is a run entry


def lines(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_the_last_logged_step_skips_a_half_written_line():
    assert last_step(b'{"step": 3}\n{"step": 4, "lo') == 3 and last_step(b"") == -1 and last_step(b'{"step": 5}\n') == 5


def test_metrics_a_resume_went_back_past_are_kept_until_it_ends_past_them(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 11)))
    Reporter(tmp_path, [], {}, console=False, resumed={"step": 4}).close()  # resumed, then killed at once
    assert lines(jsonl) == [1, 2, 3, 4] and lines(tmp_path / HISTORY_BACKUP) == list(range(1, 11))
    reporter = Reporter(tmp_path, [], {}, console=False, resumed={"step": 2})  # an older resume: keep the longer
    assert lines(tmp_path / HISTORY_BACKUP) == list(range(1, 11))
    for step in range(3, 12):
        reporter.log(step, {"loss": 0.5})
    # Logged past them, but a kill before this run's last save would resume a checkpoint they belong to
    # (tests/test_foreign_files.py): they go only when the run ends (`close`, after its last save).
    assert lines(tmp_path / HISTORY_BACKUP) == list(range(1, 11))
    reporter.close()
    assert not (tmp_path / HISTORY_BACKUP).exists() and lines(jsonl) == list(range(1, 12))
    jsonl.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    reporter = Reporter(tmp_path, [], {}, console=False, resumed={"step": 3})
    reporter.log(4, {})
    reporter.log(5, {})
    reporter.close()  # ended having logged every step again
    assert not (tmp_path / HISTORY_BACKUP).exists()


@pytest.mark.parametrize("attempt", [1, 2])  # the second would find the first's `runs/` in a shared folder
def test_every_test_starts_in_an_empty_folder_of_its_own_outside_the_clone(attempt):
    """A clone where `dflash train` already ran holds `runs/embedded/`: a test that used the default `output_dir`
    there was refused (issue 53). conftest's `_own_working_folder` gives every test an empty working folder."""
    cwd = Path.cwd().resolve()
    assert not cwd.is_relative_to(ROOT) and not any(cwd.iterdir()), cwd
    Path("runs").mkdir()  # the next test must not see it
