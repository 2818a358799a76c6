"""Packed rows (`data.packing`): the same rows and anchors give the same features, losses and metrics packed as unpacked.

Three documents of different lengths are trained as three padded rows and as one packed row: every sum the step
makes (loss, CE, correct, scored, accepted, each kind's extras) and the gradient of the draft must agree to fp32
rounding, for dflash, domino, dflash2 and dspark, on a Llama and a Qwen3 target."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import DFLASH2_HEAD, DOMINO_HEAD, TINY_VOCAB, make_tiny_target, tiny_config

from dflash.anchors import sample_anchors, valid_anchor_mask
from dflash.attention import dense_document_mask
from dflash.data.loader import Collator, ResumableSampler, padding_of, row_lengths, training_rows
from dflash.data.packing import PackedRows, pack_lengths
from dflash.factory import build_objective
from dflash.kinds.dspark_objective import DSparkObjective, dspark_block_targets
from dflash.losses import block_targets
from dflash.metrics import Metrics
from dflash.target_model.frozen import FrozenTarget

LENGTHS = (21, 13, 10)
# On a GPU the same checks run its path too: the target's flex document mask, the draft's flex BlockMask
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


PROMPTS = (3, 0, 1)  # the second document is supervised from its first token: a block must not run into it


def documents(seed: int = 0) -> list[dict[str, list[int]]]:
    """Rows of `LENGTHS` tokens, the first `PROMPTS` of each a prompt (unsupervised)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, TINY_VOCAB - 1, (n,), generator=g).tolist(),
             "loss_mask": [0] * p + [1] * (n - p)} for n, p in zip(LENGTHS, PROMPTS, strict=True)]


def both_layouts(rows: list[dict[str, list[int]]]) -> tuple[dict, dict]:
    """(the rows padded one a row, the rows packed into one sequence of 48), by the run's own collators."""
    unpacked = Collator(pad_token_id=0, bucket_multiple=8)(rows)
    packed = Collator(pad_token_id=0, bucket_multiple=48, max_length=48)(list(PackedRows(rows, LENGTHS, 48)))
    return unpacked, packed


def qwen3_target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=TINY_VOCAB, max_position_embeddings=512, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).eval()


def test_best_fit_decreasing_places_every_row_once_within_the_length():
    lengths = [7, 3, 9, 2, 5, 5, 1, 8, 12, 4]
    bins = pack_lengths(lengths, 12)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 12 for b in bins)
    assert len(bins) == -(-sum(lengths) // 12)  # these lengths pack perfectly: 56 tokens in 5 bins of 12
    assert pack_lengths(lengths, 12) == bins  # a function of the lengths alone
    assert pack_lengths([20, 3], 12) == [[0], [1]]  # a row longer than the length gets a bin of its own


def test_packed_rows_restart_positions_and_pad_as_a_document_of_their_own():
    rows = documents()
    _, packed = both_layouts(rows)
    positions = packed["position_ids"][0].tolist()
    assert positions == list(range(21)) + list(range(13)) + list(range(10)) + list(range(4))
    assert packed["input_ids"].shape == (1, 48) and packed["loss_mask"][0, 44:].sum() == 0
    # no anchor whose next token lies in the next document: the last position of each is invalid
    valid = valid_anchor_mask(packed["loss_mask"], packed["position_ids"])[0]
    assert not valid[20] and not valid[33] and valid[19] and valid[32]
    assert valid.sum() == sum(n - p - 1 for n, p in zip(LENGTHS, PROMPTS, strict=True))
    assert not valid_anchor_mask(torch.ones(1, 4, dtype=torch.bool), torch.tensor([[0, 1, 0, 1]]))[0, 1]


def test_document_masks_confine_each_query_to_its_own_document():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    dense = dense_document_mask(positions)[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(dense, expected)
    # the flex BlockMask of the same rule: tests/test_attention.py (against create_block_mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make_target", [make_tiny_target, qwen3_target], ids=["llama", "qwen3"])
def test_target_features_of_a_packed_row_equal_each_document_run_alone(make_target, device):
    target = FrozenTarget(make_target(), [0, 2, 3]).to(device)
    rows = documents()
    unpacked, packed = (_on(batch, device) for batch in both_layouts(rows))
    features, last = target.features_and_last_hidden(unpacked["input_ids"])
    packed_features, packed_last = target.features_and_last_hidden(packed["input_ids"], packed["position_ids"])
    start = 0
    for b, n in enumerate(LENGTHS):
        torch.testing.assert_close(packed_features[0, start:start + n], features[b, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed_last[0, start:start + n], last[b, :n], rtol=1e-5, atol=1e-5)
        start += n
    # the plain forward gives the same features; without the positions the documents would see each other
    torch.testing.assert_close(target(packed["input_ids"], position_ids=packed["position_ids"]), packed_features)
    leaked = target(packed["input_ids"])
    assert (leaked[0, 21:34] - features[1, :13]).abs().max() > 1e-3


def _on(batch: dict, device: str) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


KINDS = {"dflash": {}, "domino": DOMINO_HEAD, "dflash2": DFLASH2_HEAD, "dspark": {"draft__kind": "dspark"},
         "dflash_dpace": {"draft__position_weights": "dpace"}, "dflash_target_labels": {"data__labels": "target"}}


def _sums(objective, batch: dict, anchors: torch.Tensor, keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """Loss, the draft's gradient and every metric sum of one forward/backward of `objective` on given anchors."""
    positions = batch.get("position_ids")
    rule = dspark_block_targets if isinstance(objective, DSparkObjective) else block_targets
    targets = rule(batch["input_ids"], batch["loss_mask"], anchors, keep, objective.block_size, objective.gamma,
                   positions)
    objective.draft.zero_grad()
    out = objective(batch["input_ids"], anchors, keep, targets)
    out.loss_sum.backward()
    metrics = Metrics(objective.metric_layout(), batch["input_ids"].device)
    objective.accumulate(metrics, out, keep, targets)
    sums = {"loss_sum": out.loss_sum.detach(), "weight_sum": targets.weights.sum(),
            **{f"grad.{name}": p.grad.clone() for name, p in objective.draft.named_parameters() if p.grad is not None}}
    sums.update({name: metrics.buffer[where].clone() for name, where in metrics._slices.items()})
    return sums


@pytest.mark.parametrize("device", ["cpu"])  # on an H100, fp32 flex attention's backward found no kernel for head_dim 16
@pytest.mark.parametrize("kind", list(KINDS))
def test_packed_step_equals_unpacked_for_the_same_rows_and_anchors(kind, device):
    config = tiny_config(**KINDS[kind], device=device)  # attention "auto": flex on a GPU, SDPA on a CPU
    target = make_tiny_target()
    objective = build_objective(config, target, None, device=torch.device(device), dtype=torch.float32)
    rows = documents()
    unpacked, packed = (_on(batch, device) for batch in both_layouts(rows))
    # every valid anchor (the widest row has 17), so blocks at each document's end are among them
    anchors, keep = sample_anchors(unpacked["loss_mask"], 18, generator=torch.Generator(device).manual_seed(3))
    starts = torch.tensor([0, 21, 34], device=device)
    # the same anchors, shifted to where each document starts in the packed row, all in that one row
    packed_anchors = (anchors + starts.unsqueeze(1)).reshape(1, -1)
    packed_keep = keep.reshape(1, -1)
    ours = _sums(objective, packed, packed_anchors, packed_keep)
    theirs = _sums(objective, unpacked, anchors, keep)
    assert ours["weight_sum"] > 0 and ours.keys() == theirs.keys()
    for name, value in theirs.items():
        if name in ("rows_total", "rows_skipped"):  # rows: 3 unpacked, 1 packed; not a per-block figure
            continue
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-5, msg=f"{kind}: {name} differs")


def test_training_rows_pack_a_datasets_table_and_cost_less_padding():
    import datasets

    rows = documents() * 6
    table = datasets.Dataset.from_list(rows)
    settings = tiny_config(data__packing=True, data__max_length=48).data
    packed = training_rows(table, settings)
    assert isinstance(packed, PackedRows) and row_lengths(packed) == packed.lengths
    assert sum(packed.lengths) == sum(len(r["input_ids"]) for r in rows)
    bucketed = padding_of(table, 2, Collator(0, 8, 48))
    packed_cost = padding_of(packed, 2, Collator.for_tokenizer(None, settings))
    assert packed_cost.real_fraction > bucketed.real_fraction
    played = ResumableSampler(len(packed)).indices(0)[:packed_cost.batches * 2]
    assert packed_cost.real_tokens == sum(packed.lengths[i] for i in played)
    assert training_rows(table, tiny_config().data) is table  # off: the rows as they are


def test_ranks_hold_contiguous_blocks_of_each_global_micro_batch():
    one = ResumableSampler(24, seed=5, micro_rows=4).indices(0)
    ranks = [ResumableSampler(24, seed=5, rank=r, world_size=2, micro_rows=2).indices(0) for r in range(2)]
    # one process's micro-batch g of 4 rows is rank 0's rows 2g..2g+1 followed by rank 1's
    for g in range(6):
        assert one[4 * g:4 * g + 4] == ranks[0][2 * g:2 * g + 2] + ranks[1][2 * g:2 * g + 2]
    assert len(ResumableSampler(25, rank=1, world_size=2, micro_rows=3)) == 12  # 4 whole global micro-batches of 6
    assert len(ResumableSampler(5, micro_rows=4)) == 5  # one process plays every row (evaluation keeps the last)


def test_the_dry_run_and_the_run_say_what_packing_does(tmp_path, capsys):
    """Through `dflash train`: the dry run counts packed sequences per step; the run trains on them (the padding it
    logs is the packed sequences'), and a packed run refuses offline features and a tensor-parallel target."""
    from helpers import chat_file, save_tiny_target
    from test_cli import _args

    from dflash.cli.main import main

    target = tmp_path / "target"
    save_tiny_target(target)
    data = chat_file(tmp_path / "chats.jsonl")
    args = _args(target, data, tmp_path / "run", "data.packing=true", "data.max_length=192", "max_steps=2",
                 "spec_eval_prompts=0", "batch_size=2")
    assert main([*args, "--dry-run"]) == 0
    assert "2 packed sequences of 192 tokens (data.packing)" in capsys.readouterr().out
    assert main(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["padding"]["slots"] == summary["padding"]["batches"] * 2 * 192
    # epochs are passes over the packed sequences (a full batch of 2 each for the `batches`, one partial dropped):
    # 2 steps x 2 of about 11, not over the 32 rows before packing
    sequences = summary["padding"]["batches"] * 2
    assert 4 / (sequences + 2) < summary["held_out_peak"]["epochs"] <= 4 / sequences
    for refused in (["data.features=/tmp/x"], ["tensor_parallel.size=2"]):
        assert main([*args, *refused, "--dry-run"]) == 2
        assert "data.packing" in capsys.readouterr().err


def test_the_targets_document_mask_follows_the_attention_setting():
    """`draft.attention` picks the target's mask for packed rows too: flex a `BlockMask`, sdpa the dense mask (what a
    dispatch-level sync detector can run; on an H100 the flex one under it raised), auto by the device."""
    from torch.nn.attention.flex_attention import BlockMask

    from dflash.target_model.frozen import document_attention

    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert isinstance(document_attention(positions, "flex")["attention_mask"], BlockMask)
    assert torch.equal(document_attention(positions, "sdpa")["attention_mask"], dense_document_mask(positions))
    assert torch.equal(document_attention(positions, "auto")["attention_mask"], dense_document_mask(positions))  # CPU
    assert document_attention(None, "flex") == {}
