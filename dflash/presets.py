"""The embedded default's budget: what `dflash train` with no arguments does, on a CPU and on a GPU.

Applied only when the target is "embedded" and only to keys the user did not set (YAML or
key=value), so `dflash train max_steps=50` still gets every other embedded default.

CPU (2 cores, about 15 minutes end to end): a short regeneration (cached for the next run), a
2-layer draft, small batches, training stopped by a 5-minute budget, then export and a real
speculative evaluation on 20 held-out prompts. GPU: the same recipe at full size (every chitchat
prompt regenerated, larger batches, bf16 + flex attention, a 10-minute training budget).
"""

from __future__ import annotations

from typing import Any

EMBEDDED_CPU: dict[str, Any] = {
    "draft.num_layers": 2,
    "draft.num_anchors": 32,
    "batch_size": 4,
    "data.max_length": 256,
    "data.limit": 300,
    "data.eval_size": 32,
    "data.regenerate_max_new_tokens": 64,
    "data.regenerate_max_prompt_tokens": 192,
    "data.num_workers": 1,
    "max_steps": 300,
    "time_budget_minutes": 5.0,
    "log_interval": 10,
    "eval_interval": 100,
    "optim.lr": 1e-3,
    "spec_eval_prompts": 20,
    "spec_eval_max_new_tokens": 48,
    "output_dir": "runs/embedded",
}

EMBEDDED_GPU: dict[str, Any] = {
    "draft.num_layers": 2,
    "draft.num_anchors": 64,
    "batch_size": 32,
    "data.max_length": 512,
    "data.eval_size": 64,
    "data.regenerate_max_new_tokens": 256,
    "data.regenerate_batch_size": 256,
    # Two user turns per training conversation (1.31M target tokens instead of 0.96M) and 2400 steps.
    # With one turn the held-out loss turned up after about 10 epochs (1500 steps), and 3000 steps
    # lowered real τ. With two turns, 2400 steps (about 13 epochs of a larger corpus) gave real τ 2.776
    # against 2.668 after 1500 steps on the 43 held-out prompts no training conversation opened with,
    # and the held-out chain τ̂ rose up to the end (H200, docs/benchmarks.md, session 5). Training takes
    # about 3.5 minutes of the 10-minute budget; the second turns cost a one-off 7 minutes of
    # regeneration.
    "data.regenerate_turns": 2,
    "max_steps": 2400,
    "time_budget_minutes": 10.0,
    "log_interval": 50,
    "eval_interval": 500,
    "optim.lr": 6e-4,
    # Every held-out prompt (data.eval_size): real tau on the prompts the held-out chain estimate scores.
    # With 32 the sets differed; on the H200 the estimate read 13-16% under real tau while the chain over
    # the decoded prompts' own outputs matched it to 0.2% (docs/benchmarks.md, session 3).
    "spec_eval_prompts": 64,
    "spec_eval_max_new_tokens": 128,
    "output_dir": "runs/embedded",
}


def embedded_preset(device: str) -> dict[str, Any]:
    """The embedded default's settings for `device` ("auto" resolves to cuda when available)."""
    import torch

    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return dict(EMBEDDED_GPU if on_gpu else EMBEDDED_CPU)
