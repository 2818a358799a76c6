"""The data layer: conversations from any source (`sources`), the target's own replies (`regenerate`),
tokens and loss masks (`tokenization`), a run's training and held-out rows (`corpus`), offline features
(`features`, `feature_data`), and the hot path's loader (`loader`: bucketed collation, a resumable
sampler, device prefetch). Imports the target layer only for the features' frozen target; never the
run, evaluation or trainer layers.

`from dflash.data import Collator, ...` keeps naming the loader's pieces."""

from dflash.data.loader import (
    Collator,
    DataPosition,
    DevicePrefetcher,
    ResumableSampler,
    device_batches,
    make_dataloader,
    micro_batches,
)

__all__ = ["Collator", "DataPosition", "DevicePrefetcher", "ResumableSampler", "device_batches", "make_dataloader",
           "micro_batches"]
