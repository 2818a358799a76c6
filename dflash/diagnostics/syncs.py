"""`forbid_syncs()`: proof that a region of code makes no host-device synchronization.

DESIGN §3, invariant 1: a non-log training step never waits for the device. This module turns
that rule into a check that runs anywhere:

* On every machine (CPU tests and CI included), a `TorchDispatchMode` looks at each aten op the
  region runs and a `TorchFunctionMode` at the few Python-level tensor methods that read memory
  without dispatching an op (`tolist`, `numpy`, `print`). Findings, with the reason each syncs:

  1. device -> host reads: `aten._local_scalar_dense` (`.item()`, `float(t)`, `int(t)`, `bool(t)`,
     `if t:`), `aten.equal` / `aten.is_nonzero` / `aten.allclose` and any op tagged
     `data_dependent_output`; `Tensor.tolist`, `Tensor.numpy`, `np.asarray(t)`, `print(t)`,
     `f"{t}"`. The host cannot have the value before the device has computed it.
  2. data-dependent output shapes: any op tagged `dynamic_output_shape` (`nonzero`,
     `masked_select`, `unique`, `bincount`, `repeat_interleave` without `output_size`,
     `one_hot` without `num_classes`) and boolean-mask indexing (`x[mask]`, `x[mask] = v`, checked
     on the index dtype because `aten.index.Tensor` is tagged for integer indices too, which are
     fine). The host must read the device result to allocate the output.
  3. host <-> device copies (`aten._to_copy`, `aten.copy_`, `aten.to.*`, `aten._copy_from*`,
     `aten._foreach_copy_`): device -> host always waits; host -> device is allowed only from
     pinned memory with `non_blocking=True` (anything else blocks the host until the copy is done;
     this covers `torch.tensor(x, device=...)`, which builds on the host and then copies).
     Copies between two accelerators do not involve the host and are not findings.

* On a machine with CUDA, `torch.cuda.set_sync_debug_mode("error")` is also on inside the region
  (`"warn"` in collecting mode), which catches syncs made inside CUDA kernels' C++ code that no
  dispatch-level check can see. The previous mode is restored on exit.

Without a GPU, host -> device copies are invisible on real CPU tensors.
`dflash.diagnostics.fake_cuda_mode()` runs the region on fake CUDA tensors (`FakeTensorMode`) so
that they become visible; see its docstring for the exact recipe and its limits. Any non-CPU
device counts as "the device", so real `meta` tensors work as a stand-in accelerator too (and,
unlike fake CUDA on a CPU-only build, support autograd).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Finding", "SyncError", "SyncReport", "forbid_syncs"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# Frames inside this package (the dispatch modes here and fake_cuda's guard) are never the cause.
_DIAGNOSTICS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

_READ = ("reads a device value to the host (.item(), float(t), int(t), bool(t), `if t:`) "
         "— keep it a tensor / use torch.where")
_READ_OPS: dict[str, str] = {
    "aten._local_scalar_dense": _READ,
    "aten.item": _READ,
    "aten.is_nonzero": _READ,
    "aten.equal": "returns a Python bool computed on the device — compare on the device "
                 "((a == b).all()) and keep the result a tensor",
    "aten.allclose": "returns a Python bool computed on the device — keep torch.isclose(...).all() "
                    "a tensor",
}
_SHAPE = "output shape depends on device values, so the host must read them to allocate it"
_SHAPE_HINTS: dict[str, str] = {
    "aten.nonzero": "use torch.where / masked_fill, or torch.nonzero_static(x, size=N)",
    "aten.masked_select": "use torch.where(mask, x, 0) and keep the full shape",
    "aten.index": "boolean-mask indexing x[mask] calls nonzero — use torch.where / masked_fill "
                 "or a fixed-width integer index",
    "aten.repeat_interleave": "pass output_size=",
    "aten.bincount": "use torch.zeros(n).scatter_add_(...) with a fixed n",
    "aten.one_hot": "pass num_classes=",
}
_BOOL_INDEX_PUT = ("x[mask] = v with a boolean mask calls nonzero — use masked_fill_ / "
                   "torch.where / a fixed-width integer index")
_D2H = ("copies device→host, which waits for the device (.cpu(), .to('cpu'), .tolist()) — keep "
        "it on the device; only metrics.flush() at a log step reads back")
_H2D_PAGEABLE = ("copies host→device from pageable memory, which blocks the host "
                 "(torch.tensor(x, device=...), .to(device) of an unpinned tensor) — build it on "
                 "the device (torch.full / zeros / where) or copy from pinned memory with "
                 "non_blocking=True")
_H2D_BLOCKING = "copies host→device with non_blocking=False, which waits — pass non_blocking=True"

_COPY_OPS = {"aten._to_copy", "aten.to", "aten.copy_", "aten.copy", "aten._copy_from",
             "aten._copy_from_and_resize", "aten._foreach_copy_"}
_INDEX_PUT_OPS = {"aten.index_put_", "aten.index_put", "aten._index_put_impl_"}
_MASK_DTYPES = (torch.bool, torch.uint8)

# Python-level tensor methods that read memory without dispatching an aten op on CPU tensors.
_PY_READS: dict[Callable[..., Any], tuple[str, str]] = {
    torch.Tensor.tolist: ("Tensor.tolist", "copies the tensor to a Python list (device→host read)"),
    torch.Tensor.numpy: ("Tensor.numpy", "copies the tensor to numpy (device→host read)"),
    torch.Tensor.__array__: ("Tensor.__array__", "np.asarray(t) reads the tensor on the host"),
    torch.Tensor.__repr__: ("Tensor.__repr__", "print(t) / repr(t) / str(t) reads the values on "
                                               "the host — log through metrics instead"),
    torch.Tensor.__format__: ("Tensor.__format__", "f\"{t}\" / format(t) reads the values on the "
                                                   "host — log through metrics instead"),
}


@dataclass(frozen=True)
class Finding:
    """One host-device sync: the op (`aten.<name>` or `Tensor.<method>`), why it syncs, and the
    first stack frame outside torch that led to it."""

    op: str
    reason: str
    where: str

    def __str__(self) -> str:
        return f"{self.op}: {self.reason} (at {self.where})"


class SyncError(RuntimeError):
    """A host-device sync inside a `forbid_syncs()` region. `.findings` lists what was seen."""

    def __init__(self, findings: list[Finding], note: str = "") -> None:
        self.findings = list(findings)
        lines = [f"forbid_syncs: {len(self.findings)} host-device sync(s) in a sync-free region"]
        lines += [f"  {i}. {f}" for i, f in enumerate(self.findings, 1)]
        if note:
            lines.append(note)
        super().__init__("\n".join(lines))


@dataclass
class SyncReport:
    """What `forbid_syncs()` yields: the findings, in order (empty means the region is clean)."""

    findings: list[Finding] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(map(str, self.findings)) or "no host-device syncs"


def _is_pinned(t: torch.Tensor) -> bool:
    """Whether `t` lives in page-locked host memory (a seam for tests: fake tensors never are)."""
    return bool(t.is_pinned())


def _caller() -> str:
    """The innermost stack frame outside torch and this package: the line that caused the sync."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith((_TORCH_DIR, _DIAGNOSTICS_DIR)) and "contextlib" not in name:
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"


def _arg(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str, default: Any = None) -> Any:
    """Argument `name` of an aten call, wherever it was passed (positionally or by keyword)."""
    if name in kwargs:
        return kwargs[name]
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) and not a.kwarg_only else default
    return default


def _is_mask(index: Any) -> bool:
    """A boolean (or legacy uint8) index tensor: indexing with it selects a data-dependent count."""
    return isinstance(index, torch.Tensor) and index.dtype in _MASK_DTYPES


def _first_tensor(args: Iterable[Any]) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            t = _first_tensor(a)
            if t is not None:
                return t
    return None


def _copy_pairs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> list[tuple[torch.Tensor, torch.device, bool]]:
    """(source, destination device, non_blocking) for each copy a copy-like op makes."""
    packet = str(func.overloadpacket)
    nb = bool(_arg(func, args, kwargs, "non_blocking", False))
    src = args[0] if args else None
    if packet == "aten._foreach_copy_":
        dsts, srcs = _arg(func, args, kwargs, "self"), _arg(func, args, kwargs, "src")
        return [(s, d.device, nb) for d, s in zip(dsts, srcs, strict=True)]
    if packet in ("aten.copy_", "aten.copy"):
        dst, src = args[0], _arg(func, args, kwargs, "src")
        return [(src, dst.device, nb)]
    if packet in ("aten._copy_from", "aten._copy_from_and_resize"):
        return [(src, _arg(func, args, kwargs, "dst").device, nb)]
    # _to_copy and to.*: the destination is a `device` argument or `other.device`.
    dev = _arg(func, args, kwargs, "device")
    other = _arg(func, args, kwargs, "other")
    if dev is None and isinstance(other, torch.Tensor):
        dev = other.device
    if not isinstance(src, torch.Tensor) or dev is None:
        return []
    return [(src, torch.device(dev), nb)]


class _SyncMode(TorchDispatchMode):
    """The aten-level checks (1-3 in the module docstring)."""

    def __init__(self, owner: _Checker) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        reason = None if self.owner.quiet else self.owner.classify(func, args, kwargs)
        if reason is None:
            return func(*args, **kwargs)
        self.owner.report(str(func.overloadpacket), str(func), reason)
        return self.owner.run_flagged(func, args, kwargs)


def _cpu_checked_one_hot(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """`F.one_hot(t, num_classes=K)` on a CPU tensor: the CPU kernel checks `t.min() >= 0` with a
    host read that the CUDA kernel leaves to a device assert. Not a sync on the device."""
    num_classes = kwargs.get("num_classes", args[1] if len(args) > 1 else -1)
    t = args[0] if args else None
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and num_classes != -1


class _PyReadMode(TorchFunctionMode):
    """Python-level reads (`tolist`, `numpy`, `print`) that never dispatch an op on CPU tensors."""

    def __init__(self, owner: _Checker) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.one_hot and _cpu_checked_one_hot(args, kwargs):
            self.owner.quiet += 1  # its CPU kernel validates with .item(); CUDA's does not
            try:
                return func(*args, **kwargs)
            finally:
                self.owner.quiet -= 1
        hit = _PY_READS.get(func)
        t = args[0] if args else None
        if hit is None or not isinstance(t, torch.Tensor) or not self.owner.on_device(t):
            return func(*args, **kwargs)
        self.owner.report(hit[0], hit[0], hit[1])
        # The method's own aten ops (a .cpu() inside tolist, say) are the same sync: report once.
        self.owner.quiet += 1
        try:
            return self.owner.run_flagged(func, args, kwargs)
        finally:
            self.owner.quiet -= 1


class _Checker:
    """State shared by the two modes: the options, the report, and the classification rules."""

    def __init__(self, device: torch.device | None, allow: Iterable[str], raise_on_first: bool) -> None:
        self.device = device
        self.allow = set(allow)
        self.raise_on_first = raise_on_first
        self.report_ = SyncReport()
        self.quiet = 0

    def on_device(self, t: torch.Tensor) -> bool:
        """Whether `t` is a device tensor. With no `device` given every tensor is (on CPU tests
        the CPU stands in for the accelerator); otherwise other device types are host work."""
        return self.device is None or t.device.type == self.device.type

    def classify(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Why this aten call syncs, or None if it does not."""
        packet = str(func.overloadpacket)
        tags = func.tags
        if packet in _COPY_OPS:
            return self._copy_reason(func, args, kwargs)
        t = _first_tensor(args)
        if t is None or not self.on_device(t):
            return None
        if packet in _READ_OPS or torch.Tag.data_dependent_output in tags:
            return _READ_OPS.get(packet, _READ)
        if packet in _INDEX_PUT_OPS:
            indices = _arg(func, args, kwargs, "indices") or []
            return _BOOL_INDEX_PUT if any(_is_mask(i) for i in indices) else None
        if torch.Tag.dynamic_output_shape in tags:
            if packet == "aten.index" and not any(_is_mask(i) for i in _arg(func, args, kwargs, "indices")):
                return None  # integer-tensor indexing: the output shape is the indices' shape
            if packet == "aten.repeat_interleave" and _arg(func, args, kwargs, "output_size") is not None:
                return None
            if packet == "aten.one_hot" and _arg(func, args, kwargs, "num_classes", -1) != -1:
                return None
            hint = _SHAPE_HINTS.get(packet, "use a fixed-shape formulation")
            return f"{_SHAPE} — {hint}"
        return None

    def _copy_reason(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        for src, dst, non_blocking in _copy_pairs(func, args, kwargs):
            src_host, dst_host = src.device.type == "cpu", dst.type == "cpu"
            if src_host == dst_host:
                continue  # host->host, or device->device without the host
            if dst_host:
                return _D2H
            if not _is_pinned(src):
                return _H2D_PAGEABLE
            if not non_blocking:
                return _H2D_BLOCKING
        return None

    def report(self, op: str, full_name: str, reason: str) -> None:
        """Record a finding unless allowed; raise at once unless collecting."""
        if {op, full_name, op.split(".", 1)[-1]} & self.allow:
            return
        finding = Finding(op, reason, _caller())
        self.report_.findings.append(finding)
        if self.raise_on_first:
            raise SyncError([finding])

    def run_flagged(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run an op that was reported (collecting mode, or allowed). Fake and meta tensors cannot
        run data-dependent ops; turn their error into a SyncError that lists all findings."""
        try:
            return func(*args, **kwargs)
        except SyncError:
            raise
        except Exception as exc:
            if not self.report_.findings:
                raise
            note = f"({func} cannot run on these tensors: {type(exc).__name__}; stopped here)"
            raise SyncError(self.report_.findings, note) from exc


@contextlib.contextmanager
def forbid_syncs(*, device: torch.device | str | None = None, allow: Iterable[str] = (),
                 raise_on_first: bool = True, cuda_debug: bool = True,
                 aten_checks: bool = True) -> Iterator[SyncReport]:
    """Prove that the region makes no host-device synchronization.

    Usage::

        with forbid_syncs():                      # raises SyncError at the first sync
            loss = step(batch)
        with forbid_syncs(raise_on_first=False) as report:
            step(batch)
        assert report.findings == [], report

    Args:
        device: the device the region computes on. None: every tensor counts as a device tensor
            (on CPU the CPU stands in for the accelerator). Given (e.g. "cuda"): reads and
            data-dependent ops on tensors of other device types are host-side work and pass
            (a real GPU step may `.item()` a CPU tensor). Host<->device copies are checked either way.
        allow: op names to permit: "aten.nonzero", "aten.nonzero.default", "nonzero",
            "Tensor.tolist", "tolist". Only the dispatch-level checks honour it; the CUDA debug
            mode does not (pass cuda_debug=False).
        raise_on_first: raise `SyncError` at the first finding (default). False collects every
            finding in the yielded `SyncReport` instead (a fake/meta tensor that cannot run the
            flagged op still stops the region, with a SyncError listing all findings so far).
        cuda_debug: on a machine with CUDA (and `device` None or CUDA), also turn on
            `torch.cuda.set_sync_debug_mode("error")` ("warn" when collecting).
        aten_checks: the dispatch- and Python-level checks (default). False leaves the CUDA sync
            debug mode alone, for regions that call compiled code: torch.compile refuses to run a
            compiled function under an active user dispatch mode (compiled flex attention then
            fails), and compiled kernels dispatch no aten ops to inspect anyway.

    Fake CUDA: `with fake_cuda_mode(): ... with forbid_syncs(): step()` (setup outside the inner
    block). Either nesting works: FakeTensorMode is an "infra" dispatch mode, which torch always
    runs after user modes, so `forbid_syncs` sees every op, with the fake "cuda" devices, before
    FakeTensorMode computes it.

    Run the region eagerly, or pass `aten_checks=False` (see above). Work on other threads is not
    watched (dispatch modes are thread-local).
    """
    dev = torch.device(device) if device is not None else None
    checker = _Checker(dev, allow, raise_on_first)
    use_cuda = cuda_debug and (dev is None or dev.type == "cuda") and torch.cuda.is_available()
    if not aten_checks and not use_cuda:
        raise ValueError("forbid_syncs(aten_checks=False) keeps only the CUDA sync debug mode, and it is off here "
                         "(no CUDA, cuda_debug=False or a non-CUDA device): nothing would be checked")
    with contextlib.ExitStack() as stack:
        if use_cuda:
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error" if raise_on_first else "warn")
            stack.callback(torch.cuda.set_sync_debug_mode, previous)
        if aten_checks:
            stack.enter_context(_PyReadMode(checker))
            stack.enter_context(_SyncMode(checker))
        yield checker.report_
