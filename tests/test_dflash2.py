"""DFlash 2 drafts (`draft.kind: dflash2`): config, the block convs and selector, the objective against a
plain per-position loop, accumulation parity, a sync-free step, export and lossless decoding."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import DFLASH2_HEAD, TINY_VOCAB, make_tiny_target, random_batch, tiny_config

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
from dflash.factory import build_draft, build_objective
from dflash.hf.module import DFlashTrainingModule
from dflash.kinds.dflash2 import DFlash2DraftModel, GroupedDynamicConv, dflash2_propose, dflash2_weight_names
from dflash.kinds.dflash2_objective import DFlash2Objective
from dflash.losses import linear_cross_entropy, linear_cross_entropy_topk
from dflash.modeling import DFlashDraftModel

BS = 4


def _objective(target=None, **overrides) -> DFlash2Objective:
    """A DFlash 2 objective whose every weight is non-trivial (a fresh draft is its DFlash backbone)."""
    cfg = tiny_config(**{**DFLASH2_HEAD, **overrides})
    torch.manual_seed(0)
    obj = build_objective(cfg, target or make_tiny_target(), None, device=torch.device("cpu"), dtype=torch.float32)
    _perturb(obj.draft)
    return obj.train()


def _perturb(draft: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.1 * torch.randn_like(p))


# ---- config ----------------------------------------------------------------------------------------


def test_config_keys_defaults_and_refusals():
    cfg = TrainConfig.from_sources(None, ["draft.kind=dflash2", "dflash2.selector_gold=insert"], presets=False)
    assert (cfg.draft.kind, cfg.dflash2.selector_gold) == ("dflash2", "insert")
    keys = {row[0]: row[1] for row in key_table()}
    assert {k: keys[f"dflash2.{k}"] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                                              "selector_alpha", "selector_gold")} == {
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16, "selector_alpha": 1.0,
        "selector_gold": "strict"}
    for bad, message in [(["dflash2.selector_gold=maybe"], "selector_gold must be one of"),
                         (["dflash2.selector_top_k=0"], "selector_top_k must be >= 1"),
                         (["dflash2.conv_kernel_size=17"], "conv_kernel_size must be in"),
                         (["draft.kind=dflash2", "draft.position_weights=dpace"], "dpace: it is not implemented")]:
        with pytest.raises(ValueError, match=message):
            TrainConfig.from_sources(None, bad, presets=False)


def test_the_transformers_trainer_path_refuses_a_dflash2_draft(tiny_target):
    with pytest.raises(ValueError, match=r"not yet by the transformers.Trainer path.*or set draft.kind=dflash or domino here"):
        DFlashTrainingModule.from_config(tiny_config(**DFLASH2_HEAD), tiny_target, None)


@pytest.mark.parametrize("overrides, message", [({"dflash2__conv_group_size": 24}, "multiple of conv_group_size"),
                                                ({"dflash2__selector_top_k": TINY_VOCAB + 1}, "selector_top_k")])
def test_a_head_that_does_not_fit_the_target_is_refused_when_built(tiny_target, overrides, message):
    with pytest.raises(ValueError, match=message):
        build_draft(tiny_config(**{**DFLASH2_HEAD, **overrides}), tiny_target, None)


# ---- model -----------------------------------------------------------------------------------------


def test_a_fresh_dflash2_draft_computes_its_dflash_backbone(tiny_target):
    dflash = build_draft(tiny_config(), tiny_target, None)
    _perturb(dflash)
    draft = build_draft(tiny_config(**DFLASH2_HEAD), tiny_target, None)
    missing, unexpected = draft.load_state_dict(dflash.state_dict(), strict=False)
    assert set(missing) == dflash2_weight_names(2) and not unexpected
    assert isinstance(draft, DFlash2DraftModel) and type(dflash) is DFlashDraftModel
    n = 3
    embeds, positions = torch.randn(2, n * BS, 64), torch.arange(n * BS).repeat(2, 1) + 10
    feats = torch.randn(2, 9, 64 * len(dflash.config.target_layer_ids))
    torch.testing.assert_close(draft(embeds, positions, None, target_hidden=feats),
                               dflash(embeds, positions, None, target_hidden=feats), rtol=0, atol=0)


def _loop_conv(conv: GroupedDynamicConv, x: torch.Tensor, side: int, delta: torch.Tensor) -> torch.Tensor:
    """conv(x; side, delta) one output element at a time (module doc of dflash.kinds.dflash2)."""
    bsz, q, h = x.shape
    out = torch.zeros_like(x)
    for b in range(bsz):
        for i in range(q):
            k = i % conv.block_size  # slot inside its block
            for t in range(conv.taps):
                if k - t < 0:
                    continue  # no tap crosses the block start
                for c in range(h):
                    coef = conv.base_kernel[side, t, c] + delta[b, i, side, t, c // conv.group]
                    out[b, i, c] += coef * x[b, i - t, c]
    return out


def test_the_block_conv_equals_a_loop_and_stays_inside_each_block():
    torch.manual_seed(0)
    conv = GroupedDynamicConv(hidden=8, taps=3, group=4, block_size=BS)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    u, y = torch.randn(2, 3 * BS, 8), torch.randn(2, 3 * BS, 8)
    delta = conv.kernel_projection(u).view(2, 3 * BS, 2, 3, 2)  # [B, Q, side, T, G]
    first, delta_out = conv.prepare(u)
    torch.testing.assert_close(first, _loop_conv(conv, u, 0, delta))
    torch.testing.assert_close(conv.finish(y, delta_out), _loop_conv(conv, y, 1, delta))
    # No leakage: changing block 1's slot 0 moves nothing in blocks 0 and 2 (input or coefficients)
    u2 = u.clone()
    u2[:, BS] += 1.0
    moved = (conv.prepare(u2)[0] - first).abs().sum(dim=(0, 2)) > 0
    assert moved.tolist() == [False] * BS + [True] * 3 + [False] + [False] * BS  # taps 0..2 reach slots 0..2


# ---- objective -------------------------------------------------------------------------------------


def naive_dflash2(obj: DFlash2Objective, ids, anchors, keep, targets) -> dict[str, torch.Tensor]:
    """Loss and metrics of one micro-batch, position by position (float64 scores, fp32 top-K)."""
    hidden, labels = obj.draft_hidden(ids, anchors, keep, targets)  # the shared backbone
    head, sel = obj.target.lm_head_weight, obj.draft.candidate_selector
    a_book, b_book, proj = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    bsz, n, _ = labels.shape
    unary = selector = torch.zeros((), dtype=torch.float64)
    selected, found = torch.zeros(bsz, n, BS - 1, dtype=torch.bool), torch.zeros(bsz, n, BS - 1, dtype=torch.bool)
    for b in range(bsz):
        for j in range(n):
            a = anchors[b, j].item()
            for k in range(1, BS):
                h, y, w = hidden[b, j, k], labels[b, j, k].item(), targets.weights[b, j, k].double()
                logits = (head @ h).double()
                unary = unary + w * (torch.logsumexp(logits, 0) - logits[y])
                cand = (head @ h).topk(obj.draft.top_k).indices.tolist()
                if k == 1:
                    pred = ids[b, a].item()
                elif targets.valid[b, j, k - 1]:
                    pred = labels[b, j, k - 1].item()
                else:
                    pred = ids[b, min(a + k - 1, ids.shape[1] - 1)].item()

                def score(cands, h=h, pred=pred, logits=logits):
                    gate = (proj @ h) * a_book[pred]
                    return torch.stack([logits[c] + (gate * b_book[c]).sum().double() for c in cands])

                found[b, j, k - 1] = y in cand
                strict = score(cand)
                selected[b, j, k - 1] = cand[strict.argmax().item()] == y
                if y in cand:
                    selector = selector + w * (torch.logsumexp(strict, 0) - strict[cand.index(y)])
                elif obj.selector_gold == "insert":  # the gold replaces the weakest candidate, for the loss
                    s = score(cand[:-1] + [y])
                    selector = selector + w * (torch.logsumexp(s, 0) - s[-1])
    return {"loss": unary + obj.selector_alpha * selector, "unary": unary, "selector": selector,
            "selected": selected, "found": found}


def _grads(obj, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    obj.draft.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in obj.draft.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_candidates_come_from_the_ce_chunks_unchanged(dtype):
    """The top-K taken inside the CE's chunk loop equals a separate top-K of the head's logits, and the CE is
    `linear_cross_entropy`'s. Chunks of 7 over 30 tokens; zero weights and gold tokens inside the top-K, where a
    top-K read after the chunk wrote its gradient over fp32 logits would differ."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(30, 16, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(50, 16, generator=g).to(dtype)
    weights = (torch.rand(30, generator=g) > 0.4).float()
    expected_top = (hidden.detach().float() @ weight.float().t()).to(dtype).topk(5, dim=-1).indices
    labels = expected_top[:, 0].clone()  # every gold is a candidate
    loss, correct, top = linear_cross_entropy_topk(hidden, weight, labels, weights, 5, chunk_size=7)
    ref_loss, ref_correct = linear_cross_entropy(hidden, weight, labels, weights, chunk_size=7)
    assert torch.equal(top, expected_top) and torch.equal(correct, ref_correct)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    loss.backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


@pytest.mark.parametrize("gold, width, alpha", [("strict", None, 1.0), ("insert", None, 0.7), ("strict", 3, 0.5),
                                                ("insert", 3, 1.0)])
def test_dflash2_objective_equals_the_per_position_reference(gold, width, alpha):
    obj = _objective(dflash2__selector_gold=gold, dflash2__selector_alpha=alpha)
    batch = random_batch(seed=11)
    batch["loss_mask"][1, 20:] = False  # rows with different supervised counts; blocks that cross the end
    ids, lm = batch["input_ids"], batch["loss_mask"]
    anchors, keep, targets = obj.plan(ids, lm, torch.Generator().manual_seed(3), width)
    out = obj(ids, anchors, keep, targets)
    ref = naive_dflash2(obj, ids, anchors, keep, targets)
    valid = targets.valid[..., 1:]
    assert 0 < (ref["found"] & valid).sum() < valid.sum()  # gold tokens both inside and outside the top-K
    torch.testing.assert_close(out.loss_sum.double(), ref["loss"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.ce_sum.double(), ref["unary"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.extras["selector_loss_sum"].double(), ref["selector"], rtol=1e-5, atol=1e-5)
    assert torch.equal(out.correct & valid, ref["selected"] & valid)
    assert out.extras["candidate_hits"] == (ref["found"] & valid).sum()
    scale = 1 / targets.weights.sum()  # the trainer's global token mean
    got, want = _grads(obj, out.loss_sum * scale), _grads(obj, ref["loss"] * scale)
    for name, g in got.items():
        top = want[name].abs().max()
        assert top > 0, name  # every weight, the convs' and the selector's too, gets a gradient
        torch.testing.assert_close(g, want[name].to(g.dtype), rtol=1e-4, atol=1e-5 * top.item(), msg=name)


# ---- export and decoding ---------------------------------------------------------------------------


def test_export_writes_the_published_dflash2_contract_and_reads_back_equal(tmp_path, tiny_target):
    draft = build_draft(tiny_config(**DFLASH2_HEAD), tiny_target, None)
    _perturb(draft)
    out = export_draft(draft, tmp_path / "export", dtype=torch.float32)
    config = json.loads((out / CONFIG_NAME).read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert {k: config["dflash_config"][k] for k in ("block_size", "conv_kernel_size", "conv_group_size",
                                                    "selector_rank", "selector_top_k")} == {
        "block_size": BS, "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 48}
    assert "projector_type" not in config["dflash_config"]  # the keys themselves mark DFlash 2 (as SGLang reads it)
    from safetensors import safe_open

    with safe_open(str(out / WEIGHTS_NAME), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert set(shapes) == draft_weight_names(draft.config) == expected_weight_names(2) | dflash2_weight_names(2)
    assert shapes["candidate_selector.predecessor_codebook"] == shapes["candidate_selector.successor_codebook"] == (
        TINY_VOCAB, 8)
    assert shapes["candidate_selector.hidden_projection.weight"] == (8, 64)
    assert shapes["layers.1.attention_conv.base_kernel"] == shapes["layers.0.mlp_conv.base_kernel"] == (2, 2, 64)
    assert shapes["layers.0.mlp_conv.kernel_projection.weight"] == (2 * 2 * 64 // 16, 64)
    loaded = load_exported(out)
    assert isinstance(loaded, DFlash2DraftModel)
    for name, value in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    # `dflash export` prints the launch lines checked against the engines' DFlash 2 loaders (tests/test_serving.py)
    assert set(serving_commands(out)) == {"vllm", "sglang"} and "a DFlash 2 draft" in format_serving(out)


def _prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY_VOCAB - 1, (k,), generator=g).tolist() for k in [1, 5, 12, 29][:n]]


def test_speculative_decoding_with_a_dflash2_draft_is_lossless_and_walks_the_selector(target, monkeypatch):
    draft = build_draft(tiny_config(**DFLASH2_HEAD), target, None)
    _perturb(draft)
    with torch.no_grad():  # a pairwise term on the logits' scale: the walk differs from the unary argmax
        draft.candidate_selector.successor_codebook.mul_(300.0)
    report = sp.evaluate_speculative(target, draft.eval(), _prompts(), max_new_tokens=17, stop_token_ids=[])
    assert report["new_tokens"] == 17 * 4  # evaluate_speculative raises LosslessError otherwise
    hidden, first = torch.randn(3, BS, 64), torch.tensor([[5], [7], [9]])
    head = target.get_output_embeddings().weight
    drafted = dflash2_propose(draft, hidden, first, head)
    # the walk by hand: predecessor = the previous drafted token (the anchor for slot 1), best score among the top-K
    sel = draft.candidate_selector
    for b in range(3):
        pred = first[b, 0].item()
        for k in range(1, BS):
            logits = head @ hidden[b, k]
            cand = logits.topk(draft.top_k).indices
            score = logits[cand] + (sel.successor_codebook[cand] * (sel.hidden_projection.weight @ hidden[b, k]
                                                                    * sel.predecessor_codebook[pred])).sum(-1)
            pred = cand[score.argmax()].item()
            assert drafted[b, k - 1].item() == pred
    assert not torch.equal(drafted, (hidden[:, 1:] @ head.t()).argmax(-1))  # the selector changed some drafts
    with pytest.raises(ValueError, match="block_size 4, not 3"):
        sp.speculative_generate(target, draft, _prompts(1)[0], max_new_tokens=4, block_size=3)


# The held-out chain τ̂ = real τ of the selector walk: tests/test_chain.py, for every kind.
