"""What a run shows: progress bars on the long phases (rank 0, `progress_bar`), log lines routed around
them, `datasets`' bars quieted, dflash's logs in notebooks, the launch banner and the final table."""

from __future__ import annotations

import logging
import sys
import types

import datasets
import pytest
import torch
from helpers import make_chat_target, make_tiny_target, tiny_config

import dflash.report.console as console
from dflash.config import TrainConfig
from dflash.data.regenerate import regenerate
from dflash.evaluation.speculative import evaluate_speculative
from dflash.trainer import DFlashTrainer


class _Bars:
    """Stands in for tqdm: records every bar's description, total, steps and whether it was drawn."""

    def __init__(self):
        self.made = []

    def __call__(self, total=None, desc="", disable=False, **kwargs):
        bar = types.SimpleNamespace(desc=desc, total=total, drawn=not disable, n=0, closed=False)
        bar.update = lambda n=1: setattr(bar, "n", bar.n + n)
        bar.set_postfix_str = lambda text: None
        bar.close = lambda: setattr(bar, "closed", True)
        self.made.append(bar)
        return bar


@pytest.fixture
def bars(monkeypatch):
    recorder = _Bars()
    monkeypatch.setattr(console, "tqdm", recorder)
    monkeypatch.delenv("RANK", raising=False)
    console.set_progress_bars(True)  # the default; an earlier run's `progress_bar: false` holds until the next run
    yield recorder
    console.set_progress_bars(True)


def test_regeneration_held_out_and_speculative_evaluation_draw_bars(bars, tokenizer, tmp_path):
    chat_model = make_chat_target(tokenizer, num_layers=1, hidden=32)
    conversations = [{"id": str(i), "messages": [{"role": "user", "content": f"Say {i}"}]} for i in range(5)]
    regenerate(conversations, chat_model, tokenizer, tmp_path / "regen.jsonl", batch_size=2, max_new_tokens=2)

    target = make_tiny_target()
    trainer = DFlashTrainer(tiny_config(), target=target)
    rows = datasets.Dataset.from_dict({"input_ids": [list(range(1, 21))] * 6, "loss_mask": [[0] * 4 + [1] * 16] * 6})
    trainer.evaluate(rows)
    evaluate_speculative(target, trainer.draft.eval(), [[1, 2, 3], [4, 5, 6]], max_new_tokens=4, warmup=False)

    shown = {b.desc: (b.total, b.n, b.drawn, b.closed) for b in bars.made}
    assert shown == {"regenerating": (5, 5, True, True), "held-out eval": (2, 2, True, True),
                     "speculative eval": (2, 2, True, True)}

    bars.made.clear()
    console.set_progress_bars(False)  # progress_bar: false
    evaluate_speculative(target, trainer.draft, [[1, 2, 3]], max_new_tokens=2, warmup=False)
    assert [b.drawn for b in bars.made] == [False]


def test_bars_are_drawn_on_rank_0_only(bars, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert list(console.progress([1, 2, 3], desc="x")) == [1, 2, 3]
    assert not bars.made[-1].drawn and console.process_rank() == 1
    monkeypatch.setenv("RANK", "0")
    assert console.ProgressBar(3, desc="y").bar.drawn


def test_log_lines_go_through_the_bar_while_it_is_open():
    log = logging.getLogger("dflash")
    handler = logging.StreamHandler(sys.stderr)  # a console handler, like the CLI's
    log.addHandler(handler)
    try:
        with console.ProgressBar(2, desc="x") as bar:
            assert handler not in log.handlers  # replaced by one that writes above the bar (tqdm.write)
            assert any(type(h).__name__ == "_TqdmLoggingHandler" for h in log.handlers)
            bar.update(2)
        assert handler in log.handlers and not any(type(h).__name__ == "_TqdmLoggingHandler" for h in log.handlers)
    finally:
        log.removeHandler(handler)


def test_datasets_bars_are_quiet_during_data_preparation_and_restored():
    assert not datasets.are_progress_bars_disabled()
    with console.quiet_datasets():
        assert datasets.are_progress_bars_disabled()
    assert not datasets.are_progress_bars_disabled()


def test_notebooks_show_dflash_logs_when_nothing_configured_logging(monkeypatch):
    log = logging.getLogger("dflash")
    monkeypatch.setattr(log, "handlers", [])
    monkeypatch.setattr(logging.root, "handlers", [])
    monkeypatch.setattr(log, "level", logging.NOTSET)
    assert not console.show_logs_in_notebook()  # plain Python: nothing changes
    kernel = type("ZMQInteractiveShell", (), {})()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: kernel))
    assert console.show_logs_in_notebook() and log.getEffectiveLevel() == logging.INFO
    assert [h.stream for h in log.handlers] == [sys.stdout]
    assert not console.show_logs_in_notebook()  # once


def test_launch_banner_and_summary_table(monkeypatch):
    config = TrainConfig(output_dir="runs/x", compile=True)
    banner = console.launch_banner(config, world_size=4, device="cuda:0", dtype=torch.bfloat16, attention="flex",
                                   backend="nccl")
    assert banner.splitlines()[0] == "launch: 4 processes: data parallel 4 x tensor parallel 1 | distributed ddp over nccl"
    assert "compute bfloat16, draft weights float32 | attention flex | compile on, CUDA graph off" in banner
    for name in ("ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(name, raising=False)
    plain = console.launch_banner(config, world_size=1, device="cpu", dtype=torch.float32, attention="sdpa")
    assert "note" not in plain  # `dflash train` itself: one process, as asked
    # `accelerate launch --num_processes 2` on a machine without GPUs (ACCELERATE_USE_CPU False, the launch's
    # own variables set), and with --cpu: both start one process and say so.
    for env in ({"ACCELERATE_USE_CPU": "False", "ACCELERATE_MIXED_PRECISION": "no"}, {"ACCELERATE_USE_CPU": "True"}):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        single = console.launch_banner(config, world_size=1, device="cpu", dtype=torch.float32, attention="sdpa")
        assert "starts ONE process whatever --num_processes says" in single and "torchrun --nproc_per_node N" in single
        for name in env:
            monkeypatch.delenv(name)

    table = console.summary_table({"steps": 5, "train": {"loss": 2.0, "accuracy": 0.5, "tau": 1.5, "tokens_per_s": 2000.0,
                                                         "tokens_per_s_per_rank": 1000.0, "ranks": 2},
                                   "checkpoint": "c"}, "runs/x/summary.json")
    assert table.splitlines() == [
        "steps       5",
        "training    loss 2.0000 | accuracy 0.500 | tau 1.500 | 2,000 tokens/s over 2 ranks (1,000 per rank)",
        "checkpoint  c",
        "summary     runs/x/summary.json"]
    on_gpu = console.summary_table({"steps": 5, "train": {"tau": 1.5, "tokens_per_s": 2000.0, "peak_memory_gib": 14.76}})
    assert on_gpu.splitlines()[1].endswith("| 2,000 tokens/s | peak 14.8 GiB")
    peak = {"peak_step": 3500, "peak_chain_tau": 3.643, "last_step": 9000, "epochs": 27.7}
    past = console.summary_table({"steps": 9000, "held_out_peak": {**peak, "past_peak_warning": True}})
    assert past.splitlines()[1] == "held-out peak  chain tau 3.643 at step 3500, past it since; 27.7 epochs in all"
    assert "peak" not in console.summary_table({"steps": 3000, "held_out_peak": {**peak, "past_peak_warning": False}})


def test_the_training_bars_eta_is_the_sooner_of_the_steps_end_and_the_time_budgets(monkeypatch):
    """Issue 53: the bar showed tqdm's ETA, from the steps alone (37 min for a run its 1.5-min budget ended). Given
    the budget's deadline it shows the sooner end, the budget's marked, at the rate since the first (compiling) step."""
    import functools
    import io

    from tqdm.std import tqdm as std_tqdm

    out = io.StringIO()
    monkeypatch.setattr(console, "tqdm", functools.partial(std_tqdm, file=out, mininterval=0, miniters=1))
    monkeypatch.delenv("RANK", raising=False)
    console.set_progress_bars(True)
    now = [0.0]

    def bar(total):
        made = console.ProgressBar(total, desc="dflash train", unit="step", deadline=90.0)  # 1.5 min from 0
        made.clock = lambda: now[0]
        return made

    slow = bar(1000)
    now[0] = 10.0  # the first step compiles for 10 s: no rate yet, the budget bounds the wait
    slow.update()
    assert slow.eta() == (80.0, True)
    for _ in range(10):  # then 1 step/s: 989 steps would take 989 s, the budget ends the run in 70 s
        now[0] += 1.0
        slow.update()
    assert slow.eta() == (70.0, True)
    shown = out.getvalue().split("\r")[-1]
    assert "11/1000 [" in shown and "<01:10 (time budget)," in shown, shown
    slow.close()

    now[0] = 0.0
    fast = bar(20)
    now[0] = 10.0
    fast.update()
    for _ in range(5):  # 1 step/s after the first: 14 steps left end in 14 s, before the budget's 75 s
        now[0] += 1.0
        fast.update()
    assert fast.eta() == (14.0, False)
    assert "6/20 [" in out.getvalue().split("\r")[-1] and "<00:14," in out.getvalue().split("\r")[-1]
    fast.close()

    plain = console.ProgressBar(20, desc="x")  # no budget: tqdm's own ETA, its format untouched
    plain.update()
    assert plain.bar.bar_format is None and plain.eta() == (None, False)
    plain.close()
