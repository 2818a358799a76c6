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
    on_gpu = window_metrics(flushed, elapsed=2.0, tokens=1000, peak_bytes=3 * 2**29)  # a GPU run: its peak memory
    assert format_line(4, 8, on_gpu) == "step 4/8 | loss 1.0000 | tau 1.200 | tokens/s 500 | peak GiB 1.5"


def test_held_out_rows_outnumbering_training_rows_warn():
    assert split_warning(100, 32) is None and split_warning(32, 32) is None
    assert split_warning(7, 32).startswith("32 held-out rows outnumber the 7 training rows")
