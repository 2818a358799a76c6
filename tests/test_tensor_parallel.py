"""The tensor-parallel frozen target (CPU, gloo, `torch.distributed.run`): equality with the
single-process FrozenTarget, the three schedules (identical, and the overlap schedule's order of
issues and waits), the group-batch path, per-rank bytes, sync-freedom, errors, sharded loading, a
(dp x tp) = 2 x 2 mesh, and the bench_tp.py smoke run; training with `tensor_parallel.size` (a step
equal to one process on the concatenated batch, sync-free, a whole `fit()`), the lockstep speculative
decode, the settings refused at start and the dry run.

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
from dist_worker import fixed_plan
from helpers import check_speculative_report, make_tiny_target, tiny_config
from tp_training_checks import LABELS, SAMPLED
from transformers import GemmaConfig, GPT2Config, LlamaConfig, Qwen3Config

from dflash.cli.dry_run import plan
from dflash.config import TrainConfig
from dflash.factory import build_objective
from dflash.run.state import accepted_changes, config_differences
from dflash.target_model.tensor_parallel import check_tp_support
from dflash.target_model.tp_overlap import batch_halves, schedule_for
from dflash.trainer import DFlashTrainer

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
    """Tiny Llama (the helpers target; tied + biased), Qwen3 (untied, tied), Qwen2 (tied); layer
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
            assert row["shape"][0] == (2 if rows == "padded" else int(rows.removeprefix("rows")))
            assert rows != "padded" or row["shape"][1] == row["length"] == 24 - 8 * rank  # cut back to its own length
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
    assert "num_key_value_heads=1" in errors["kv_heads"] and "set tensor_parallel.size to one of [1]" in errors["kv_heads"]
    assert "not a multiple of tensor_parallel.size=3" in errors["world"]
    assert "choose one of" in errors["schedule"]
    assert "out of range" in errors["layers"]


def test_from_pretrained_reads_only_this_ranks_shards(ranks):
    for rank, results in ranks.items():
        for name, row in results["loading"].items():
            assert row["features"][0] <= ATOL and row["greedy_equal"], (rank, name, row)
            assert row["q_proj_shape"] == (32, 64) and row["o_proj_shape"] == (64, 32)  # half the heads
        assert results["loading"]["qwen3_tied"]["tied"] and results["loading"]["qwen3_tied"]["memory"]["lm_head"] == 0
        assert results["loading"]["llama_bias_sharded"]["files"] > 1  # an index over several files


@pytest.fixture(scope="module")
def mesh_ranks(tmp_path_factory) -> dict[int, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("mesh")
    launch(4, "tests/tp_worker.py", "mesh", str(tmp / "mesh.pt"))
    return torch.load(tmp / "mesh.pt", weights_only=False)


def test_dp_by_tp_mesh_on_four_processes(mesh_ranks):
    ranks = mesh_ranks
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
    (_llama(), 3, "tensor_parallel.size=3 does not divide num_attention_heads=4, num_key_value_heads=2, intermediate_size=128"),
    (_llama(num_attention_heads=8, num_key_value_heads=2), 4, "num_key_value_heads=2: each rank must hold whole"),
    (_llama(intermediate_size=130), 4, "intermediate_size=130"),
    (_llama(), 0, "tensor_parallel.size=0 does not divide"),
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


# ---- training and evaluation with tensor_parallel.size > 1 ----


def test_train_step_under_tp_equals_one_process_on_the_concatenated_batch(ranks, monkeypatch):
    """tp = 2 on 2 ranks (each its 2 rows, the target run once on the group's 4) = one process on the
    4 rows: gradients (DDP-averaged over both ranks) and metrics, for data labels and target labels, for a
    DFlash 2 draft (its top-K and candidate logits through the TP target's head) and a DSpark draft (the TP
    target's final hidden state for its L1 term)."""
    batch, anchors, keep = fixed_plan()
    monkeypatch.setattr("dflash.objective.sample_anchors", lambda loss_mask, n, generator=None, **_: (anchors, keep))
    for labels, overrides in LABELS.items():
        one = DFlashTrainer(tiny_config(**overrides), target=make_tiny_target())
        one.draft.load_state_dict(ranks[0]["training"][labels]["init"])  # DDP broadcast rank 0's
        monkeypatch.setattr(one.optimizer, "step", lambda: None)
        monkeypatch.setattr(one.optimizer, "zero_grad", lambda set_to_none=True: None)
        one.train_step(batch)
        single = one.metrics.flush()
        for rank, results in ranks.items():
            two = results["training"][labels]
            for name, p in one.draft.named_parameters():  # observed (fp32): max abs 3.6e-7, 7e-7 of the tensor max
                # DFlash 2's perturbed weights give gradients up to ~6: fp32 noise up to 1.6e-6 of the tensor max
                atol = 1e-5 * float(p.grad.abs().max()) if labels == "dflash2" else 1e-7
                torch.testing.assert_close(two["grads"][name], p.grad, rtol=1e-4, atol=atol, msg=f"{labels} {rank} {name}")
            for key in ("loss", "accuracy", "tau", "supervised_tokens", "anchors_kept"):
                assert two["metrics"][key] == pytest.approx(single[key], rel=1e-5), (labels, rank, key)


def test_tp_with_sampled_anchors_equals_one_process_on_the_concatenated_batch(ranks):
    """Fewer anchors than positions, drawn by the trainer: every rank seeds the draw alike and keeps its rows
    of one draw over both ranks' rows (`anchors.GlobalRows`), so tp = 2 on 2 ranks trains the anchors one
    process draws for the 4 rows: the same gradients and metrics."""
    batch, _, _ = fixed_plan()
    one = DFlashTrainer(tiny_config(**SAMPLED), target=make_tiny_target())
    one.draft.load_state_dict(ranks[0]["training"]["sampled"]["init"])
    one.optimizer.step = lambda: None
    one.optimizer.zero_grad = lambda set_to_none=True: None  # keep the gradients to compare
    one.train_step(batch)
    single = one.metrics.flush()
    assert single["anchors_kept"] < single["supervised_tokens"]  # a real draw: not every position an anchor
    for rank, results in ranks.items():
        two = results["training"]["sampled"]
        for name, p in one.draft.named_parameters():
            torch.testing.assert_close(two["grads"][name], p.grad, rtol=1e-4, atol=1e-7, msg=f"{rank} {name}")
        for key in ("loss", "accuracy", "tau", "supervised_tokens", "anchors_kept"):
            assert two["metrics"][key] == pytest.approx(single[key], rel=1e-5), (rank, key)


def test_tp_training_holds_a_shard_and_makes_no_host_sync(ranks):
    for results in ranks.values():
        training = results["training"]
        assert training["target_type"] == "GroupBatchTarget"
        tp, rep = training["memory"]["tp"], training["memory"]["replicated"]
        assert tp["layers"] / rep["layers"] == pytest.approx(0.5, abs=0.01)
        assert tp["embedding"] == rep["embedding"] and tp["lm_head"] == rep["lm_head"]
        assert training["syncs"] == []  # ranks of 32 and 16 tokens, one non-log step under forbid_syncs
        assert training["after_sync_check"] == training["after_sync_check"]  # finite loss (not NaN)
        assert "num_attention_heads=3" in training["heads_error"] and "tensor_parallel.size" in training["heads_error"]


def test_lockstep_decode_equals_the_single_process_decode(ranks):
    leader, follower = ranks[0]["decode"], ranks[1]["decode"]
    assert (leader["role"], follower["role"]) == ("leader", "follower")
    assert leader["texts_equal"]  # the same outputs token for token (lossless-checked on both)
    assert leader["tau"][0] == leader["tau"][1] > 1.0  # the draft's tokens were accepted
    assert leader["per_prompt_target_forwards"][0] == leader["per_prompt_target_forwards"][1]
    assert leader["no_cache_logits_diff"] <= ATOL
    assert leader["raised"] == "planted" and follower["released"] and leader["released"]


def test_fit_with_a_sharded_target_evaluates_and_exports(ranks):
    """`fit()` with tensor_parallel.size=2 from a saved folder: each rank loads half the heads, trains on
    its own rows (of different padded lengths), evaluates held-out rows, and rank 0 reports the lockstep
    speculative evaluation (lossless) and exports."""
    for rank, results in ranks.items():
        fit = results["fit"]
        assert fit["steps"] == 4 and fit["q_proj_shape"] == (32, 64), (rank, fit)
        assert fit["train_loss"] == fit["train_loss"] and fit["held_out_loss"] == fit["held_out_loss"]
    spec = ranks[0]["fit"]["speculative"]
    assert spec["lossless"] and spec["num_prompts"] == 3 and spec["block_size"] == 4
    assert spec["new_tokens"] <= 3 * 8  # spec_eval_max_new_tokens=8
    check_speculative_report(spec)  # the lockstep decode's τ is its own tokens per target forward
    assert ranks[0]["fit"]["eval_json"] == spec and ranks[0]["fit"]["export"]  # the report beside the export
    assert ranks[1]["fit"]["speculative"] is None  # it followed rank 0's decode; rank 0 reports
    # `dflash eval` under the launch: every rank returns rank 0's report, equal to the one-process evaluation's
    assert ranks[0]["fit"]["eval_tp"] == ranks[1]["fit"]["eval_tp"] == ranks[0]["fit"]["eval_one"]
    assert ranks[0]["fit"]["eval_tp"]["lossless"]


def test_dp_by_tp_training_on_four_processes(mesh_ranks):
    for rank, r in mesh_ranks.items():
        training = r["training"]
        losses = training["ddp_losses"] + training["fsdp2_losses"]
        assert all(loss == loss and loss > 0 for loss in losses), (rank, training)
        assert training["ddp_losses"] == pytest.approx(training["fsdp2_losses"], rel=1e-5)  # observed: 1.4e-8
        assert training["fsdp"]
        assert training["tp_group_ranks"] == ([0, 1] if rank < 2 else [2, 3])
        tp, rep = training["memory"]["tp"], training["memory"]["replicated"]
        assert tp["layers"] / rep["layers"] == pytest.approx(0.5, abs=0.01)


def test_bad_tensor_parallel_settings_fail_at_start():
    with pytest.raises(ValueError, match=r"tensor_parallel.size=2 needs a number of processes that is a multiple of it, "
                                         r"and this launch has 1: launch a multiple of 2 processes"):
        DFlashTrainer(tiny_config(tensor_parallel__size=2), target=make_tiny_target())
    with pytest.raises(ValueError, match="cuda_graph: true is not supported with tensor_parallel.size > 1"):
        TrainConfig.from_sources(None, ["tensor_parallel.size=2", "cuda_graph=true"], presets=False)
    with pytest.raises(ValueError, match="tensor_parallel.size must be >= 1"):
        TrainConfig.from_sources(None, ["tensor_parallel.size=0"], presets=False)
    with pytest.raises(ValueError, match="the transformers.Trainer path does not support tensor parallelism"):
        build_objective(tiny_config(tensor_parallel__size=2), make_tiny_target(), None, device=torch.device("cpu"),
                        dtype=torch.float32)


def test_dry_run_shows_the_mesh_and_the_per_rank_target_memory(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    p = plan(TrainConfig.from_sources(None, ["tensor_parallel.size=3", "device=cpu"]))  # SmolLM2: 9 heads, 3 KV heads
    assert p["mesh"].startswith("dp 2 x tp 3 (6 processes")
    assert "decoder layers 135.1 MiB of 405.1 MiB" in p["target_memory_per_rank"], p["target_memory_per_rank"]
    monkeypatch.delenv("WORLD_SIZE")
    assert plan(TrainConfig.from_sources(None, ["device=cpu"]))["mesh"] == "dp 1 x tp 1"
    with pytest.raises(ValueError, match=r"needs a number of processes that is a multiple of it, and this launch has 1"):
        plan(TrainConfig.from_sources(None, ["tensor_parallel.size=2", "device=cpu"]))  # the run's own refusal
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"set tensor_parallel.size to one of \[1, 3\]"):
        plan(TrainConfig.from_sources(None, ["tensor_parallel.size=2", "device=cpu"]))


def test_resume_refuses_another_tensor_parallel_size_and_accepts_overlap():
    saved = TrainConfig().to_dict()
    saved["tensor_parallel"] = {"size": 2, "overlap": True}
    current = TrainConfig().to_dict()
    current["tensor_parallel"] = {"size": 4, "overlap": False}
    assert config_differences(saved, current) == ["tensor_parallel.size: 2 -> 4"]
    assert "tensor_parallel.overlap: True -> False" in accepted_changes(saved, current)
