"""Two processes (accelerate launch, CPU, gloo) equal one process on the concatenated batch, under DDP
and under FSDP2 (`distributed: fsdp2`); 2-process CLI runs save, resume and export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import make_tiny_target, save_tiny_target, tiny_config

ROOT = Path(__file__).resolve().parents[1]
# accelerate's multi-process launcher (torchrun underneath); on a CPU-only machine the ranks use gloo.
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def launch(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([*LAUNCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.parametrize("position_weights", ["decay", "dpace"])
def test_two_ranks_equal_one_process_on_the_concatenated_batch(tmp_path, monkeypatch, position_weights):
    """The ranks hold unequal anchor counts (row 0 is mostly unsupervised): the global denominator, known
    before the first backward (D-PACE: the supervised-slot count), makes 2 ranks compute one process's
    gradient of the concatenated batch."""
    sys.path.insert(0, str(ROOT / "tests"))
    from dist_worker import fixed_plan

    from dflash.trainer import DFlashTrainer

    launch("tests/dist_worker.py", str(tmp_path / "ranks.pt"), position_weights)
    two = torch.load(tmp_path / "ranks.pt")

    batch, anchors, keep = fixed_plan()
    monkeypatch.setattr("dflash.objective.sample_anchors", lambda loss_mask, n, generator=None, **_: (anchors, keep))
    one = DFlashTrainer(tiny_config(draft__position_weights=position_weights), target=make_tiny_target())
    one.draft.load_state_dict(two["init"])  # DDP broadcast rank 0's initial weights
    monkeypatch.setattr(one.optimizer, "step", lambda: None)
    monkeypatch.setattr(one.optimizer, "zero_grad", lambda set_to_none=True: None)
    one.train_step(batch)
    for name, p in one.draft.named_parameters():
        torch.testing.assert_close(two["grads"][name], p.grad, rtol=1e-4, atol=1e-7, msg=name)
    single = one.metrics.flush()
    for key in ("loss", "accuracy", "tau", "supervised_tokens", "anchors_kept"):
        assert two["metrics"][key] == pytest.approx(single[key], rel=1e-5), key
    rank0, rank1 = two["anchors"]
    assert not torch.equal(rank0, rank1)  # seeded from (seed, rank, step): ranks draw differently


def test_muon_under_ddp_steps_like_one_process_on_the_concatenated_batch(tmp_path, monkeypatch):
    """Muon orthogonalises the all-reduced gradient: both ranks apply the same update, that of one process
    on the whole batch, to the same matrices (the DDP wrapper must not change which parameters Muon takes)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from dist_worker import fixed_plan

    from dflash.trainer import DFlashTrainer

    launch("tests/dist_worker.py", str(tmp_path / "ranks.pt"), "muon")
    two = torch.load(tmp_path / "ranks.pt")
    rank0, rank1 = two["after"]

    batch, anchors, keep = fixed_plan()
    monkeypatch.setattr("dflash.objective.sample_anchors", lambda loss_mask, n, generator=None, **_: (anchors, keep))
    one = DFlashTrainer(tiny_config(optim__optimizer="muon"), target=make_tiny_target())
    one.draft.load_state_dict(two["init"])
    names = {p: n for n, p in one.draft.named_parameters()}
    assert two["muon"] == sorted(names[p] for group in one.optimizer.parts[0].param_groups for p in group["params"])
    one.train_step(batch)
    for name, p in one.draft.named_parameters():
        assert torch.equal(rank0[name], rank1[name]), name  # one update, applied identically on both ranks
        assert not torch.equal(rank0[name], two["init"][name]), name  # the step did update it
        # Newton-Schulz runs in bf16: the all-reduced and the single-process gradient differ in the last
        # fp32 bits, which its rounding amplifies (up to 1.5% of a matrix's update here, most are equal), so
        # the updates are compared as wholes. A rank's own gradient would give another update (~100% off).
        update, expected = rank0[name] - two["init"][name], p.detach() - two["init"][name]
        assert (update - expected).norm() <= 5e-2 * expected.norm(), name


def test_two_process_cli_run_resumes(tmp_path):
    """`accelerate launch -m dflash train` on 2 CPU processes, then a resume to more steps."""
    from test_cli import _args  # the tiny-target CLI arguments

    from dflash.report.sinks import read_history

    target = tmp_path / "target"
    save_tiny_target(target)
    data = chat_data(tmp_path / "chats.jsonl")
    out = tmp_path / "run"
    args = _args(target, data, out, "max_steps=4", "save_interval=2", "spec_eval_prompts=0", "batch_size=2")
    proc = launch("-m", "dflash", *args)
    assert (out / "checkpoints" / "latest").read_text() == "step-00000004"
    # Rank 0 says what runs (the banner), prepares the data and prints the final table; rank 1 stays quiet.
    banners = [line for line in proc.stderr.splitlines() if "launch: 2 processes" in line]
    assert banners and "launch: 2 processes: data parallel 2 x tensor parallel 1 | distributed ddp over " in banners[0]
    assert "gloo" in banners[0]  # "gloo" or "cpu:gloo": the process group's backend
    assert len(banners) == 1 and proc.stderr.count("corpus: {") == 1, proc.stderr[-3000:]
    assert [line.split()[:2] for line in proc.stdout.splitlines() if line.startswith("steps ")] == [["steps", "4"]]
    launch("-m", "dflash", *_args(target, data, out, "max_steps=6", "resume_from=latest", "spec_eval_prompts=0",
                                  "batch_size=2"))
    assert [r["step"] for r in read_history(out) if "loss" in r] == [2, 4, 6]


def chat_data(path: Path) -> Path:
    with path.open("w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Say {i} twice"},
                                             {"role": "assistant", "content": f"{i} {i}. " * 3}]}) + "\n")
    return path


def test_distributed_mode_is_validated():
    from dflash.config import TrainConfig

    assert TrainConfig().distributed == "ddp"
    assert TrainConfig.from_sources(None, ["distributed=fsdp2"], presets=False).distributed == "fsdp2"
    with pytest.raises(ValueError, match=r"distributed must be one of ddp, fsdp2 \(got 'zero3'\)"):
        TrainConfig.from_sources(None, ["distributed=zero3"], presets=False)


def test_fsdp2_two_ranks_equal_one_process_on_the_concatenated_batch(tmp_path, monkeypatch):
    """FSDP2 on 2 ranks (2 micro-batches per step, 2 updates applied) = one process on the 4 rows."""
    sys.path.insert(0, str(ROOT / "tests"))
    from dist_worker import FSDP2_CONFIG, FSDP2_DRAFT_SEED, FSDP2_STEPS, fixed_anchors, fixed_plan

    from dflash.trainer import DFlashTrainer

    launch("tests/dist_worker.py", str(tmp_path / "ranks.pt"), "fsdp2")
    two = torch.load(tmp_path / "ranks.pt")

    batch, anchors, keep = fixed_plan()
    monkeypatch.setattr("dflash.objective.sample_anchors", fixed_anchors(anchors, keep, range(4)))
    target = make_tiny_target()
    # Rank 0's draft seed (rank 1 built different weights); one process: nothing to shard.
    one = DFlashTrainer(tiny_config(**FSDP2_CONFIG, seed=FSDP2_DRAFT_SEED), target=target)
    assert not one.fsdp
    for name, p in one.draft.state_dict().items():
        assert torch.equal(two["init"][name], p), f"{name}: the sharded run did not start from rank 0's weights"
        assert two["shard_rows"][name] < p.shape[0], f"{name} is not sharded"  # rank 0 held part of every tensor

    grads = []
    real_step = one.optimizer.step

    def recording_step():
        grads.append({n: p.grad.clone() for n, p in one.draft.named_parameters()})
        real_step()

    monkeypatch.setattr(one.optimizer, "step", recording_step)
    for _ in range(FSDP2_STEPS):
        one.train_step(batch)
    assert len(two["grads"]) == len(grads) == FSDP2_STEPS
    for step, (sharded, single) in enumerate(zip(two["grads"], grads, strict=True)):
        for name, g in single.items():  # the clipped gradient each update applied
            torch.testing.assert_close(sharded[name], g, rtol=1e-4, atol=1e-7, msg=f"step {step}: {name}")
    for name, p in one.draft.state_dict().items():  # the weights after both AdamW updates
        torch.testing.assert_close(two["updated"][name], p, rtol=1e-4, atol=1e-7, msg=name)
    single = one.metrics.flush()
    for key in ("loss", "accuracy", "tau", "supervised_tokens", "anchors_kept", "grad_norm", "lr"):
        assert two["metrics"][key] == pytest.approx(single[key], rel=1e-5), key
    assert single["grad_norm"] > tiny_config(**FSDP2_CONFIG).optim.max_grad_norm  # clipping was active
    # Gradients crossed ranks once per step: one reduce-scatter per shard group (2 layers + the draft),
    # in the last micro-batch only.
    groups = len(one.draft.layers) + 1
    assert two["reduce_scatters"] == [step for step in range(FSDP2_STEPS) for _ in range(groups)]
    # A non-finite loss: the update was skipped on every shard, and counted once (not once per rank).
    assert two["nan_metrics"]["nonfinite_skips"] == 1 and two["nan_metrics"]["nonfinite_run"] == 1
    for name, t in two["updated"].items():
        assert torch.equal(two["after_nan"][name], t), name


def test_fsdp2_cli_run_saves_resumes_and_exports(tmp_path):
    """`distributed=fsdp2` through the CLI on 2 processes: a 6-step run (checkpoints at 2, 4, 6, export,
    speculative evaluation), and a second run resumed from its step-4 checkpoint that ends at the same
    weights and optimizer state; the export is one consolidated file that `load_exported` reads back."""
    from safetensors.torch import load_file
    from test_cli import _args

    from dflash.evaluation.export import load_exported
    from dflash.report.sinks import read_history
    from dflash.run.checkpoint import load_checkpoint

    target = tmp_path / "target"
    save_tiny_target(target)
    data = chat_data(tmp_path / "chats.jsonl")
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    common = ("distributed=fsdp2", "save_interval=2", "batch_size=2", "max_steps=6")
    launch("-m", "dflash", *_args(target, data, run, *common))
    assert (run / "checkpoints" / "latest").read_text() == "step-00000006"
    assert [r["step"] for r in read_history(run) if "loss" in r] == [2, 4, 6]
    assert (run / "export" / "eval.json").exists()  # speculative decoding ran on rank 0 with the full draft
    step4 = run / "checkpoints" / "step-00000004"
    launch("-m", "dflash", *_args(target, data, resumed, *common, f"resume_from={step4}", "spec_eval_prompts=0"))
    assert [r["step"] for r in read_history(resumed) if "loss" in r] == [6]

    straight_draft, _, straight = load_checkpoint(run / "checkpoints" / "step-00000006")
    resumed_draft, _, again = load_checkpoint(resumed / "checkpoints" / "step-00000006")
    assert straight_draft.keys() == resumed_draft.keys()
    for name, w in straight_draft.items():
        torch.testing.assert_close(resumed_draft[name], w, rtol=1e-5, atol=1e-7, msg=name)
    assert again["step"] == straight["step"] == 6 and again["world_size"] == 2
    full_shapes = sorted(tuple(w.shape) for w in straight_draft.values())  # consolidated, not rank 0's shard
    assert sorted(tuple(m["exp_avg"].shape) for m in straight["optimizer"]["state"].values()) == full_shapes
    for i, moments in straight["optimizer"]["state"].items():
        for key, value in moments.items():
            torch.testing.assert_close(again["optimizer"]["state"][i][key], value, rtol=1e-5, atol=1e-9,
                                       msg=f"{i}.{key}")

    exported = load_exported(run / "export").state_dict()  # shapes checked against config.json
    assert exported.keys() == straight_draft.keys()
    assert load_file(str(run / "export" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    for name, w in straight_draft.items():
        assert torch.equal(exported[name], w.to(torch.bfloat16).float()), name


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while being read
    return found


def test_ranks_stop_and_save_when_the_launcher_is_killed(tmp_path):
    """SIGKILL to torchrun left both ranks training as orphans. Now the kernel sends each rank SIGTERM when
    its launcher dies (`runtime.stop_with_launcher`): they stop together at the next flush and save."""
    from test_cli import _args

    from dflash.report.sinks import read_history

    target = tmp_path / "target"
    save_tiny_target(target)
    out = tmp_path / "run"
    args = _args(target, chat_data(tmp_path / "chats.jsonl"), out, "max_steps=100000", "spec_eval_prompts=0",
                 "batch_size=2", "progress_bar=false", "log_interval=1")
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                 "2", "-m", "dflash", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not read_history(out):  # both ranks are in the training loop
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        ranks = children(launcher.pid)
        assert len(ranks) == 2
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 120
        while any(Path(f"/proc/{pid}").exists() for pid in ranks):
            assert time.monotonic() < deadline, "the ranks trained on after their launcher died"
            time.sleep(0.5)
    finally:
        for pid in ranks:
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["signal"] == "SIGTERM"
    assert Path(summary["checkpoint"]).name == f"step-{summary['steps']:08d}"


def test_a_dry_run_under_torchrun_prints_its_plan_once(tmp_path):
    """Every rank plans (the same checks, the same exit code); rank 0 alone prints the plan."""
    from test_cli import _args

    target = tmp_path / "target"
    save_tiny_target(target)
    args = _args(target, chat_data(tmp_path / "chats.jsonl"), tmp_path / "run", "--dry-run")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "dflash", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("phase_regeneration") == 1, proc.stdout


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "dflash"]


@pytest.mark.parametrize(("packing", "mode"), [(False, "ddp"), (True, "ddp"), (True, "fsdp2"), (False, "tp2")],
                         ids=["rows-ddp", "packed-ddp", "packed-fsdp2", "rows-tp2"])
def test_torchrun_two_ranks_train_what_one_process_trains_on_the_concatenated_batch(tmp_path, packing, mode):
    """Through the real entry points: `torchrun ... -m dflash train` on 2 CPU processes with batch_size=2 against
    `dflash train` in one process with batch_size=4 (and grad_accum 2 on both: each micro-batch is one global
    micro-batch): the same per-step losses, anchors included (8 of them a row, so the draw matters). The sampler
    hands rank r the r-th block of each global micro-batch, the layout the anchor draw assumes (`GlobalRows`);
    dealt round-robin the losses differed by 1e-2 to 1e-1 here."""
    from test_cli import _args

    from dflash.report.sinks import read_history

    target = tmp_path / "target"
    save_tiny_target(target)
    data = chat_data(tmp_path / "chats.jsonl")
    common = ("max_steps=3", "log_interval=1", "spec_eval_prompts=0", "optim.grad_accum=2", "export_on_finish=false",
              "data.eval_size=0", f"data.packing={str(packing).lower()}")

    def losses(out: Path) -> list[float]:
        return [r["loss"] for r in read_history(out) if "loss" in r]

    two = tmp_path / "two"
    layout = "tensor_parallel.size=2" if mode == "tp2" else f"distributed={mode}"  # tp2: one group, the draft DDP
    proc = subprocess.run([*TORCHRUN, *_args(target, data, two, *common, "batch_size=2", layout)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one = tmp_path / "one"
    proc = subprocess.run([sys.executable, "-m", "dflash", *_args(target, data, one, *common, "batch_size=4")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(losses(one)) == 3
    assert losses(two) == pytest.approx(losses(one), rel=1e-5, abs=1e-6)
