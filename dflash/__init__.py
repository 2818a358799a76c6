"""dflash: a sync-free trainer for DFlash-family speculative-decoding draft models (DFlash, Domino, DFlash 2, DSpark).

Heavy submodules are imported lazily so that `import dflash` stays cheap (the CLI and the
GPU scripts import only what they use).
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

from dflash.version import __version__

_LAZY = {
    "sample_anchors": "dflash.anchors",
    "DFlashDraftConfig": "dflash.modeling",
    "DFlashDraftModel": "dflash.modeling",
    "FrozenTarget": "dflash.target_model.frozen",
    "TensorParallelTarget": "dflash.target_model.tensor_parallel",
    "GroupBatchTarget": "dflash.target_model.tp_group",
    "TrainConfig": "dflash.config",
    "DFlashTrainer": "dflash.trainer",
    "forbid_syncs": "dflash.diagnostics",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dflash' has no attribute {name!r}")


# transformers imports torchao whenever it is installed (its quantizers, on any model load), and torchao then
# warns "Failed to load .../_C*.so" for each prebuilt kernel library this torch build cannot load (its CUDA
# kernels beside a CPU torch), and torch that torchao registers its enums the deprecated way: lines on every
# command that say nothing about the run. dflash's fp8 (float8 training, rowwise) multiplies through
# torch._scaled_mm, not those libraries, so both are dropped here, before anything imports torchao; other
# warnings pass.
logging.getLogger("torchao").addFilter(lambda record: not record.getMessage().startswith("Failed to load "))
logging.getLogger("torch.utils._pytree").addFilter(
    lambda record: "is an Enum subclass and is now natively supported" not in record.getMessage())

# In a notebook with no logging configured, dflash's progress lines (regeneration, training, evaluation)
# are shown in the cells; Python would print warnings only (`dflash.report.console.show_logs_in_notebook`).
if "IPython" in sys.modules:
    importlib.import_module("dflash.report.console").show_logs_in_notebook()
