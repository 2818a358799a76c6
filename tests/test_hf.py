"""transformers.Trainer integration: DFlashTrainingModule + DFlashCallback (+ DFlashHFTrainer).

Tiny Llama target from config, rows of a fixed random batch, CPU, a few steps per run.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from helpers import make_tiny_target, random_batch, tiny_config
from safetensors import safe_open
from transformers import Trainer, TrainerCallback, TrainingArguments

from dflash.anchors import anchor_seed, sample_anchors
from dflash.cli.main import main
from dflash.config import OptimSettings, TrainConfig
from dflash.data.loader import Collator
from dflash.diagnostics import DFlashSyncWarning, SyncProbe, per_step_sync_settings
from dflash.evaluation.export import load_exported
from dflash.hf.trainer import (
    EXPORT_DIRNAME,
    TRAINER_DRAFT_NAME,
    DFlashCallback,
    DFlashHFTrainer,
    DFlashTrainingModule,
    config_conflicts,
)
from dflash.metrics import Metrics
from dflash.report.sinks import read_history


def _module(**overrides) -> DFlashTrainingModule:
    """A module for the tiny config; steps and batch are left to TrainingArguments (which run them)."""
    config = tiny_config(**overrides)
    config.max_steps, config.batch_size = TrainConfig.max_steps, TrainConfig.batch_size
    return DFlashTrainingModule.from_config(config, make_tiny_target(), None)


def _rows(rows: int = 8, repeat: int = 8, prompt: int = 4) -> list[dict]:
    """`rows` distinct random rows (learnable by memorizing), each repeated `repeat` times."""
    batch = random_batch(batch=rows, seq=32, prompt=prompt, seed=3)
    distinct = [{"input_ids": batch["input_ids"][i].tolist(), "loss_mask": batch["loss_mask"][i].int().tolist()}
                for i in range(rows)]
    return distinct * repeat


def _args(tmp_path, **overrides) -> TrainingArguments:
    settings = dict(output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=4, logging_steps=4,
                    save_steps=6, learning_rate=3e-3, report_to="none", use_cpu=True, disable_tqdm=True,
                    logging_nan_inf_filter=False, dataloader_num_workers=0)
    settings.update(overrides)
    return TrainingArguments(**settings)


def _train(tmp_path, module, *, trainer_cls=Trainer, callbacks=(), rows=None, collator=None, resume=None, **args):
    trainer = trainer_cls(model=module, args=_args(tmp_path, **args), train_dataset=rows or _rows(),
                          eval_dataset=_rows(repeat=1), data_collator=collator or Collator(0, 32),
                          callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_trainer_run_trains_the_draft_logs_at_log_steps_and_exports_at_save_steps(tmp_path, monkeypatch):
    module = _module()
    target_before = {k: v.clone() for k, v in module.target.state_dict().items()}
    draft_before = {k: v.clone() for k, v in module.draft.state_dict().items()}
    flushed = []
    flush = Metrics.flush
    monkeypatch.setattr(Metrics, "flush", lambda self: flushed.append(self) or flush(self))
    callback = DFlashCallback(module)
    trainer = _train(tmp_path, module, callbacks=[callback], eval_strategy="steps", eval_steps=6)

    # Training metrics: exactly one flush per logging step, values in the Trainer's logs.
    logged = [h for h in trainer.state.log_history if "dflash_tau" in h]
    assert [h["step"] for h in logged] == [4, 8, 12]
    assert sum(m is module.metrics for m in flushed) == callback.flushes == 3
    assert all(f"dflash_pos_acc_{k}" in h and "dflash_accuracy" in h and "dflash_anchors_kept" in h
               for h in logged for k in (1, 2, 3))
    # Held-out metrics: one flush per evaluation, as eval_dflash_*.
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [6, 12] and all("eval_dflash_tau" in h for h in evals)
    assert sum(m is module.eval_metrics for m in flushed) == callback.eval_flushes == 2

    # The loss went down (the draft memorizes 8 rows), in the Trainer's loss and in DFlash's.
    assert logged[-1]["dflash_loss"] < 0.85 * logged[0]["dflash_loss"], logged
    assert logged[-1]["loss"] < 0.85 * logged[0]["loss"]
    assert logged[0]["dflash_loss"] == pytest.approx(logged[0]["loss"], rel=0.05)  # one micro-batch per step

    # metrics.jsonl in DFlashTrainer's format (what dflash.report.plot reads).
    history = read_history(tmp_path)
    assert [h["step"] for h in history if "tau" in h] == [4, 8, 12]
    assert [h["step"] for h in history if "eval_tau" in h] == [6, 12]
    assert all(len(h["per_position_accuracy"]) == 3 for h in history if "tau" in h)

    # Only the draft trained; the target (embedding and LM head included) is bit-identical.
    opt_params = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert opt_params == {id(p) for p in module.draft.parameters()}
    for k, v in module.target.state_dict().items():
        assert torch.equal(v, target_before[k]), k
    unchanged = [k for k, v in module.draft.state_dict().items() if torch.equal(v, draft_before[k])]
    assert unchanged == []

    # Every save step exported the draft in the published format next to the Trainer checkpoint,
    # and the checkpoint's own weights file holds the draft only.
    assert callback.exports == [tmp_path / f"checkpoint-{s}" / EXPORT_DIRNAME for s in (6, 12)]
    exported = load_exported(callback.exports[-1], target_model=module.target)
    for name, value in module.draft.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], value.to(torch.bfloat16).float(), msg=name)
    earlier = load_exported(callback.exports[0])
    assert not torch.equal(earlier.state_dict()["fc.weight"], exported.state_dict()["fc.weight"])
    with safe_open(str(tmp_path / "checkpoint-12" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {f"objective.draft.{k}" for k in module.draft.state_dict()}
    # `dflash export` reads the plain Trainer's checkpoint (its weights, the config of its dflash-draft export).
    assert main(["export", str(tmp_path / "checkpoint-12"), str(tmp_path / "exported")]) == 0
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "exported" / name).read_bytes() == (callback.exports[-1] / name).read_bytes(), name


@pytest.mark.parametrize(("trainer_cls", "accum"), [(Trainer, 1), (Trainer, 2), (DFlashHFTrainer, 2)])
def test_non_log_steps_make_no_host_device_sync(tmp_path, trainer_cls, accum):
    """forbid_syncs() over every non-log, non-eval, non-save stretch of a Trainer run with the
    recommended settings (defaults + logging_nan_inf_filter=False): nothing found."""
    probe = SyncProbe()
    module = _module()
    _train(tmp_path, module, trainer_cls=trainer_cls, callbacks=[DFlashCallback(module), probe],
           gradient_accumulation_steps=accum, per_device_train_batch_size=2, eval_strategy="steps", eval_steps=6)
    assert probe.steps_watched == 12
    assert probe.findings == [], "\n".join(map(str, probe.findings))


@pytest.mark.parametrize(("setting", "where", "per_micro_batch"), [
    ({"logging_nan_inf_filter": True}, "in _run_epoch", 2),  # isnan(loss) or isinf(loss)
    ({"include_num_input_tokens_seen": "all"}, "in _track_num_input_tokens", 1),
])
def test_settings_that_sync_every_step_are_caught_and_warned_once(tmp_path, setting, where, per_micro_batch):
    probe = SyncProbe()
    module = _module()
    name = next(iter(setting))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(tmp_path, module, callbacks=[DFlashCallback(module), probe], max_steps=8, save_strategy="no", **setting)
    assert len(probe.findings) == 8 * per_micro_batch
    assert all(f.op == "aten._local_scalar_dense" and where in f.where for f in probe.findings), probe.findings
    named = [w for w in caught if issubclass(w.category, DFlashSyncWarning) and name in str(w.message)]
    assert len(named) == 1


def test_a_sync_planted_in_the_draft_forward_is_caught(tmp_path, monkeypatch):
    probe = SyncProbe()
    module = _module()
    forward = module.objective.forward

    def leaky(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.loss_sum.item()  # what a per-step print of the loss would do
        return out

    monkeypatch.setattr(module.objective, "forward", leaky)
    _train(tmp_path, module, callbacks=[DFlashCallback(module), probe], max_steps=4, save_strategy="no")
    assert len(probe.findings) == 4 and all("test_hf.py" in f.where for f in probe.findings)


def test_sync_settings_checklist(tmp_path):
    def args(**kw):  # no use_cpu: it turns dataloader_pin_memory off
        return TrainingArguments(output_dir=str(tmp_path), report_to="none", **{"logging_nan_inf_filter": False, **kw})

    def named(found):
        return [m.split("=")[0] for m in found]

    assert named(per_step_sync_settings(args(logging_nan_inf_filter=True))) == ["logging_nan_inf_filter"]
    assert per_step_sync_settings(args()) == []
    assert named(per_step_sync_settings(args(), device_type="cuda")) == ["accelerator_config.non_blocking"]
    assert per_step_sync_settings(args(accelerator_config={"non_blocking": True}), device_type="cuda") == []
    unpinned = args(accelerator_config={"non_blocking": True}, dataloader_pin_memory=False)
    assert named(per_step_sync_settings(unpinned, device_type="cuda")) == ["dataloader_pin_memory"]
    many = args(include_num_input_tokens_seen="non_padding", torch_empty_cache_steps=10)
    assert named(per_step_sync_settings(many)) == ["include_num_input_tokens_seen", "torch_empty_cache_steps"]


def _window_grads(module, batches, exact: bool) -> dict[str, torch.Tensor]:
    """Draft gradients of one accumulation window computed by hand, with the module's anchor seeds."""
    module.train()
    module.micro_step = 0
    module.draft.zero_grad()
    parts = []
    for batch in batches:
        anchors, keep, targets = module.plan(batch["input_ids"], batch["loss_mask"])
        parts.append((module.objective(batch["input_ids"], anchors, keep, targets).loss_sum, targets.weights.sum()))
    if exact:  # sum(w * CE) / sum(w) over the whole window
        loss = sum(s for s, _ in parts) / sum(w for _, w in parts)
    else:  # mean over micro-batches of each one's weighted mean
        loss = sum(s / w for s, w in parts) / len(parts)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.draft.named_parameters()}


class _GradCapture(TrainerCallback):
    def __init__(self, module):
        self.module, self.grads = module, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.clone() for n, p in self.module.draft.named_parameters()}


@pytest.mark.parametrize("trainer_cls", [DFlashHFTrainer, Trainer])
def test_loss_normalization_over_gradient_accumulation(tmp_path, trainer_cls):
    """DFlashHFTrainer: the exact global token mean; plain Trainer: the mean of micro-batch means."""
    # 28 and 12 supervised tokens: both more valid anchors than the 8 drawn, so each draw depends on its seed
    long_row, short_row = _rows(rows=2, repeat=1, prompt=4)[0], _rows(rows=2, repeat=1, prompt=20)[1]
    seen = []
    collator = Collator(0, 32)

    def recording(rows):
        batch = collator(rows)
        seen.append({k: v.clone() for k, v in batch.items()})
        return batch

    module = _module()
    start = copy.deepcopy(module.draft.state_dict())
    capture = _GradCapture(module)
    drawn, plan = [], module.plan

    def recording_plan(input_ids, loss_mask, position_ids=None):
        out = plan(input_ids, loss_mask, position_ids)
        drawn.append(out[0].clone())
        return out

    module.plan = recording_plan
    _train(tmp_path, module, trainer_cls=trainer_cls, callbacks=[DFlashCallback(module), capture],
           rows=[long_row, short_row], collator=recording, max_steps=1, per_device_train_batch_size=1,
           gradient_accumulation_steps=2, max_grad_norm=0.0, save_strategy="no")
    window = seen[:2]
    weights = [int(b["loss_mask"].sum()) for b in window]
    assert weights[0] != weights[1]  # unequal micro-batches: the two normalizations differ

    module.draft.load_state_dict(start)
    exact, mean_of_means = _window_grads(module, window, True), _window_grads(module, window, False)
    expected, other = (exact, mean_of_means) if trainer_cls is DFlashHFTrainer else (mean_of_means, exact)
    for name, grad in capture.grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-7, msg=name)
    assert any(not torch.allclose(other[n], g, rtol=1e-3, atol=1e-6) for n, g in capture.grads.items())
    # Micro-batch i drew its anchors from (seed, rank, micro_step i): not one stream, not the step's seed
    # (`seed` is TrainingArguments'.)
    def seeded(micro_step):
        return torch.Generator().manual_seed(anchor_seed(module.seed, 0, micro_step))

    def draw(batch, generator):
        return sample_anchors(batch["loss_mask"], module.objective.num_anchors, generator=generator)[0]

    assert torch.equal(drawn[0], draw(window[0], seeded(0))) and torch.equal(drawn[1], draw(window[1], seeded(1)))
    assert not torch.equal(drawn[0], draw(window[0], seeded(1)))
    assert not torch.equal(drawn[1], draw(window[1], seeded(0)))  # not the step's seed again
    stream = seeded(0)
    draw(window[0], stream)
    assert not torch.equal(drawn[1], draw(window[1], stream))  # not the first micro-batch's stream, continued


def test_schedule_step_tensor_is_bound_and_advanced_on_the_device(tmp_path, monkeypatch):
    module = _module()
    bound = {}
    monkeypatch.setattr(module.objective, "bind_schedule",
                        lambda step_t, max_steps: bound.update(step_t=step_t, max_steps=max_steps))
    callback, probe = DFlashCallback(module), SyncProbe()
    _train(tmp_path, module, callbacks=[callback, probe], max_steps=8, save_strategy="no")
    assert bound["max_steps"] == 8 and bound["step_t"] is callback.step_t
    assert bound["step_t"].device == module.device and bound["step_t"].item() == 8.0
    assert probe.findings == []  # add_(1) per step, no host->device copy


def test_domino_lambda_follows_the_trainer_step_and_is_logged(tmp_path):
    module = _module(draft__kind="domino", domino__gru_hidden_dim=32, domino__emb_dim=16, domino__decay_ratio=0.5)
    probe = SyncProbe()
    trainer = _train(tmp_path, module, callbacks=[DFlashCallback(module), probe], max_steps=8, logging_steps=2,
                     save_strategy="no")
    logged = [h for h in trainer.state.log_history if "dflash_lambda" in h]
    # decay over int(0.5 * 8) = 4 steps: lambda 1, .75, .5, .25, 0, ...; each log averages its 2 steps.
    assert [h["dflash_lambda"] for h in logged] == pytest.approx([0.875, 0.375, 0.0, 0.0])
    assert all("dflash_base_tau" in h and "dflash_base_loss" in h for h in logged)
    assert probe.findings == []


def test_resume_restores_the_draft_and_the_anchor_stream(tmp_path):
    straight = _module()
    _train(tmp_path / "a", straight, callbacks=[DFlashCallback(straight)], max_steps=8, save_steps=4)
    resumed = _module(seed=0)
    with torch.no_grad():  # a different starting point: the checkpoint must overwrite it
        for p in resumed.draft.parameters():
            p.add_(1.0)
    callback = DFlashCallback(resumed)
    _train(tmp_path / "a", resumed, callbacks=[callback], max_steps=8, save_steps=4,
           resume=str(tmp_path / "a" / "checkpoint-4"))
    assert resumed.micro_step == 8  # set to 4 at on_train_begin, then 4 more micro-batches
    for name, value in straight.draft.state_dict().items():
        torch.testing.assert_close(resumed.draft.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_hf_trainer_saves_the_published_draft_and_resumes_exactly(tmp_path):
    """DFlashHFTrainer: save_model() and every checkpoint are the published format, byte for byte what
    `dflash export` writes from the checkpoint; a resume from such a checkpoint continues exactly."""
    straight = _module(target="tiny-llama")
    trainer = _train(tmp_path / "run", straight, trainer_cls=DFlashHFTrainer, max_steps=8, save_steps=4)
    logged = [row["step"] for row in read_history(tmp_path / "run") if "loss" in row]
    final = tmp_path / "final"
    trainer.save_model(str(final))
    assert not (final / TRAINER_DRAFT_NAME).exists()  # a save_model output is what gets served or pushed
    draft = load_exported(final, target_model=straight.target)
    for name, value in straight.draft.state_dict().items():
        assert torch.equal(draft.state_dict()[name], value.to(torch.bfloat16).float()), name
    config = json.loads((final / "config.json").read_text())
    assert config["dflash_config"]["target"] == "tiny-llama"
    checkpoint = tmp_path / "run" / "checkpoint-8"
    assert (checkpoint / TRAINER_DRAFT_NAME).is_file() and not (checkpoint / EXPORT_DIRNAME).exists()
    assert main(["export", str(checkpoint), str(tmp_path / "exported")]) == 0
    for name in ("config.json", "model.safetensors"):
        exported = (tmp_path / "exported" / name).read_bytes()
        assert exported == (final / name).read_bytes() == (checkpoint / name).read_bytes(), name

    resumed = _module(target="tiny-llama")
    with torch.no_grad():  # another starting point: the checkpoint must overwrite it
        for p in resumed.draft.parameters():
            p.add_(1.0)
    _train(tmp_path / "run", resumed, trainer_cls=DFlashHFTrainer, max_steps=8, save_steps=4,
           resume=str(tmp_path / "run" / "checkpoint-4"))
    for name, value in straight.draft.state_dict().items():  # bf16 weights would miss by ~1e-3
        torch.testing.assert_close(resumed.draft.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # metrics.jsonl: the lines past checkpoint-4 were dropped at the resume and logged again, each step once
    assert [row["step"] for row in read_history(tmp_path / "run") if "loss" in row] == logged and logged[-1] == 8


def test_hf_trainer_takes_the_tokenizer_as_processing_class(tmp_path, tokenizer):
    """docs/trainer_integration.md passes `processing_class=tokenizer`: transformers 5.24 then aligns the
    tokenizer's special tokens with `model.config`, which was the TrainConfig and crashed `train()`. The
    module's `config` is the target's HF config; the run's settings are `train_config`; the tokenizer is
    saved beside the draft."""
    module = _module()
    trainer = DFlashHFTrainer(model=module, args=_args(tmp_path / "run", max_steps=2, save_steps=2),
                              train_dataset=_rows(), data_collator=Collator(0, 32), processing_class=tokenizer)
    trainer.train()
    assert module.config is module.target.text_config and module.train_config.draft.block_size == 4
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "tokenizer_config.json").is_file() and (tmp_path / "final" / "config.json").is_file()


def test_trainconfig_keys_that_trainingarguments_runs_must_agree_with_it(tmp_path):
    """TrainingArguments wins for the optimizer, schedule, steps, batch, seed and device: a TrainConfig value
    set to something else is refused with the argument to set, on both Trainer paths; agreeing or default
    values pass, and the anchors follow args.seed."""
    def hf(module, **args):
        return DFlashHFTrainer(model=module, args=_args(tmp_path, **args), train_dataset=_rows(),
                               data_collator=Collator(0, 32))

    with pytest.raises(ValueError, match=r"optim\.lr=0\.001, but TrainingArguments\.learning_rate=0\.003") as err:
        hf(_module(optim__lr=1e-3, seed=5, optim__warmup_ratio=0.1))
    assert "seed=5, but TrainingArguments.seed=42" in str(err.value)
    assert "optim.warmup_ratio=0.1, but TrainingArguments.warmup_steps=0" in str(err.value)
    agreeing = _module(seed=5, optim__warmup_ratio=0.1, optim__max_grad_norm=0.5)
    hf(agreeing, seed=5, warmup_steps=0.1, max_grad_norm=0.5)
    assert agreeing.seed == 5
    defaults = _module()
    hf(defaults, seed=11)
    assert defaults.seed == 11  # TrainConfig left seed at its default: TrainingArguments' seed draws the anchors
    assert config_conflicts(TrainConfig(device="cuda:0"), _args(tmp_path)) == [
        "device='cuda:0', but TrainingArguments.device=device(type='cpu')"]
    (muon,) = config_conflicts(TrainConfig(optim=OptimSettings(optimizer="muon")), _args(tmp_path))
    assert muon.startswith("optim.optimizer='muon', but TrainingArguments.optim=")  # the Trainer runs its own optimizer
    assert config_conflicts(TrainConfig(num_epochs=2), _args(tmp_path)) == [  # the Trainer counts its own epochs
        "num_epochs=2, but TrainingArguments.num_train_epochs=3.0"]
    assert config_conflicts(TrainConfig(num_epochs=3), _args(tmp_path)) == []

    plain = _module()
    plain.train_config.max_steps = 50
    trainer = Trainer(model=plain, args=_args(tmp_path, max_steps=4), train_dataset=_rows(),
                      data_collator=Collator(0, 32), callbacks=[DFlashCallback(plain)])
    with pytest.raises(ValueError, match="max_steps=50, but TrainingArguments.max_steps=4"):
        trainer.train()


def test_state_dict_holds_the_draft_only_and_loads_strictly():
    module = _module()
    state = module.state_dict()
    assert set(state) == {f"objective.draft.{k}" for k in module.draft.state_dict()}
    other = _module()
    other.load_state_dict(state)
    for k, v in state.items():
        assert torch.equal(other.state_dict()[k], v)
    state.pop(next(iter(state)))
    with pytest.raises(RuntimeError, match="missing"):
        other.load_state_dict(state)
    other.load_state_dict(state, strict=False)


class _Recorder(TrainerCallback):
    def __init__(self):
        self.keys = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.keys.append(set(logs))


def test_attach_puts_the_callback_before_reporting_integrations(tmp_path):
    # A user callback stands in for an integration: those run before user-added callbacks.
    module, late = _module(), _Recorder()
    _train(tmp_path / "late", module, callbacks=[late, DFlashCallback(module)], max_steps=4, save_strategy="no")
    assert not any("dflash_tau" in keys for keys in late.keys)

    module, early = _module(), _Recorder()
    trainer = Trainer(model=module, args=_args(tmp_path / "early", max_steps=4, save_strategy="no"),
                      train_dataset=_rows(), data_collator=Collator(0, 32), callbacks=[early])
    callback = DFlashCallback.attach(trainer)
    trainer.train()
    assert callback.module is module and callback.flushes == 1
    assert any("dflash_tau" in keys for keys in early.keys)

    hf = DFlashHFTrainer(model=_module(), args=_args(tmp_path / "hf", max_steps=4), train_dataset=_rows(),
                         data_collator=Collator(0, 32))
    assert hf.callback_handler.callbacks[1] is hf.dflash_callback


def test_the_trainer_path_trains_packed_rows(tmp_path):
    """`transformers.Trainer` with `training_rows(rows, config.data)` under `data.packing` and dflash's collator: the
    batches carry `position_ids` (kept through the Trainer's column filter: the module's forward names them), the
    module plans per document, and the draft learns."""
    from dflash.data.loader import training_rows
    from dflash.data.packing import PackedRows
    from dflash.hf.module import dflash_collator

    module = _module(data__packing=True, data__max_length=64)
    packed = training_rows(_rows(), module.train_config.data)
    assert isinstance(packed, PackedRows) and len(packed) == 32  # two 32-token rows to a 64-token sequence
    seen = []
    collator = dflash_collator(None, module.train_config)

    def recording(rows):
        batch = collator(rows)
        seen.append(batch)
        return batch

    planned, plan = [], module.plan

    def recording_plan(input_ids, loss_mask, position_ids=None):
        planned.append(position_ids)
        return plan(input_ids, loss_mask, position_ids)

    module.plan = recording_plan
    trainer = _train(tmp_path, module, trainer_cls=DFlashHFTrainer, callbacks=[DFlashCallback(module)], rows=packed,
                     collator=recording, save_strategy="no")
    assert all(b["input_ids"].shape[1] == 64 and "position_ids" in b for b in seen)
    assert planned and all(p is not None and p.shape == (4, 64) for p in planned)  # every micro-batch by document
    logged = [h for h in trainer.state.log_history if "dflash_loss" in h]
    assert logged[-1]["dflash_loss"] < 0.85 * logged[0]["dflash_loss"], logged
