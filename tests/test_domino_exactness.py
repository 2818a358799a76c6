"""The Domino step's fast path against a naive Domino written out by hand, and the shape of its GEMMs.

The reference spells out every rule of `dflash.kinds.domino` on its own: a GRU loop over the equations of
`torch.nn.GRU` (r, z, n gates; no cuDNN), the GRU's input tokens (anchor, labels, data where
unsupervised, the base predictions where scheduled sampling drew them), materialized float64 logits, and
the metrics. The objective must equal it in loss, base / final CE, every metric and every gradient, for
both label layouts, scheduled sampling on and off, a host-bounded anchor width, and the compiled CE chunk.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_VOCAB, make_tiny_target, random_batch, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from dflash.factory import build_objective
from dflash.kinds.domino import DominoObjective
from dflash.losses import accepted_prefix_length, block_positions

BS = 4


def _objective(**overrides) -> DominoObjective:
    cfg = tiny_config(**{"draft__kind": "domino", "domino__gru_hidden_dim": 24, "domino__emb_dim": 12,
                         "domino__lambda_start": 0.4, **overrides})
    torch.manual_seed(0)
    obj = build_objective(cfg, make_tiny_target(), None, device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():  # non-trivial values everywhere (a fresh draft predicts one token in every slot)
        for p in obj.draft.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return obj.train()


def naive_gru(x: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor) -> torch.Tensor:
    """States `[M, L, G]` of a bias-free GRU over `x` `[M, L, H]` (torch.nn.GRU's equations, one step at a time)."""
    h = x.new_zeros(x.shape[0], w_hh.shape[1])
    out = []
    for t in range(x.shape[1]):
        ir, iz, i_n = (x[:, t] @ w_ih.t()).chunk(3, dim=-1)
        hr, hz, h_n = (h @ w_hh.t()).chunk(3, dim=-1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        h = (1 - z) * torch.tanh(i_n + r * h_n) + z * h
        out.append(h)
    return torch.stack(out, dim=1)


def naive_domino(obj: DominoObjective, ids, anchors, keep, targets) -> dict[str, torch.Tensor]:
    """Loss, sums and metrics of one micro-batch, every rule written out (float64 logits)."""
    draft, head = obj.draft, obj.target.lm_head_weight
    hidden, labels = obj.draft_hidden(ids, anchors, keep, targets)  # [B, N, bs, H], the shared backbone
    p, s = BS - 1, draft.head_config.pure_draft_prefix_len
    first = 0 if draft.head_config.shift_label else 1
    z = hidden[:, :, first:first + p]  # proposal j's state
    y, w, valid = labels[..., 1:], targets.weights[..., 1:].double(), targets.valid[..., 1:]
    # GRU input j: the anchor token, then the label of proposal j - 1 where supervised, else the data token
    pos, _ = block_positions(anchors, p, ids.shape[1])
    data = torch.gather(ids, 1, pos.flatten(1)).view_as(pos)
    tokens = torch.where(targets.valid[..., :p], labels[..., :p], data)
    sampled = getattr(targets, "sampled", None)
    if sampled is not None:  # scheduled sampling: the backbone's own base prediction of proposal j - 1
        guess = (z.detach() @ head.t()).argmax(-1)
        tokens[..., 1:] = torch.where(sampled[..., 1:], guess[..., :-1], tokens[..., 1:])
    g = naive_gru(obj.target.embed(tokens).flatten(0, 1), draft.prefix_gru.weight_ih_l0,
                  draft.prefix_gru.weight_hh_l0).view(*z.shape[:3], -1)
    base = z.double() @ head.double().t()
    corr = draft.embed_proj(torch.cat([z, g], dim=-1)).double()
    final = torch.cat([base[:, :, :s], base[:, :, s:] + corr[:, :, s:]], dim=2)

    def ce(logits):
        return (F.cross_entropy(logits.flatten(0, 2), y.flatten(), reduction="none") * w.flatten()).sum()

    lam = obj.lambda_base().double()
    f, b = ce(final), ce(base)
    hit, base_hit = final.argmax(-1) == y, base.argmax(-1) == y
    return {"loss": (1 - lam) * f + lam * b, "final": f, "base": b, "correct": hit,
            "base_correct": (base_hit & valid).sum(),
            "base_accepted": (accepted_prefix_length(base_hit, valid) * keep).sum()}


def _grads(obj: DominoObjective, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    obj.draft.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in obj.draft.named_parameters()}


CASES = [  # (shift_label, scheduled sampling, host-bounded width, compiled CE chunk)
    (False, 0.0, None, False), (True, 0.0, None, False), (False, 0.5, None, False), (True, 0.5, None, False),
    (False, 0.0, 3, False), (True, 0.5, 3, False), (True, 0.5, None, True), (False, 0.0, 3, True),
]


@pytest.mark.parametrize("shift_label,sampling,width,compiled", CASES)
def test_domino_objective_equals_the_naive_reference(shift_label, sampling, width, compiled):
    obj = _objective(domino__shift_label=shift_label, domino__scheduled_sampling=sampling)
    obj.compile_loss = compiled
    batch = random_batch(seed=11)
    batch["loss_mask"][1, 20:] = False  # rows with different supervised counts; blocks that cross the end
    ids, lm = batch["input_ids"], batch["loss_mask"]
    anchors, keep, targets = obj.plan(ids, lm, torch.Generator().manual_seed(3), width)
    assert anchors.shape[1] == (width or obj.num_anchors)
    assert (getattr(targets, "sampled", None) is not None) == (sampling > 0)
    out = obj(ids, anchors, keep, targets)
    ref = naive_domino(obj, ids, anchors, keep, targets)
    for got, want in ((out.loss_sum, ref["loss"]), (out.ce_sum, ref["final"]),
                      (out.extras["base_loss_sum"], ref["base"])):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.correct, ref["correct"])
    assert out.extras["base_correct"] == ref["base_correct"]
    assert out.extras["base_accepted"] == ref["base_accepted"]
    scale = 1 / targets.weights.sum()  # the trainer's global token mean
    got, want = _grads(obj, out.loss_sum * scale), _grads(obj, ref["loss"] * scale)
    for name, g in got.items():
        top = want[name].abs().max()
        assert top > 0, name  # every weight, the Domino head's too, gets a gradient
        torch.testing.assert_close(g, want[name].to(g.dtype), rtol=1e-4, atol=1e-5 * top.item(), msg=name)


def test_a_diverging_fast_path_fails_the_reference(monkeypatch):
    """The check above can fail: the CE chunk with the correction's gradient dropped from d loss / d base
    (a plausible fusion bug) changes the backbone's gradient, and the comparison catches it."""
    import dflash.losses as losses

    real = losses._domino_ce_chunk

    def wrong(base, delta, labels, weights, lam, s, need_grad):
        f_rows, b_rows, f_hit, b_hit, d_base, d_delta = real(base, delta, labels, weights, lam, s, need_grad)
        if need_grad:
            d_base = d_base.clone()
            d_base[:, s:] -= d_delta  # d loss / d base without the final term's share on corrected proposals
        return f_rows, b_rows, f_hit, b_hit, d_base, d_delta

    monkeypatch.setattr(losses, "_domino_ce_chunk", wrong)
    obj = _objective()
    ids, lm = random_batch(seed=11)["input_ids"], random_batch(seed=11)["loss_mask"]
    anchors, keep, targets = obj.plan(ids, lm, torch.Generator().manual_seed(3))
    scale = 1 / targets.weights.sum()
    got = _grads(obj, obj(ids, anchors, keep, targets).loss_sum * scale)
    want = _grads(obj, naive_domino(obj, ids, anchors, keep, targets)["loss"] * scale)
    top = want["norm.weight"].abs().max().item()
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got["norm.weight"], want["norm.weight"], rtol=1e-4, atol=1e-5 * top)


class _VocabGemms(TorchDispatchMode):
    """Records (op, dtypes) of every matrix product with a vocabulary-sized operand."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "bmm", "addmm", "baddbmm"):
            operands = [a for a in args if isinstance(a, torch.Tensor)]
            if any(TINY_VOCAB in a.shape for a in operands):
                self.seen.append((name, tuple(str(a.dtype) for a in operands)))
        return func(*args, **(kwargs or {}))


def test_vocabulary_gemms_are_plain_2d_products_in_the_compute_dtype():
    """Every vocabulary-sized product of the Domino step (base and correction logits, both gradients, W2's
    gradient) is a 2-D `mm` in the compute dtype, with fp32 master weights under bf16 autocast (the GPU
    preset). A strided `[M, P, H]` operand made `@` a batched GEMM that read the whole head once per block
    (155 ms a step on an H200); fp32 correction products ran without tensor cores."""
    cfg = tiny_config(**{"draft__kind": "domino", "domino__gru_hidden_dim": 24, "domino__emb_dim": 12,
                         "domino__shift_label": False})
    torch.manual_seed(0)
    obj = build_objective(cfg, make_tiny_target(), None, device=torch.device("cpu"), dtype=torch.bfloat16).train()
    assert obj.draft.correction_weight.dtype == torch.float32  # master weights
    batch = random_batch(seed=2)
    anchors, keep, targets = obj.plan(batch["input_ids"], batch["loss_mask"], torch.Generator().manual_seed(0))
    with _VocabGemms() as record:
        obj(batch["input_ids"], anchors, keep, targets).loss_sum.backward()
    assert record.seen, "no vocabulary-sized product recorded"
    assert {name for name, _ in record.seen} == {"mm"}, record.seen
    assert all(set(dtypes) == {"torch.bfloat16"} for _, dtypes in record.seen), record.seen
    assert obj.draft.correction_weight.grad.dtype == torch.float32


def test_greedy_labels_and_block_logits_run_one_2d_gemm():
    """The target's greedy labels (a sequence slice of `[B, S, H]`) and a block's proposal logits go through
    `head_logits`: one `mm`, equal to the batched product."""
    from dflash.losses import head_logits
    from dflash.target_model.frozen import greedy_labels

    g = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(3, 10, 8, generator=g), torch.randn(TINY_VOCAB, 8, generator=g)
    ids = torch.randint(0, TINY_VOCAB, (3, 10), generator=g)
    with _VocabGemms() as record:
        labels = greedy_labels(ids, hidden, head, chunk=4)
        logits = head_logits(hidden[:, 1:], head)
    assert {name for name, _ in record.seen} == {"mm"}, record.seen
    torch.testing.assert_close(logits, hidden[:, 1:] @ head.t())
    assert torch.equal(labels[:, 1:], (hidden[:, :-1] @ head.t()).argmax(-1)) and torch.equal(labels[:, 0], ids[:, 0])
