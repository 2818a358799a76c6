"""Domino: fused CE, lambda schedule, loss mix, label layouts, sync-free steps, export, speculative decoding."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    DOMINO_HEAD,
    TINY_VOCAB,
    make_tiny_target,
    random_batch,
    tiny_config,
)
from safetensors import safe_open

from dflash.diagnostics import forbid_syncs
from dflash.evaluation import speculative as sp
from dflash.evaluation.export import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    draft_weight_names,
    expected_weight_names,
    export_draft,
    load_exported,
)
from dflash.factory import build_objective
from dflash.kinds.domino import (
    DOMINO_WEIGHT_NAMES,
    DominoDraftModel,
    DominoHeadConfig,
    DominoObjective,
    DominoTargets,
    domino_propose,
)
from dflash.losses import BlockTargets, block_targets, domino_linear_cross_entropy
from dflash.objective import DFlashObjective
from dflash.target_model.frozen import FrozenTarget
from dflash.trainer import DFlashTrainer

BS = 4


def _config(**overrides):
    return tiny_config(**{**DOMINO_HEAD, **overrides})


def _trainer(target=None, **overrides) -> DFlashTrainer:
    return DFlashTrainer(_config(**overrides), target=target or make_tiny_target(), tokenizer=None)


def _objective(target=None, **overrides) -> DominoObjective:
    cfg = _config(**overrides)
    torch.manual_seed(0)
    return build_objective(cfg, target or make_tiny_target(), None, device=torch.device("cpu"), dtype=torch.float32)


def _plan(obj: DFlashObjective, batch, seed: int = 0):
    ids, lm = batch["input_ids"], batch["loss_mask"]
    anchors, keep, targets = obj.plan(ids, lm, torch.Generator().manual_seed(seed))
    return ids, anchors, keep, targets


def _perturb(draft: torch.nn.Module, seed: int = 0) -> None:
    """Non-trivial values everywhere (a fresh draft predicts nearly the same token in every slot)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.1 * torch.randn_like(p))


# ---- the fused CE ------------------------------------------------------------------------------


def _ce_inputs(m=9, p=3, h=8, e=5, v=40, s=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, p, h, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(v, h, generator=g, dtype=torch.float64)
    corr = torch.randn(m, p - s, e, generator=g, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(v, e, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (m, p), generator=g)
    weights = torch.rand(m, p, generator=g, dtype=torch.float64) * (torch.rand(m, p, generator=g) < 0.8)
    return hidden, head, corr, w2, labels, weights


def _reference_ce(hidden, head, corr, w2, labels, weights, lam, s):
    """Unchunked float64: materialize both logits tensors."""
    base = hidden @ head.t()
    final = torch.cat([base[:, :s], base[:, s:] + corr @ w2.t()], dim=1)
    ce = lambda logits: (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")  # noqa: E731
                         * weights.flatten()).sum()
    f, b = ce(final), ce(base)
    return (1 - lam) * f + lam * b, f, b, final.argmax(-1) == labels, base.argmax(-1) == labels


@pytest.mark.parametrize("chunk,s,lam", [(4, 1, 0.3), (7, 0, 0.0), (1000, 2, 1.0), (3, 1, 0.75)])
def test_fused_domino_ce_equals_float64_reference_loss_and_grads(chunk, s, lam):
    hidden, head, corr, w2, labels, weights = _ce_inputs(s=s)
    out = domino_linear_cross_entropy(hidden, head, corr, w2, labels, weights, torch.tensor(lam), s, chunk_size=chunk)
    (0.5 * out.loss_sum).backward()
    grads = [t.grad.clone() for t in (hidden, corr, w2)]
    for t in (hidden, corr, w2):
        t.grad = None
    ref, ref_f, ref_b, ref_fc, ref_bc = _reference_ce(hidden, head, corr, w2, labels, weights, lam, s)
    (0.5 * ref).backward()
    torch.testing.assert_close(out.loss_sum.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.final_sum.double(), ref_f, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.base_sum.double(), ref_b, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.final_correct, ref_fc) and torch.equal(out.base_correct, ref_bc)
    for name, got, t in zip(("hidden", "correction", "W2"), grads, (hidden, corr, w2), strict=True):
        torch.testing.assert_close(got, t.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert not out.final_sum.requires_grad and not out.base_sum.requires_grad


def test_fused_domino_ce_under_no_grad_forms_no_gradients():
    hidden, head, corr, w2, labels, weights = _ce_inputs()
    with torch.no_grad():
        out = domino_linear_cross_entropy(hidden, head, corr, w2, labels, weights, torch.tensor(0.5), 1, 4)
    assert not out.loss_sum.requires_grad and out.final_correct.shape == (9, 3)
    with pytest.raises(ValueError, match="shapes disagree"):
        domino_linear_cross_entropy(hidden, head, corr, w2, labels, weights, torch.tensor(0.5), 2, 4)


# ---- lambda ------------------------------------------------------------------------------------


def test_lambda_schedule_on_device_follows_the_step_tensor_in_place():
    obj = _objective(max_steps=100, domino__lambda_start=0.8, domino__decay_ratio=0.5)
    assert obj.lambda_base().item() == pytest.approx(0.8)  # unbound: lambda_start, constant
    step = torch.zeros((), dtype=torch.float32)
    obj.bind_schedule(step, max_steps=100)  # decay over int(0.5 * 100) = 50 steps
    for s, expected in [(0, 0.8), (10, 0.64), (25, 0.4), (49, 0.016), (50, 0.0), (80, 0.0)]:
        step.fill_(s)  # the trainer updates its step tensor in place; the objective sees it
        lam = obj.lambda_base()
        assert lam.device == step.device and lam.dtype == torch.float32
        assert lam.item() == pytest.approx(expected, abs=1e-6), s


def test_trainer_binds_lambda_and_reports_it():
    trainer = _trainer(max_steps=10, domino__decay_ratio=0.5)  # lambda 1, 0.8, 0.6, ... over 5 steps
    batch = random_batch()
    for _ in range(3):
        trainer.train_step(batch)
    out = trainer.metrics.flush()
    assert out["lambda"] == pytest.approx((1.0 + 0.8 + 0.6) / 3, rel=1e-6)
    assert {"base_loss", "base_accuracy", "base_tau"} <= set(out)
    for _ in range(4):
        trainer.train_step(batch)
    assert trainer.metrics.flush()["lambda"] == pytest.approx((0.4 + 0.2 + 0.0 + 0.0) / 4, abs=1e-6)


# ---- the objective against an explicit reference -------------------------------------------------


def _reference_objective(obj: DominoObjective, ids, anchors, keep, targets, lam: float):
    """Domino written out: materialized logits, the GRU over the data tokens a..a+P-1 (module doc)."""
    draft = obj.draft
    hidden, labels = obj.draft_hidden(ids, anchors, keep, targets)  # [B, N, bs, H]
    p, s = BS - 1, draft.head_config.pure_draft_prefix_len
    first = 0 if draft.head_config.shift_label else 1
    z = hidden[:, :, first:first + p]  # [B, N, P, H]
    pos = (anchors.unsqueeze(-1) + torch.arange(p)).clamp(max=ids.shape[1] - 1)
    tokens = torch.gather(ids, 1, pos.flatten(1)).view_as(pos)
    states = draft.prefix_gru(obj.target.embed(tokens).flatten(0, 1))[0].view(*z.shape[:3], -1)
    base = z.double() @ obj.target.lm_head_weight.double().t()
    corr = draft.embed_proj(torch.cat([z, states], dim=-1)).double()
    final = torch.cat([base[:, :, :s], base[:, :, s:] + corr[:, :, s:]], dim=2)
    y, w = labels[..., 1:], targets.weights[..., 1:].double()

    def ce(logits):
        return (F.cross_entropy(logits.flatten(0, 2), y.flatten(), reduction="none") * w.flatten()).sum()

    f, b = ce(final), ce(base)
    return (1 - lam) * f + lam * b, f, b, final.argmax(-1) == y, base.argmax(-1) == y


@pytest.mark.parametrize("shift_label,prefix", [(False, 1), (True, 1), (False, 0), (True, 2)])
def test_objective_equals_reference_in_both_label_layouts(shift_label, prefix):
    obj = _objective(domino__shift_label=shift_label, domino__pure_draft_prefix_len=prefix,
                     domino__lambda_start=0.3).train()
    ids, anchors, keep, targets = _plan(obj, random_batch(seed=2))
    out = obj(ids, anchors, keep, targets)
    ref, ref_f, ref_b, ref_fc, ref_bc = _reference_objective(obj, ids, anchors, keep, targets, 0.3)
    torch.testing.assert_close(out.loss_sum.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.ce_sum.double(), ref_f, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.extras["base_loss_sum"].double(), ref_b, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.correct, ref_fc)
    valid = targets.valid[..., 1:]
    assert out.extras["base_correct"] == (ref_bc & valid).sum()
    accepted = (ref_bc & valid).long().cumprod(-1).sum(-1)
    assert out.extras["base_accepted"] == (accepted * keep).sum()
    assert out.extras["lambda"].item() == pytest.approx(0.3)
    draft = obj.draft
    for p in draft.parameters():
        p.grad = None
    ref.backward()
    want = {n: p.grad.clone() for n, p in draft.named_parameters()}
    draft.zero_grad(set_to_none=True)
    out.loss_sum.backward()
    for n, p in draft.named_parameters():
        torch.testing.assert_close(p.grad, want[n].to(p.grad.dtype), rtol=1e-4, atol=1e-6, msg=n)


def test_lambda_one_gives_the_head_no_gradient_and_is_dflash():
    obj = _objective(domino__lambda_start=1.0).train()
    ids, anchors, keep, targets = _plan(obj, random_batch(seed=4))
    obj(ids, anchors, keep, targets).loss_sum.backward()
    head = {n for n, _ in obj.draft.named_parameters() if n.startswith(("prefix_gru.", "embed_proj."))}
    assert len(head) == 4
    grads = {n: p.grad.clone() for n, p in obj.draft.named_parameters()}
    assert all(torch.count_nonzero(grads[n]) == 0 for n in head)
    # ... and the backbone gets exactly DFlash's gradient (same draft, same blocks, base CE only)
    obj.draft.zero_grad(set_to_none=True)
    dflash = DFlashObjective(obj.target, obj.draft, num_anchors=obj.num_anchors, ce_chunk_size=obj.ce_chunk_size)
    dflash(ids, anchors, keep, targets).loss_sum.backward()
    for n, p in obj.draft.named_parameters():
        if n not in head:
            assert grads[n].abs().max() > 0, n
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-5, msg=n)


def test_lambda_zero_leaves_the_base_loss_out():
    obj = _objective(domino__lambda_start=0.0).train()
    ids, anchors, keep, targets = _plan(obj, random_batch(seed=5))
    obj(ids, anchors, keep, targets).loss_sum.backward()
    got = {n: p.grad.clone() for n, p in obj.draft.named_parameters()}
    obj.draft.zero_grad(set_to_none=True)
    _, final_only, _, _, _ = _reference_objective(obj, ids, anchors, keep, targets, 0.0)
    final_only.backward()
    for n, p in obj.draft.named_parameters():
        assert got[n].abs().max() > 0, n
        torch.testing.assert_close(got[n], p.grad.float(), rtol=1e-4, atol=1e-5, msg=n)


# ---- the training step (grad accumulation = one big batch: test_model_loss, for both kinds) -----------


def test_domino_steps_make_no_sync():
    batch = random_batch(batch=4)
    # unbound objective (lambda constant), forward + backward by hand
    obj = _objective().train()
    ids, anchors, keep, targets = _plan(obj, batch)
    with forbid_syncs(raise_on_first=False) as report:
        obj(ids, anchors, keep, targets).loss_sum.backward()
    assert report.findings == [], report
    # trainer steps: bound lambda, grad accumulation, scheduled sampling
    trainer = _trainer(optim__grad_accum=2, domino__scheduled_sampling=0.5)
    with forbid_syncs(raise_on_first=False) as report:
        for _ in range(4):
            trainer.train_step(batch)
    assert report.findings == [], report
    assert trainer.step == 4 and trainer.metrics.flush()["base_loss"] > 0


def test_tiny_domino_draft_overfits_a_fixed_batch():
    trainer = _trainer(max_steps=100)  # lambda reaches 0 at step 50: the head takes over
    batch = random_batch(seed=3)
    trainer.train_step(batch)
    first = trainer.metrics.flush()
    for _ in range(99):
        trainer.train_step(batch)
    trainer.metrics.flush()
    for _ in range(10):  # lambda is 0 now: the final logits alone are trained
        trainer.train_step(batch)
    last = trainer.metrics.flush()
    assert last["loss"] < 0.5 * first["loss"], (first["loss"], last["loss"])
    assert last["lambda"] == 0.0 and last["loss"] < last["base_loss"]  # the correction helps


def test_scheduled_sampling_feeds_the_base_predictions_to_the_gru():
    obj = _objective(domino__scheduled_sampling=1.0).train()
    _perturb(obj.draft)  # base predictions that differ from slot to slot
    ids, anchors, keep, targets = _plan(obj, random_batch(seed=6))
    assert isinstance(targets, DominoTargets) and targets.sampled.shape == (4, 8, BS - 1)
    assert torch.equal(_plan(obj, random_batch(seed=6))[3].sampled, targets.sampled)  # from the plan's generator
    hidden, labels = obj.draft_hidden(ids, anchors, keep, targets)
    proposals = obj.draft.proposal_states(hidden)
    tokens = obj.gru_tokens(ids, anchors, labels, targets, proposals)
    base_pred = (proposals @ obj.target.lm_head_weight.t()).argmax(-1)
    assert not torch.equal(base_pred[..., 1:], base_pred[..., :-1])
    assert torch.equal(tokens[..., 0], torch.gather(ids, 1, anchors))  # the anchor is never replaced
    assert torch.equal(tokens[..., 1:], base_pred[..., :-1])
    obj.eval()  # evaluation is teacher-forced
    pos = (anchors.unsqueeze(-1) + torch.arange(BS - 1)).clamp(max=ids.shape[1] - 1)
    truth = torch.gather(ids, 1, pos.flatten(1)).view_as(pos)
    assert torch.equal(obj.gru_tokens(ids, anchors, labels, targets, proposals), truth)
    none = _objective(domino__scheduled_sampling=0.0).train()
    _, _, _, plain = _plan(none, random_batch(seed=6))
    assert torch.equal(none.gru_tokens(ids, anchors, labels, plain, proposals), truth)


def test_scheduled_sampling_without_the_plans_draw_is_refused():
    """A draw from the global RNG (the old fallback for hand-built targets) is outside (seed, rank, step):
    exact resume and graph replay would differ silently. Targets without the plan's `sampled` are refused."""
    obj = _objective(domino__scheduled_sampling=0.5).train()
    ids, anchors, keep, targets = _plan(obj, random_batch(seed=6))
    hidden, labels = obj.draft_hidden(ids, anchors, keep, targets)
    plain = BlockTargets(**{f.name: getattr(targets, f.name) for f in dataclasses.fields(BlockTargets)})
    with pytest.raises(ValueError, match="needs targets from DominoObjective.plan"):
        obj.gru_tokens(ids, anchors, labels, plain, obj.draft.proposal_states(hidden))


def test_gru_reads_the_labels_and_the_data_where_unsupervised():
    """data.labels=target: the GRU reads the target's greedy tokens (what it reads at inference);
    a loss-mask hole inside a block gets the data token, not the label placeholder 0."""
    obj = _objective(data__labels="target").train()
    batch = random_batch(seed=7)
    batch["loss_mask"][:, 12:14] = False
    ids, anchors, keep, targets = _plan(obj, batch)
    hidden, labels = obj.draft_hidden(ids, anchors, keep, targets)
    tokens = obj.gru_tokens(ids, anchors, labels, targets, obj.draft.proposal_states(hidden))
    num = BS - 1
    pos = (anchors.unsqueeze(-1) + torch.arange(num)).clamp(max=ids.shape[1] - 1)
    data = torch.gather(ids, 1, pos.flatten(1)).view_as(pos)
    valid = targets.valid[..., :num]
    assert valid.any() and (~valid[..., 1:]).any()
    assert torch.equal(tokens, torch.where(valid, labels[..., :num], data))
    assert not torch.equal(tokens, data)  # the greedy labels differ from the data somewhere


# ---- the model, export -------------------------------------------------------------------------


def _domino_draft(target, **head) -> DominoDraftModel:
    obj = _objective(target, **{f"domino__{k}": v for k, v in head.items()})
    _perturb(obj.draft)
    return obj.draft.eval()


def _final_logits(draft: DominoDraftModel, hidden, tokens, embed, head):
    """Teacher-forced final logits `[1, P, V]` of one block."""
    z = draft.proposal_states(hidden)
    g = draft.prefix_states(F.embedding(tokens, embed))[0]
    return z @ head.t() + draft.embed_proj(torch.cat([z, g], dim=-1))


def test_bad_domino_configs_are_refused(tiny_target):
    with pytest.raises(ValueError, match="lacks"):
        DominoHeadConfig.from_extra({"projector_type": "domino", "emb_dim": 8}, BS)
    with pytest.raises(ValueError, match="pure_draft_prefix_len"):
        DominoHeadConfig.from_extra({"projector_type": "domino", "emb_dim": 8, "gru_hidden_dim": 8,
                                     "pure_draft_prefix_len": BS - 1, "shift_label": False}, BS)
    dflash_draft = DFlashTrainer(tiny_config(), target=tiny_target).draft
    with pytest.raises(TypeError, match="DominoDraftModel"):
        DFlashTrainer(_config(), target=tiny_target, draft=dflash_draft)


def test_export_round_trip_with_the_published_domino_keys(tiny_target, tmp_path):
    draft = _domino_draft(tiny_target, shift_label=True)
    export_draft(draft, tmp_path)
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert cfg["dflash_config"] == {"mask_token_id": draft.config.mask_token_id,
                                    "target_layer_ids": draft.config.target_layer_ids, "projector_type": "domino",
                                    "emb_dim": 16, "gru_hidden_dim": 32, "pure_draft_prefix_len": 1,
                                    "shift_label": True}
    with safe_open(str(tmp_path / WEIGHTS_NAME), framework="pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    assert set(shapes) == expected_weight_names(2) | DOMINO_WEIGHT_NAMES == draft_weight_names(draft.config)
    assert shapes["prefix_gru.weight_ih_l0"] == (3 * 32, 64) and shapes["prefix_gru.weight_hh_l0"] == (3 * 32, 32)
    assert shapes["embed_proj.0.weight"] == (16, 64 + 32) and shapes["embed_proj.2.weight"] == (TINY_VOCAB, 16)

    loaded = load_exported(tmp_path, target_model=tiny_target)
    assert isinstance(loaded, DominoDraftModel) and loaded.config == draft.config
    reference = DominoDraftModel(draft.config)
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in draft.state_dict().items()})
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 10, 64 * len(draft.config.target_layer_ids), generator=g)
    noise = torch.randn(1, BS, 64, generator=g)
    pos = torch.arange(10, 10 + BS).unsqueeze(0)
    tokens = torch.randint(0, TINY_VOCAB, (1, BS - 1), generator=g)
    embed, head = tiny_target.get_input_embeddings().weight, tiny_target.get_output_embeddings().weight
    with torch.no_grad():
        outs = [_final_logits(m, m(noise, pos, None, target_hidden=feats), tokens, embed, head)
                for m in (loaded, reference)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


# ---- speculative decoding --------------------------------------------------------------------------


def _prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY_VOCAB - 1, (k,), generator=g).tolist() for k in [1, 5, 12, 29][:n]]


@pytest.mark.parametrize("shift_label,prefix", [(False, 1), (True, 0), (True, 2)])
def test_rollout_drafts_are_what_the_training_path_predicts(target, shift_label, prefix):
    """Inference (GRU stepped over drafted tokens) and training (GRU over the label sequence) agree:
    feeding the rollout's drafts as labels, the training forward predicts every one of them."""
    obj = _objective(target, draft__num_anchors=1, domino__shift_label=shift_label,
                     domino__pure_draft_prefix_len=prefix).eval()
    draft = obj.draft
    _perturb(draft)
    with torch.no_grad():  # a strong, token-dependent correction, so a misaligned GRU would show
        for p in (*draft.prefix_gru.parameters(), *draft.embed_proj.parameters()):
            p.normal_(0, 1.0)
        draft.correction_weight.mul_(5.0)  # corrections larger than the base logits' spread
    prompt = _prompts(4)[3]
    a = len(prompt)
    anchor = torch.tensor([[7]])
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    with torch.no_grad():
        feats = FrozenTarget(target, draft.config.target_layer_ids)(torch.tensor([prompt]))
        ids = torch.cat([anchor, torch.full((1, BS - 1), draft.config.mask_token_id)], dim=1)
        hidden = draft(obj.target.embed(ids), torch.arange(a, a + BS).unsqueeze(0), None, target_hidden=feats)
        drafts = domino_propose(draft, hidden, anchor, embed, head)
        # the test proves something only if the head changes drafts and reads the tokens
        assert not torch.equal(drafts, (draft.proposal_states(hidden) @ head.t()).argmax(-1))
        assert not torch.equal(drafts, domino_propose(draft, hidden, anchor + 1, embed, head))
        sequence = torch.cat([torch.tensor([prompt]), anchor, drafts], dim=1)
        loss_mask = torch.ones_like(sequence, dtype=torch.bool)
        anchors, keep = torch.tensor([[a]]), torch.tensor([[True]])
        targets = block_targets(sequence, loss_mask, anchors, keep, BS, obj.gamma)
        out = obj(sequence, anchors, keep, targets)
    assert out.correct.all(), out.correct


def test_speculative_decoding_with_domino_drafts_is_lossless(target, trained_domino):
    prompts = _prompts(4, seed=3)
    random_draft = _domino_draft(target, shift_label=True)
    report = sp.evaluate_speculative(target, random_draft, prompts, max_new_tokens=17, stop_token_ids=[])
    assert report["new_tokens"] == 17 * len(prompts)  # evaluate_speculative raises LosslessError otherwise
    assert isinstance(trained_domino.draft, DominoDraftModel)
    report = sp.evaluate_speculative(target, trained_domino.draft, prompts, max_new_tokens=30, stop_token_ids=[])
    assert report["tau"] > 1.2, report["tau"]  # real acceptance: the trained Domino draft drafts well


def test_oracle_domino_head_reaches_tau_equal_block_size(target, monkeypatch):
    """The Domino head is what speculative decoding uses: an oracle head gives tau = bs."""
    draft = _domino_draft(target)
    for prompt in _prompts(3):
        ref = sp.target_generate(target, prompt, 1 + 3 * BS).output_ids
        starts = []

        def oracle(draft_, hidden, first_token, embed, head, ref=ref, prompt=prompt, starts=starts):
            i = len(starts) * BS + 1  # every block is fully accepted: block k starts at new token k*bs
            starts.append(i)
            return torch.tensor([ref[i:i + BS - 1]])

        monkeypatch.setattr("dflash.kinds.domino.domino_propose", oracle)  # what DominoDraftModel.propose runs
        spec = sp.speculative_generate(target, draft, prompt, max_new_tokens=1 + 3 * BS)
        monkeypatch.undo()
        assert spec.output_ids == ref and spec.tau == BS and spec.num_target_forwards == 3


# Held-out evaluation of a Domino draft trained with scheduled sampling (every valid anchor, no sampled GRU inputs,
# chain τ̂ = real τ): tests/test_chain.py, for every kind.
