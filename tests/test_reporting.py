"""Metrics sinks: JSONL always, wandb offline, tensorboard when installed."""

from __future__ import annotations

import json

import pytest

from dflash.data.corpus import split_warning
from dflash.report.sinks import Reporter, format_line, read_history, window_metrics


def test_jsonl_and_console_line(tmp_path):
    r = Reporter(tmp_path, [], {"a": 1})
    r.log(10, {"loss": 1.5, "tau": 2.25, "per_position_accuracy": [0.5, 0.25]}, max_steps=100)
    r.close()
    assert read_history(tmp_path) == [{"step": 10, "loss": 1.5, "tau": 2.25, "per_position_accuracy": [0.5, 0.25]}]
    assert format_line(10, 100, {"loss": 1.5, "tau": 2.25}) == "step 10/100 | loss 1.5000 | tau 2.250"


def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    r = Reporter(tmp_path, ["wandb"], {"lr": 1e-3})
    r.log(1, {"loss": 2.0, "per_position_accuracy": [0.1]})
    r.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and any(f.suffix == ".wandb" for f in runs[0].iterdir())
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["loss"] == 2.0


def test_a_max_steps_off_the_log_interval_ends_in_a_marked_window(tiny_target_dir, conversations_file, tmp_path):
    """`dflash train max_steps=10 log_interval=4`: the last window has 2 steps. It is logged with them, marked
    `partial_window` like a time budget's, the summary's training figures are step 8's full window, and the
    plots leave it out (it was reported and drawn as a full window)."""
    from test_cli import _args

    from dflash.cli.main import main
    from dflash.report.plot import series

    out = tmp_path / "run"
    assert main(_args(tiny_target_dir, conversations_file, out, "max_steps=10", "log_interval=4",
                      "spec_eval_prompts=0")) == 0
    history = read_history(out)
    windows = {row["step"]: row for row in history if "tokens_per_s" in row}
    assert sorted(windows) == [4, 8, 10] and [windows[s]["steps"] for s in (4, 8, 10)] == [4, 4, 2]
    assert windows[10]["partial_window"] is True and not any("partial_window" in windows[s] for s in (4, 8))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["train"] == {k: v for k, v in windows[8].items() if k != "step"}
    assert series(history, "loss")[0] == [4, 8]
    assert series([windows[10]], "loss")[0] == [10]  # a run shorter than one window still draws its point


def _recording_wandb_init(monkeypatch) -> list[tuple[str, str, list[str]]]:
    """wandb.init as it is, recording each run's (project, name, tags) as the run object reads them."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    runs, init = [], wandb.init

    def recording(*args, **kwargs):
        run = init(*args, **kwargs)
        runs.append((run.project, run.name, sorted(run.tags)))
        return run

    monkeypatch.setattr(wandb, "init", recording)
    return runs


def test_dflash_train_names_the_wandb_run_as_asked(tiny_target_dir, conversations_file, tmp_path, monkeypatch):
    """The config's wandb_project, run_name and wandb_tags reach the wandb run of `dflash train`; the key wins
    over WANDB_PROJECT (the run went to the project "dflash" whatever either said)."""
    from test_cli import _args

    from dflash.cli.main import main

    runs = _recording_wandb_init(monkeypatch)
    monkeypatch.setenv("WANDB_PROJECT", "from-the-environment")
    assert main(_args(tiny_target_dir, conversations_file, tmp_path / "run", "max_steps=2", "spec_eval_prompts=0",
                      "report_to=[wandb]", "wandb_project=drafts", "run_name=tiny-seed-0",
                      "wandb_tags=[cpu,tiny]")) == 0
    assert runs == [("drafts", "tiny-seed-0", ["cpu", "tiny"])]
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_the_wandb_project_is_the_key_else_wandb_project_else_dflash(tmp_path, monkeypatch):
    from dflash.config import TrainConfig

    runs = _recording_wandb_init(monkeypatch)
    monkeypatch.setenv("WANDB_PROJECT", "from-the-environment")
    Reporter(tmp_path / "key", ["wandb"], TrainConfig(wandb_project="drafts").to_dict()).close()
    Reporter(tmp_path / "env", ["wandb"], TrainConfig().to_dict()).close()
    monkeypatch.delenv("WANDB_PROJECT")
    Reporter(tmp_path / "default", ["wandb"], TrainConfig().to_dict()).close()
    assert [project for project, _, tags in runs] == ["drafts", "from-the-environment", "dflash"]
    assert all(tags == [] for _, _, tags in runs)


def test_unknown_sink_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown sink"):
        Reporter(tmp_path, ["mlflow"], {})


def test_throughput_is_input_tokens_per_second_over_all_ranks_and_per_rank():
    flushed = {"loss": 1.0, "tau": 1.2, "supervised_tokens": 300.0}
    two = window_metrics(flushed, elapsed=2.0, tokens=1000, world_size=2)  # this rank: 1000 tokens in 2 s
    assert (two["tokens_per_s"], two["tokens_per_s_per_rank"], two["supervised_tokens_per_s"]) == (1000.0, 500.0, 150.0)
    assert format_line(4, 8, two) == ("step 4/8 | loss 1.0000 | tau 1.200 | tokens/s 1,000 over 2 ranks "
                                      "(500 per rank)")
    one = window_metrics(flushed, elapsed=2.0, tokens=1000)
    assert format_line(4, 8, one) == "step 4/8 | loss 1.0000 | tau 1.200 | tokens/s 500"
    assert window_metrics({**flushed, "steps": 4}, elapsed=2.0, tokens=1000)["step_ms"] == 500.0  # 2 s over 4 steps
    on_gpu = window_metrics(flushed, elapsed=2.0, tokens=1000, peak_bytes=3 * 2**29)  # a GPU run: its peak memory
    assert format_line(4, 8, on_gpu) == "step 4/8 | loss 1.0000 | tau 1.200 | tokens/s 500 | peak GiB 1.5"


def test_held_out_rows_outnumbering_training_rows_warn():
    assert split_warning(100, 32) is None and split_warning(32, 32) is None
    assert split_warning(7, 32).startswith("32 held-out rows outnumber the 7 training rows")


def test_the_phase_timer_sums_a_phase_counts_a_failed_one_and_times_a_first_call_once():
    """`dflash.report.phases`: what RUN/summary.json's `wall_seconds` and `phases` are made of."""
    from dflash.report.phases import PhaseTimer, dflash_version

    now = [100.0]

    def tick(seconds):
        now[0] += seconds
        return seconds

    timer = PhaseTimer(clock=lambda: now[0])
    with timer("data_preparation"):
        tick(2.0)
    for seconds in (5.0, 1.0, 1.0):  # the first call only: the compiling step
        timer.first("first_step", tick, seconds)
    with pytest.raises(RuntimeError), timer("training"):  # a phase cut short still took its time
        tick(3.0)
        raise RuntimeError("stopped")
    assert timer.timed("export", tick, 0.25) == 0.25
    with timer("data_preparation"):  # entered twice: summed
        tick(0.5)
    record = timer.record()
    assert record == {"dflash_version": dflash_version(), "wall_seconds": 12.75,
                      "phases": {"data_preparation": 2.5, "first_step": 5.0, "training": 3.0, "export": 0.25}}


def test_write_summary_records_the_version_and_the_phases_and_a_signal_stop(tmp_path, caplog):
    """RUN/summary.json gets `dflash_version` always, `wall_seconds` and `phases` from the run's timer, and a signal's
    stop marks it interrupted with a log line saying how to continue."""
    import logging

    from dflash.report.phases import PhaseTimer, dflash_version
    from dflash.report.sinks import write_summary

    plain = write_summary(tmp_path, {"steps": 3})
    assert plain == {"steps": 3, "dflash_version": dflash_version()}
    with caplog.at_level(logging.INFO, logger="dflash"):
        stopped = write_summary(tmp_path, {"steps": 5, "checkpoint": "RUN/checkpoints/step-00000005"},
                                timer=PhaseTimer(), stopped_by="SIGINT")
    assert stopped["interrupted"] and stopped["signal"] == "SIGINT" and stopped["wall_seconds"] >= 0
    assert json.loads((tmp_path / "summary.json").read_text()) == stopped
    assert ("stopped by signal SIGINT at step 5; saved RUN/checkpoints/step-00000005; to continue, run again with "
            "resume_from=latest (the same output_dir) or resume_from=RUN/checkpoints/step-00000005") in caplog.text
