"""Config checks through `dflash train` and `TrainConfig.from_sources` (issue 53, item 4): another kind's keys,
target layer ids out of order, a section given a value, other trainers' key names, and `num_epochs`."""

from __future__ import annotations

import types

import pytest
import torch
import yaml
from test_cli import _args

from dflash.cli.main import main
from dflash.config import TrainConfig, _keys
from dflash.config_checks import SYNONYMS
from dflash.data.loader import Collator, make_dataloader
from dflash.optim import lr_at
from dflash.run.stopping import apply_num_epochs, epoch_steps


def _refused(capsys, *args: str) -> str:
    """`dflash train ARGS --dry-run` exits 2 with one line on stderr; that line."""
    assert main(["train", *args, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash train: error: ")
    return err


# ---- another kind's section -------------------------------------------------------------------------------


@pytest.mark.parametrize("args, key, in_use, owner", [
    (["draft.kind=dflash", "domino.emb_dim=32"], "domino.emb_dim=32", "dflash", "domino"),
    (["draft.kind=domino", "dflash2.selector_top_k=4"], "dflash2.selector_top_k=4", "domino", "dflash2"),
    (["draft.kind=dflash2", "dspark.markov_rank=8"], "dspark.markov_rank=8", "dflash2", "dspark"),
    (["device=cpu", "domino.emb_dim=32"], "domino.emb_dim=32", "dflash2, the embedded preset's", "domino"),
    (["target=some/model", "domino.emb_dim=256"], "domino.emb_dim=256", "dflash, the default,", "domino"),
])
def test_another_kinds_keys_are_refused_in_one_line(capsys, args, key, in_use, owner):
    """They were ignored (rc 0, no word). The line names the key, the kind in use and the kind the key is for;
    a key set to its default counts too: the user typed it."""
    err = _refused(capsys, *args)
    assert "\n" not in err
    assert f"{key} is a setting of draft.kind={owner}" in err and f"draft.kind={in_use}" in err
    assert f"set draft.kind={owner} to train that draft, or drop the key" in err


def test_another_kinds_keys_in_a_yaml_file_are_refused_and_a_runs_own_config_loads(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("draft:\n  kind: dflash\ndomino:\n  emb_dim: 32\n  gru_hidden_dim: 64\n")
    err = _refused(capsys, str(path))
    assert "domino.emb_dim=32 and domino.gru_hidden_dim=64 are settings of draft.kind=domino" in err
    assert "drop those keys" in err
    # A run's config.yaml lists every section at its values: the unused ones at their defaults load again.
    full = TrainConfig.from_sources(None, ["draft.kind=dflash", "target=some/model"]).to_dict()
    path.write_text(yaml.safe_dump(full))
    assert TrainConfig.from_sources(path, []).to_dict() == full
    # The kind's own section is its to set.
    cfg = TrainConfig.from_sources(None, ["draft.kind=domino", "domino.emb_dim=32", "device=cpu"])
    assert (cfg.draft.kind, cfg.domino.emb_dim) == ("domino", 32)


# ---- target layer ids ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("ids, why, fixed", [
    ("[3,1]", "is not in ascending order", "[1, 3]"),
    ("[1,3,1]", "repeats a layer", "[1, 3]"),
])
def test_target_layer_ids_out_of_order_or_repeated_are_refused_naming_the_list_to_use(capsys, ids, why, fixed):
    """Unsorted ids trained a draft the engines cannot serve (only `dflash export` warned, after the run)."""
    err = _refused(capsys, "device=cpu", f"draft.target_layer_ids={ids}")
    assert why in err and f"use draft.target_layer_ids={fixed}" in err
    assert "negative id" in _refused(capsys, "device=cpu", "draft.target_layer_ids=[-1,2]")
    assert TrainConfig.from_sources(None, ["device=cpu", "draft.target_layer_ids=[1,3]"]).draft.target_layer_ids == [1, 3]


# ---- a section given a value --------------------------------------------------------------------------------


def test_a_section_given_a_value_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("draft: 2\n")  # was an AttributeError traceback from validate
    err = _refused(capsys, str(path))
    assert "config key 'draft' is a section of settings, not a value (got 2)" in err
    assert "draft.kind=dflash on the command line" in err
    assert "'optim' is a section" in _refused(capsys, "optim=3")
    path.write_text("draft:\n#  num_layers: 3\nmax_steps: 5\n")  # every key commented out: nothing set
    assert TrainConfig.from_sources(path, [], presets=False).draft == TrainConfig().draft


# ---- other trainers' names ----------------------------------------------------------------------------------


@pytest.mark.parametrize("typed, meant", [
    ("learning_rate=1e-4", "optim.lr"), ("lr=1e-4", "optim.lr"), ("optim.learning_rate=1e-4", "optim.lr"),
    ("per_device_train_batch_size=4", "batch_size"), ("gradient_accumulation_steps=2", "optim.grad_accum"),
    ("num_train_epochs=3", "num_epochs"), ("epochs=3", "num_epochs"), ("learning-rate=1e-4", "optim.lr"),
    ("max_seq_length=512", "data.max_length"), ("optim.lrr=1", "optim.lr"),  # a typo: the closest key, as before
])
def test_other_trainers_key_names_get_did_you_mean(capsys, typed, meant):
    err = _refused(capsys, typed)
    assert f"unknown config key '{typed.split('=')[0]}' (did you mean {meant}?)" in err


def test_every_synonym_names_a_key_and_none_shadows_one():
    keys = set(_keys(TrainConfig()))
    assert set(SYNONYMS.values()) <= keys and not set(SYNONYMS) & keys


# ---- num_epochs ---------------------------------------------------------------------------------------------


def _config(**keys) -> TrainConfig:
    cfg = TrainConfig(batch_size=4)
    for key, value in keys.items():
        cfg.set(key.replace("__", "."), value)
    return cfg


def test_epoch_steps_count_the_full_batches_the_loader_plays_on_each_process():
    """An epoch is the loader's full batches of batch_size * grad_accum rows on each process (the last partial
    one dropped): counted here from the loader itself, for one and two processes."""
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}] * 39  # 19 of them a process for 2: 4 batches, not 5
    for world, accum in ((1, 1), (2, 1), (2, 2), (3, 2)):
        cfg = _config(num_epochs=1, optim__grad_accum=accum)
        played = [len(list(make_dataloader(rows, 4 * accum, Collator(0), num_workers=0, rank=r, world_size=world)))
                  for r in range(world)]
        assert played == [epoch_steps(cfg, len(rows), world)] * world, (world, accum)
    assert epoch_steps(_config(num_epochs=3), 37) == 27  # 9 full batches an epoch
    assert epoch_steps(_config(num_epochs=0.5), 37) == 4 and epoch_steps(_config(num_epochs=0.01), 37) == 1
    assert epoch_steps(_config(num_epochs=0.29), 400) == 29  # 0.29 * 100 is 28.999... in floats
    assert epoch_steps(_config(num_epochs=3, max_steps=20), 37) == 20  # whichever comes first
    assert epoch_steps(_config(num_epochs=1, max_steps=20), 37) == 9
    assert epoch_steps(_config(), 37) is None
    assert epoch_steps(_config(num_epochs=2000), 37) == 18000  # max_steps at its default caps nothing


def test_num_epochs_is_a_key_the_presets_max_steps_does_not_cut_short():
    cpu = TrainConfig.from_sources(None, ["device=cpu", "num_epochs=1"])
    assert (cpu.num_epochs, cpu.max_steps) == (1.0, TrainConfig.max_steps)  # not the preset's 150
    assert cpu.time_budget_minutes == 7.0 and cpu.draft.kind == "dflash2"  # the rest of the preset stays
    assert TrainConfig.from_sources(None, ["device=cpu"]).max_steps == 150
    assert "num_epochs must be > 0" in str(pytest.raises(ValueError, TrainConfig.from_sources, None, ["num_epochs=0"]).value)


def test_apply_num_epochs_moves_the_step_count_and_restarts_the_schedules():
    """The lr's warmup and cosine and Domino's λ were built from max_steps in __init__: they must end where the
    epochs end, from the step the trainer stands at (a resume's)."""
    cfg = _config(num_epochs=2, optim__lr=1e-3)
    bound = []
    trainer = types.SimpleNamespace(config=cfg, world_size=1, rank=0, step_t=torch.tensor(3.0),
                                    lr=torch.tensor(cfg.optim.lr), objective=types.SimpleNamespace(
                                        bind_schedule=lambda step_t, steps: bound.append((step_t, steps))))
    apply_num_epochs(trainer, 37)
    assert cfg.max_steps == 18 and bound == [(trainer.step_t, 18)]
    assert trainer.lr.item() == pytest.approx(lr_at(torch.tensor(3.0), cfg.optim, 18).item())
    untouched = types.SimpleNamespace(config=_config(), world_size=1, rank=0)  # no num_epochs: nothing read or set
    apply_num_epochs(untouched, 37)
    assert untouched.config.max_steps == TrainConfig.max_steps


def test_resuming_a_num_epochs_run_logs_only_a_real_max_steps_change(tiny_target_dir, conversations_file, tmp_path,
                                                                      capsys):
    """Resuming `num_epochs=1` with the same command logged `resume: max_steps: 8 -> 1000`: the checkpoint's count
    (set from the rows) against max_steps' default, before num_epochs had set it. It is compared once set: the same
    command logs no change, two epochs log 8 -> 16, and a max_steps without num_epochs is logged as before."""
    args = _args(tiny_target_dir, conversations_file, tmp_path / "run", "num_epochs=1", "spec_eval_prompts=0",
                 "export_on_finish=false")  # 32 training rows: 8 batches of 4 an epoch
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "resume_from=latest"]) == 0
    err = capsys.readouterr().err
    assert "resumed from" in err and "resume: max_steps" not in err
    assert main([*args, "resume_from=latest", "num_epochs=2"]) == 0
    err = capsys.readouterr().err
    assert "resume: num_epochs: 1.0 -> 2.0 (accepted" in err
    assert "resume: max_steps: 8 -> 16, from num_epochs=2 (accepted" in err and err.count("resume: max_steps") == 1
    assert main([*args, "resume_from=latest", "num_epochs=null", "max_steps=18"]) == 0
    assert "resume: max_steps: 16 -> 18 (accepted" in capsys.readouterr().err
