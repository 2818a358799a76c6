"""Sync-checking tools: prove that training code makes no host-device synchronization.

They ship with the package so that a run can be checked on its own configuration, but nothing in
the training path imports them except `dflash.hf.trainer`, which uses the Trainer checklist to warn.

* `forbid_syncs()` (`syncs`): a region that raises (or collects) on every host-device sync.
* `fake_cuda_mode()`, `FAKE_CUDA` (`fake_cuda`): fake CUDA tensors, so a CPU-only machine sees
  host -> device copies.
* `SyncProbe` (`probe`): a `transformers.TrainerCallback` that runs a Trainer's non-log steps
  under `forbid_syncs()`.
* `per_step_sync_settings`, `DFlashSyncWarning` (`trainer_settings`): the `TrainingArguments`
  settings that sync every step, which `dflash.hf.trainer.DFlashCallback` warns about.
"""

from dflash.diagnostics.fake_cuda import FAKE_CUDA, fake_cuda_mode
from dflash.diagnostics.probe import SyncProbe
from dflash.diagnostics.syncs import Finding, SyncError, SyncReport, forbid_syncs
from dflash.diagnostics.trainer_settings import DFlashSyncWarning, per_step_sync_settings

__all__ = [
    "FAKE_CUDA",
    "DFlashSyncWarning",
    "Finding",
    "SyncError",
    "SyncProbe",
    "SyncReport",
    "fake_cuda_mode",
    "forbid_syncs",
    "per_step_sync_settings",
]
