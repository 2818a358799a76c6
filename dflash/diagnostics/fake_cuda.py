"""`fake_cuda_mode()`: fake CUDA tensors on a CPU-only machine, for `forbid_syncs()`.

On real CPU tensors a host -> device copy is a CPU -> CPU copy, which `forbid_syncs()` cannot tell
from host work. Under `fake_cuda_mode()` tensors live on fake "cuda" devices (`FakeTensorMode`),
so the copies to them are visible; a guard turns what a CPU-only torch build cannot do on them into
clear errors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

__all__ = ["FAKE_CUDA", "fake_cuda_mode"]

#: The fake accelerator device. Use it (with its index) rather than the string "cuda": in a
#: CPU-only build, `t.to("cuda")` and `t.cuda()` fail before any fake mode sees them.
FAKE_CUDA = torch.device("cuda", 0)


class _FakeCudaGuard(TorchFunctionMode):
    """Turns the two ways fake CUDA fails in a CPU-only build into clear Python errors.

    1. Recording autograd history on a fake CUDA tensor aborts the whole process (C++ asks for a
       CUDA stream: `terminate called ... not linked with support for cuda devices`); refuse first.
    2. Python bindings that take a CUDA device guard (`x[...]` indexing and assignment,
       `Tensor.copy_`, `Tensor.nonzero`, `torch.nonzero`, `new_tensor`, `.to("cuda")`, `.cuda()`)
       raise an unhelpful RuntimeError; re-raise it with the reason and the way out.
    """

    _SAFE = {"__get__", "__set__", "detach", "detach_", "requires_grad_", "size", "dim", "numel",
             "stride", "is_contiguous", "__repr__", "__format__", "__len__", "__hash__"}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__qualname__", str(func))
        if torch.is_grad_enabled() and getattr(func, "__name__", "") not in self._SAFE:
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            if any(isinstance(x, torch.Tensor) and x.requires_grad and x.device.type == "cuda"
                   for x in leaves):
                raise RuntimeError(
                    f"fake_cuda_mode: {name} would record autograd history on a fake CUDA tensor, "
                    "which aborts a CPU-only torch build. Run it under torch.no_grad(), or use "
                    "real 'meta' tensors (forbid_syncs(device='meta')) for a step with backward.")
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:
            if "not linked with support for cuda" not in str(exc):
                raise
            raise RuntimeError(
                f"fake_cuda_mode: {name} needs a real CUDA runtime in this CPU-only torch build "
                "(Python indexing x[...], Tensor.copy_, nonzero, new_tensor, .cuda() and "
                ".to('cuda') without an index take a CUDA device guard). Use FAKE_CUDA for "
                "devices, or real 'meta' tensors (forbid_syncs(device='meta')) as the stand-in "
                "device.") from exc


@contextlib.contextmanager
def fake_cuda_mode() -> Iterator[FakeTensorMode]:
    """Fake CUDA tensors on a CPU-only machine, so that host->device copies become visible.

    Recipe (a CPU-only torch build)::

        with fake_cuda_mode():
            x = torch.zeros(4, device=FAKE_CUDA)        # factories take "cuda" or FAKE_CUDA
            model.to(FAKE_CUDA)                          # a module built (and initialised) on CPU
            batch = cpu_batch.to(FAKE_CUDA)              # setup copies: before forbid_syncs
            with forbid_syncs():                         # (either nesting order works)
                with torch.no_grad():
                    step(model, batch)

    Inside, tensors made without a device are fake CPU tensors and real tensors are accepted
    (`allow_non_fake_inputs=True`). What a CPU-only build cannot do on fake CUDA tensors (a guard
    turns each into a clear RuntimeError):

    * autograd: recording history aborts the process in C++ — run forward-only code under
      `torch.no_grad()`;
    * Python indexing `x[...]` / `x[...] = v`, `Tensor.copy_`, `Tensor.nonzero`, `torch.nonzero`,
      `new_tensor`, `.cuda()`, `.to("cuda")` without an index: their bindings take a CUDA device
      guard. Use FAKE_CUDA for devices; `narrow`, `select`, `index_select`, `gather`, `where`
      work;
    * in-place random init (`uniform_`), so build modules on the CPU and `.to(FAKE_CUDA)` them.

    For a whole step (slicing, backward, optimizer) use real 'meta' tensors instead:
    `model.to("meta")`, inputs on "meta", `forbid_syncs(device="meta")`; copies between the CPU
    and meta are host<->device copies to it. Fake tensors are never pinned, so an allowed pinned
    non_blocking copy cannot be shown with either.
    """
    with contextlib.ExitStack() as stack:
        fake = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        if not torch.backends.cuda.is_built():
            stack.enter_context(_FakeCudaGuard())
        yield fake
