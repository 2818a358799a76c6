"""The embedded default's budget: what `dflash train` with no arguments does, on a CPU and on a GPU.

Applied only when the target is "embedded" and only to keys the user did not set (YAML or
key=value), so `dflash train max_steps=50` still gets every other embedded default.

CPU (2 cores, at most 15 minutes end to end): a short regeneration (cached for the next run), a 2-layer
DFlash 2 draft with blocks of 4 trained with Muon at lr 3e-3, 150 steps (a 7-minute budget caps them), then
export and a real speculative evaluation on 20 held-out prompts. DFlash 2 beat DFlash in that same budget on
two seeds (real τ 2.054 / 2.104 against 1.853 / 1.927, docs/benchmarks.md, 2026-12-04); Domino, whose step
costs 2.4 DFlash steps there, lost at equal time. GPU: the same recipe at full size (every user message
of every chitchat conversation regenerated as a single-turn prompt, packed into full sequences, larger batches,
bf16 + flex attention, 4000 steps in a 10-minute training budget) with a compiled Domino draft, whose real τ beat
DFlash's at the same steps (docs/benchmarks.md, 2026-12-03).
"""

from __future__ import annotations

from typing import Any

import torch

EMBEDDED_CPU: dict[str, Any] = {
    # DFlash 2 (block convolutions and the candidate selector): in the README line's 7-minute budget it trains
    # about as many steps as DFlash (110-119 against 118-122) and decodes 9-11% more tokens per target forward.
    "draft.kind": "dflash2",
    # Block 4 with 32 anchors per row, 8 rows of 192 tokens, twice the conversations (600): a weak draft
    # wastes less of a short block (its acceptance is ~0 past the third slot), more anchors train the
    # early slots more often, and the draft sees more target-written text in the same steps. Real tau
    # 1.53 against 1.35 for block 8 / 16 anchors and 1.12 for block 16 / 32 anchors / 4 rows of 256 /
    # 300 conversations (docs/benchmarks.md, 2026-12-03).
    "draft.num_layers": 2,
    "draft.block_size": 4,
    "draft.num_anchors": 32,
    "batch_size": 8,
    "data.max_length": 192,
    "data.limit": 600,
    "data.eval_size": 32,
    "data.regenerate_max_new_tokens": 64,
    "data.regenerate_max_prompt_tokens": 192,
    "data.num_workers": 1,
    "max_steps": 150,
    "time_budget_minutes": 7.0,
    "log_interval": 10,
    "eval_interval": 100,
    # Muon for the layers' matrices at lr 3e-3: real tau 1.869 / 1.962 (seeds 0 / 1) against 1.742 / 1.830 at
    # 1e-3 and AdamW's 1.544 / 1.634 after the same 150 steps, for 6-12% more time a step; AdamW at 3e-3 falls
    # to 1.195, so the lr follows the optimizer (FOLLOWS below; docs/benchmarks.md, 2026-12-03 and 12-04).
    "optim.optimizer": "muon",
    "optim.lr": 3e-3,
    "spec_eval_prompts": 20,
    "spec_eval_max_new_tokens": 48,
    "output_dir": "runs/embedded",
}

EMBEDDED_GPU: dict[str, Any] = {
    # Domino: real τ 3.90 / 3.74 (two seeds) against DFlash's 3.21 after the same 3000 steps. Compiled,
    # because the Domino CE is elementwise-bound uncompiled (0.57x DFlash's step rate; 0.86x compiled).
    "draft.kind": "domino",
    "compile": True,
    "draft.num_layers": 2,
    "draft.num_anchors": 64,
    "batch_size": 32,
    "data.max_length": 512,
    # With `data.packing=false`: padded lengths of 128, 256, 384 and 512, not eight multiples of 64: a cold run
    # compiles each padded length once (about 25 s each on an H200, docs/benchmarks.md), and the draft's cost is
    # mostly its N * block query tokens, so padding the context up to 63 more tokens costs little.
    "data.bucket_multiple": 128,
    "data.eval_size": 64,
    "data.regenerate_max_new_tokens": 256,
    # Every user message of every training conversation (1000: chitchat's longest conversation has 564
    # turns), each asked as a single-turn prompt like the evaluation's: more prompts of the kind the
    # speculative evaluation decodes. 57,741 rows against the first three turns' 10,396: at 3000 steps the
    # three-turn file was 9 epochs in and overfit past step 3500 (docs/benchmarks.md, 2026-12-05 and 12-06).
    # Regenerated once at a large batch (7.9 minutes on an H100, the target's load included): HF generate is
    # bound by per-step overhead at this model size, so a larger batch is nearly free.
    "data.regenerate_turns": 1,
    "data.standalone_turns": 1000,
    "data.regenerate_batch_size": 4096,
    # Packed rows (one [32 x 512] shape, 90% real slots against 49% bucketed): 1.9-2.0x the real tokens/s for a
    # step 6-14% slower. Real tau 4.297 (seed 0, 4000 steps, 314 s of training) and 4.400 (seed 1, 4708 steps, 364 s)
    # against the bucketed 5000 steps' 4.263 / 4.159 (341 s on seed 1's card); seed 1's held-out chain tau at packed
    # step 4000 (about 309 s) already stood above the bucketed run's end, 4.226 against 4.100 (docs/benchmarks.md,
    # 2026-12-06 night and late night).
    "data.packing": True,
    # 4000 packed steps: 4.9 epochs of the 26,240 packed sequences, the held-out chain tau at its peak at the end
    # (seed 0); less training time than the bucketed 5000 steps (about 309 s against 341 s on seed 1's card).
    # `data.packing=false max_steps=5000` is that earlier recipe.
    "max_steps": 4000,
    "time_budget_minutes": 10.0,
    "log_interval": 50,
    "eval_interval": 500,
    # AdamW (the key's default): Muon led after a minute of steps at equal time (real tau 3.426 against 3.294)
    # but tied at the full 3000 steps (3.878 against 3.896, seed 0; docs/benchmarks.md, 2026-12-04 evening).
    "optim.lr": 6e-4,
    # Every held-out prompt (data.eval_size): real tau on the prompts the held-out chain estimate scores,
    # so the two figures differ only by numerics, not by the choice of prompts (docs/benchmarks.md).
    "spec_eval_prompts": 64,
    "spec_eval_max_new_tokens": 128,
    "output_dir": "runs/embedded",
}


# Keys that only make sense together: when the user sets one of them, the preset sets none of them
# (`data.regenerate_turns=2` on a GPU must not meet the preset's standalone prompts, which need one turn).
LINKED: tuple[frozenset[str], ...] = (
    frozenset({"data.regenerate", "data.regenerate_turns", "data.standalone_turns"}),
    frozenset({"distributed", "optim.optimizer"}),  # the CPU preset's Muon would refuse a user's distributed=fsdp2
    # A user's num_epochs sets the step count: the preset's max_steps must not cut the passes short (its time budget,
    # which keeps the README line's minutes, still applies)
    frozenset({"max_steps", "num_epochs"}),
    # The GPU preset's packing is refused with offline features and a tensor-parallel target (config.validate): a
    # user who sets either gets unpacked rows, not a config error
    frozenset({"data.packing", "data.features", "tensor_parallel.size"}),
)


# A preset key tuned for the preset's value of another key (its leader): dropped wherever the leader is the
# user's or linked to one of the user's keys, while setting the follower leaves the leader to the preset. The
# CPU preset's lr of 3e-3 is Muon's; AdamW at that lr trains a far worse draft (real tau 1.195 against 1.544 at
# 1e-3), so a user's optim.optimizer=adamw (or distributed=..., which holds the optimizer) gets the key's own
# default lr, and a user's optim.lr keeps Muon.
FOLLOWS: dict[str, str] = {"optim.lr": "optim.optimizer"}


def embedded_preset(device: str, given: set[str] = frozenset()) -> dict[str, Any]:
    """The embedded default's settings for `device` ("auto" resolves to cuda when available), less the
    keys in `given` (set by the user), the keys linked to one of them and the keys that follow a held one."""
    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    held = set(given).union(*(group for group in LINKED if group & set(given)))
    held |= {follower for follower, leader in FOLLOWS.items() if leader in held}
    return {key: value for key, value in (EMBEDDED_GPU if on_gpu else EMBEDDED_CPU).items() if key not in held}
