"""The main job through the CLI on a tiny local target: config, dry run, train, resume, export, eval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from conftest import save_tiny_target
from dflash.cli import main
from dflash.config import TrainConfig
from dflash.corpus import training_data
from dflash.factory import build_draft
from dflash.plan import plan
from dflash.reporting import read_history


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-target")
    save_tiny_target(out)
    return out


@pytest.fixture(scope="module")
def conversations_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    with path.open("w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"},
                {"role": "assistant", "content": f"The answer is {2 * i}. " * (1 + i % 3)},
            ]}) + "\n")
    return path


def _args(target, data, out, *extra):
    return ["train", f"target={target}", f"data.source={data}", f"output_dir={out}", "device=cpu",
            "draft.mask_token_id=16", "draft.block_size=4", "draft.num_anchors=8", "batch_size=4",
            "data.max_length=64", "data.bucket_multiple=32", "data.eval_size=8", "data.regenerate=false",
            "data.num_workers=0", "log_interval=2", "ce_chunk_size=256", "spec_eval_prompts=3",
            "spec_eval_max_new_tokens=8", f"data.cache_dir={out}/cache", *extra]


def test_overrides_and_unknown_keys(capsys):
    cfg = TrainConfig.from_sources(None, ["optim.lr=3e-4", "draft.num_layers=3", "report_to=[tensorboard]"])
    assert cfg.optim.lr == 3e-4 and cfg.draft.num_layers == 3 and cfg.report_to == ["tensorboard"]
    assert main(["train", "optim.lrr=1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'optim.lrr'" in err and "optim.lr" in err  # lists the valid keys
    assert main(["train", "optim.lr=-1", "--dry-run"]) == 2
    assert "optim.lr must be > 0" in capsys.readouterr().err


def test_yaml_config_and_presets(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 0.002\nmax_steps: 7\n")
    cfg = TrainConfig.from_sources(path, ["batch_size=3"])
    assert (cfg.optim.lr, cfg.max_steps, cfg.batch_size) == (0.002, 7, 3)
    assert cfg.draft.num_layers == 2  # embedded preset fills what the user left unset
    other = TrainConfig.from_sources(None, ["target=some/model"])
    assert other.max_steps == TrainConfig().max_steps  # presets only for the embedded target


def test_gpu_preset_leaves_linked_data_keys_to_the_user():
    """The GPU preset asks standalone prompts (one turn each); a user who sets how many turns the target
    answers gets none of the preset's turn settings, not a config error."""
    preset = TrainConfig.from_sources(None, ["device=cuda"])
    assert (preset.data.regenerate_turns, preset.data.standalone_turns, preset.max_steps) == (1, 3, 3000)
    turns = TrainConfig.from_sources(None, ["device=cuda", "data.regenerate_turns=2"])
    assert (turns.data.regenerate_turns, turns.data.standalone_turns) == (2, 1)
    assert turns.max_steps == 3000  # keys outside the linked group still come from the preset
    plain = TrainConfig.from_sources(None, ["device=cuda", "data.regenerate=false"])
    assert (plain.data.regenerate, plain.data.standalone_turns) == (False, 1)


def test_dry_run_prints_the_plan(tiny_target_dir, capsys):
    assert main(["train", f"target={tiny_target_dir}", "draft.mask_token_id=16", "draft.num_layers=2",
                 "device=cpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "target_layer_ids" in out and "[0, 2]" in out
    assert "draft_parameters" in out and "mask_token" in out and "<empty_output>" in out


@pytest.mark.parametrize("kind", ["dflash", "domino"])
def test_dry_run_counts_the_parameters_the_trainer_builds(tiny_target_dir, kind):
    """The dry run sizes the draft through the trainer's own factory (a Domino head included)."""
    config = TrainConfig.from_sources(None, [f"target={tiny_target_dir}", "draft.mask_token_id=16", "device=cpu",
                                             "draft.num_layers=2", f"draft.kind={kind}"])
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    built = sum(p.numel() for p in build_draft(config, target, None).parameters())
    assert plan(config)["draft_parameters"] == built


def test_train_writes_metrics_checkpoint_export_and_resumes(tiny_target_dir, conversations_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(tiny_target_dir, conversations_file, out, "max_steps=4", "save_interval=2", "eval_interval=2",
                      "spec_eval_interval_prompts=2")) == 0
    summary = json.loads(capsys.readouterr().out)
    history = read_history(out)
    assert [r["step"] for r in history if "spec_tau" in r] == [2, 4]  # real tau during training
    train_rows = [r for r in history if "loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4]  # logged at log_interval only
    assert any("eval_tau" in r for r in history)  # held-out evaluation at the end
    assert (out / "checkpoints" / "latest").read_text() == "step-00000004"
    assert (out / "config.yaml").exists()
    assert (out / "export" / "config.json").exists() and (out / "export" / "model.safetensors").exists()
    assert summary["speculative"]["lossless"] and summary["speculative"]["num_prompts"] == 3
    assert summary["speculative"]["teacher_forced_chain_tau"] >= 1.0 and "texts" not in summary["speculative"]

    # resume: continues from step 4 to 6, the log continues, no step is repeated
    assert main(_args(tiny_target_dir, conversations_file, out, "max_steps=6", "resume_from=latest")) == 0
    capsys.readouterr()
    steps = [r["step"] for r in read_history(out) if "loss" in r]
    assert steps == [2, 4, 6]
    assert (out / "checkpoints" / "latest").read_text() == "step-00000006"


def test_export_and_eval_commands(tiny_target_dir, conversations_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(tiny_target_dir, conversations_file, out, "max_steps=2", "spec_eval_prompts=0",
                      "export_on_finish=false")) == 0
    capsys.readouterr()
    assert main(["export", str(out), str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "model.safetensors").exists()
    capsys.readouterr()
    assert main(["eval", "--draft", str(tmp_path / "exported"), "--target", str(tiny_target_dir), "--prompts",
                 str(conversations_file), "--num-prompts", "2", "--max-new-tokens", "6", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "tau" in printed and "per-position acceptance" in printed
    report = json.loads((tmp_path / "exported" / "eval.json").read_text())
    assert report["num_prompts"] == 2 and report["tau"] >= 1.0


def test_step_with_the_real_data_pipeline_is_sync_free(tiny_target_dir, conversations_file, tmp_path):
    """DataLoader + prefetcher feeding several non-log steps inside forbid_syncs()."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.diagnostics import forbid_syncs
    from dflash.trainer import DFlashTrainer

    cfg = TrainConfig.from_sources(None, _args(tiny_target_dir, conversations_file, tmp_path / "r")[1:])
    trainer = DFlashTrainer(cfg, target=AutoModelForCausalLM.from_pretrained(tiny_target_dir),
                            tokenizer=AutoTokenizer.from_pretrained(tiny_target_dir))
    train = training_data(None, cfg.data, trainer.tokenizer, trainer.target.model, cfg.target).train
    batches = trainer._device_batches(train)
    trainer.train_step(next(batches))
    with forbid_syncs(raise_on_first=False) as report:
        for _ in range(4):
            trainer.train_step(next(batches))
    assert report.findings == [], report


def test_plot_command_writes_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = [{"step": s, "loss": 3.0 / s, "accuracy": 0.1 * s, "tau": 1 + 0.2 * s,
             "per_position_accuracy": [0.5 / s, 0.25 / s, 0.1 / s]} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["plot", str(tmp_path)]) == 0
    written = [line for line in capsys.readouterr().out.splitlines() if line.endswith(".png")]
    assert written and all(Path(p).stat().st_size > 1000 for p in written)
