"""Training from offline target features (`data.features`, `dflash features`): the same steps as online
training, written and resumed through the CLI, refused when they do not match the run, sync-free."""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path

import datasets
import pytest
import torch
from helpers import DFLASH2_HEAD, DOMINO_HEAD, make_tiny_target, tiny_config
from transformers import AutoModelForCausalLM, AutoTokenizer

import dflash.cli.features as features_command
from dflash.cli.main import main
from dflash.config import TrainConfig
from dflash.data.corpus import training_data
from dflash.data.feature_data import FeatureDataset
from dflash.data.features import HELD_OUT_PART, MANIFEST, TRAIN_PART, write_features
from dflash.diagnostics import forbid_syncs
from dflash.hf.module import DFlashTrainingModule
from dflash.target_model.frozen import FrozenTarget
from dflash.target_model.offline import OfflineTarget
from dflash.trainer import DFlashTrainer

STEPS = 4


def make_rows(n: int = 16, seed: int = 0) -> datasets.Dataset:
    """Rows of varied length (5..36 tokens) without the tiny mask token, the first 3 tokens unsupervised."""
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for i in range(n):
        length = 5 + (11 * i) % 32
        ids.append(torch.randint(0, 120, (length,), generator=g).tolist())
        masks.append([0] * 3 + [1] * (length - 3))
    return datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks})


def _train(trainer: DFlashTrainer, batches: list[dict]) -> list[float]:
    losses = []
    for batch in batches:
        trainer.train_step(batch)
        losses.append(trainer.metrics.flush()["loss"])  # a sync per step: fine outside the sync check
    return losses


@pytest.mark.parametrize("labels, head", [("data", {}), ("target", {}), ("data", DOMINO_HEAD), ("target", DFLASH2_HEAD)],
                         ids=["data", "target", "domino", "dflash2"])
def test_offline_training_equals_online_step_for_step(labels, head, tokenizer, tmp_path):
    """Same seed, same rows in the same batches (grad_accum 2, so the features are split into micro-batches
    too): the losses and the final weights of a run from fp32 feature files equal the online run's (a DFlash
    draft with either labels, a Domino draft, and a DFlash 2 draft on the target's greedy labels)."""
    model, rows = make_tiny_target(head_std=0.05), make_rows()
    settings = dict(target="tiny", data__labels=labels, optim__grad_accum=2, batch_size=2, data__max_length=32,
                    data__bucket_multiple=16, spec_eval_prompts=0, **head)
    online = DFlashTrainer(tiny_config(**settings), target=model, tokenizer=tokenizer)
    root = tmp_path / "features"
    write_features(FrozenTarget(model, online.draft_config.target_layer_ids), "tiny", rows, root / TRAIN_PART,
                   tokenizer=tokenizer, dtype="float32", max_length=32, labels=labels == "target", shard_rows=5,
                   batch_size=3, progress=False)
    offline = DFlashTrainer(tiny_config(**settings, data__features=str(root)), target=model, tokenizer=tokenizer)
    assert isinstance(offline.target, OfflineTarget)
    feature_rows = FeatureDataset(root / TRAIN_PART)
    order = [[(4 * s + k) % len(rows) for k in range(4)] for s in range(STEPS)]
    on_collate, off_collate = online._collator(), offline._collator()
    online_batches = [on_collate([rows[i] for i in idx]) for idx in order]
    offline_batches = [off_collate([feature_rows[i] for i in idx]) for idx in order]
    assert all("features" in b and ("labels" in b) == (labels == "target") for b in offline_batches)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(online_batches, offline_batches, strict=True))

    torch.manual_seed(0)
    with torch.no_grad():  # every weight non-trivial (a fresh DFlash 2 selector's B = 0 gives A and P no gradient)
        for p in online.draft.parameters():
            p.add_(0.1 * torch.randn_like(p))
    offline.draft.load_state_dict(online.draft.state_dict())
    online_losses, offline_losses = _train(online, online_batches), _train(offline, offline_batches)
    assert offline_losses == pytest.approx(online_losses, abs=1e-6)
    assert online_losses[0] != online_losses[-1]  # the weights did move
    for (name, a), (_, b) in zip(online.draft.state_dict().items(), offline.draft.state_dict().items(), strict=True):
        # DFlash 2: one weight element moved 2e-6 apart (AdamW's early updates, ~sign(g), amplify fp32 noise
        # in a near-zero gradient: the top-K selector's losses agree to 1e-6 every step)
        assert torch.allclose(a, b, atol=1e-5 if head is DFLASH2_HEAD else 1e-6, rtol=0), name


def _settings(target: Path, data: Path, cache: Path, *extra: str) -> list[str]:
    """What `dflash features` and `dflash train` share on the tiny target (the held-out split included)."""
    return [f"target={target}", f"data.source={data}", "device=cpu", "draft.mask_token_id=16", "draft.block_size=4",
            "draft.num_anchors=8", "batch_size=4", "data.max_length=64", "data.bucket_multiple=32", "data.eval_size=8",
            "data.regenerate=false", "data.num_workers=0", "log_interval=2", "ce_chunk_size=256",
            "spec_eval_prompts=0", "progress_bar=false", f"data.cache_dir={cache}", *extra]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def feature_dir(tiny_target_dir, conversations_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-features") / "features"
    cache = root.parent / "cache"
    assert main(["features", *_settings(tiny_target_dir, conversations_file, cache, f"data.features={root}")]) == 0
    return root


def test_features_command_writes_what_train_trains_from(feature_dir, tiny_target_dir, conversations_file, tmp_path,
                                                       capsys, monkeypatch):
    """Both parts written (train and held-out rows, as training splits them); `dflash train data.features=...`
    trains from them without loading the trunk, and evaluates on the held-out part."""
    cache = feature_dir.parent / "cache"
    config = TrainConfig.from_sources(None, _settings(tiny_target_dir, conversations_file, cache))
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    corpus = training_data(None, config.data, AutoTokenizer.from_pretrained(tiny_target_dir), model, config.target)
    train, held_out = FeatureDataset(feature_dir / TRAIN_PART), FeatureDataset(feature_dir / HELD_OUT_PART)
    assert len(train) == len(corpus.train) and len(held_out) == len(corpus.eval)
    assert train[3]["input_ids"].tolist() == list(corpus.train[3]["input_ids"])

    def no_trunk(*args, **kwargs):
        raise AssertionError("a run from offline features loaded the target model")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_trunk)
    evaluated, evaluate = [], DFlashTrainer.evaluate

    def recording_evaluate(self, dataset, **kwargs):
        evaluated.append(dataset)
        return evaluate(self, dataset, **kwargs)

    monkeypatch.setattr(DFlashTrainer, "evaluate", recording_evaluate)
    out = tmp_path / "run"
    assert main(["train", *_settings(tiny_target_dir, conversations_file, cache, f"data.features={feature_dir}",
                                     f"output_dir={out}", "max_steps=4")]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["train"]["loss"] > 0
    # The held-out figures come from the held-out part's rows and features, not the training part's.
    def same_rows(ds) -> bool:
        return len(ds) == len(held_out) and all(torch.equal(ds[i][k], held_out[i][k]) for i in range(len(held_out))
                                                for k in ("input_ids", "loss_mask", "features"))

    assert evaluated and all(same_rows(ds) for ds in evaluated)
    assert train[0]["input_ids"].tolist() != held_out[0]["input_ids"].tolist() and len(train) != len(held_out)
    assert (out / "export" / "model.safetensors").exists()
    # The export names the held-out split the feature folder recorded: `dflash eval` decodes those prompts.
    recorded = json.loads((out / "export" / "config.json").read_text())["dflash_config"]["held_out_split"]
    assert recorded == config.data.held_out_split() == corpus.held_out_split
    assert recorded == {"source": str(conversations_file), "split": "train", "limit": None, "eval_size": 8}
    capsys.readouterr()


def test_the_train_command_features_prints_trains_as_printed(tiny_target_dir, conversations_file, tmp_path, capsys):
    """`dflash features` ends with the `dflash train` line for its files. With the config's speculative evaluation
    left on (the default), that line trains from them as printed (it used to leave spec_eval_prompts on, which a
    run without the trunk refuses); only a step cap and a run folder are added here."""
    root = tmp_path / "features"
    settings = [item for item in _settings(tiny_target_dir, conversations_file, tmp_path / "cache", f"data.features={root}")
                if not item.startswith("spec_eval_prompts=")]
    assert main(["features", *settings]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1].split("train from them with: ", 1)[1]
    command = shlex.split(printed)
    assert command[:2] == ["dflash", "train"] and f"data.features={root}" in command
    assert main([*command[1:], f"output_dir={tmp_path / 'run'}", "max_steps=2"]) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["held_out"]["loss"] > 0 and "speculative" not in summary


def test_features_command_skips_a_finished_folder_and_resumes_an_interrupted_one(
        feature_dir, tiny_target_dir, conversations_file, tmp_path, monkeypatch, capsys):
    cache = feature_dir.parent / "cache"
    before = _files(feature_dir)
    assert main(["features", *_settings(tiny_target_dir, conversations_file, cache, f"data.features={feature_dir}")]) == 0
    assert _files(feature_dir) == before  # finished: nothing rewritten
    assert "features already complete" in capsys.readouterr().err

    # Small shards; the first run stops after one shard of the training part (as a killed run would).
    real = features_command.write_features

    def write(stop_first: list[bool], *args, **kwargs):
        stop = stop_first.pop() if stop_first else None
        return real(*args, **kwargs, shard_rows=5, stop_after_shards=1 if stop else None)

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    monkeypatch.setattr(features_command, "write_features", functools.partial(write, []))
    assert main(["features", *_settings(tiny_target_dir, conversations_file, cache, f"data.features={straight}")]) == 0
    monkeypatch.setattr(features_command, "write_features", functools.partial(write, [True]))
    assert main(["features", *_settings(tiny_target_dir, conversations_file, cache, f"data.features={resumed}")]) == 0
    assert not (resumed / TRAIN_PART / MANIFEST).exists()  # interrupted after its first shard
    [kept] = (resumed / TRAIN_PART).glob("shard-*")
    written = kept.stat().st_ino, kept.stat().st_mtime_ns
    monkeypatch.setattr(features_command, "write_features", functools.partial(write, []))
    assert main(["features", *_settings(tiny_target_dir, conversations_file, cache, f"data.features={resumed}")]) == 0
    assert (kept.stat().st_ino, kept.stat().st_mtime_ns) == written  # kept, not computed again
    assert len(list((straight / TRAIN_PART).glob("shard-*"))) > 1
    assert _files(resumed) == _files(straight)
    capsys.readouterr()


@pytest.mark.parametrize("override, named", [
    ("data.max_length=48", "another max length: expected 48, found 64"),
    ("draft.target_layer_ids=[0,1]", "another set of layer ids: expected [0, 1]"),
    ("data.labels=target", "another label setting"),
])
def test_train_refuses_features_of_other_settings(override, named, feature_dir, tiny_target_dir, conversations_file,
                                                  tmp_path, capsys):
    out = tmp_path / "run"
    args = _settings(tiny_target_dir, conversations_file, feature_dir.parent / "cache", f"data.features={feature_dir}",
                     f"output_dir={out}", "max_steps=2", override)
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert named in err and f"dflash features CONFIG data.features={feature_dir}" in err
    assert not (out / "metrics.jsonl").exists()  # refused before training


def test_features_command_needs_the_folder_key(tiny_target_dir, conversations_file, tmp_path, capsys):
    assert main(["features", *_settings(tiny_target_dir, conversations_file, tmp_path)]) == 2
    assert "set data.features=DIR" in capsys.readouterr().err


def test_a_run_from_features_refuses_speculative_evaluation(feature_dir, tiny_target_dir, conversations_file, tmp_path,
                                                           capsys):
    args = _settings(tiny_target_dir, conversations_file, tmp_path, f"data.features={feature_dir}",
                     f"output_dir={tmp_path / 'run'}", "spec_eval_prompts=3")
    assert main(["train", *args]) == 2
    assert "set spec_eval_prompts=0" in capsys.readouterr().err


def test_offline_steps_from_the_real_data_pipeline_are_sync_free(feature_dir, tiny_target_dir, conversations_file,
                                                                tmp_path):
    """DataLoader (one worker) + FeatureCollator + prefetcher feeding non-log offline steps inside forbid_syncs()."""
    cfg = TrainConfig.from_sources(None, _settings(tiny_target_dir, conversations_file, feature_dir.parent / "cache",
                                                   f"data.features={feature_dir}", f"output_dir={tmp_path / 'r'}",
                                                   "data.num_workers=1", "optim.grad_accum=2", "batch_size=2"))
    trainer = DFlashTrainer(cfg)
    train = training_data(None, cfg.data, trainer.tokenizer, trainer.target.model, cfg.target).train
    batches = trainer._device_batches(train)
    trainer.train_step(next(batches))
    with forbid_syncs(raise_on_first=False) as report:
        for _ in range(3):
            batch = next(batches)
            assert "features" in batch
            trainer.train_step(batch)
    assert report.findings == [], report


def test_dry_run_says_the_trunk_is_not_loaded(feature_dir, tiny_target_dir, conversations_file, tmp_path, capsys):
    args = _settings(tiny_target_dir, conversations_file, tmp_path, f"data.features={feature_dir}")
    assert main(["train", *args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "embedding and LM head only (data.features: the trunk is not loaded)" in out
    assert f"none (data.features: the target's features are read from {feature_dir})" in out


def test_the_transformers_trainer_path_refuses_features(tmp_path):
    with pytest.raises(ValueError, match="not by the transformers.Trainer path: set data.features=null"):
        DFlashTrainingModule.from_config(tiny_config(data__features=str(tmp_path)), make_tiny_target(), None)


def test_the_offline_target_shares_the_head_rule_and_the_layer_rule():
    """`OfflineTarget` reads like the live target (`SharedHead`): the same embedding, head, sizes and token
    embeddings from the two weight tensors alone, and layer ids outside the target refused the same way."""
    model = make_tiny_target()
    live, offline = FrozenTarget(model, [1, 2]), OfflineTarget.from_model(model, [1, 2])
    ids = torch.tensor([[3, 5, 7]])
    assert offline.hidden_size == live.hidden_size and offline.vocab_size == live.vocab_size
    assert torch.equal(offline.embed(ids), live.embed(ids)) and torch.equal(offline.lm_head_weight, live.lm_head_weight)
    for target in (FrozenTarget, OfflineTarget.from_model):
        with pytest.raises(ValueError, match=r"target_layer_ids \[1, 99\] out of range: the target has"):
            target(model, [1, 99])


@pytest.mark.parametrize("features,extra,refusal", [
    (False, ["data.source=/no/such/chats.jsonl"], "dataset file or folder not found: /no/such/chats.jsonl"),
    (True, ["report_to=[tensorboard]"], "report_to: tensorboard needs tensorboard"),
    (True, ["draft.target_layer_ids=[0,2]"], "layer"),
    (True, ["spec_eval_prompts=3"], "cannot decode speculatively"),
])
def test_the_dry_run_refuses_what_the_run_refuses_with_its_message(features, extra, refusal, feature_dir,
                                                                  tiny_target_dir, conversations_file, tmp_path, capsys,
                                                                  monkeypatch):
    """A missing data file, a reporter package that is not installed, a feature folder made for other
    layers, speculative evaluation with features: the dry run passed them; it now stops as the run does,
    with the run's message."""
    monkeypatch.setattr("dflash.preflight.importable", lambda module: module != "tensorboard")
    args = _settings(tiny_target_dir, conversations_file, tmp_path, f"output_dir={tmp_path / 'run'}", "max_steps=2",
                     *([f"data.features={feature_dir}"] if features else []), *extra)
    for command in (["train", *args, "--dry-run"], ["train", *args]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert refusal in err and "Traceback" not in err, err
