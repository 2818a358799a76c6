"""`fp8: true`: which of the draft's linear layers run float8 GEMMs, that an (emulated) float8 step trains
like the full-precision one, and that a launch that cannot run it is refused at start."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import make_tiny_target, random_batch, tiny_config

from dflash.config import TrainConfig
from dflash.factory import build_objective, check_run_settings
from dflash.precision import convert_to_fp8
from dflash.preflight import MissingDependencyError, check_dependencies

LAYER = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj"]


def objective(kind: str):
    torch.manual_seed(0)
    return build_objective(tiny_config(draft__kind=kind), make_tiny_target(), None, device=torch.device("cpu"),
                           dtype=torch.float32)


@pytest.mark.parametrize("kind", ["dflash", "domino"])
def test_the_attention_mlp_and_context_projections_are_converted_and_nothing_else(kind):
    obj = objective(kind)
    names = set(obj.draft.state_dict())
    converted = convert_to_fp8(obj.draft, emulate=True)
    assert sorted(converted) == sorted(["fc"] + [f"layers.{i}.{n}" for i in range(2) for n in LAYER])
    assert set(obj.draft.state_dict()) == names  # checkpoints, resume and export keep their tensor names
    head = [m for n, m in obj.draft.named_modules() if n.startswith("embed_proj") and isinstance(m, torch.nn.Linear)]
    assert (len(head) == 2) is (kind == "domino") and all(type(m) is torch.nn.Linear for m in head)


def test_an_emulated_float8_step_trains_like_full_precision():
    batch = random_batch(seed=3)
    losses, grads = {}, {}
    for fp8 in (False, True):
        obj = objective("dflash")
        if fp8:
            convert_to_fp8(obj.draft, emulate=True)
        anchors, keep, targets = obj.plan(batch["input_ids"], batch["loss_mask"], torch.Generator().manual_seed(0))
        out = obj(batch["input_ids"], anchors, keep, targets)
        (out.loss_sum / targets.weights.sum()).backward()
        losses[fp8] = float(out.loss_sum.detach() / targets.weights.sum())
        grads[fp8] = obj.draft.layers[0].mlp.down_proj.weight.grad.clone()
    assert losses[True] == pytest.approx(losses[False], rel=0.02) and losses[True] != losses[False]
    cosine = torch.nn.functional.cosine_similarity(grads[True].flatten(), grads[False].flatten(), dim=0)
    assert cosine > 0.95  # float8 rounding, not another gradient


def test_a_launch_without_fp8_tensor_cores_or_torchao_is_refused_at_start(monkeypatch):
    cfg = TrainConfig(fp8=True)
    with pytest.raises(ValueError, match="fp8: true needs a GPU with FP8 tensor cores"):
        check_run_settings(cfg, 1, torch.device("cpu"), torch.float32)
    monkeypatch.setattr("dflash.preflight.importable", lambda module: module != "torchao")
    with pytest.raises(MissingDependencyError, match=r"fp8: true needs torchao \(`pip install 'dflash\[fp8\]'`\)"):
        check_dependencies(cfg, target_given=True, dataset_given=True)


def test_a_command_prints_no_torchao_kernel_notices(tiny_target_dir):
    """transformers imports torchao on a model load whenever it is installed; its "Failed to load ....so" lines
    (kernel libraries of another build) and torch's notice on its enums were printed by every command that
    loads a model, fp8 or not."""
    pytest.importorskip("torchao")
    proc = subprocess.run([sys.executable, "-m", "dflash", "train", f"target={tiny_target_dir}", "device=cpu",
                           "draft.mask_token_id=16", "--dry-run"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout + proc.stderr
    assert "Failed to load" not in printed and "is an Enum subclass" not in printed, proc.stderr[-3000:]
