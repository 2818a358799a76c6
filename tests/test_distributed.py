"""Two processes (accelerate launch, CPU, gloo) equal one process on the concatenated batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_target, save_tiny_target, tiny_config

ROOT = Path(__file__).resolve().parents[1]
# accelerate's multi-process launcher (torchrun underneath); on a CPU-only machine the ranks use gloo.
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]



def launch(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([*LAUNCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_two_ranks_equal_one_process_on_the_concatenated_batch(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tests"))
    from dist_worker import fixed_plan

    from dflash.trainer import DFlashTrainer

    launch("tests/dist_worker.py", str(tmp_path / "ranks.pt"))
    two = torch.load(tmp_path / "ranks.pt")

    batch, anchors, keep = fixed_plan()
    monkeypatch.setattr("dflash.objective.sample_anchors", lambda loss_mask, n, generator=None: (anchors, keep))
    one = DFlashTrainer(tiny_config(), target=make_tiny_target())
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


def test_two_process_cli_run_resumes(tmp_path):
    """`accelerate launch -m dflash train` on 2 CPU processes, then a resume to more steps."""
    from test_cli import _args  # the tiny-target CLI arguments

    from dflash.reporting import read_history

    target = tmp_path / "target"
    save_tiny_target(target)
    data = tmp_path / "chats.jsonl"
    with data.open("w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Say {i} twice"},
                                             {"role": "assistant", "content": f"{i} {i}. " * 3}]}) + "\n")
    out = tmp_path / "run"
    args = _args(target, data, out, "max_steps=4", "save_interval=2", "spec_eval_prompts=0", "batch_size=2")
    launch("-m", "dflash", *args)
    assert (out / "checkpoints" / "latest").read_text() == "step-00000004"
    launch("-m", "dflash", *_args(target, data, out, "max_steps=6", "resume_from=latest", "spec_eval_prompts=0",
                                  "batch_size=2"))
    assert [r["step"] for r in read_history(out) if "loss" in r] == [2, 4, 6]

