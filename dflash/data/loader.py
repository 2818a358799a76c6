"""Tokenized rows -> padded batches in a resumable order, on the device one batch ahead.

The hot path's data: :class:`Collator` pads rows to bucketed lengths (shapes repeat),
:func:`make_dataloader` plays a deterministic, shardable order that can resume mid-epoch
(:class:`ResumableSampler`), and :class:`DevicePrefetcher` copies the next batch to the device
while the current one trains. Rows come from :func:`dflash.data.tokenization.build_dataset`.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

import datasets
import pyarrow.compute as pc
import torch
from torch.utils.data import DataLoader, Sampler

from dflash.anchors import bounded_width
from dflash.data.packing import PackedRows, packed_positions


class Batch(TypedDict):
    """A batch of B rows padded to S tokens, as the collators build it (CPU) and `device_batches` hands it out (on
    the device): tensors, and one host int."""

    input_ids: torch.Tensor  # LongTensor [B, S]
    loss_mask: torch.Tensor  # BoolTensor [B, S], False on padding
    position_ids: NotRequired[torch.Tensor]  # LongTensor [B, S] restarting per document (data.packing)
    num_anchors: NotRequired[int]  # the anchor width the rows need (a Python int: read on the host, no device sync)
    features: NotRequired[torch.Tensor]  # [B, S, K*H] offline target features (data.features)
    labels: NotRequired[torch.Tensor]  # LongTensor [B, S]: the target's greedy next tokens (offline features, labels: target)


class Collator:
    """Pads rows to a bucketed length so batch shapes repeat (static shapes for compile / graphs).

    ``rows[b]`` has ``input_ids`` and ``loss_mask`` of length L_b. The batch length is
    ``S = ceil(max L_b / bucket_multiple) * bucket_multiple``, capped at ``max_length`` (rows longer
    than S are cut). Right padding with ``pad_token_id``; ``loss_mask`` is False on padding.
    ``bucket_multiple = max_length`` gives one fixed shape.
    """

    def __init__(self, pad_token_id: int, bucket_multiple: int = 64, max_length: int | None = None,
                 anchor_widths: Sequence[int] | None = None) -> None:
        if bucket_multiple < 1:
            raise ValueError(f"bucket_multiple must be >= 1, got {bucket_multiple}")
        self.pad_token_id = pad_token_id
        self.bucket_multiple = bucket_multiple
        self.max_length = max_length
        self.anchor_widths = sorted(anchor_widths) if anchor_widths else None

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, settings: Any, anchor_widths: Sequence[int] | None = None) -> Collator:
        """The collator of `settings` (a `DataSettings`), padding with the tokenizer's pad token (else
        eos, else 0); with `anchor_widths`, each batch also names the anchor width it needs. Packed rows
        (`data.packing`) fill one fixed length, `pack_length(settings)`: one shape."""
        pad = getattr(tokenizer, "pad_token_id", None)
        pad = pad if pad is not None else getattr(tokenizer, "eos_token_id", None) or 0
        if settings.packing:
            return cls(pad, pack_length(settings), pack_length(settings), anchor_widths)
        return cls(pad, settings.bucket_multiple, settings.max_length, anchor_widths)

    @property
    def num_lengths(self) -> int | None:
        """How many padded lengths S batches can have (None without ``max_length``: unbounded)."""
        return math.ceil(self.max_length / self.bucket_multiple) if self.max_length else None

    @property
    def num_shapes(self) -> int:
        """How many distinct batch shapes this collator produces for one batch size (a bound for the
        per-shape CUDA graphs; 1 when the length is unbounded, where only fixed shapes can be captured)."""
        return (self.num_lengths or 1) * len(self.anchor_widths or [None])

    def length(self, longest: int) -> int:
        """Padded length S for a batch whose longest row has ``longest`` tokens."""
        padded = math.ceil(max(longest, 1) / self.bucket_multiple) * self.bucket_multiple
        return min(padded, self.max_length) if self.max_length else padded

    def __call__(self, rows: Sequence[Mapping[str, Sequence[int]]]) -> Batch:
        """``{"input_ids": LongTensor[B, S], "loss_mask": BoolTensor[B, S]}``, with packed rows
        (`dflash.data.packing`) ``"position_ids": LongTensor[B, S]`` restarting per document, and with
        ``anchor_widths`` ``"num_anchors"``: the smallest allowed width holding every row's valid anchors, read
        from this CPU copy of the mask before any transfer (a Python int: no device read)."""
        seq = self.length(max(len(r["input_ids"]) for r in rows))
        input_ids = torch.full((len(rows), seq), self.pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros((len(rows), seq), dtype=torch.bool)
        for b, row in enumerate(rows):
            n = min(len(row["input_ids"]), seq)
            input_ids[b, :n] = torch.as_tensor(row["input_ids"][:n], dtype=torch.long)
            loss_mask[b, :n] = torch.as_tensor(row["loss_mask"][:n]).bool()
        batch: Batch = {"input_ids": input_ids, "loss_mask": loss_mask}
        if "position_ids" in rows[0]:
            batch["position_ids"] = packed_positions(rows, seq)
        if self.anchor_widths:
            batch["num_anchors"] = bounded_width(loss_mask, self.anchor_widths, batch.get("position_ids"))
        return batch


def pack_length(settings: Any) -> int:
    """The fixed length of packed sequences: `data.pack_length`, else `data.max_length`."""
    return settings.pack_length or settings.max_length


def training_rows(dataset: Any, settings: Any) -> Any:
    """What the loader plays of a training set: its rows, or with `data.packing` the rows packed into sequences of
    `pack_length(settings)` tokens (`dflash.data.packing.PackedRows`; their lengths read from Arrow, no row decoded)."""
    if not settings.packing:
        return dataset
    lengths = row_lengths(dataset)
    if lengths is None:
        raise ValueError("data.packing needs tokenized rows (a datasets.Dataset or a list of rows); offline feature "
                         "sets are not packed: set data.packing=false")
    return PackedRows(dataset, lengths, pack_length(settings))


class ResumableSampler(Sampler[int]):
    """Deterministic (optionally sharded) sample order that can start mid-epoch.

    Epoch e's order is a permutation seeded by (seed, e). With w ranks the order is cut into global micro-batches
    of ``w * micro_rows`` indices and rank r takes the r-th block of ``micro_rows`` of each: the rows one process
    would train on in a micro-batch of ``w * micro_rows`` rows, rank r holding rows ``r * micro_rows ..`` of it,
    the layout the anchor draw assumes (`dflash.anchors.GlobalRows`); an incomplete last global micro-batch is
    left out (one process plays every index: the loader's `drop_last` decides). Each ``iter()`` plays the
    current epoch and then advances it, so a loop over epochs needs no ``set_epoch``. ``start`` indices of the
    first epoch played are skipped (``skip_batches * batch_size`` when resuming).
    """

    def __init__(
        self,
        num_samples: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        epoch: int = 0,
        start: int = 0,
        rank: int = 0,
        world_size: int = 1,
        micro_rows: int = 1,
    ) -> None:
        self.num_samples = num_samples
        self.micro_rows = micro_rows
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = epoch
        self.start = start
        self.rank = rank
        self.world_size = world_size

    def indices(self, epoch: int) -> list[int]:
        """This rank's full sample order of ``epoch``."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        block, group = self.micro_rows, self.micro_rows * self.world_size
        return [i for g in range(0, self.per_rank_count * self.world_size, group)
                for i in order[g + self.rank * block : g + (self.rank + 1) * block]]

    @property
    def per_rank_count(self) -> int:
        """Indices each rank plays in an epoch: its blocks of the complete global micro-batches (one process: all)."""
        if self.world_size == 1:
            return self.num_samples
        return self.num_samples // (self.micro_rows * self.world_size) * self.micro_rows

    def __iter__(self) -> Iterator[int]:
        order = self.indices(self.epoch)[self.start :]
        self.epoch += 1
        self.start = 0
        return iter(order)

    def __len__(self) -> int:
        return self.per_rank_count - self.start


def make_dataloader(
    dataset: Any,
    batch_size: int,
    collator: Collator,
    *,
    shuffle: bool = True,
    seed: int = 0,
    num_workers: int = 2,
    drop_last: bool = True,
    epoch: int = 0,
    skip_batches: int = 0,
    rank: int = 0,
    world_size: int = 1,
    micro_batches: int = 1,
) -> DataLoader:
    """DataLoader over ``dataset`` with a deterministic, resumable order (:class:`ResumableSampler`); a batch of
    ``batch_size`` rows is ``micro_batches`` micro-batches (``optim.grad_accum``), each rank's block of a global one.

    Resume at global batch k of an epoch with ``epoch=e, skip_batches=k``. Batches are pinned when
    a GPU exists (so the device copy can be ``non_blocking`` without a hidden sync) and workers
    persist across epochs. Workers ignore SIGTERM / SIGINT (:func:`_leave_signals_to_the_main_process`).
    """
    sampler = ResumableSampler(
        len(dataset),
        shuffle=shuffle,
        seed=seed,
        epoch=epoch,
        start=skip_batches * batch_size,
        rank=rank,
        world_size=world_size,
        micro_rows=batch_size // micro_batches,
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collator,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=_leave_signals_to_the_main_process if num_workers > 0 else None,
    )


def _leave_signals_to_the_main_process(worker_id: int) -> None:
    """A DataLoader worker ignores SIGTERM and SIGINT. Schedulers signal the whole process group (`scancel`,
    preemption, `systemctl stop`, Ctrl-C); a worker killed by it would end the run with "DataLoader worker
    is killed by signal" before the main process could finish its step and save. The main process handles
    the request (`dflash.run.stopping.StopRequest`) and shuts its workers down as it exits."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


class DevicePrefetcher:
    """Iterates ``loader`` with each batch already on ``device``, the next one copying meanwhile.

    CUDA: copies run ``non_blocking`` from pinned memory on a side stream, one batch ahead; the
    consumer's stream waits for the copy (``wait_stream``) and the tensors are marked as used there
    (``record_stream``) so the allocator never recycles them early. Other devices: a plain ``.to``
    (a passthrough on CPU).
    """

    def __init__(self, loader: Iterable[Mapping[str, Any]], device: torch.device | str) -> None:
        self.loader = loader
        self.device = torch.device(device)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.device.type != "cuda":
            for batch in self.loader:
                yield {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            return
        stream = torch.cuda.Stream(self.device)
        batches = iter(self.loader)
        ahead = self._copy(next(batches, None), stream)
        while ahead is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(stream)
            for value in ahead.values():
                if torch.is_tensor(value):
                    value.record_stream(current)
            batch = ahead
            ahead = self._copy(next(batches, None), stream)
            yield batch

    def _copy(self, batch: Mapping[str, Any] | None, stream: torch.cuda.Stream) -> dict[str, Any] | None:
        """Start the host->device copy of ``batch`` on ``stream`` (pinning first if needed)."""
        if batch is None:
            return None
        with torch.cuda.stream(stream):
            return {
                k: (v if v.is_pinned() else v.pin_memory()).to(self.device, non_blocking=True)
                if torch.is_tensor(v)
                else v
                for k, v in batch.items()
            }


def micro_batches(batch: Batch, n: int) -> list[Batch]:
    """`batch` split by rows into `n` micro-batches (`optim.grad_accum`): every row tensor (ids, mask;
    offline features and labels) chunked, the collator's anchor width (a host int) given to each."""
    if batch["input_ids"].shape[0] % n:
        raise ValueError(f"batch of {batch['input_ids'].shape[0]} rows does not split into grad_accum={n}")
    parts = {k: v.chunk(n) for k, v in batch.items() if torch.is_tensor(v)}
    width = {"num_anchors": batch["num_anchors"]} if "num_anchors" in batch else {}
    return [{**{k: v[i] for k, v in parts.items()}, **width} for i in range(n)]


def row_lengths(dataset: Any) -> list[int] | None:
    """Tokens of every row of a training set: a `datasets.Dataset`'s `input_ids` list lengths read from its Arrow
    column (no row is decoded), a list's rows counted; None for other sets (an offline feature set would read
    every row's features to count them); packed sequences' token counts (`PackedRows`)."""
    if isinstance(dataset, PackedRows):
        return list(dataset.lengths)
    if isinstance(dataset, datasets.Dataset):  # as an Arrow table: the rows a selection or filter kept, in its order
        return pc.list_value_length(dataset.with_format("arrow")[:]["input_ids"]).to_pylist()
    if isinstance(dataset, list):
        return [len(row["input_ids"]) for row in dataset]
    return None


@dataclass(frozen=True)
class PaddingCost:
    """What one epoch of bucketed batches carries: `real_tokens` of rows in `slots` = batch rows x padded
    length, summed over the epoch's full batches. Every op of a step (the target's forward, attention, MLP, the
    LM head) runs on the slots, so `real_fraction` is the share of a step's work spent on text."""

    real_tokens: int
    slots: int
    batches: int

    @property
    def real_fraction(self) -> float:
        return self.real_tokens / self.slots if self.slots else 0.0

    def describe(self) -> str:
        return (f"padding: {self.real_tokens:,} real tokens in {self.slots:,} slots over the {self.batches:,} batches of "
                f"an epoch ({self.real_fraction:.1%} real, {1 - self.real_fraction:.1%} padding)")

    def to_dict(self) -> dict[str, Any]:
        """The summary's record (`summary.json` "padding")."""
        return {"real_tokens": self.real_tokens, "slots": self.slots, "batches": self.batches,
                "real_fraction": round(self.real_fraction, 4)}


def padding_of(dataset: Any, rows: int, collator: Any, *, seed: int = 0) -> PaddingCost | None:
    """`padding_cost` of a training set whose row lengths can be read (`row_lengths`) under a bucketing
    `Collator`; None otherwise (offline features)."""
    lengths = row_lengths(dataset) if isinstance(collator, Collator) else None
    return padding_cost(lengths, rows, collator, seed=seed) if lengths is not None else None


def padding_cost(lengths: Sequence[int], rows: int, collator: Collator, *, seed: int = 0) -> PaddingCost:
    """`PaddingCost` of the first epoch's batches of `rows` rows in the order `make_dataloader` plays them (one
    process's share of it; full batches only, as the loader drops the last), from row `lengths` alone: the
    run's exact padding, known before its first step."""
    order = ResumableSampler(len(lengths), seed=seed).indices(0)
    real = slots = batches = 0
    for start in range(0, len(order) - rows + 1, rows):
        batch = [lengths[i] for i in order[start : start + rows]]
        seq = collator.length(max(batch))
        real, slots, batches = real + sum(min(n, seq) for n in batch), slots + rows * seq, batches + 1
    return PaddingCost(real, slots, batches)


@dataclass
class DataPosition:
    """Where a run stands in its data: the epoch and the loader batches consumed in it (host counters,
    saved in checkpoints so a resumed run continues with the next batch)."""

    epoch: int = 0
    batches: int = 0


def device_batches(dataset: Any, rows: int, collator: Collator, device: torch.device, position: DataPosition, *,
                   seed: int, num_workers: int, rank: int = 0, world_size: int = 1,
                   micro_batches: int = 1) -> Iterator[Batch]:
    """Endless device batches of `rows` rows, epoch after epoch, from `position` on (advanced as they are
    taken). Batches come pinned from DataLoader workers and are copied one ahead (`non_blocking`). One
    loader serves every epoch (its sampler advances the epoch on each pass), so its persistent workers
    start once per run."""
    if len(dataset) // world_size < rows:
        share = f" ({len(dataset) // world_size} for each of {world_size} processes)" if world_size > 1 else ""
        raise ValueError(f"the training set has {len(dataset)} rows{share}, fewer than one step needs ({rows}): "
                         "lower batch_size / optim.grad_accum or add data")
    loader = make_dataloader(dataset, rows, collator, seed=seed, epoch=position.epoch, skip_batches=position.batches,
                             num_workers=num_workers, rank=rank, world_size=world_size, micro_batches=micro_batches)
    while True:
        for batch in DevicePrefetcher(loader, device):
            position.batches += 1
            yield batch
        position.epoch, position.batches = position.epoch + 1, 0
