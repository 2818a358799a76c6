"""forbid_syncs(): every kind of host-device sync is caught, and sync-free code passes clean.

Each planted sync below is real: if the detector stopped catching it, its test fails.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from dflash.diagnostics import FAKE_CUDA, Finding, SyncError, SyncReport, fake_cuda_mode, forbid_syncs, syncs

X = torch.arange(8, dtype=torch.float32) - 3.5
MASK = X > 0

# (name, planted sync, op that must be named in the error)
PLANTED: list[tuple[str, Callable[[], object], str]] = [
    ("item", lambda: X.sum().item(), "aten._local_scalar_dense"),
    ("float", lambda: float(X.sum()), "aten._local_scalar_dense"),
    ("int", lambda: int(X.argmax()), "aten._local_scalar_dense"),
    ("bool", lambda: bool(MASK.any()), "aten._local_scalar_dense"),
    ("if", lambda: 1 if MASK.any() else 0, "aten._local_scalar_dense"),
    ("tolist", lambda: X.tolist(), "Tensor.tolist"),
    ("numpy", lambda: X.numpy(), "Tensor.numpy"),
    ("print", lambda: print(X), "Tensor.__repr__"),
    ("fstring", lambda: f"{X.sum():.3f}", "Tensor.__format__"),
    ("equal", lambda: torch.equal(X, X), "aten.equal"),
    ("bool_mask_index", lambda: X[MASK], "aten.index"),
    ("bool_mask_assign", lambda: X.clone().__setitem__(MASK, 0.0), "aten.index_put_"),
    ("nonzero", lambda: torch.nonzero(MASK), "aten.nonzero"),
    ("argwhere", lambda: torch.argwhere(MASK), "aten.nonzero"),
    ("masked_select", lambda: torch.masked_select(X, MASK), "aten.masked_select"),
    ("unique", lambda: torch.unique(X), "aten._unique2"),
    ("bincount", lambda: torch.bincount(MASK.long()), "aten.bincount"),
    ("repeat_interleave", lambda: torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3])),
     "aten.repeat_interleave"),
]


@pytest.mark.parametrize("name,plant,op", PLANTED, ids=[p[0] for p in PLANTED])
def test_planted_sync_is_caught_and_named(name: str, plant: Callable[[], object], op: str) -> None:
    with pytest.raises(SyncError) as info:
        with forbid_syncs():
            plant()
    (finding,) = info.value.findings
    assert finding.op == op
    assert op in str(info.value)
    assert "test_syncs.py" in finding.where  # points at the offending line, not into torch


def test_error_message_names_op_and_why() -> None:
    with pytest.raises(SyncError, match=r"aten\._local_scalar_dense: reads a device value to the host"):
        with forbid_syncs():
            X.sum().item()
    assert issubclass(SyncError, RuntimeError)


def test_sync_in_backward_is_caught() -> None:
    w = torch.ones(4, requires_grad=True)
    y = w * 2
    y.register_hook(lambda g: g * g.sum().item())
    with pytest.raises(SyncError, match="_local_scalar_dense"):
        with forbid_syncs():
            y.sum().backward()


def test_repeat_interleave_with_output_size_is_allowed() -> None:
    with forbid_syncs() as report:
        out = torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3]), output_size=6)
    assert report.findings == []
    assert out.tolist() == [0, 1, 1, 2, 2, 2]


def _linear_adamw_step() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 5)
    lr = torch.tensor(1e-2)  # schedule lives in a tensor, updated in place
    # fused=True: the default (foreach / for-loop) AdamW reads its step counters with .item().
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    return model, opt, lr


def test_clean_training_step_has_no_findings() -> None:
    model, opt, lr = _linear_adamw_step()
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, -100])
    before = model.weight.detach().clone()
    with forbid_syncs(raise_on_first=False) as report:
        for _ in range(2):
            loss = F.cross_entropy(model(x), y, ignore_index=-100, reduction="sum")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            lr.mul_(0.5)
    assert report.findings == [], str(report)
    assert not torch.equal(before, model.weight)  # the step really ran


def test_clean_tensor_idioms_have_no_findings() -> None:
    idx = torch.tensor([[0, 2], [1, 3]])
    with forbid_syncs(raise_on_first=False) as report:
        torch.where(MASK, X, -1.0)  # Python scalar sentinels
        torch.where(MASK, 0, 1)
        torch.full_like(X, float("-inf"))
        X.masked_fill(~MASK, 0.0)
        X.topk(3)
        X.view(2, 4).gather(1, idx)
        torch.zeros(2, 4).scatter(1, idx, 1.0)
        torch.zeros(2, 4).scatter_add_(1, idx, torch.ones(2, 2))
        X[torch.tensor([0, 3])]  # integer-tensor indexing: static shape
        X[2:5]
        torch.nonzero_static(MASK, size=8)
        F.one_hot(idx, num_classes=4)  # its CPU-only .item() input check is not a device sync
        torch.cumsum(MASK.long(), 0)
        torch.randperm(8)
    assert report.findings == [], str(report)


def test_allow_permits_named_ops_only() -> None:
    with forbid_syncs(allow=("aten.nonzero", "tolist")) as report:
        torch.nonzero(MASK)
        X.tolist()
    assert report.findings == []
    with forbid_syncs(allow=("aten.nonzero.default",)):
        torch.nonzero(MASK)
    with pytest.raises(SyncError, match="masked_select"):
        with forbid_syncs(allow=("aten.nonzero",)):
            torch.nonzero(MASK)
            torch.masked_select(X, MASK)


def test_collecting_mode_returns_all_findings_in_order() -> None:
    with forbid_syncs(raise_on_first=False) as report:
        X.sum().item()
        X[MASK]
        X.tolist()
        torch.unique(X)
        X.sum() * 2  # clean
    assert isinstance(report, SyncReport)
    assert [f.op for f in report.findings] == [
        "aten._local_scalar_dense", "aten.index", "Tensor.tolist", "aten._unique2"]
    assert all(isinstance(f, Finding) and f.reason for f in report.findings)
    assert "aten.index" in str(report)


def test_device_argument_treats_other_devices_as_host_work() -> None:
    host = torch.ones(3)
    with forbid_syncs(device="meta") as report:
        host.sum().item()  # a CPU read while the step runs on another device: not a sync
        torch.nonzero(host)
    assert report.findings == []
    with pytest.raises(SyncError, match="_local_scalar_dense"):
        with forbid_syncs(device="meta"):
            torch.ones(3, device="meta").sum().item()


# --- host <-> device copies, made visible with fake CUDA (and meta) tensors -----------------


def test_torch_tensor_on_device_is_caught_under_fake_cuda() -> None:
    with fake_cuda_mode():
        with pytest.raises(SyncError, match=r"aten\._to_copy: copies host→device from pageable"):
            with forbid_syncs():
                torch.tensor(1.0, device="cuda")


@pytest.mark.parametrize("non_blocking", [False, True])
def test_unpinned_host_to_device_copy_is_caught(non_blocking: bool) -> None:
    with fake_cuda_mode():
        host = torch.ones(3)
        with pytest.raises(SyncError, match="pageable memory"):
            with forbid_syncs():
                host.to(FAKE_CUDA, non_blocking=non_blocking)


def test_pinned_copy_needs_non_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fake tensors are never pinned and a CPU-only build cannot pin: stand in for pinned memory.
    monkeypatch.setattr(syncs, "_is_pinned", lambda t: True)
    with fake_cuda_mode():
        host = torch.ones(3)
        with forbid_syncs() as report:
            out = host.to(FAKE_CUDA, non_blocking=True)
        assert report.findings == [] and out.device == FAKE_CUDA
        with pytest.raises(SyncError, match="non_blocking=False"):
            with forbid_syncs():
                host.to(FAKE_CUDA)


def test_device_to_host_copy_is_caught_under_fake_cuda() -> None:
    with fake_cuda_mode():
        dev = torch.ones(3, device=FAKE_CUDA)
        with forbid_syncs(raise_on_first=False) as report:
            dev.cpu()
            dev.to("cpu", non_blocking=True)  # still waits for the value before the host uses it
        assert [f.reason for f in report.findings] == [syncs._D2H, syncs._D2H]
        with pytest.raises(SyncError, match="_local_scalar_dense"):
            with forbid_syncs():
                dev.sum().item()


def test_clean_device_code_under_fake_cuda() -> None:
    model = torch.nn.Linear(4, 3)
    with fake_cuda_mode():
        model.to(FAKE_CUDA)
        x = torch.randn(2, 4, device=FAKE_CUDA)
        with forbid_syncs(raise_on_first=False) as report, torch.no_grad():
            logits = model(x)
            keep = torch.where(logits > 0, logits, 0.0)
            torch.full_like(keep, 1.0).add_(keep.topk(2).values.sum())
            F.one_hot(logits.argmax(-1), num_classes=3)
            torch.zeros(4, device="cuda")  # factories on the device are fine
            x.to(torch.bfloat16)  # dtype casts on the device are fine
        assert report.findings == [], str(report)
        assert logits.device == FAKE_CUDA


def test_fake_cuda_autograd_fails_cleanly_instead_of_aborting() -> None:
    with fake_cuda_mode():
        w = torch.ones(3, device=FAKE_CUDA, requires_grad=True)
        with pytest.raises(RuntimeError, match="autograd history on a fake CUDA tensor"):
            w * 2


def test_fake_cuda_indexing_fails_cleanly() -> None:
    with fake_cuda_mode():
        dev = torch.ones(3, device=FAKE_CUDA)
        with pytest.raises(RuntimeError, match="fake_cuda_mode: .*needs a real CUDA runtime"):
            dev[0]


def test_meta_device_stands_in_for_a_step_with_backward() -> None:
    model = torch.nn.Linear(4, 3).to("meta")
    x = torch.randn(2, 4, device="meta")
    with forbid_syncs(device="meta", raise_on_first=False) as report:
        model(x).sum().backward()
    assert report.findings == [] and model.weight.grad is not None
    with pytest.raises(SyncError, match="pageable memory"):
        with forbid_syncs(device="meta"):
            torch.empty(3, device="meta").copy_(torch.ones(3))  # a step that uploads mid-way
    with pytest.raises(SyncError, match="device→host"):
        with forbid_syncs(device="meta"):
            x.cpu()


def test_collecting_mode_stops_cleanly_on_ops_fake_tensors_cannot_run() -> None:
    with fake_cuda_mode():
        dev = torch.ones(3, device=FAKE_CUDA)
        with pytest.raises(SyncError, match="stopped here") as info:
            with forbid_syncs(raise_on_first=False):
                dev.cpu()
                dev.sum().item()  # a fake tensor has no value to return
    assert [f.op for f in info.value.findings] == ["aten._to_copy", "aten._local_scalar_dense"]


def test_cuda_debug_mode_is_set_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", calls.append)
    with pytest.raises(SyncError):
        with forbid_syncs():
            assert calls == ["error"]
            X.sum().item()
    assert calls == ["error", 0]  # restored even though the region raised
    with forbid_syncs(raise_on_first=False):
        pass
    with forbid_syncs(cuda_debug=False), forbid_syncs(device="meta"):
        pass
    assert calls == ["error", 0, "warn", 0]


def test_nesting_order_with_fake_cuda_does_not_matter() -> None:
    with forbid_syncs(raise_on_first=False) as report, fake_cuda_mode():
        torch.ones(3).to(FAKE_CUDA)
    assert [f.reason for f in report.findings] == [syncs._H2D_PAGEABLE]


def test_cuda_debug_mode_alone_for_compiled_regions(monkeypatch: pytest.MonkeyPatch) -> None:
    """`aten_checks=False` (regions that call torch.compile'd code) keeps the CUDA sync debug mode and drops
    the dispatch detector; without CUDA that would check nothing, so it is refused."""
    with pytest.raises(ValueError, match="nothing would be checked"):
        with forbid_syncs(aten_checks=False):
            pass
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", calls.append)
    with forbid_syncs(aten_checks=False) as report:
        X.sum().item()  # the dispatch detector is off: only a real CUDA sync would raise here
    assert calls == ["error", 0] and report.findings == []
