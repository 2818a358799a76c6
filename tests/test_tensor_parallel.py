"""The tensor-parallel frozen target (CPU, gloo, `torch.distributed.run`): equality with the
single-process FrozenTarget, the three schedules (identical, and the overlap schedule's order of
issues and waits), the group-batch path, per-rank bytes, sync-freedom, errors, sharded loading, a
(dp x tp) = 2 x 2 mesh, and the bench_tp.py smoke run.

One 2-process launch of tests/tp_worker.py serves most tests (module fixture); checks that need no
process group run in this process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GemmaConfig, GPT2Config, LlamaConfig, Qwen3Config

from dflash.tensor_parallel import check_tp_support
from dflash.tp_overlap import batch_halves, schedule_for

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-5  # fp32: the sharded matmuls sum in a different order than the whole ones


def launch(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tp")
    launch(2, "tests/tp_worker.py", "checks", str(tmp / "out.pt"), str(tmp))
    return torch.load(tmp / "out.pt", weights_only=False)


def _per_schedule(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in results.items() if isinstance(v, dict) and "features" in v}


def test_features_last_hidden_and_greedy_equal_the_single_process_target(ranks):
    """Tiny Llama (the conftest target; tied + biased), Qwen3 (untied, tied), Qwen2 (tied); layer
    subsets; batches 4, 3 (odd) and 1; every schedule; on both ranks."""
    for rank, results in ranks.items():
        rows = _per_schedule(results["equality"])
        assert len(rows) == 6 * 3 * 3
        for key, row in rows.items():
            assert row["shape_ok"], (rank, key)
            for what in ("features", "features_greedy_path", "last_hidden"):
                assert row[what][0] <= ATOL, (rank, key, what, row[what])
            assert row["greedy_equal"], (rank, key)
        assert results["equality"]["tied_head_is_embedding"]
        assert "sharded over a tensor-parallel group" in results["equality"]["model_forward_refused"]


def test_overlap_on_and_off_give_identical_features(ranks):
    for results in ranks.values():
        eq = results["equality"]
        bitwise = {k: v for k, v in eq.items() if k.endswith("overlap_vs_split_bitwise")}
        assert bitwise and all(bitwise.values()), bitwise  # the same ops in the same order
        unsplit = {k: v for k, v in eq.items() if k.endswith("overlap_vs_unsplit")}
        assert unsplit and max(unsplit.values()) <= 1e-6, unsplit  # observed: 0.0 on CPU fp32


def test_every_all_reduce_but_the_last_has_the_other_halfs_compute_before_its_wait(ranks):
    trace = ranks[0]["equality"]["trace"]
    layers = 4  # llama_untied, layer ids 0..3
    issues = {s: [e for e in trace[s] if e[0] == "issue"] for s in trace}
    assert len(issues["unsplit"]) == 2 * layers and len(issues["split"]) == 2 * 2 * layers
    assert not any(e[2] for e in issues["unsplit"] + issues["split"])  # blocking
    events = trace["overlap"]
    assert len(issues["overlap"]) == 2 * 2 * layers and all(e[2] for e in issues["overlap"])
    unhidden = []
    for n in range(len(issues["overlap"])):
        start, stop = events.index(("issue", n, True)), events.index(("wait", n))
        if ("compute",) not in events[start:stop]:
            unhidden.append(n)
    assert unhidden == [len(issues["overlap"]) - 1]  # only the very last (nothing left to hide behind)


def test_group_batch_returns_each_ranks_own_rows(ranks):
    for rank, results in ranks.items():
        for rows, row in results["equality"]["group"].items():
            assert row["gathered_equal"], (rank, rows)
            assert row["shape"][0] == int(rows.removeprefix("rows"))
            assert row["features"][0] <= ATOL and row["features_greedy_path"][0] <= ATOL, (rank, rows, row)
            assert row["greedy_equal"], (rank, rows)


def test_per_rank_trunk_bytes_are_one_over_tp(ranks):
    for results in ranks.values():
        tp, rep = results["equality"]["memory"]["tp"], results["equality"]["memory"]["replicated"]
        assert tp["layers"] / rep["layers"] == pytest.approx(0.5, abs=0.01)  # norms replicate (observed 0.5017)
        assert tp["embedding"] == rep["embedding"] and tp["lm_head"] == rep["lm_head"] > 0  # whole: the draft needs them
        assert tp["total"] == tp["layers"] + tp["embedding"] + tp["lm_head"] + tp["other"]
        assert tp["total"] - tp["embedding"] - tp["lm_head"] < 0.51 * (rep["total"] - rep["embedding"] - rep["lm_head"])


def test_tp_forward_makes_no_host_sync(ranks):
    """forbid_syncs sees the gloo collectives as `c10d.*` ops (no sync tag, no host read); their
    internal copies run in gloo's C++ threads, which no dispatch mode sees (and on CPU tensors are
    host work anyway). The planted `.item()` shows the detector is live in this setting."""
    for results in ranks.values():
        syncs = results["equality"]["syncs"]
        assert syncs.pop("planted_item") == ["aten._local_scalar_dense"]
        assert all(found == [] for found in syncs.values()), syncs


def test_bad_settings_in_a_group_fail_with_the_fix(ranks):
    errors = ranks[0]["errors"]
    assert "num_key_value_heads=1" in errors["kv_heads"] and "set target.tp_size to one of [1]" in errors["kv_heads"]
    assert "not a multiple of target.tp_size=3" in errors["world"]
    assert "choose one of" in errors["schedule"]
    assert "out of range" in errors["layers"]


def test_from_pretrained_reads_only_this_ranks_shards(ranks):
    for rank, results in ranks.items():
        for name, row in results["loading"].items():
            assert row["features"][0] <= ATOL and row["greedy_equal"], (rank, name, row)
            assert row["q_proj_shape"] == (32, 64) and row["o_proj_shape"] == (64, 32)  # half the heads
        assert results["loading"]["qwen3_tied"]["tied"] and results["loading"]["qwen3_tied"]["memory"]["lm_head"] == 0
        assert results["loading"]["llama_bias_sharded"]["files"] > 1  # an index over several files


def test_dp_by_tp_mesh_on_four_processes(tmp_path):
    launch(4, "tests/tp_worker.py", "mesh", str(tmp_path / "mesh.pt"))
    ranks = torch.load(tmp_path / "mesh.pt", weights_only=False)
    assert [(r["dp_rank"], r["tp_rank"]) for r in ranks.values()] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, r in ranks.items():
        assert r["group_batch"] == (4, 24)  # the group's two micro-batches, not the world's four
        assert r["features"][0] <= ATOL and r["greedy_equal"], (rank, r)


def test_bench_tp_cpu_smoke():
    proc = launch(2, "scripts/bench_tp.py", "--shape", "tiny", "--steps", "2", "--warmup", "1", "--profile-steps", "1",
                  "--device", "cpu")
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("bench_tp tiny tp=2 batch=4 seq=64"), line
    assert "unsplit" in line and "split" in line and "overlap" in line and "syncs 0" in line, line
    assert "trunk/rank 0.50" in line, line


def _llama(**overrides: Any) -> LlamaConfig:
    return LlamaConfig(**{**dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=128, vocab_size=128), **overrides})


@pytest.mark.parametrize(("config", "tp", "message"), [
    (_llama(), 3, "target.tp_size=3 does not divide num_attention_heads=4, num_key_value_heads=2, intermediate_size=128"),
    (_llama(num_attention_heads=8, num_key_value_heads=2), 4, "num_key_value_heads=2: each rank must hold whole"),
    (_llama(intermediate_size=130), 4, "intermediate_size=130"),
    (_llama(), 0, "target.tp_size=0 does not divide"),
    (GPT2Config(), 2, "'gpt2' has no tensor-parallel plan (config.base_model_tp_plan): run it replicated"),
    (GemmaConfig(), 2, "'gemma' is not supported under tensor parallelism (supported: llama, qwen2, qwen3)"),
    (Qwen3Config(use_sliding_window=True, max_window_layers=1, num_hidden_layers=2), 1, "sliding-window layers"),
])
def test_plan_checks_name_the_fix(config, tp, message):
    with pytest.raises(ValueError) as info:
        check_tp_support(config, tp)
    assert message in str(info.value), str(info.value)


def test_plan_check_accepts_llama_and_qwen3_and_lists_valid_sizes():
    assert check_tp_support(_llama(), 2)["layers.*.self_attn.o_proj"] == "rowwise"
    plan = check_tp_support(Qwen3Config(num_attention_heads=8, num_key_value_heads=4, intermediate_size=64), 4)
    assert plan["layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"  # per-head: whole on each rank
    with pytest.raises(ValueError, match=r"one of \[1, 2, 4\]"):
        check_tp_support(Qwen3Config(num_attention_heads=8, num_key_value_heads=4, intermediate_size=64), 8)


def test_batch_halves_split_even_batches_only():
    assert batch_halves(4, "overlap") == batch_halves(4, "split") == [(0, 2), (2, 4)]
    assert batch_halves(4, "unsplit") == [(0, 4)]
    assert batch_halves(3, "overlap") == [(0, 3)] and batch_halves(1, "overlap") == [(0, 1)]
    assert batch_halves(2, "overlap") == [(0, 1), (1, 2)]
    assert schedule_for(True) == "overlap" and schedule_for(False) == "unsplit"
    with pytest.raises(ValueError, match="unknown tensor-parallel schedule"):
        batch_halves(4, "domino")
