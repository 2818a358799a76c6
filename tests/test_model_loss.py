"""Draft model, block labels, chunked CE, metrics and the training step on tiny targets (CPU)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DFLASH2_HEAD, DOMINO_HEAD, TINY_MASK_ID, make_tiny_target, random_batch, tiny_config

from dflash.anchors import sample_anchors
from dflash.losses import accepted_prefix_length, block_targets, linear_cross_entropy
from dflash.metrics import MetricLayout, Metrics
from dflash.modeling import DFlashDraftConfig, DFlashDraftModel, default_target_layer_ids
from dflash.optim import lr_at
from dflash.target_model.frozen import FrozenTarget, resolve_mask_token_id
from dflash.trainer import DFlashTrainer

# ---- labels and weights ----------------------------------------------------------------------


def test_block_targets_match_reference():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3, 20), generator=g)
    lm = torch.rand(3, 20, generator=g) < 0.8
    anchors, keep = sample_anchors(lm, 5, generator=g)
    bs, gamma = 4, 7.0
    t = block_targets(ids, lm, anchors, keep, bs, gamma)
    for b in range(3):
        for j in range(5):
            a = int(anchors[b, j])
            for k in range(bs):
                p = a + k
                ok = bool(keep[b, j]) and k >= 1 and p < 20 and bool(lm[b, min(p, 19)])
                assert bool(t.valid[b, j, k]) == ok
                w = math.exp(-(k - 1) / gamma) if ok else 0.0
                assert t.weights[b, j, k].item() == pytest.approx(w)
                if ok:
                    assert t.labels[b, j, k] == ids[b, p]  # same-position layout
    assert (t.weights[..., 0] == 0).all()  # slot 0 is never a target


def test_accepted_prefix_length():
    correct = torch.tensor([[[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]]], dtype=torch.bool)
    valid = torch.tensor([[[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 1]]], dtype=torch.bool)
    assert accepted_prefix_length(correct, valid).tolist() == [[2, 0, 2]]


# ---- chunked CE ------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_chunked_ce_equals_unchunked_loss_and_grads(chunk):
    g = torch.Generator().manual_seed(0)
    t, h, v = 100, 16, 50
    hidden = torch.randn(t, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (t,), generator=g)
    w = torch.rand(t, generator=g, dtype=torch.float64) * (torch.rand(t, generator=g) < 0.7)

    loss, correct = linear_cross_entropy(hidden, weight, labels, w, chunk_size=chunk)
    (loss * 0.5).backward()
    grad = hidden.grad.clone()

    hidden.grad = None
    logits = hidden @ weight.t()
    ref = (F.cross_entropy(logits, labels, reduction="none") * w.float()).sum()
    (ref * 0.5).backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, hidden.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(correct, logits.argmax(-1) == labels)


def test_chunked_ce_without_grad():
    hidden = torch.randn(10, 8)
    loss, correct = linear_cross_entropy(hidden, torch.randn(20, 8), torch.zeros(10, dtype=torch.long),
                                         torch.ones(10), chunk_size=3)
    assert loss.requires_grad is False and correct.shape == (10,)


# ---- model -----------------------------------------------------------------------------------


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # published Qwen3-8B drafts
    assert default_target_layer_ids(30, 2) == [1, 27]


def _draft(target, layers=2, bs=4):
    cfg = DFlashDraftConfig.for_target(target.config, mask_token_id=TINY_MASK_ID, num_hidden_layers=layers,
                                       block_size=bs)
    return DFlashDraftModel(cfg)


def test_draft_block_sees_only_context_before_anchor_and_its_own_block(tiny_target):
    """End to end through the model: perturbing what the mask hides changes nothing."""
    from dflash.attention import dense_dflash_mask

    torch.manual_seed(0)
    draft = _draft(tiny_target).eval()
    target = FrozenTarget(tiny_target, draft.config.target_layer_ids)
    ids = torch.randint(0, 100, (1, 24))
    anchors = torch.tensor([[5, 12]])
    keep = torch.tensor([[True, True]])
    bs = 4
    mask = dense_dflash_mask(anchors, keep, 24, bs)
    pos = (anchors.unsqueeze(-1) + torch.arange(bs)).flatten(1)
    noise = torch.randn(1, 2 * bs, 64)

    def run(feats, noise):
        return draft(noise, pos, mask, target_hidden=feats)

    feats = target(ids)
    out = run(feats, noise)
    feats2 = feats.clone()
    feats2[:, 5:] += 10.0  # positions >= first anchor: block 0 must not change
    noise2 = noise.clone()
    noise2[:, bs:] += 1.0  # the other block's inputs: block 0 must not change
    out2 = run(feats2, noise2)
    torch.testing.assert_close(out[:, :bs], out2[:, :bs])
    assert not torch.allclose(out[:, bs:], out2[:, bs:])
    feats3 = feats.clone()
    feats3[:, :5] += 1.0  # context before the anchor does matter
    assert not torch.allclose(run(feats3, noise)[:, :bs], out[:, :bs])


def test_target_features_are_chosen_hidden_states(tiny_target):
    target = FrozenTarget(tiny_target, [0, 2])
    ids = torch.randint(0, 100, (2, 10))
    out = tiny_target.model(ids, output_hidden_states=True)
    feats = target(ids)
    assert feats.shape == (2, 10, 128)
    torch.testing.assert_close(feats, torch.cat([out.hidden_states[1], out.hidden_states[3]], dim=-1))
    with pytest.raises(ValueError, match="out of range"):
        FrozenTarget(tiny_target, [4])


def test_target_runs_only_the_layers_it_needs(tiny_target):
    calls = []
    tiny_target.model.layers[3].register_forward_hook(lambda *a: calls.append(3))
    target = FrozenTarget(tiny_target, [0, 1])
    target(torch.randint(0, 100, (1, 6)))
    assert calls == []  # layers above max(layer_ids) never ran
    assert len(tiny_target.model.layers) == 4  # the wrapped model keeps all its layers
    last = FrozenTarget(tiny_target, [3])(torch.randint(0, 100, (1, 6)))
    assert calls == [3] and last.shape == (1, 6, 64)


def test_mask_token_resolution_errors():
    class Tok:
        mask_token_id = None

    with pytest.raises(ValueError, match="defines no mask token"):
        resolve_mask_token_id(Tok(), 128, None)
    with pytest.raises(ValueError, match="not a row of the target's embedding table"):
        resolve_mask_token_id(None, 128, 128)
    assert resolve_mask_token_id(None, 128, 127) == 127


# ---- metrics ---------------------------------------------------------------------------------


def test_metrics_flush_ratios_and_reset():
    m = Metrics(MetricLayout(proposals=3), device="cpu")
    m.add("loss_sum", torch.tensor(6.0))
    m.add("weight_sum", torch.tensor(3.0))
    m.add("correct", torch.tensor(2.0))
    m.add("scored", torch.tensor(8.0))
    m.add("pos_correct", torch.tensor([1.0, 1.0, 0.0]))
    m.add("pos_scored", torch.tensor([2.0, 4.0, 2.0]))
    m.add("accepted", torch.tensor(3.0))
    m.add("blocks", torch.tensor(2.0))
    m.add("steps", 2.0)
    m.add("lr", torch.tensor(2e-3))
    out = m.flush()
    assert out["loss"] == pytest.approx(2.0)
    assert out["accuracy"] == pytest.approx(0.25)
    assert out["tau"] == pytest.approx(2.5)
    assert out["per_position_accuracy"] == pytest.approx([0.5, 0.25, 0.0])
    assert out["lr"] == pytest.approx(1e-3)
    assert m.flush()["loss"] == 0.0  # the window was reset


# ---- the training step -----------------------------------------------------------------------


def _trainer(target=None, **overrides):
    return DFlashTrainer(tiny_config(**overrides), target=target or make_tiny_target(), tokenizer=None)


def test_only_draft_trains_and_target_is_unchanged():
    trainer = _trainer()
    before_target = {k: v.clone() for k, v in trainer.target.state_dict().items()}
    before_draft = {k: v.clone() for k, v in trainer.draft.state_dict().items()}
    assert not any(p.requires_grad for p in trainer.target.parameters())
    opt_params = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert opt_params == {id(p) for p in trainer.draft.parameters()}
    batch = random_batch()
    trainer.train_step(batch)
    trainer.draft.zero_grad()
    # gradients reach every draft parameter and nothing else
    trainer.draft.train()
    ids, lm = batch["input_ids"], batch["loss_mask"]
    anchors, keep = sample_anchors(lm, 8)
    targets = block_targets(ids, lm, anchors, keep, 4, 7.0)
    trainer.objective(ids, anchors, keep, targets).loss_sum.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.draft.parameters())
    assert all(p.grad is None for p in trainer.target.parameters())
    for _ in range(3):
        trainer.train_step(batch)
    for k, v in trainer.target.state_dict().items():
        assert torch.equal(v, before_target[k]), k  # target, embedding and LM head frozen
    changed = [k for k, v in trainer.draft.state_dict().items() if not torch.equal(v, before_draft[k])]
    assert len(changed) == len(before_draft)


def test_tiny_draft_overfits_a_fixed_batch():
    trainer = _trainer()
    batch = random_batch(seed=3)
    losses = []
    for step in range(100):
        trainer.train_step(batch)
        if step in (0, 99):
            losses.append(trainer.metrics.flush()["loss"])
        elif step == 1:
            trainer.metrics.flush()
    assert losses[1] < 0.5 * losses[0], losses


def _dflash2_recall_is_partial(m: dict) -> bool:
    return 0 < m["candidate_recall"] < 1


def _dspark_every_slot_proposes(m: dict) -> bool:
    return len(m["per_position_accuracy"]) == 4 and m["dspark_loss"] > 0 and 0 < m["mean_acceptance"] < 1


@pytest.mark.parametrize("overrides, metrics, check", [
    ({"draft__position_weights": "decay"}, ("loss", "accuracy"), None),
    ({"draft__position_weights": "dpace"}, ("loss", "accuracy"), None),
    ({**DOMINO_HEAD, "domino__lambda_start": 0.5}, ("loss", "base_loss", "lambda", "accuracy", "base_tau"), None),
    (DFLASH2_HEAD, ("loss", "selector_loss", "accuracy", "tau", "base_tau", "candidate_recall", "selector_accuracy"),
     _dflash2_recall_is_partial),
    ({"draft__kind": "dspark", "dspark__markov_rank": 8}, ("loss", "dspark_loss", "l1_loss", "confidence_loss",
     "accuracy", "tau", "base_accuracy", "base_tau", "mean_confidence", "mean_acceptance"), _dspark_every_slot_proposes),
], ids=["dflash-decay", "dflash-dpace", "domino", "dflash2", "dspark"])
def test_grad_accumulation_equals_one_big_batch(monkeypatch, overrides, metrics, check):
    """Global token normalization: 2 micro-batches give the same update as their concatenation (D-PACE
    too: its weights come after each forward, its denominator, the supervised-slot count, before; Domino: both
    terms of its loss mix; DFlash 2: each micro-batch its own top-K and selector loss; DSpark: its three terms)."""
    batch = random_batch(batch=4, seed=1)
    batch["loss_mask"][0, 10:] = False  # unequal supervised counts per micro-batch
    batch["loss_mask"][3, 17] = False  # a hole: DSpark's validity cut ends that block there
    big = _trainer(optim__grad_accum=1, **overrides)
    acc = _trainer(optim__grad_accum=2, **overrides)
    torch.manual_seed(0)
    with torch.no_grad():  # every weight non-trivial: a fresh DFlash 2 selector's B = 0 would leave A and P no gradient
        for p in big.draft.parameters():
            p.add_(0.1 * torch.randn_like(p))
    acc.draft.load_state_dict(big.draft.state_dict())
    # same anchors: both draw per micro-batch row with the same generator stream
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    g = torch.Generator().manual_seed(0)
    plans = [sample_anchors(h["loss_mask"], 8, generator=g) for h in halves]
    both = (torch.cat([plans[0][0], plans[1][0]]), torch.cat([plans[0][1], plans[1][1]]))

    def fixed(loss_mask, num_anchors, generator=None, **_):  # both trainers score exactly the same blocks
        if loss_mask.shape[0] == 4:
            return both
        return plans[0] if torch.equal(loss_mask, halves[0]["loss_mask"]) else plans[1]

    monkeypatch.setattr("dflash.objective.sample_anchors", fixed)  # every kind's plan draws through it
    for t in (big, acc):  # compare the accumulated gradients themselves (Adam's first step is ~sign(g))
        monkeypatch.setattr(t.optimizer, "step", lambda: None)
        monkeypatch.setattr(t.optimizer, "zero_grad", lambda set_to_none=True: None)
    big.train_step(batch)
    acc.train_step(halves)
    m_big, m_acc = big.metrics.flush(), acc.metrics.flush()
    for key in metrics:
        assert m_big[key] == pytest.approx(m_acc[key], rel=1e-5), key
    assert check is None or check(m_big), m_big
    for (name, p), q in zip(big.draft.named_parameters(), acc.draft.parameters(), strict=True):
        assert p.grad.abs().max() > 0, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_lr_schedule_warmup_then_cosine_on_device():
    trainer = _trainer(max_steps=100, optim__warmup_ratio=0.1, optim__lr=1e-3)
    assert trainer.lr.item() == pytest.approx(1e-4)  # (0 + 1) / 10 of peak
    lrs = [lr_at(torch.tensor(float(s)), trainer.config.optim, 100).item() for s in (9, 10, 55, 100)]
    assert lrs[0] == pytest.approx(1e-3) and lrs[1] == pytest.approx(1e-3)
    assert lrs[2] == pytest.approx(0.5e-3, rel=1e-5) and lrs[3] == pytest.approx(0.0, abs=1e-9)
    assert trainer.optimizer.param_groups[0]["lr"] is trainer.lr  # one device tensor, updated in place


def test_hidden_size_mismatch_is_refused():
    draft_target = make_tiny_target(hidden=32)
    cfg = DFlashDraftConfig.for_target(draft_target.config, mask_token_id=TINY_MASK_ID)
    with pytest.raises(ValueError, match="hidden_size"):
        DFlashTrainer(tiny_config(), target=make_tiny_target(), draft=DFlashDraftModel(cfg))


def test_chunked_ce_allocates_one_vocabulary_sized_tensor_per_chunk():
    """Every forward activation is alive during this loss: per chunk, the logits are the only new
    `[chunk, V]` tensor; the softmax for the gradient reuses their buffer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    chunk, vocab = 8, 50

    class NewVocabTensors(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.shape == (chunk, vocab) and not func._schema.name.endswith("_"):
                self.ops.append(str(func))
            return out

    hidden = torch.randn(2 * chunk, 4, requires_grad=True)
    with NewVocabTensors() as seen:
        linear_cross_entropy(hidden, torch.randn(vocab, 4), torch.zeros(2 * chunk, dtype=torch.long),
                             torch.ones(2 * chunk), chunk_size=chunk)
    assert seen.ops == ["aten.mm.default"] * 2, seen.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_ce_equals_eager(dtype):
    """`compile: true` runs each CE chunk through torch.compile (fused on a GPU); same loss, argmax
    and gradient as the eager chunks, for fp32 and for bf16 heads (the GPU's case)."""
    g = torch.Generator().manual_seed(0)
    t, h, v = 40, 16, 96
    hidden = torch.randn(t, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g).to(dtype)
    labels = torch.randint(0, v, (t,), generator=g)
    w = torch.rand(t, generator=g) * (torch.rand(t, generator=g) < 0.7)
    results = []
    for compiled in (False, True):
        hidden.grad = None
        loss, correct = linear_cross_entropy(hidden, weight, labels, w, chunk_size=16, compiled=compiled)
        loss.backward()
        results.append((loss.detach(), correct, hidden.grad.clone()))
    (l0, c0, g0), (l1, c1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    assert torch.equal(c1, c0)
    torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-6)


def test_compiled_ce_chunk_stores_no_fp32_vocabulary_buffer():
    """The compiled chunk must write d loss / d logits straight into the logits' dtype. Inductor's code
    for a bf16 chunk allocates exactly one `[c, V]` buffer, the bf16 gradient. A scatter for the one-hot
    made it store an fp32 `[c, V]` buffer first: 4 extra bytes per logit (1.2 GiB at 2048 x 151,936)."""
    import re

    from torch._inductor.utils import run_and_get_code

    from dflash.losses import _ce_chunk

    c, v = 24, 320
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(c, v, generator=g).bfloat16()
    labels = torch.randint(0, v, (c,), generator=g)
    (_, _, grad), codes = run_and_get_code(torch.compile(_ce_chunk, dynamic=False), logits, labels,
                                           torch.rand(c, generator=g), True)
    assert grad.dtype == torch.bfloat16 and grad.shape == (c, v)
    allocations = re.findall(r"empty_strided\w*\(\(([^)]*)\), \([^)]*\), (?:dtype=)?torch\.(\w+)", "\n".join(codes))
    vocab_sized = [dtype for shape, dtype in allocations if shape.replace(" ", "") in (f"{c},{v}", f"{c},{v},")]
    assert vocab_sized == ["bfloat16"], allocations


def test_compiled_draft_recomputes_the_swiglu_product_instead_of_storing_it():
    """Compiled, an MLP's backward keeps gate and up but not silu(gate) * up (recomputed from them for
    down_proj's weight gradient): two `[tokens, FFN]` tensors saved per layer, not three. Gradients are
    the eager ones."""
    torch.manual_seed(0)
    hidden, ffn, tokens, ctx = 64, 192, 96, 16
    cfg = DFlashDraftConfig(hidden_size=hidden, vocab_size=100, num_target_layers=4, target_layer_ids=[0, 1],
                            mask_token_id=0, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=ffn)
    model = DFlashDraftModel(cfg)
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    features = torch.randn(1, ctx, 2 * hidden)
    position_ids = torch.arange(tokens).unsqueeze(0) % ctx
    mask = torch.rand(1, 1, tokens, ctx + tokens) < 0.5
    mask[..., 0] = True  # every query sees at least one key
    grads, ffn_sized = [], []
    for fn in (model, torch.compile(model, dynamic=False)):
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            out = fn(x, position_ids, mask, target_hidden=features)
        out.square().sum().backward()
        ffn_sized.append(sum(1 for t in saved if t.numel() == tokens * ffn))
        grads.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters()])
        x.grad = None
        model.zero_grad()
    assert ffn_sized[1] == 2 * cfg.num_hidden_layers, ffn_sized  # gate and up per layer
    for eager, compiled in zip(*grads, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
