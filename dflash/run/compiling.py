"""`compile: true`: what is compiled, where the compiled code is kept, and how long each new shape took.

Two scopes (`compile_scope`):

* `layers` (regional compilation): each decoder layer of the draft is compiled on its own. The layers
  share one class and one code object, so Dynamo traces and Inductor compiles the layer once per batch
  shape and every other layer reuses that code: compile time grows with the number of shapes, not
  with depth. The glue around the layers (context projection, norms) runs eagerly; it is a few
  elementwise kernels per step.
* `step`: the whole draft call (DDP / FSDP2 wrapper included) as one graph, so Inductor can fuse
  across layer boundaries, at the price of compiling every layer's code again for each shape.

The compiled artefacts (Inductor's FX graph cache and AOTAutograd's cache) are kept on disk under the
dflash cache (`$DFLASH_CACHE/inductor`, unless `TORCHINDUCTOR_CACHE_DIR` is already set), so a second
run on the same shapes loads them instead of compiling again.

The first step of every new batch shape is timed on the host and logged ("compiling for shape ...",
then its seconds), so a user never watches a silent minute. Host time only: no device sync is added
(compilation runs on the host before the step's kernels are queued, so it dominates that time).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

log = logging.getLogger("dflash")

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def keep_compile_cache(cache_root: str | Path) -> Path:
    """Point Inductor's on-disk caches at `cache_root/inductor` unless the user chose a folder
    (`TORCHINDUCTOR_CACHE_DIR`); returns the folder used. Call before the first compilation.

    Inductor writes its default (`/tmp/torchinductor_$USER`) into the environment the first time anything
    asks for its cache folder (importing some float8 / flex code does), so that value is not a user's
    choice: it is replaced too. (A folder under /tmp is also lost with the machine's temporary files.)"""
    chosen = os.environ.get(INDUCTOR_CACHE_ENV)
    if chosen is None or chosen == default_cache_dir():
        os.environ[INDUCTOR_CACHE_ENV] = chosen = str(Path(cache_root) / "inductor")
    folder = Path(chosen)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def compile_draft_call(call: Callable[..., torch.Tensor], layers: Sequence[nn.Module], scope: str
                       ) -> Callable[..., torch.Tensor]:
    """What runs the draft under `compile: true`: `call` with each of `layers` compiled in place
    (`scope="layers"`), or `call` compiled whole (`scope="step"`). Shapes are static (`dynamic=False`):
    one graph per padded length, which `modeling.allow_compiled_shapes` budgets."""
    if scope == "layers":
        for layer in layers:
            layer.compile(dynamic=False)
        return call
    if scope == "step":
        return torch.compile(call, dynamic=False)
    raise ValueError(f"compile_scope {scope!r}: choose 'layers' or 'step'")


def batch_shape(micro: Sequence[Mapping[str, Any]]) -> tuple[Any, ...]:
    """What a compiled step is specialised to: each micro-batch's token shape and anchor width."""
    return tuple((tuple(mb["input_ids"].shape), mb.get("num_anchors")) for mb in micro)


class ShapeLog:
    """Logs the first step of each new batch shape and its host seconds (`compile: true`)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.seconds: dict[tuple[Any, ...], float] = {}  # shape -> host seconds of its first step

    @contextmanager
    def first_step(self, shape: tuple[Any, ...]) -> Iterator[None]:
        if not self.enabled or shape in self.seconds:
            yield
            return
        log.info("compiling for shape %s ...", _describe(shape))
        start = time.perf_counter()
        yield
        self.seconds[shape] = time.perf_counter() - start
        log.info("compiled for shape %s in %.1f s", _describe(shape), self.seconds[shape])


def _describe(shape: tuple[Any, ...]) -> str:
    (rows, length), width = shape[0]
    extra = f", {len(shape)} micro-batches" if len(shape) > 1 else ""
    return f"[{rows} x {length}]" + (f", {width} anchors" if width is not None else "") + extra
