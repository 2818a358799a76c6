"""Metrics sinks: JSONL always, wandb offline, tensorboard when installed."""

from __future__ import annotations

import json

import pytest

from dflash.reporting import Reporter, format_line, read_history


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
