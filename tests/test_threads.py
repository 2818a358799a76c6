"""On a CPU the torch thread count is chosen, not torch's host-wide default: OMP_NUM_THREADS when set,
else the CPUs the process may use (affinity, a cgroup quota) shared among the launch's local processes."""

from __future__ import annotations

import torch

import dflash.runtime as runtime


def test_threads_follow_the_environment_then_the_affinity_the_quota_and_the_local_processes(monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert runtime.cpu_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(runtime, "_CGROUP_CPU_MAX", str(tmp_path / "absent"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert runtime.cpu_threads() == 4  # 8 CPUs for 2 local processes
    quota = tmp_path / "cpu.max"
    quota.write_text("250000 100000\n")  # 2.5 CPUs of quota on an 8-CPU affinity
    monkeypatch.setattr(runtime, "_CGROUP_CPU_MAX", str(quota))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert runtime.cpu_threads() == 3
    quota.write_text("max 100000\n")
    assert runtime.cpu_threads() == 8


def test_a_cpu_device_sets_the_chosen_threads_and_says_so(monkeypatch, caplog):
    before = torch.get_num_threads()
    monkeypatch.setattr(runtime, "cpu_threads", lambda: 2 if before != 2 else 1)
    monkeypatch.setattr(runtime, "_THREADS_SAID", False)
    try:
        with caplog.at_level("INFO", logger="dflash"):
            assert runtime.resolve_device("cpu").type == "cpu"
        assert torch.get_num_threads() == (2 if before != 2 else 1)
        assert "torch thread(s) per process (set OMP_NUM_THREADS to change)" in caplog.text
    finally:
        torch.set_num_threads(before)
