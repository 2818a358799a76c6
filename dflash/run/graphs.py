"""The whole training step captured in CUDA graphs, one graph per batch shape.

Batches come in a few shapes: the collator pads the sequence to one of `max_length / bucket_multiple`
lengths and may bound the anchor width to a few allowed widths. A graph replays one fixed shape, so
`StepGraphs` keeps one per shape key, captured on first use into a memory pool all of them share
(they never run concurrently, and the step keeps nothing alive in a graph's temporaries: weights,
gradients, optimizer state and metric sums are allocated before capture). The number of keys is
bounded by the collator's shapes; a key beyond the bound is an error, never a silent eager step.

Before each capture the step runs a few times on the new shape (allocating gradients and optimizer
state, compiling kernels for it) and everything those runs changed is put back, so a capture at any
point of a run leaves the run where it was.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from dflash.metrics import Metrics

Batch = dict[str, Any]
ShapeKey = tuple[tuple[tuple[str, Any], ...], ...]
log = logging.getLogger("dflash")


class Replayable(Protocol):
    def replay(self) -> None: ...


Capture = Callable[[Callable[[], None]], Replayable]  # records `fn` once; `replay()` runs it again


def shape_key(micro: Sequence[Mapping[str, Any]]) -> ShapeKey:
    """What a graph is specialised to: every tensor's shape and every plain value (the anchor width)."""
    return tuple(tuple((k, tuple(v.shape) if torch.is_tensor(v) else v) for k, v in sorted(mb.items()))
                 for mb in micro)


def cuda_graph_capture(generator: torch.Generator) -> Capture:
    """Capture with `torch.cuda.CUDAGraph`, every graph in one shared memory pool. `generator` (the
    anchor generator) is registered with each graph, so each replay draws fresh anchors by advancing its
    Philox offset on the device."""
    pool: list[Any] = []  # made at the first capture: building the capture needs no GPU

    def capture(fn: Callable[[], None]) -> Replayable:
        if not pool:
            pool.append(torch.cuda.graph_pool_handle())
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(generator)
        with torch.cuda.graph(graph, pool=pool[0]):
            fn()
        return graph

    return capture


class StepGraphs:
    """Replays `step(micro)` through one captured graph per shape key.

    Args:
        step: runs one optimizer step on a list of micro-batches (the trainer's eager step).
        warm_up: runs `step` on static inputs and restores the run's state (`warm_up_and_restore`);
            called before each capture.
        capture: records a callable into a graph (`cuda_graph_capture` on a GPU; tests pass a stand-in).
        max_graphs: the most shape keys the data can produce; one more raises.
    """

    def __init__(self, step: Callable[[list[Batch]], None], warm_up: Callable[[list[Batch]], None], *,
                 capture: Capture, max_graphs: int) -> None:
        self.step, self.warm_up, self.capture, self.max_graphs = step, warm_up, capture, max_graphs
        self.graphs: dict[ShapeKey, tuple[Replayable, list[Batch]]] = {}

    def __len__(self) -> int:
        return len(self.graphs)

    def run(self, micro: list[Batch]) -> None:
        key = shape_key(micro)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(key, micro)
        graph, static = entry
        for buffers, mb in zip(static, micro, strict=True):
            for k, v in mb.items():
                if torch.is_tensor(v):
                    buffers[k].copy_(v, non_blocking=True)
        graph.replay()

    def _capture(self, key: ShapeKey, micro: list[Batch]) -> tuple[Replayable, list[Batch]]:
        if len(self.graphs) >= self.max_graphs:
            raise RuntimeError(f"a batch of shape {key} would be CUDA graph {len(self.graphs) + 1}, past the "
                               f"{self.max_graphs} shapes the collator can produce: the data pipeline made a "
                               "shape it does not announce (a bug); run with cuda_graph: false meanwhile")
        start = time.perf_counter()
        static = [{k: v.clone() if torch.is_tensor(v) else v for k, v in mb.items()} for mb in micro]
        self.warm_up(static)
        graph = self.capture(lambda: self.step(static))
        log.info("captured CUDA graph %d (of at most %d) for batch shape %s in %.1f s", len(self.graphs) + 1,
                 self.max_graphs, key, time.perf_counter() - start)
        return graph, static


def warm_up_and_restore(run: Callable[[], None], *, steps: int, draft: nn.Module, optimizer: torch.optim.Optimizer,
                        metrics: Metrics, tensors: Sequence[torch.Tensor], generator: torch.Generator,
                        device: torch.device) -> None:
    """Call `run` `steps` times (on a side stream on CUDA), so gradients, optimizer state and compiled
    kernels exist before a capture, then put back the draft's weights, the optimizer state, the metric
    sums, each of `tensors` (the schedule's step and lr) and the generator as they were.

    The optimizer state is restored IN PLACE (a fresh run's is zeroed: AdamW's initial state).
    Replacing it by `optimizer.load_state_dict` would leave a fresh run with no state, and the capture
    would then record its lazy creation: every replay would zero the moments and the step count again
    (Adam reduced to its first step). The generator goes back to where it stood, so the replays continue
    the anchor stream an uninterrupted run draws (a resumed run captures again and continues it too).
    """
    weights = {k: v.clone() for k, v in draft.state_dict().items()}
    before = {p: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    saved_metrics, saved = metrics.state_dict(), [t.clone() for t in tensors]
    generator_state = generator.get_state()
    side = torch.cuda.Stream() if device.type == "cuda" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for _ in range(steps):
            run()
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
    with torch.no_grad():
        draft.load_state_dict(weights)
        for p, state in optimizer.state.items():
            for k, v in state.items():
                if torch.is_tensor(v):
                    v.copy_(before[p][k]) if p in before else v.zero_()
        for t, value in zip(tensors, saved, strict=True):
            t.copy_(value)
    metrics.load_state_dict(saved_metrics)
    generator.set_state(generator_state)


def step_graphs(step: Callable[[list[Batch]], None], *, draft: nn.Module, optimizer: torch.optim.Optimizer,
                metrics: Metrics, tensors: Sequence[torch.Tensor], generator: torch.Generator, device: torch.device,
                capture: Capture | None, max_graphs: int) -> StepGraphs:
    """`StepGraphs` of the trainer's eager `step`: before each capture it runs 3 times on the new shape and
    the run's state is put back (`warm_up_and_restore`); `capture` None: `cuda_graph_capture(generator)`."""
    def warm_up(static: list[Batch]) -> None:
        warm_up_and_restore(lambda: step(static), steps=3, draft=draft, optimizer=optimizer, metrics=metrics,
                            tensors=tensors, generator=generator, device=device)

    return StepGraphs(step, warm_up, capture=capture or cuda_graph_capture(generator), max_graphs=max_graphs)
