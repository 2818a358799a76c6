"""Issue 53, item 8 ("time is invisible"), through `dflash train` on a tiny local target:

- a run stopped by a signal prints the command that resumes it, and that command does;
- the training bar's ETA honours `time_budget_minutes` (tqdm's own counted steps alone: 37 min for a 1.5-min run);
- RUN/summary.json records `dflash_version`, `wall_seconds` and the `phases` that ran (the README's timings were read
  off log timestamps by hand), and RUN/run.json the version;
- the dry run says which phases will run and the training time's bound, and estimates nothing it cannot measure.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import signal
from pathlib import Path

from test_cli import _args

import dflash
from dflash.cli.main import launcher, main, resume_command
from dflash.trainer import DFlashTrainer

END_OF_RUN = ["held_out_eval", "export", "speculative_eval"]


def test_a_signalled_run_prints_the_command_that_resumes_it_and_the_command_does(
        tiny_target_dir, conversations_file, tmp_path, monkeypatch, capsys):
    """SIGTERM after step 1: the run saves, exits 143 and says (stderr, after the log line's generic
    `resume_from=latest`) the whole command: the same overrides, overwrite_output_dir dropped, resume_from=latest.
    Run as printed, it continues the run to max_steps. The interrupted summary has the phases that ran."""
    run = tmp_path / "run"
    args = _args(tiny_target_dir, conversations_file, run, "max_steps=3", "spec_eval_prompts=0",
                 "overwrite_output_dir=true", "optim.lr=1e-3")
    real_step = DFlashTrainer.train_step

    def step_then_sigterm(self, batch):
        real_step(self, batch)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(DFlashTrainer, "train_step", step_then_sigterm)
    assert main(args) == 143
    err = capsys.readouterr().err
    assert "to continue, run again with resume_from=latest (the same output_dir) or resume_from=" in err  # the log line
    said = err.split("continue it with:\n", 1)[1].splitlines()[0].strip()
    kept = [word for word in args[1:] if word != "overwrite_output_dir=true"]
    assert said == "dflash train " + shlex.join([*kept, "resume_from=latest"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and summary["steps"] == 1
    assert list(summary["phases"]) == ["data_preparation", "first_step", "training"]  # no end-of-run work
    assert summary["dflash_version"] == importlib.metadata.version("dflash")

    monkeypatch.setattr(DFlashTrainer, "train_step", real_step)
    assert main(shlex.split(said)[1:]) == 0  # the printed command, as a shell would split it
    err = capsys.readouterr().err
    assert "resumed from" in err and "continue it with" not in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and "interrupted" not in summary
    assert list(summary["phases"]) == ["data_preparation", "first_step", "training", "held_out_eval", "export"]


def test_the_resume_command_names_the_launcher_and_quotes_the_overrides(monkeypatch, tmp_path):
    """torchrun on one node: its process count; `python -m dflash`: that; the console script: `dflash`. A config file
    stays first; an override with a space is quoted; an earlier resume_from is replaced."""
    from dflash.cli.main import build_parser

    config = tmp_path / "my config.yaml"
    args = build_parser().parse_args(["train", str(config), "data.source=my chats.jsonl", "resume_from=step-2",
                                      "max_steps=9", "--json"])
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("sys.argv", ["/usr/bin/dflash", "train"])
    assert resume_command(args) == (f"dflash train {shlex.quote(str(config))} 'data.source=my chats.jsonl' max_steps=9 "
                                    "resume_from=latest --json")
    monkeypatch.setattr("sys.argv", ["/x/pytest/__main__.py", "tests"])  # another module's `python -m`
    assert launcher() == "dflash"
    monkeypatch.setattr("sys.argv", [str(Path(dflash.__file__).parent / "__main__.py"), "train"])
    assert launcher() == "python -m dflash"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launcher() == "torchrun --nproc_per_node 2 -m dflash"
    monkeypatch.setenv("WORLD_SIZE", "4")  # two nodes: the launcher's options are not a rank's to see
    assert launcher() == "torchrun <torchrun options> -m dflash"


def test_a_time_budget_sets_the_bars_eta_and_the_summary_records_every_phase(tiny_target_dir, conversations_file,
                                                                               tmp_path, capsys):
    """max_steps=100000 under a 3-second budget: the bar's ETA is the budget's (tqdm's, from the steps, read hours),
    and RUN/summary.json holds the version, the wall time and all six phases, each within the wall time."""
    run = tmp_path / "run"
    assert main(_args(tiny_target_dir, conversations_file, run, "max_steps=100000", "time_budget_minutes=0.05",
                      "log_interval=1000", "spec_eval_prompts=2")) == 0
    err = capsys.readouterr().err
    renders = [part for part in re.split(r"[\r\n]", err) if part.startswith("dflash train:") and "/100000 [" in part]
    last = renders[-1]
    eta = re.search(r"<(\d\d):(\d\d) \(time budget\),", last)
    assert eta and 60 * int(eta[1]) + int(eta[2]) <= 3, last  # at most the budget's 3 s
    summary = json.loads((run / "summary.json").read_text())
    version = importlib.metadata.version("dflash")
    assert summary["dflash_version"] == version and json.loads((run / "run.json").read_text())["dflash_version"] == version
    phases, wall = summary["phases"], summary["wall_seconds"]
    assert list(phases) == ["data_preparation", "first_step", "training", *END_OF_RUN]
    assert phases["training"] >= 0.05 * 60 - 0.1  # the budget ended it
    assert phases["first_step"] <= phases["training"]  # the first step is inside the training
    disjoint = phases["data_preparation"] + phases["training"] + sum(phases[name] for name in END_OF_RUN)
    assert 0 < disjoint <= wall
    assert f"time: {wall:,.1f} s wall: data_preparation" in err  # the same figures, logged


def test_the_dry_run_names_the_phases_and_bounds_the_training_time(tiny_target_dir, conversations_file, tmp_path,
                                                                    capsys):
    """What the dry run can honestly say: the phases the run will go through (summary.json's names) with what decides
    their cost, the regeneration's cache, and the budget against the steps; no duration it could not measure."""
    base = [f"target={tiny_target_dir}", "draft.mask_token_id=16", "device=cpu", f"data.source={conversations_file}",
            "data.eval_size=8", "max_steps=20", f"output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]

    def dry(*extra: str) -> dict[str, str]:
        assert main(["train", *base, *extra, "--dry-run"]) == 0
        return dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())

    lines = dry("time_budget_minutes=1.5")
    assert lines["time_estimate"].startswith("training up to 1.5 min (time_budget_minutes), less if max_steps=20 comes "
                                             "first; the other phases are not estimated (a dry run measures no speed)")
    assert lines["phases_to_run"] == ("data_preparation (regeneration: 40 of 40 prompts to generate, none cached), "
                                      "first_step (no compilation), training, held_out_eval, export, speculative_eval")
    lines = dry("data.regenerate=false", "data.eval_size=0", "compile=true", "export_on_finish=false")
    assert lines["time_estimate"].startswith("training until max_steps=20, with no time bound (no time_budget_minutes)")
    assert lines["phases_to_run"] == ("data_preparation (no regeneration: the data's own replies), "
                                      "first_step (compiles the draft: compile=true), training")


def test_the_dry_run_shows_the_steps_num_epochs_sets(tiny_target_dir, conversations_file, tmp_path, capsys):
    """`dflash train num_epochs=2 --dry-run` showed `steps 1,000` (max_steps' default) for a run that trained 16: it
    shows the trainer's own count (`epoch_steps`) over the training rows it counts, and the run trains that many."""
    args = _args(tiny_target_dir, conversations_file, tmp_path / "run", "num_epochs=2", "spec_eval_prompts=0",
                 "export_on_finish=false", "eval_interval=4")

    def dry(*extra: str) -> dict[str, str]:
        assert main([*args, *extra, "--dry-run"]) == 0
        return dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())

    lines = dry()  # 40 conversations, 8 held out: 32 rows, 8 batches of 4 an epoch
    assert lines["steps"] == ("from num_epochs=2 over 32 training rows = 16; at most: the run counts the rows left "
                              "after tokenization, and logs the steps they give")
    assert lines["phase_training"].startswith("up to 16 steps x 4 rows per rank, over 32 training conversations of 40 "
                                              "in the source (~2.0 epochs on one process)")
    assert lines["phase_evaluation"].startswith("8 held-out conversations (4 times during training")
    assert dry("max_steps=5")["steps"].startswith("from num_epochs=2 over 32 training rows = 5 (max_steps=5 caps it)")
    assert main(args) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 16
