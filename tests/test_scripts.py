"""CPU smoke runs of the GPU scripts on tiny configurations (no GPU assertions here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dflash.kinds.registry import KIND_NAMES

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_bench_step_tiny(tmp_path):
    stdout = run("scripts/bench_step.py", "--config", "tiny", "--steps", "2", "--warmup", "1", "--latency",
                 "--data-latency-ms", "2", "--profile", "--json", str(tmp_path / "b.json"))
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["ms_per_step"] > 0 and 0 < result["mask_density"] < 1
    assert {"ms_free_0", "ms_free_lat", "ms_sync_0", "ms_sync_lat"} <= result.keys()
    kernels = result["profile"]["kernels"]  # on a CPU: op self times
    assert kernels["ms_per_step_by_category"]["matmul"] > 0 and kernels["ms_per_step_by_category"]["optimizer"] > 0
    assert sum(kernels["ms_per_step_by_category"].values()) == pytest.approx(kernels["busy_ms_per_step"])
    assert kernels["top"][0]["ms_per_step"] >= kernels["top"][-1]["ms_per_step"] > 0
    memory = result["profile"]["memory_gib"]
    assert set(memory) == {"weights", "gradients", "optimizer_state", "activations_and_workspace", "step_peak",
                           "forward_peak"}  # the peaks are NaN on a CPU
    assert memory["weights"] > memory["gradients"] > 0  # the weights include the frozen target's
    assert memory["optimizer_state"] == pytest.approx(2 * memory["gradients"], rel=0.01)  # AdamW: two moments
    assert stdout.strip().splitlines()[-1].startswith("bench tiny")


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_bench_step_end_to_end_tiny(tmp_path, kind):
    """The end-to-end configuration's path (a real target forward, the draft through the factory, the sync
    count) on a tiny shape."""
    stdout = run("scripts/bench_step.py", "--config", "tiny", "--real-target", "--kind", kind, "--steps", "2",
                 "--warmup", "1", "--sync-check", "--json", str(tmp_path / "e.json"))
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["kind"] == kind and result["syncs"] == 0 and result["target_tflop_per_step"] > 0
    assert result["samples_per_s"] > 0 and "end to end" in stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("shift_label", [True, False])
def test_bench_step_random_features_builds_the_kind_asked_for(tmp_path, shift_label):
    """`--kind domino` without a real target (the specforge / smollm2 / tiny path) builds and times a Domino
    draft: it was once ignored there, and the run reported a DFlash draft's figures."""
    flags = [] if shift_label else ["--no-shift-label", "--compile-loss"]  # and the compiled CE chunk once
    stdout = run("scripts/bench_step.py", "--config", "tiny", "--kind", "domino", *flags, "--steps", "2",
                 "--warmup", "1", "--sync-check", "--json", str(tmp_path / "d.json"))
    result = json.loads((tmp_path / "d.json").read_text())
    assert result["kind"] == "domino" and result["draft"] == "DominoDraftModel" and result["syncs"] == 0
    assert result["compile_loss"] is not shift_label
    assert stdout.strip().splitlines()[-1].startswith("bench tiny domino")


@pytest.mark.parametrize("kind, draft, optimizer", [("dflash2", "DFlash2DraftModel", "adamw"),
                                                     ("dspark", "DSparkDraftModel", "muon")])
def test_bench_step_random_features_builds_the_newer_kinds(tmp_path, kind, draft, optimizer):
    """The stand-in target's path builds the kind's heads (DSpark also reads the stand-in's last hidden state);
    `--optimizer muon` steps with Muon, sync-free too."""
    stdout = run("scripts/bench_step.py", "--config", "tiny", "--kind", kind, "--steps", "2", "--warmup", "1", "--sync-check",
                 "--optimizer", optimizer, "--json", str(tmp_path / "k.json"))
    result = json.loads((tmp_path / "k.json").read_text())
    assert (result["kind"], result["draft"], result["syncs"], result["optimizer"]) == (kind, draft, 0, optimizer)
    assert stdout.strip().splitlines()[-1].startswith(f"bench tiny {kind}{' muon' if optimizer == 'muon' else ''} ")


@pytest.mark.parametrize("flags, message", [
    (["--config", "smollm2", "--real-target"], "--real-target does not apply to --config smollm2"),
    (["--config", "qwen3-8b", "--real-target"], "--real-target does not apply to --config qwen3-8b"),
    (["--no-shift-label"], "--no-shift-label applies to Domino drafts only"),
    (["--data-latency-ms", "3"], "--data-latency-ms applies to the latency measurement only"),
    (["--distributed", "fsdp2"], "--distributed applies under several processes only"),
    (["--compile", "--compile-loss"], "--compile-loss is part of --compile"),
])
def test_bench_step_refuses_a_flag_that_does_not_apply(flags, message):
    out = subprocess.run([sys.executable, "scripts/bench_step.py", "--config", "tiny", *flags], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_bench_step_two_processes(tmp_path, mode):
    """`accelerate launch --num_processes 2` (CPU, gloo): rank 0 writes the JSON and the one summary line,
    with per-rank and total tokens/s."""
    from test_distributed import LAUNCH

    out = subprocess.run([*LAUNCH, "scripts/bench_step.py", "--config", "tiny", "--steps", "2", "--warmup", "1",
                          "--distributed", mode, "--json", str(tmp_path / "b.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["world_size"] == 2 and result["distributed"] == mode
    assert len(result["tokens_per_s_per_rank"]) == len(result["ms_per_step_per_rank"]) == 2
    assert result["tokens_per_s_total"] == pytest.approx(sum(result["tokens_per_s_per_rank"]))
    summaries = [line for line in out.stdout.splitlines() if line.startswith("bench tiny")]
    assert len(summaries) == 1 and f"2 ranks ({mode})" in summaries[0]  # printed by rank 0 only


def test_gpu_kernel_time_skips_annotation_ranges():
    """A record_function range shows on the device with the time of the kernels inside it: counted,
    it doubles them (the `a312745` profile read 13.5 ms of optimizer for 7.9 ms of kernels)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_step

    def event(key, us, annotation=False, kind=DeviceType.CUDA):
        return SimpleNamespace(key=key, self_device_time_total=us, self_cpu_time_total=us, device_type=kind,
                               is_user_annotation=annotation)

    events = [event("Optimizer.step#AdamW.step", 5600.0, annotation=True),
              event("multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", 5500.0),
              event("nvjet_sm90_tst_256x128", 2000.0), event("aten::mm", 9000.0, kind=DeviceType.CPU)]
    rows = dict(bench_step.kernel_rows(events, DeviceType.CUDA, steps=1))
    assert rows == {"multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>": 5.5, "nvjet_sm90_tst_256x128": 2.0}
    cpu_rows = dict(bench_step.kernel_rows([event("Optimizer.step#AdamW.step", 300.0, annotation=True,
                                                  kind=DeviceType.CPU)], DeviceType.CPU, steps=1))
    assert cpu_rows == {"Optimizer.step#AdamW.step": 0.3}  # on a CPU a range's self time is its own work


def test_memory_breakdown_counts_gradients_only_when_alive_at_the_peak(monkeypatch):
    """Eager steps free the gradients after the update: when the step's peak comes in the forward pass,
    they hold none of it (the `a312745` breakdown counted all 1.95 GiB of them whatever the phase)."""
    from helpers import make_tiny_target, random_batch, tiny_config

    from dflash.trainer import DFlashTrainer

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_step

    trainer = DFlashTrainer(tiny_config(), target=make_tiny_target())
    trainer.train_step(random_batch())
    grads = sum(p.numel() * p.element_size() for p in trainer.draft.parameters()) / 2**30
    gib = 2**30
    monkeypatch.setattr(bench_step, "phase_peaks", lambda *a: (1.0 * gib, 1.0 * gib))  # peak in the forward
    in_forward = bench_step.memory_breakdown(trainer, {}, torch.device("cpu"))
    monkeypatch.setattr(bench_step, "phase_peaks", lambda *a: (0.5 * gib, 1.0 * gib))  # peak in the backward
    in_backward = bench_step.memory_breakdown(trainer, {}, torch.device("cpu"))
    assert in_forward["gradients"] == 0 and in_backward["gradients"] == pytest.approx(grads)
    for m in (in_forward, in_backward):
        parts = m["weights"] + m["optimizer_state"] + m["gradients"] + m["activations_and_workspace"]
        assert m["step_peak"] == 1.0 and parts == pytest.approx(1.0)


def test_flop_counting_reproduces_specforge_figure():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_step

    # SpecForge: 180.7 ms/step at 492 TFLOP/s counted as 3x forward FLOPs -> 88.9 TFLOP per step
    f = bench_step.flops(bench_step.SHAPES["specforge"], mask_density=1.0)
    assert abs(f["specforge"] / 1e12 - 0.1807 * 492) < 0.5
    assert f["needed"] < f["specforge"]


@pytest.mark.parametrize("kind,optimizer", [("dflash", "adamw"), ("domino", "adamw"), ("dflash", "muon")])
def test_check_sync_free_cpu(kind, optimizer):
    stdout = run("scripts/check_sync_free.py", "--steps", "3", "--kind", kind, "--optimizer", optimizer)
    last = stdout.strip().splitlines()[-1]
    label = kind if optimizer == "adamw" else f"{kind}, {optimizer}"
    assert last.startswith(f"check_sync_free ({label}): 0 syncs") and last.endswith("PASS")


def test_check_sync_free_two_processes():
    """Under `accelerate launch --num_processes 2` (CPU, gloo) every rank counts its syncs and rank 0 alone
    prints the total."""
    from test_distributed import LAUNCH

    out = subprocess.run([*LAUNCH, "scripts/check_sync_free.py", "--steps", "3", "--distributed", "ddp"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summaries = [line for line in out.stdout.splitlines() if line.startswith("check_sync_free")]
    assert len(summaries) == 1 and "0 syncs" in summaries[0] and "each of 2 ranks" in summaries[0]
    assert summaries[0].endswith("PASS")


def test_compare_recipes_tiny(tmp_path):
    """Two variants share one loaded target; each is warmed (a discarded short run that measures its step
    time), then trains for the first variant's time, evaluates (uniform and chain τ̂) and decodes. The second
    holds a quarter of the rows a step, so equal time goes by step time, not tokens/s (which would give it
    about a quarter of the steps)."""
    from helpers import check_speculative_report, save_tiny_target

    save_tiny_target(tmp_path / "target")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"It is {2 * i}. " * (1 + i % 3)}]}) + "\n" for i in range(24)))
    out = tmp_path / "compare"
    stdout = run("scripts/compare_recipes.py", "--variants", "labels-data,dom:draft.kind=domino+draft.num_anchors=6+batch_size=1",
                 "--steps", "8", "--out", str(out),
                 "--warm-steps", "4", "--equal-time", f"target={tmp_path / 'target'}", f"data.source={data}", "device=cpu",
                 "draft.mask_token_id=16",
                 "draft.block_size=4", "draft.num_anchors=8", "batch_size=4", "data.max_length=64",
                 "data.bucket_multiple=32", "data.eval_size=4", "data.num_workers=0", "data.regenerate_max_new_tokens=8",
                 f"data.cache_dir={tmp_path / 'cache'}", "spec_eval_prompts=2", "spec_eval_max_new_tokens=6")
    rows = json.loads((out / "compare.json").read_text())
    assert [r["variant"] for r in rows] == ["labels-data", "dom"]
    written_out = yaml.safe_load((out / "dom" / "config.yaml").read_text())  # written out as LABEL:key=value+...
    assert (written_out["draft"]["kind"], written_out["draft"]["num_anchors"], written_out["batch_size"]) == ("domino", 6, 1)
    warm = {r["variant"]: json.loads((out / f"{r['variant']}-warm" / "summary.json").read_text()) for r in rows}
    reference = warm["labels-data"]["train"]["step_ms"]
    for r in rows:  # each row reports its own run's figures, under the right names
        summary = json.loads((out / r["variant"] / "summary.json").read_text())
        held, spec = summary["held_out"], summary["speculative"]
        assert warm[r["variant"]]["steps"] == 4
        # equal time: the first variant's 8 steps, scaled by its warm-up step time against each variant's
        assert r["steps"] == summary["steps"] == max(1, round(8 * reference / warm[r["variant"]]["train"]["step_ms"]))
        assert (r["real_tau"], r["held_out_chain_tau"], r["held_out_tau"]) == (spec["tau"], held["chain_tau"], held["tau"])
        assert (r["step_ms"], r["real_fraction"]) == (summary["train"]["step_ms"], summary["padding"]["real_fraction"])
        assert r["train_s"] == summary["phases"]["training"] > 0
        check_speculative_report(spec)  # real τ: the decode's tokens per target forward
        assert spec["teacher_forced_chain_tau"] == pytest.approx(spec["tau"], rel=1e-9)  # the chain on its outputs
        assert 1.0 <= held["chain_tau"] <= 4 and held["chain_forwards"] > 0
        assert 1.0 <= held["tau"] <= 1.0 + sum(held["per_position_accuracy"]) + 1e-9  # accepted <= correct slots
    assert stdout.strip().splitlines()[-1].startswith("compare_recipes (the time of 8 steps of labels-data, cpu)")


def test_bench_width_tiny():
    """The host-bounded width benchmark runs on CPU and both variants reach the same loss."""
    out = subprocess.run([sys.executable, "scripts/bench_width.py", "--tiny", "--steps", "4"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("bench_width:") and "steps/s bounded" in line, out.stdout
    bounded, fixed = (float(x) for x in line.split("loss ")[1].split(" vs "))
    assert bounded == pytest.approx(fixed, rel=1e-5)


def test_bench_packing_runs_both_layouts_through_dflash_train(tmp_path):
    """`scripts/bench_packing.py` (docs/benchmarks.md's packing figures), CPU smoke: two `dflash train` runs, their
    windows and padding read back; packed rows carry more real tokens per slot than bucketed ones."""
    from helpers import chat_file, save_tiny_target
    from test_cli import _args

    target = tmp_path / "target"
    save_tiny_target(target)
    data = chat_file(tmp_path / "chats.jsonl")
    args = _args(target, data, tmp_path / "unused", "max_steps=6", "log_interval=2", "batch_size=2", "data.max_length=192")[1:]
    stdout = run("scripts/bench_packing.py", "--out", str(tmp_path / "bench"), *args)
    runs = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert [r["run"] for r in runs] == ["bucketed", "packed"] and runs[1]["overrides"] == ["data.packing=true"]
    assert runs[1]["real_fraction"] > runs[0]["real_fraction"] and all(r["ms_per_step"] > 0 for r in runs)
    assert stdout.splitlines()[-1].startswith("bench_packing: bucketed ")


def test_compare_long_tiny(tmp_path):
    """`scripts/compare_long.py` (issue 61's quality comparison), CPU smoke: the short-row run and the long-conversation
    run (chitchat-long regenerated whole, packed) train, and each draft is decoded on both kinds of held-out prompts,
    the long ones being histories before a last reply."""
    from helpers import save_tiny_target

    save_tiny_target(tmp_path / "target")
    out = tmp_path / "compare"
    stdout = run("scripts/compare_long.py", "--steps", "3", "--seeds", "0", "--out", str(out), "--pack-length", "256",
                 "--max-history", "192", "--reply-tokens", "8", "--long-batch", "1", "--long-anchors", "16",
                 "--long-eval-size", "2", "--prompts", "2", f"target={tmp_path / 'target'}", "device=cpu",
                 "draft.mask_token_id=16", "draft.block_size=4", "draft.num_anchors=8", "batch_size=2", "data.limit=12",
                 "data.eval_size=3", "data.max_length=64", "data.num_workers=0", "data.regenerate_max_new_tokens=8",
                 f"data.cache_dir={tmp_path / 'cache'}", "spec_eval_max_new_tokens=6")
    rows = json.loads((out / "compare_long.json").read_text())
    assert [(r["draft"], r["seed"], r["steps"]) for r in rows] == [("short", 0, 3), ("long", 0, 3)]
    assert all(r["short_prompts"] == 2 and r["long_prompts"] >= 1 and r["short_prompts_lossless"] and
               r["long_prompts_lossless"] and 1 <= r["long_prompts_tau"] <= 4 for r in rows), rows
    config = yaml.safe_load((out / "long-s0" / "config.yaml").read_text())
    data = config["data"]
    assert (data["source"], data["regenerate_turns"], data["packing"]) == ("chitchat-long", "all", True)
    assert stdout.strip().splitlines()[-1].startswith("compare_long: short seed 0 (3 steps): real tau")


def test_bench_long_tiny(tmp_path):
    """`scripts/bench_long.py` (issue 61's long-context table), CPU smoke: one process per shape and side, the end to
    end run with a real target, the longest-fit search, a table and one summary line; `check_sync_free.py` at a
    longer sequence than its default."""
    out = tmp_path / "long"
    stdout = run("scripts/bench_long.py", "--config", "tiny", "--shapes", "64x8x2", "--end-to-end", "64x8x2",
                 "--fits", "8:32,64", "--steps", "1", "--warmup", "1", "--out", str(out))
    report = json.loads((out / "bench_long.json").read_text())
    sides = [(r["side"], r["seq"], r["status"]) for r in report["runs"]]
    assert sides == [("dflash", 64, "ok"), ("end-to-end", 64, "ok"), ("dflash", 32, "ok"), ("dflash", 64, "ok")], sides
    assert report["fits"] == {"dflash": 64} and all(r["ms_per_step"] > 0 for r in report["runs"])
    assert len((out / "results.jsonl").read_text().splitlines()) == 4  # written as each run ended
    assert stdout.strip().splitlines()[-1].startswith("bench_long: 4/4 runs ok")
    line = run("scripts/check_sync_free.py", "--steps", "2", "--seq", "96", "--anchors", "12").strip().splitlines()[-1]
    assert line.startswith("check_sync_free (dflash, S=96, N=12): 0 syncs") and line.endswith("PASS")
