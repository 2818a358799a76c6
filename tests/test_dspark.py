"""DSpark drafts (`draft.kind: dspark`): config, the heads, the objective against a plain per-slot loop, accumulation
parity, a sync-free step, export in DeepSpec's shape, lossless decoding with the Markov walk and a short training run
(chain τ̂ = real τ: tests/test_chain.py, for every kind)."""

from __future__ import annotations

import json

import datasets
import helpers as fixtures
import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_MASK_ID, TINY_VOCAB, check_speculative_report, make_tiny_target, random_batch, tiny_config

from dflash.anchors import sample_anchors
from dflash.cli.config_keys import key_table
from dflash.config import TrainConfig
from dflash.evaluation import speculative as sp
from dflash.evaluation.export import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    draft_weight_names,
    expected_weight_names,
    export_draft,
    load_exported,
)
from dflash.evaluation.serving import format_serving, serving_commands
from dflash.factory import build_draft, build_objective, check_kind_support
from dflash.hf.module import DFlashTrainingModule
from dflash.kinds.dspark import TARGET_COPY_NAMES, DSparkDraftModel, dspark_propose, dspark_weight_names
from dflash.kinds.dspark_objective import DSparkObjective, dspark_block_targets
from dflash.modeling import DFlashDraftModel
from dflash.report.sinks import read_history
from dflash.trainer import DFlashTrainer

BS = 4
RANK = 8
DSPARK = {"draft__kind": "dspark", "dspark__markov_rank": RANK}  # a small Markov head (tiny_config's blocks of 4)


def _perturb(module: torch.nn.Module, scale: float = 0.1) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn_like(p))


def _objective(target=None, markov_scale: float = 30.0, **overrides) -> DSparkObjective:
    """A DSpark objective whose every weight is non-trivial (the Markov bias near the logits' scale)."""
    torch.manual_seed(0)
    obj = build_objective(tiny_config(**{**DSPARK, **overrides}), target or make_tiny_target(), None,
                          device=torch.device("cpu"), dtype=torch.float32)
    _perturb(obj.draft)
    with torch.no_grad():
        obj.draft.markov_head.markov_w2.weight.mul_(markov_scale)
    return obj.train()


# ---- config ----------------------------------------------------------------------------------------


def test_config_keys_defaults_and_refusals():
    keys = {row[0]: row[1] for row in key_table()}
    assert {k: keys[f"dspark.{k}"] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                             "confidence_head_with_markov", "loss_decay_gamma", "ce_alpha", "l1_alpha",
                                             "confidence_alpha")} == {
        "markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True, "loss_decay_gamma": 4.0, "ce_alpha": 0.1, "l1_alpha": 0.9,
        "confidence_alpha": 1.0}
    block = lambda *o, presets=False: TrainConfig.from_sources(None, list(o), presets=presets).draft.block_size  # noqa: E731
    assert block("draft.kind=dspark") == 7 and block("draft.kind=dspark", "draft.block_size=5") == 5
    assert block() == 16 and block("draft.kind=domino") == 16  # DFlash and Domino keep their default
    assert block("draft.kind=dflash2") == 8 and block("draft.kind=dflash2", "draft.block_size=16") == 16
    assert block("draft.kind=dspark", "device=cpu", presets=True) == 4  # the embedded CPU budget's blocks win
    for bad, message in [(["dspark.markov_rank=0"], "markov_rank must be >= 1"),
                         (["dspark.loss_decay_gamma=0"], "loss_decay_gamma must be > 0"),
                         (["dspark.l1_alpha=-1"], "must be >= 0"),
                         (["dspark.markov_head_type=gated"], "only vanilla"),
                         (["dspark.ce_alpha=0", "dspark.l1_alpha=0"], "nothing trains the drafts")]:
        with pytest.raises(ValueError, match=message):  # out of range whichever kind trains
            TrainConfig.from_sources(None, bad, presets=False)
    with pytest.raises(ValueError, match="setting of draft.kind=dspark, which this run does not train"):
        TrainConfig.from_sources(None, ["dspark.markov_rank=8"], presets=False)  # in range: another kind's key
    for bad, message in [(["dspark.markov_head_type=gated"], "only vanilla"),
                         (["dspark.ce_alpha=0", "dspark.l1_alpha=0"], "nothing trains the drafts"),
                         (["draft.loss_decay_gamma=3"], "leave draft.loss_decay_gamma at auto"),
                         (["draft.position_weights=dpace"], "dpace"),
                         (["data.features=/tmp/x"], "offline features .*data.features=null")]:
        with pytest.raises(ValueError, match=message):  # refused with the config
            TrainConfig.from_sources(None, ["draft.kind=dspark", *bad], presets=False)
        cfg = TrainConfig.from_sources(None, ["draft.kind=dspark"], presets=False)
        for item in bad:  # and by the factory, for a config changed after it was validated
            cfg.set(*item.split("="))
        with pytest.raises(ValueError, match=message):
            check_kind_support(cfg)
        if not any(key.startswith("dspark.") for key in bad):  # only a DSpark run refuses them
            check_kind_support(TrainConfig.from_sources(None, bad, presets=False))


def test_refusals_come_before_the_draft_and_on_the_transformers_trainer_path(tiny_target):
    with pytest.raises(ValueError, match="only vanilla"):
        build_draft(tiny_config(**DSPARK, dspark__markov_head_type="rnn"), tiny_target, None)
    with pytest.raises(ValueError, match="not yet by the transformers.Trainer path"):
        DFlashTrainingModule.from_config(tiny_config(**DSPARK), tiny_target, None)


# ---- model -----------------------------------------------------------------------------------------


def test_a_dspark_draft_is_its_dflash_backbone_plus_the_published_heads(tiny_target):
    dflash = build_draft(tiny_config(), tiny_target, None)
    draft = build_draft(tiny_config(**DSPARK), tiny_target, None)
    missing, unexpected = draft.load_state_dict(dflash.state_dict(), strict=False)
    head = draft.head_config
    assert set(missing) == dspark_weight_names(head) and not unexpected and type(dflash) is DFlashDraftModel
    shapes = {n: tuple(p.shape) for n, p in draft.named_parameters() if "_head." in n}
    assert shapes == {"markov_head.markov_w1.weight": (TINY_VOCAB, RANK), "markov_head.markov_w2.weight": (TINY_VOCAB, RANK),
                      "confidence_head.proj.weight": (1, 64 + RANK), "confidence_head.proj.bias": (1,)}
    draft.reset_parameters()  # the backbone's rule would set the bias to 1: the heads keep their own init
    assert draft.confidence_head.proj.bias.item() == 0.0
    assert 0.01 < draft.markov_head.markov_w2.weight.std().item() < 0.03
    h_only = build_draft(tiny_config(**DSPARK, dspark__confidence_head_with_markov=False), tiny_target, None)
    assert h_only.confidence_head.proj.weight.shape == (1, 64)
    assert build_draft(tiny_config(**DSPARK, dspark__enable_confidence_head=False), tiny_target, None).confidence_head is None


# ---- objective -------------------------------------------------------------------------------------


def naive_dspark(obj: DSparkObjective, ids, loss_mask, anchors, keep) -> dict[str, torch.Tensor]:
    """Loss, metric sums and correctness of one micro-batch, slot by slot, from the module doc's formulas: each
    block is run alone on the features of the positions before its anchor, the target's distribution comes
    from its own HF forward, validity stops at the first invalid label."""
    draft, target = obj.draft, obj.target
    head, embed, mh, ch = target.lm_head_weight, target.embed_weight, draft.markov_head, draft.confidence_head
    with torch.no_grad():
        target_logits = target.model(ids).logits  # [B, S, V]
        features = target(ids)
    greedy = torch.cat([ids[:, :1], target_logits[:, :-1].argmax(-1)], dim=1)  # the target's next token at p
    labels = greedy if obj.labels == "target" else ids
    bsz, n = anchors.shape
    out = {name: torch.zeros(()) for name in ("loss", "ce", "l1", "bce", "confidence", "acceptance", "weight")}
    correct, base, valid = (torch.zeros(bsz, n, BS, dtype=torch.bool) for _ in range(3))
    for b in range(bsz):
        for j in range(n):
            a = anchors[b, j].item()
            block = torch.tensor([ids[b, a].item()] + [TINY_MASK_ID] * (BS - 1))
            hidden = draft(embed[block].unsqueeze(0), torch.arange(a, a + BS).unsqueeze(0), None,
                           target_hidden=features[b:b + 1, :a], ctx_position_ids=torch.arange(a).unsqueeze(0))[0]
            for k in range(BS):
                p = a + k + 1
                if not (keep[b, j] and p < ids.shape[1] and loss_mask[b, p]):
                    break  # no later slot of this block is supervised either
                valid[b, j, k] = True
                w = torch.tensor(1.0) if obj.gamma is None else torch.exp(torch.tensor(-k / obj.gamma))
                y = labels[b, p].item()
                u = mh.markov_w1.weight[ids[b, a] if k == 0 else labels[b, a + k]]
                unary = head @ hidden[k]
                z = unary + mh.markov_w2.weight @ u
                p_draft, p_target = z.softmax(-1), target_logits[b, a + k].softmax(-1)
                ce, l1 = -z.log_softmax(-1)[y], (p_draft - p_target).abs().sum()
                soft = (1 - l1 / 2).clamp(0, 1).detach()
                bce = torch.zeros(())
                if ch is not None:
                    logit = ch.proj(torch.cat([hidden[k], u]) if ch.with_markov else hidden[k])[0]
                    bce = F.binary_cross_entropy_with_logits(logit, soft)
                    out["confidence"] = out["confidence"] + torch.sigmoid(logit).detach()
                out["loss"] = out["loss"] + w * (obj.ce_alpha * ce + obj.l1_alpha * l1 + obj.confidence_alpha * bce)
                out["ce"], out["l1"], out["bce"] = out["ce"] + w * ce, out["l1"] + w * l1, out["bce"] + w * bce
                out["acceptance"], out["weight"] = out["acceptance"] + soft, out["weight"] + w
                correct[b, j, k], base[b, j, k] = z.argmax() == y, unary.argmax() == y
    return {**out, "correct": correct, "base": base, "valid": valid}


def _edge_batch(draft: DSparkDraftModel | None = None):
    """Two rows of 32 with blocks of every kind: a one-token hole in the reply (labels valid again after an
    invalid one: the cumprod), blocks running past the end and into the padding, and dropped anchors. With
    `draft`, the text after the prompt follows its Markov head's favourite successor of each token, so that the
    corrected argmax is often right and the backbone's alone rarely: correctness is then checked where it is set."""
    batch = random_batch(batch=2, seed=5)
    if draft is not None:
        successor = (draft.markov_head.markov_w2.weight @ draft.markov_head.markov_w1.weight.t()).argmax(0)  # [V]
        for p in range(4, batch["input_ids"].shape[1]):
            batch["input_ids"][:, p] = successor[batch["input_ids"][:, p - 1]]
    lm = batch["loss_mask"]
    lm[0, 14] = False  # a one-token turn inside row 0's reply
    lm[1, 20:] = False  # row 1's reply ends at 19 (padding after)
    anchors = torch.tensor([[4, 11, 12, 13, 20, 29, 30, 0], [5, 16, 17, 18, 19, 0, 0, 0]])
    keep = torch.tensor([[True] * 7 + [False], [True] * 4 + [False] * 4])
    return batch["input_ids"], lm, anchors, keep


def _grads(obj, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    obj.draft.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in obj.draft.named_parameters()}


@pytest.mark.parametrize("overrides, sampled", [
    ({}, False),
    ({"data__labels": "target", "dspark__confidence_head_with_markov": False, "dspark__ce_alpha": 0.6,
      "dspark__l1_alpha": 0.3, "dspark__confidence_alpha": 0.5}, True),
    ({"dspark__enable_confidence_head": False, "draft__position_weights": "none"}, False),
], ids=["defaults", "target-labels-h-only", "no-confidence-no-decay"])
def test_dspark_objective_equals_the_per_slot_reference(overrides, sampled):
    # a flat LM head and a strong Markov head: its bias decides most argmaxes without saturating the softmax
    obj = _objective(make_tiny_target(head_std=0.1), markov_scale=100.0, **overrides)
    ids, lm, anchors, keep = _edge_batch(obj.draft)
    if sampled:
        anchors, keep = sample_anchors(lm, 6, generator=torch.Generator().manual_seed(3))
    targets = dspark_block_targets(ids, lm, anchors, keep, BS, obj.gamma)
    out = obj(ids, anchors, keep, targets)
    ref = naive_dspark(obj, ids, lm, anchors, keep)
    valid = targets.valid[..., 1:]
    assert torch.equal(valid, ref["valid"])
    if not sampled:  # the cases the hand-made anchors are there for
        assert valid[0, 2].tolist() == [True, False, False, False]  # label 14 is masked: 15 and 16 are cut too
        assert valid[0, 5].tolist() == [True, True, False, False] and not valid[0, 7].any()  # past S; dropped
        assert valid[1, 2].tolist() == [True, True, False, False]  # into the padding
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss_sum, ref["loss"], **close)
    torch.testing.assert_close(out.ce_sum, ref["ce"], **close)
    torch.testing.assert_close(targets.weights.sum(), ref["weight"], **close)
    for name, key in [("objective_sum", "loss"), ("l1_loss_sum", "l1"), ("confidence_loss_sum", "bce"),
                      ("confidence_sum", "confidence"), ("acceptance_sum", "acceptance")]:
        torch.testing.assert_close(out.extras[name], ref[key], **close, msg=name)
    assert torch.equal(out.correct & valid, ref["correct"]) and out.extras["base_correct"] == ref["base"].sum()
    assert (ref["correct"] != ref["base"]).any()  # the Markov bias changes which slots are right
    scale = 1 / targets.weights.sum()  # the trainer's global token mean
    got, want = _grads(obj, out.loss_sum * scale), _grads(obj, ref["loss"] * scale)
    for name, g in got.items():
        top = want[name].abs().max()
        assert top > 0, name  # every weight, the heads' too, gets a gradient
        torch.testing.assert_close(g, want[name], rtol=1e-4, atol=1e-5 * top.item(), msg=name)


def test_no_gradient_work_under_no_grad_and_the_same_numbers():
    obj = _objective()
    ids, lm, anchors, keep = _edge_batch()
    targets = dspark_block_targets(ids, lm, anchors, keep, BS, obj.gamma)
    with_grad = obj(ids, anchors, keep, targets)
    with torch.no_grad():
        without = obj(ids, anchors, keep, targets)
    assert without.loss_sum.grad_fn is None
    torch.testing.assert_close(without.loss_sum, with_grad.loss_sum.detach(), rtol=0, atol=0)


# ---- the training step -----------------------------------------------------------------------------


def test_a_short_training_run_lowers_the_loss_and_exports_a_dspark_draft(tmp_path, target):
    ids, loss_mask = fixtures.continuation_batch(target)
    rows = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "loss_mask": loss_mask.int().tolist()})
    unused = next(t for t in range(TINY_VOCAB - 1, 0, -1) if t not in ids)  # the run refuses a mask token in its data
    cfg = tiny_config(**DSPARK, output_dir=str(tmp_path / "run"), max_steps=40, log_interval=10, optim__lr=1e-2,
                      draft__mask_token_id=unused, data__num_workers=0, data__bucket_multiple=8, spec_eval_prompts=0,
                      progress_bar=False)
    summary = DFlashTrainer(cfg, target=target, dataset=(rows, rows)).fit()
    losses = [row["dspark_loss"] for row in read_history(tmp_path / "run") if "dspark_loss" in row]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses
    assert summary["held_out"]["chain_tau"] > 1.0
    assert isinstance(load_exported(tmp_path / "run" / "export"), DSparkDraftModel)


# ---- export and decoding ---------------------------------------------------------------------------


def test_export_writes_deepspec_s_dspark_contract_and_reads_back_equal(tmp_path, tiny_target):
    draft = build_draft(tiny_config(**DSPARK), tiny_target, None)
    _perturb(draft)
    out = export_draft(draft, tmp_path / "export", dtype=torch.float32, target_model=tiny_target)
    config = json.loads((out / CONFIG_NAME).read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert {k: config[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                   "confidence_head_with_markov", "block_size", "sample_from_anchor", "mask_token_id",
                                   "target_layer_ids", "num_target_layers")} == {
        "markov_rank": RANK, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True, "block_size": BS, "sample_from_anchor": True, "mask_token_id": TINY_MASK_ID,
        "target_layer_ids": draft.config.target_layer_ids, "num_target_layers": 4}
    assert config["dflash_config"] == {"mask_token_id": TINY_MASK_ID, "target_layer_ids": draft.config.target_layer_ids,
                                       "block_size": BS}  # for the DFlash parsers; the head keys stay top-level
    assert "speculators_model_type" not in config
    from safetensors import safe_open

    with safe_open(str(out / WEIGHTS_NAME), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        copies = {k: f.get_tensor(k) for k in TARGET_COPY_NAMES}
    assert set(shapes) == draft_weight_names(draft.config) | set(TARGET_COPY_NAMES)
    assert draft_weight_names(draft.config) == expected_weight_names(2) | dspark_weight_names(draft.head_config)
    assert shapes["markov_head.markov_w1.weight"] == shapes["markov_head.markov_w2.weight"] == (TINY_VOCAB, RANK)
    assert shapes["confidence_head.proj.weight"] == (1, 64 + RANK) and shapes["confidence_head.proj.bias"] == (1,)
    assert torch.equal(copies["embed_tokens.weight"], tiny_target.get_input_embeddings().weight)
    assert torch.equal(copies["lm_head.weight"], tiny_target.get_output_embeddings().weight)
    for folder in (out, export_draft(draft, tmp_path / "plain", dtype=torch.float32)):  # with and without the copies
        loaded = load_exported(folder)
        assert isinstance(loaded, DSparkDraftModel)
        assert loaded.state_dict().keys() == draft.state_dict().keys()
        assert all(torch.equal(loaded.state_dict()[n], v) for n, v in draft.state_dict().items())
    # DeepSpec's own shape has no dflash_config: its top-level keys are enough
    (out / CONFIG_NAME).write_text(json.dumps({k: v for k, v in config.items() if k != "dflash_config"}))
    assert load_exported(out).config == draft.config
    with pytest.raises(ValueError, match="DSpark exports"):
        export_draft(build_draft(tiny_config(), tiny_target, None), tmp_path / "dflash", target_model=tiny_target)
    named = export_draft(draft, tmp_path / "named", target="some/target")  # a re-export keeps what the export recorded
    again = json.loads((export_draft(load_exported(named), tmp_path / "again") / CONFIG_NAME).read_text())
    assert again["dflash_config"]["target"] == "some/target" and "markov_rank" not in again["dflash_config"]
    assert again["markov_rank"] == RANK
    (out / CONFIG_NAME).write_text(json.dumps({**config, "sample_from_anchor": False}))
    with pytest.raises(ValueError, match="layout"):
        load_exported(out)
    # `dflash export` prints the launch lines checked against the engines' DSpark loaders (tests/test_serving.py)
    plain = tmp_path / "plain"
    assert set(serving_commands(plain)) == {"vllm", "sglang"} and "a DSpark draft" in format_serving(plain)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, TINY_VOCAB - 1, (k,), generator=g).tolist() for k in [1, 5, 12, 29]]


def test_speculative_decoding_with_a_dspark_draft_is_lossless_and_walks_the_markov_head(target):
    draft = build_draft(tiny_config(**DSPARK), target, None)
    _perturb(draft)
    with torch.no_grad():  # a Markov bias on the logits' scale: the walk differs from the backbone's argmax
        draft.markov_head.markov_w2.weight.mul_(300.0)
    report = sp.evaluate_speculative(target, draft.eval(), _prompts(), max_new_tokens=17, stop_token_ids=[])
    assert report["new_tokens"] == 17 * 4  # evaluate_speculative raises LosslessError otherwise
    assert len(report["acceptance_histogram"]) == BS + 1  # a block verifies the last token and BS drafts
    check_speculative_report({**report, "block_size": BS + 1})  # its identities, at the verification width
    hidden, first = torch.randn(3, BS, 64), torch.tensor([[5], [7], [9]])
    head = target.get_output_embeddings().weight
    drafted = dspark_propose(draft, hidden, first, head)
    assert drafted.shape == (3, BS)  # every slot, slot 0 included, proposes
    w1, w2 = draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight
    for b in range(3):  # the walk by hand: slot k's bias from the token drafted at k - 1 (the anchor for slot 0)
        previous = first[b, 0].item()
        for k in range(BS):
            previous = (head @ hidden[b, k] + w2 @ w1[previous]).argmax().item()
            assert drafted[b, k].item() == previous
    assert not torch.equal(drafted, (hidden @ head.t()).argmax(-1))  # the Markov head changed some drafts
    _perturb(draft.confidence_head, scale=10.0)  # the confidence head never changes a drafted token
    assert torch.equal(dspark_propose(draft, hidden, first, head), drafted)


# The held-out chain τ̂ = real τ of the Markov walk: tests/test_chain.py, for every kind.
