"""FP8 training for the draft's linear layers (`fp8: true`): torchao's float8 training with rowwise
scaling, applied to what the draft multiplies most: the attention projections (q/k/v/o), the MLP
(gate/up/down) and the context projection `fc`. The frozen embedding and LM head are the target's and
stay in the compute dtype, and so does a Domino draft's correction head (its vocabulary-wide product runs
in the fused CE, not through an `nn.Linear`). Weights keep their dtype (fp32 master weights by default);
only the GEMMs run in float8 with per-row scales computed on the device, so the step stays sync-free.
"""

from __future__ import annotations

import dataclasses
import re

from torch import nn

# The linear layers converted, by name in the draft (`DFlashDraftModel`, `DominoDraftModel`).
FP8_LINEARS = re.compile(r"^(fc|layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj))$")
FP8_INSTALL = "pip install 'dflash[fp8]'"


def convert_to_fp8(draft: nn.Module, *, emulate: bool = False) -> list[str]:
    """Swap the draft's `FP8_LINEARS` for torchao `Float8Linear`s (rowwise scaling), in place; returns the
    converted names. `emulate` runs the float8 casts without FP8 tensor cores (tests on a CPU)."""
    try:  # optional and GPU-bound: imported only when fp8 is asked for
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError(f"fp8: true needs torchao: `{FP8_INSTALL}`") from e
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate)
    converted: list[str] = []

    def wanted(module: nn.Module, name: str) -> bool:
        # float8 GEMMs need both dimensions divisible by 16
        ok = isinstance(module, nn.Linear) and bool(FP8_LINEARS.match(name)) and not (
            module.in_features % 16 or module.out_features % 16)
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(draft, config=config, module_filter_fn=wanted)
    return converted
