"""The main job through the CLI on a tiny local target: config, dry run, train, resume, export, eval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import check_speculative_report
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash.cli.dry_run import plan
from dflash.cli.main import main
from dflash.config import TrainConfig
from dflash.data.corpus import training_data
from dflash.evaluation.evaluate import eval_conversations
from dflash.factory import build_draft
from dflash.optim import lr_at
from dflash.report.sinks import read_history
from dflash.runtime import shutdown_distributed


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


def test_gpu_preset_trains_a_compiled_domino_draft_and_the_cpu_preset_dflash2():
    """Domino won on the GPU preset (real τ, docs/benchmarks.md 2026-12-03) and lost at equal time on 2 CPU
    cores, where DFlash 2 won (2026-12-04); a user's kind wins over both, and D-PACE, which neither default kind
    takes, names the fix on both."""
    gpu = TrainConfig.from_sources(None, ["device=cuda"])
    assert (gpu.draft.kind, gpu.compile) == ("domino", True)
    assert -(-gpu.data.max_length // gpu.data.bucket_multiple) <= 4  # a cold run compiles each padded length
    cpu = TrainConfig.from_sources(None, ["device=cpu"])
    assert (cpu.draft.kind, cpu.compile, cpu.draft.block_size) == ("dflash2", False, 4)
    assert (cpu.optim.optimizer, gpu.optim.optimizer) == ("muon", "adamw")  # the GPU keeps AdamW until Muon wins a full run
    sharded = TrainConfig.from_sources(None, ["device=cpu", "distributed=fsdp2"])  # Muon would refuse FSDP2: not set
    assert (sharded.distributed, sharded.optim.optimizer) == ("fsdp2", "adamw")
    assert TrainConfig.from_sources(None, ["device=cuda", "draft.kind=dflash"]).draft.kind == "dflash"
    assert TrainConfig.from_sources(None, ["device=cpu", "draft.kind=dflash"]).draft.kind == "dflash"
    for device in ("cuda", "cpu"):
        with pytest.raises(ValueError, match="add draft.kind=dflash"):
            TrainConfig.from_sources(None, [f"device={device}", "draft.position_weights=dpace"])
    dpace = TrainConfig.from_sources(None, ["device=cpu", "draft.kind=dflash", "draft.position_weights=dpace"])
    assert (dpace.draft.kind, dpace.draft.position_weights) == ("dflash", "dpace")  # the named fix works


def test_cpu_preset_lr_is_muons_and_follows_the_optimizer():
    """The CPU preset's lr (3e-3) is tuned for its Muon; AdamW at that lr trains a far worse draft
    (docs/benchmarks.md), so wherever the preset's optimizer is not applied its lr is not either, while a
    user's lr keeps the preset's Muon."""
    default_lr = TrainConfig().optim.lr
    cpu = TrainConfig.from_sources(None, ["device=cpu"])
    assert (cpu.optim.optimizer, cpu.optim.lr) == ("muon", 3e-3) and default_lr != 3e-3
    adamw = TrainConfig.from_sources(None, ["device=cpu", "optim.optimizer=adamw"])
    assert (adamw.optim.optimizer, adamw.optim.lr) == ("adamw", default_lr)
    sharded = TrainConfig.from_sources(None, ["device=cpu", "distributed=fsdp2"])  # holds the optimizer, so the lr
    assert (sharded.optim.optimizer, sharded.optim.lr) == ("adamw", default_lr)
    tuned = TrainConfig.from_sources(None, ["device=cpu", "optim.lr=1e-3"])
    assert (tuned.optim.optimizer, tuned.optim.lr) == ("muon", 1e-3)
    assert tuned.max_steps == cpu.max_steps  # the rest of the preset stays


def test_gpu_preset_leaves_linked_data_keys_to_the_user():
    """The GPU preset asks standalone prompts (one turn each); a user who sets how many turns the target
    answers gets none of the preset's turn settings, not a config error."""
    preset = TrainConfig.from_sources(None, ["device=cuda"])
    assert (preset.data.regenerate_turns, preset.data.standalone_turns, preset.max_steps) == (1, 1000, 4000)
    turns = TrainConfig.from_sources(None, ["device=cuda", "data.regenerate_turns=2"])
    assert (turns.data.regenerate_turns, turns.data.standalone_turns) == (2, 1)
    assert turns.max_steps == 4000 and turns.data.packing  # keys outside the linked group still come from the preset
    plain = TrainConfig.from_sources(None, ["device=cuda", "data.regenerate=false"])
    assert (plain.data.regenerate, plain.data.standalone_turns) == (False, 1)


def test_gpu_preset_packs_rows_unless_a_user_key_refuses_packing():
    """Packed rows won real τ on two seeds (seed 0 in less training time, seed 1 ahead at equal elapsed time;
    docs/benchmarks.md, 2026-12-06 late night), so the GPU preset packs; the CPU preset does not (a tie there).
    Packing is refused with offline features and a tensor-parallel target: a user who sets either gets unpacked
    rows from the preset, not a config error."""
    gpu = TrainConfig.from_sources(None, ["device=cuda"])
    assert (gpu.data.packing, gpu.max_steps) == (True, 4000)
    assert not TrainConfig.from_sources(None, ["device=cpu"]).data.packing
    features = TrainConfig.from_sources(None, ["device=cuda", "data.features=/some/features"])
    assert (features.data.packing, features.max_steps, features.draft.kind) == (False, 4000, "domino")
    assert not TrainConfig.from_sources(None, ["device=cuda", "tensor_parallel.size=2"]).data.packing
    with pytest.raises(ValueError, match="set data.packing=false"):  # a user's own packing still meets the refusal
        TrainConfig.from_sources(None, ["device=cuda", "data.features=/some/features", "data.packing=true"])
    unpacked = TrainConfig.from_sources(None, ["device=cuda", "data.packing=false"])
    assert (unpacked.data.packing, unpacked.data.bucket_multiple) == (False, 128)


def test_dry_run_prints_the_plan(tiny_target_dir, conversations_file, capsys):
    assert main(["train", f"target={tiny_target_dir}", "draft.mask_token_id=16", "draft.num_layers=2",
                 "device=cpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "target_layer_ids" in out and "[0, 2]" in out
    assert "draft_parameters" in out and "mask_token" in out and "<empty_output>" in out
    # The time budget and the phases with their sizes; held-out rows outnumbering training rows warn.
    assert main(["train", f"target={tiny_target_dir}", "draft.mask_token_id=16", "device=cpu",
                 f"data.source={conversations_file}", "data.eval_size=8", "data.limit=12", "max_steps=20",
                 "batch_size=2", "time_budget_minutes=3", f"data.cache_dir={tiny_target_dir}/no-cache", "--dry-run"]) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert lines["time_budget"] == "3 min of training, then save, evaluate and export"
    assert lines["phase_regeneration"].startswith("4 training prompts (0 cached) and 8 held-out prompts (0 cached)")
    assert lines["phase_training"].startswith("up to 20 steps x 2 rows per rank, over 4 training conversations of 40")
    assert lines["phase_evaluation"].startswith("8 held-out conversations")
    assert "up to 8 held-out prompts x 128 new tokens" in lines["phase_evaluation"]
    assert lines["warning"].startswith("8 held-out rows outnumber the 4 training rows: data.limit is too small")


def test_config_command_lists_every_key_with_default_type_and_meaning(capsys):
    from dflash.cli.config_keys import key_table
    from dflash.config import _keys

    assert main(["config"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[1:] if line.strip() and not line.startswith((" ", "Set"))}
    table = key_table()
    assert [k for k, *_ in table] == _keys(TrainConfig())  # every key, in the config's order
    for key, default, type_name, meaning in table:
        assert meaning, f"{key} has no meaning: comment its field in dflash/config.py"
        shown = repr(default) if isinstance(default, str) else str(default)
        assert rows[key].split(None, 2)[1] == shown.split()[0] and f" {type_name} " in rows[key]
        assert rows[key].rstrip().endswith(meaning)
    assert rows["optim.lr"].split()[1:3] == ["0.0006", "float"]
    assert "did you mean" not in out and "GPU: " in out  # the embedded presets follow the table


def test_a_missing_reporter_fails_before_any_model_loads(tiny_target_dir, conversations_file, tmp_path, monkeypatch,
                                                          capsys):
    import sys

    loaded = []
    monkeypatch.setattr("dflash.trainer.prepare_target", lambda *a, **k: loaded.append("target"))
    monkeypatch.setattr("dflash.trainer.training_data", lambda *a, **k: loaded.append("data"))
    for package in ("tensorboard", "wandb"):
        monkeypatch.setitem(sys.modules, package, None)  # `import tensorboard` fails: as if not installed
    assert main(_args(tiny_target_dir, conversations_file, tmp_path / "run", "report_to=[wandb,tensorboard]")) == 2
    err = capsys.readouterr().err
    assert "report_to: wandb needs wandb (`pip install wandb`)" in err
    assert "report_to: tensorboard needs tensorboard (`pip install tensorboard`)" in err and "Traceback" not in err
    assert loaded == []  # refused before the target or the data was touched


@pytest.mark.parametrize("kind", ["dflash", "domino"])
def test_dry_run_counts_the_parameters_the_trainer_builds(tiny_target_dir, kind):
    """The dry run sizes the draft through the trainer's own factory (a Domino head included)."""
    config = TrainConfig.from_sources(None, [f"target={tiny_target_dir}", "draft.mask_token_id=16", "device=cpu",
                                             "draft.num_layers=2", f"draft.kind={kind}"])
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    built = sum(p.numel() for p in build_draft(config, target, None).parameters())
    assert plan(config)["draft_parameters"] == built


@pytest.mark.parametrize("target", ["/no/such/model", "no-such-org/no-such-model"])
def test_the_dry_run_refuses_a_missing_or_offline_target_as_the_run_does(target, conversations_file, tmp_path, capsys):
    """Issue 53: the dry run exited 4 ("output not writable") with the hub's raw repo-id text where the run
    exited 2 with one line; both now take the runtime's loaders, so the code and the line are the run's."""
    said = {}
    for mode, extra in (("run", ["max_steps=1"]), ("dry run", ["--dry-run"])):
        assert main(_args(target, conversations_file, tmp_path / mode, *extra)) == 2, mode
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("dflash train: error: ")]
        assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
        said[mode] = lines[0]
    assert said["dry run"] == said["run"] and f"target={target}" in said["run"]


def test_train_writes_metrics_checkpoint_export_and_resumes(tiny_target_dir, conversations_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(tiny_target_dir, conversations_file, out, "max_steps=4", "save_interval=2", "eval_interval=2",
                      "spec_eval_interval_prompts=2")) == 0
    captured = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())  # the whole summary; the console shows a table
    table = dict(line.split(None, 1) for line in captured.out.strip().splitlines())
    assert list(table) == ["steps", "training", "held-out", "speculative", "checkpoint", "export", "summary"]
    assert table["steps"] == "4" and table["summary"] == str(out / "summary.json")
    assert f"tau {summary['speculative']['tau']:.3f} on 3 prompts, lossless" in table["speculative"]
    assert "1 process: data parallel 1 x tensor parallel 1" in captured.err  # the launch banner
    assert "device cpu | compute float32, draft weights float32 | attention sdpa" in captured.err
    assert " tokens/s " in next(line for line in captured.err.splitlines() if "step 2/4" in line)
    # What the buckets cost (issue 51): the epoch's real tokens and slots, logged before step 1 and kept.
    padding = summary["padding"]
    assert 0 < padding["real_tokens"] < padding["slots"] and padding["real_fraction"] == round(
        padding["real_tokens"] / padding["slots"], 4)
    assert f"padding: {padding['real_tokens']:,} real tokens in {padding['slots']:,} slots" in captured.err
    history = read_history(out)
    assert [r["step"] for r in history if "spec_tau" in r] == [2, 4]  # real tau during training
    train_rows = [r for r in history if "loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4]  # logged at log_interval only
    assert [r["step"] for r in history if "eval_tau" in r] == [2, 4]  # once a step: the end reuses step 4's
    assert (out / "checkpoints" / "latest").read_text() == "step-00000004"
    assert (out / "config.yaml").exists()
    assert (out / "export" / "config.json").exists() and (out / "export" / "model.safetensors").exists()
    spec = summary["speculative"]
    assert spec["lossless"] and spec["num_prompts"] == 3 and spec["block_size"] == 4 and "texts" not in spec
    check_speculative_report(spec)
    # The chain scored teacher-forced over the decoded outputs follows the decoder's own path: in fp32 it is the real τ.
    assert spec["teacher_forced_chain_tau"] == pytest.approx(spec["tau"], rel=1e-9)
    assert json.loads((out / "export" / "eval.json").read_text()) == spec  # the report beside the export

    # `dflash eval` on the export decodes the run's own held-out prompts, in the run's order (its τ is the
    # run's end-of-run τ up to the export's bf16 weights).
    config = TrainConfig.from_sources(str(out / "config.yaml"), [])
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    held = training_data(None, config.data, AutoTokenizer.from_pretrained(tiny_target_dir), target,
                         config.target).held_out_conversations
    assert len(held) == 8 and eval_conversations("auto", out / "export") == held
    assert eval_conversations("chitchat", out / "export") != held  # the fallback of a draft without a record

    # resume: continues from step 4 to 6, the log continues, no step is repeated
    assert main(_args(tiny_target_dir, conversations_file, out, "max_steps=6", "resume_from=latest")) == 0
    capsys.readouterr()
    steps = [r["step"] for r in read_history(out) if "loss" in r]
    assert steps == [2, 4, 6]
    assert (out / "checkpoints" / "latest").read_text() == "step-00000006"


@pytest.mark.parametrize("case", ["launch", "non-finite stop", "caller's group"])
def test_train_destroys_the_process_group_of_its_launch(case, tiny_target_dir, conversations_file, tmp_path,
                                                        monkeypatch, capsys):
    """Under torchrun `dflash train` initialises the process group; it destroys it before returning (left
    to interpreter exit, teardown order can abort a rank after its run is saved), also after the
    non-finite stop (exit 3). A group the caller made before is the caller's and stays."""
    def one_rank_group() -> tuple[int, int]:  # what init_distributed does under a launcher, on one rank
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return 0, 1

    monkeypatch.setattr("dflash.trainer.init_distributed", one_rank_group)
    if case == "caller's group":
        one_rank_group()
    extra = ["optim.lr=1e30", "max_nonfinite_skips=1"] if case == "non-finite stop" else []
    try:
        code = main(_args(tiny_target_dir, conversations_file, tmp_path / "run", "max_steps=2", "spec_eval_prompts=0",
                          "export_on_finish=false", *extra))
        assert code == (3 if case == "non-finite stop" else 0), capsys.readouterr().err[-2000:]
        assert dist.is_initialized() == (case == "caller's group")
    finally:
        shutdown_distributed()


def test_export_and_eval_commands(tiny_target_dir, conversations_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(tiny_target_dir, conversations_file, out, "max_steps=2", "spec_eval_prompts=0",
                      "export_on_finish=false", "data.limit=14", "--json")) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["steps"] == 2  # --json: the summary itself on stdout
    assert "8 held-out rows outnumber the 6 training rows: data.limit is too small" in captured.err
    assert main(["export", str(out), str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "model.safetensors").exists()
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert config["dflash_config"]["target"] == str(tiny_target_dir)  # from the run's config.yaml
    ids = config["dflash_config"]["target_layer_ids"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ids]  # vLLM: the input of layer i + 1
    capsys.readouterr()
    # No --target: the draft names the target it was trained for.
    assert main(["eval", "--draft", str(tmp_path / "exported"), "--prompts", str(conversations_file),
                 "--num-prompts", "2", "--max-new-tokens", "6", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert f"target: {tiny_target_dir} (from the draft's config.json)" in captured.err
    report = json.loads((tmp_path / "exported" / "eval.json").read_text())
    assert report["num_prompts"] == 2 and report["block_size"] == 4 and report["lossless"]
    assert report["new_tokens"] <= 2 * 6  # --max-new-tokens 6 per prompt
    check_speculative_report(report)
    assert f"tau {report['tau']:.3f} over 2 prompts ({report['new_tokens']} new tokens, lossless" in printed
    assert "per-position acceptance: " + " ".join(f"{x:.2f}" for x in report["per_position_acceptance"]) in printed


def test_step_with_the_real_data_pipeline_is_sync_free(tiny_target_dir, conversations_file, tmp_path):
    """DataLoader + prefetcher feeding several non-log steps (batches of host-bounded anchor widths) inside
    forbid_syncs(). Collation reads the CPU copy of the batch (the anchor width): it runs in a DataLoader
    worker, as by default, because on a CPU-only machine forbid_syncs counts every tensor as a device one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.diagnostics import forbid_syncs
    from dflash.trainer import DFlashTrainer

    cfg = TrainConfig.from_sources(None, _args(tiny_target_dir, conversations_file, tmp_path / "r")[1:]
                                   + ["data.num_workers=1", "draft.num_anchors=64"])
    trainer = DFlashTrainer(cfg, target=AutoModelForCausalLM.from_pretrained(tiny_target_dir),
                            tokenizer=AutoTokenizer.from_pretrained(tiny_target_dir))
    train = training_data(None, cfg.data, trainer.tokenizer, trainer.target.model, cfg.target).train
    batches = trainer._device_batches(train)
    trainer.train_step(next(batches))
    widths = []
    with forbid_syncs(raise_on_first=False) as report:
        for _ in range(4):
            batch = next(batches)
            widths.append(batch["num_anchors"])
            trainer.train_step(batch)
    assert report.findings == [], report
    assert all(type(w) is int for w in widths) and min(widths) < cfg.draft.num_anchors, widths


def test_plot_command_writes_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = [{"step": s, "loss": 3.0 / s, "accuracy": 0.1 * s, "tau": 1 + 0.2 * s,
             "per_position_accuracy": [0.5 / s, 0.25 / s, 0.1 / s]} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["plot", str(tmp_path)]) == 0
    written = [line for line in capsys.readouterr().out.splitlines() if line.endswith(".png")]
    assert written and all(Path(p).stat().st_size > 1000 for p in written)


# ---- bad input: one line naming the problem, an exit code, never a traceback (issue 18) ----------------

@pytest.fixture(scope="module")
def trained_run(tiny_target_dir, conversations_file, tmp_path_factory):
    """A 4-step run (checkpoints at 2 and 4) that the bad-input cases copy and spoil."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert main(_args(tiny_target_dir, conversations_file, out, "max_steps=4", "save_interval=2",
                      "spec_eval_prompts=0", "export_on_finish=false")) == 0
    return out


def _spoil(run: Path, name: str, folder: str = "step-00000004") -> Path:
    path = run / "checkpoints" / folder / name
    path.write_bytes(path.read_bytes()[:100])
    return path


def _pickled_callable(run: Path) -> Path:
    import pathlib

    import torch

    class Payload:
        def __reduce__(self):
            return (pathlib.Path.touch, (run / "the-payload-ran",))

    for folder in ("step-00000002", "step-00000004"):
        path = run / "checkpoints" / folder
        torch.save({"step": 2, "payload": Payload()}, path / "trainer_state.pt")
        (path / "COMPLETE").write_text("2")  # an older marker: no sizes to compare
    return run / "the-payload-ran"


def _no_space(errno_code: int, text: str):
    def write(path, data):
        raise OSError(errno_code, text, str(path))

    return write


def _cuda_device() -> str:
    import torch

    return f"device=cuda:{torch.cuda.device_count()}"  # a GPU this machine lacks, with or without GPUs


# name -> (make the argv and spoil what it needs, exit code, what the one error line must say)
BAD_INPUTS = {
    "missing target path": (lambda c: c.train("target=/no/such/model"), 2, "target=/no/such/model: no such model folder"),
    "unknown hub target (offline)": (lambda c: c.train("target=no-such-org/no-such-model"), 2,
                                     "target=no-such-org/no-such-model could not be loaded"),
    "YAML syntax error": (lambda c: ["train", str(c.write("bad.yaml", "optim:\n  lr: [0.1\nmax_steps: 3\n"))], 2,
                          "bad.yaml is not valid YAML"),
    "YAML not a mapping": (lambda c: ["train", str(c.write("list.yaml", "- 1\n- 2\n"))], 2, "must hold a mapping"),
    "override that is not YAML": (lambda c: ["train", "optim.lr=[1", "--dry-run"], 2, "override 'optim.lr=[1'"),
    "unknown config key": (lambda c: ["train", "optim.lrr=1", "--dry-run"], 2, "unknown config key 'optim.lrr'"),
    "CUDA device on a machine without it": (lambda c: c.train(_cuda_device()), 2, "device=cuda:"),
    "eval_size larger than the data": (lambda c: c.train("data.eval_size=39"), 2, "data.eval_size=39 holds out"),
    "export of a missing checkpoint": (lambda c: ["export", str(c.tmp / "nothing"), str(c.tmp / "out")], 2,
                                       "is neither a checkpoint folder nor a run folder"),
    "export of a damaged checkpoint": (lambda c: ["export", str(_spoil(c.run, "draft.safetensors").parent),
                                                  str(c.tmp / "out")], 2, "draft.safetensors is"),
    "export of a run with every checkpoint damaged": (
        lambda c: (_spoil(c.run, "draft.safetensors", "step-00000002"), _spoil(c.run, "draft.safetensors"),
                   ["export", str(c.run), str(c.tmp / "out")])[-1], 2, "no intact checkpoint"),
    "a value that is not a number": (lambda c: ["train", "optim.lr=abc", "--dry-run"], 2,
                                     "optim.lr: could not convert 'abc' to float"),
    "a mistyped key": (lambda c: ["train", "max_step=3", "--dry-run"], 2,
                       "unknown config key 'max_step' (did you mean max_steps?)"),
    "resume of a named damaged checkpoint": (
        lambda c: c.resume(f"resume_from={_spoil(c.run, 'trainer_state.pt').parent}"), 2, "trainer_state.pt is"),
    "resume with every checkpoint damaged": (
        lambda c: (_spoil(c.run, "draft.safetensors", "step-00000002"), _spoil(c.run, "draft.safetensors"),
                   c.resume())[-1], 2, "no intact checkpoint"),
    "resume with a run-defining change": (lambda c: c.resume("batch_size=2"), 2, "batch_size: 4 -> 2"),
    "resume on different data content": (lambda c: c.changed_data(), 2, "training data differs"),
    "trainer_state.pt carrying a pickled callable": (lambda c: (_pickled_callable(c.run), c.resume())[-1], 2,
                                                     "holds objects other than tensors"),
    "updates that never stay finite": (lambda c: c.train("optim.lr=1e30", "max_nonfinite_skips=2", "max_steps=8"), 3,
                                       "consecutive optimizer updates were skipped"),
    "disk full while saving": (lambda c: c.resume("max_steps=6", write=_no_space(28, "No space left on device")), 4,
                               "draft.safetensors: No space left on device); the earlier checkpoints are intact"),
    "read-only output": (lambda c: c.resume("max_steps=6", write=_no_space(30, "Read-only file system")), 4,
                         "Read-only file system"),
    "eval of a draft whose run's data is not here": (lambda c: c.moved_export(), 2,
                                                     "not readable here (dataset file or folder not found"),
    "plot of a damaged metrics line": (lambda c: ["plot", str(c.write("m/metrics.jsonl", "{\"step\": 1,\n{}\n").parent)],
                                       2, "metrics.jsonl, line 1: not a JSON line"),
}


class _Case:
    def __init__(self, tmp: Path, target: Path, data: Path, trained: Path, monkeypatch) -> None:
        import shutil

        self.tmp, self.target, self.data, self.monkeypatch = tmp, target, data, monkeypatch
        self.run = tmp / "run"
        shutil.copytree(trained, self.run)

    def write(self, name: str, text: str) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def changed_data(self) -> list[str]:
        """A run on a copy of the data, whose content then changes under the same path."""
        data, run = self.write("chats.jsonl", self.data.read_text()), self.tmp / "own"
        assert main(_args(self.target, data, run, "max_steps=2", "spec_eval_prompts=0", "export_on_finish=false")) == 0
        data.write_text(data.read_text().replace("Question number", "Query"))
        return _args(self.target, data, run, "max_steps=4", "spec_eval_prompts=0", "resume_from=latest")

    def moved_export(self) -> list[str]:
        """`dflash eval` of the run's export on a machine without the run's data file."""
        assert main(["export", str(self.run), str(self.tmp / "exported")]) == 0
        config = json.loads((self.tmp / "exported" / "config.json").read_text())
        config["dflash_config"]["held_out_split"]["source"] = str(self.tmp / "elsewhere.jsonl")
        (self.tmp / "exported" / "config.json").write_text(json.dumps(config))
        return ["eval", "--draft", str(self.tmp / "exported"), "--device", "cpu"]

    def train(self, *extra: str) -> list[str]:
        return _args(self.target, self.data, self.tmp / "fresh", "spec_eval_prompts=0", "max_steps=2", *extra)

    def resume(self, *extra: str, write=None) -> list[str]:
        if write is not None:
            import dflash.run.checkpoint as ck

            self.monkeypatch.setattr(ck, "_write", write)
        return _args(self.target, self.data, self.run, "save_interval=2", "spec_eval_prompts=0",
                     "export_on_finish=false", "max_steps=4", "resume_from=latest", *extra)


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_ends_in_one_clear_line(name, tiny_target_dir, conversations_file, trained_run, tmp_path,
                                          monkeypatch, capsys):
    make, code, says = BAD_INPUTS[name]
    case = _Case(tmp_path, tiny_target_dir, conversations_file, trained_run, monkeypatch)
    config_before = (case.run / "config.yaml").read_text()
    argv = make(case)
    capsys.readouterr()
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith(f"dflash {argv[0]}: ") and ": error: " in line
              or line.startswith(f"dflash {argv[0]}: stopped: ")]
    assert len(errors) == 1 and says in err[err.index(errors[0]):], err[-3000:]
    rest = err[err.index(errors[0]) + len(errors[0]):].strip("\n").splitlines()
    assert all(line.startswith("  ") and " -> " in line for line in rest), rest  # a refused resume lists its diff
    assert argv[0] != "export" or "resume_from" not in err  # export has no such setting
    if code == 2:
        assert (case.run / "config.yaml").read_text() == config_before  # a refused resume leaves it alone
    assert not (case.run / "the-payload-ran").exists()


def test_plot_of_a_half_written_last_line_names_the_file(tmp_path, capsys):
    """The last line of a run killed while logging is left out, with a warning naming the file."""
    pytest.importorskip("matplotlib")
    rows = [{"step": s, "loss": 3.0 / s, "tau": 1 + 0.2 * s, "per_position_accuracy": [0.5 / s]} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lo')
    assert main(["plot", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert f"{tmp_path / 'metrics.jsonl'}: left out its half-written last line 3" in err and "Traceback" not in err


def test_sigterm_exits_with_143_and_export_reads_no_optimizer_state(trained_run, tiny_target_dir, conversations_file,
                                                                    tmp_path, monkeypatch, capsys):
    """An interrupted run's exit code differs from a finished one's (README, "Exit codes"); `dflash export`
    reads the weights and config alone (the optimizer state may be missing or from anywhere)."""
    import os
    import shutil
    import signal

    from dflash.trainer import DFlashTrainer

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    real_step = DFlashTrainer.train_step

    def step_then_sigterm(self, batch):
        real_step(self, batch)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(DFlashTrainer, "train_step", step_then_sigterm)
    assert main(_args(tiny_target_dir, conversations_file, run, "max_steps=8", "resume_from=latest")) == 143
    assert "interrupted by signal" in capsys.readouterr().out
    assert json.loads((run / "summary.json").read_text())["interrupted"]
    assert (run / "checkpoints" / "latest").read_text() == "step-00000005"
    (run / "checkpoints" / "step-00000005" / "trainer_state.pt").unlink()
    assert main(["export", str(run), str(tmp_path / "exported")]) == 0
    assert "step-00000005" in capsys.readouterr().out and (tmp_path / "exported" / "model.safetensors").exists()


@pytest.mark.parametrize("key,bad", [("draft.kind", "eagle"), ("draft.attention", "xformers"),
                                     ("draft.position_weights", "linear"), ("data.labels", "teacher"),
                                     ("dtype", "float16"), ("param_dtype", "auto"), ("distributed", "zero3")])
def test_a_choice_outside_its_literal_type_is_refused_when_set_and_when_assigned(key, bad):
    """The choices are written once, as the field's Literal type: the override and a direct assignment in
    code are both refused with the same message, which lists them."""
    with pytest.raises(ValueError, match=f"{key} must be one of .* \\(got '{bad}'\\)"):
        TrainConfig.from_sources(None, [f"{key}={bad}"], presets=False)
    cfg = TrainConfig()
    section, _, name = key.rpartition(".")
    setattr(getattr(cfg, section) if section else cfg, name, bad)
    with pytest.raises(ValueError, match=f"{key} must be one of .* \\(got '{bad}'\\)"):
        cfg.validate()


def test_num_epochs_trains_whole_passes_of_the_default_data_and_the_schedule_ends_with_them(tiny_target_dir, tmp_path,
                                                                                          capsys):
    """`dflash train num_epochs=1` on chitchat (the default data; issue 53): no epochs key existed. The run takes one
    pass of full batches (counted from the training rows, built here as the run builds them), and the lr's cosine,
    built from max_steps before the data was known, ends with it."""
    out = tmp_path / "run"
    args = _args(tiny_target_dir, "chitchat", out, "num_epochs=1", "data.limit=60", "spec_eval_prompts=0",
                 "export_on_finish=false")
    assert main(args) == 0, capsys.readouterr().err[-2000:]
    err = capsys.readouterr().err
    config = TrainConfig.from_sources(None, args[1:])
    rows = len(training_data(None, config.data, AutoTokenizer.from_pretrained(tiny_target_dir),
                             AutoModelForCausalLM.from_pretrained(tiny_target_dir), config.target).train)
    steps = rows // config.batch_size
    assert 5 <= steps < TrainConfig.max_steps
    assert f"num_epochs=1: {steps} steps ({rows} training rows: {steps} full batches of 4 rows an epoch)" in err
    assert json.loads((out / "summary.json").read_text())["steps"] == steps
    assert TrainConfig.from_sources(out / "config.yaml", []).max_steps == steps  # the resolved count is recorded
    windows = [r for r in read_history(out) if "lr" in r]  # each window's mean lr, the first step's included
    assert windows[-1]["step"] == steps
    for start, window in zip([0] + [w["step"] for w in windows], windows, strict=False):
        used = [lr_at(torch.tensor(float(k)), config.optim, steps).item() for k in range(start, window["step"])]
        assert window["lr"] == pytest.approx(sum(used) / len(used), rel=1e-5), window  # lr of step k + 1
