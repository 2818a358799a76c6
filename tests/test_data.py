"""Batches: collation to bucketed lengths, seeded and resumable loading order, device prefetching."""

from __future__ import annotations

import torch

from dflash.data.loader import Collator, DevicePrefetcher, make_dataloader


def test_collator_pads_to_buckets():
    rows = [
        {"input_ids": [5] * 70, "loss_mask": [0] * 10 + [1] * 60},
        {"input_ids": [7] * 3, "loss_mask": [0, 1, 1]},
    ]
    batch = Collator(pad_token_id=2, bucket_multiple=64)(rows)
    assert batch["input_ids"].shape == batch["loss_mask"].shape == (2, 128)
    assert batch["input_ids"].dtype == torch.long and batch["loss_mask"].dtype == torch.bool
    assert batch["input_ids"][1, :3].tolist() == [7, 7, 7] and (batch["input_ids"][1, 3:] == 2).all()
    assert not batch["loss_mask"][:, 70:].any() and batch["loss_mask"][0].sum() == 60
    capped = Collator(pad_token_id=2, bucket_multiple=64, max_length=100)(rows)
    assert capped["input_ids"].shape == (2, 100)
    assert Collator(pad_token_id=0, bucket_multiple=64)(rows[1:])["input_ids"].shape == (1, 64)


def _rows(n: int) -> list[dict]:
    return [{"input_ids": [i] * (i % 5 + 1), "loss_mask": [1] * (i % 5 + 1)} for i in range(n)]


def _order(loader) -> list[list[int]]:
    return [batch["input_ids"][:, 0].tolist() for batch in loader]


def test_dataloader_order_is_seeded_and_resumable():
    rows, collate = _rows(20), Collator(pad_token_id=0, bucket_multiple=8)
    first = _order(make_dataloader(rows, 4, collate, seed=3, num_workers=0))
    assert len(first) == 5 and sorted(sum(first, [])) == list(range(20))
    assert _order(make_dataloader(rows, 4, collate, seed=3, num_workers=0)) == first
    assert _order(make_dataloader(rows, 4, collate, seed=4, num_workers=0)) != first
    resumed = make_dataloader(rows, 4, collate, seed=3, num_workers=0, skip_batches=2)
    assert len(resumed) == 3 and _order(resumed) == first[2:]
    # The next epoch is a fresh permutation, the same one a run started at that epoch sees.
    second = _order(resumed)
    assert second != first and second == _order(
        make_dataloader(rows, 4, collate, seed=3, num_workers=0, epoch=1)
    )
    shards = [
        _order(make_dataloader(rows, 4, collate, seed=3, num_workers=0, rank=r, world_size=2)) for r in (0, 1)
    ]
    assert not set(sum(shards[0], [])) & set(sum(shards[1], [])) and len(shards[0]) == 2


def test_dataloader_workers_keep_the_order():
    rows, collate = _rows(12), Collator(pad_token_id=0, bucket_multiple=8)
    loader = make_dataloader(rows, 3, collate, seed=1, num_workers=2)
    assert loader.persistent_workers and loader.pin_memory == torch.cuda.is_available()
    assert _order(loader) == _order(make_dataloader(rows, 3, collate, seed=1, num_workers=0))


def test_device_prefetcher_on_cpu_keeps_order_and_content():
    rows, collate = _rows(10), Collator(pad_token_id=0, bucket_multiple=4)
    loader = make_dataloader(rows, 2, collate, shuffle=False, num_workers=0)
    expected = list(make_dataloader(rows, 2, collate, shuffle=False, num_workers=0))
    got = list(DevicePrefetcher(loader, "cpu"))
    assert len(got) == len(expected) == 5
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) and a[k].device.type == "cpu" for k in a)


def test_padding_cost_counts_the_epochs_real_tokens_and_slots():
    """`padding_cost` replays the loader's first epoch: the same batches, each padded as the collator pads it."""
    import datasets

    from dflash.data.loader import Collator, ResumableSampler, make_dataloader, padding_cost, row_lengths

    lengths = [5, 64, 3, 70, 10, 128, 1, 40, 33]
    rows = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in lengths], "loss_mask": [[1] * n for n in lengths]})
    assert row_lengths(rows) == lengths == row_lengths(list(rows))
    collator = Collator(pad_token_id=0, bucket_multiple=32, max_length=96)
    cost = padding_cost(lengths, 2, collator, seed=3)
    real = slots = 0
    for batch in make_dataloader(rows, 2, collator, seed=3, num_workers=0):  # what training reads
        real, slots = real + int(batch["loss_mask"].sum()), slots + batch["input_ids"].numel()
    assert (cost.real_tokens, cost.slots, cost.batches) == (real, slots, 4)
    order = ResumableSampler(len(lengths), seed=3).indices(0)
    assert cost.slots == sum(2 * collator.length(max(lengths[i] for i in order[k:k + 2])) for k in (0, 2, 4, 6))
    assert 0 < cost.real_fraction < 1 and "padding" in cost.describe()
