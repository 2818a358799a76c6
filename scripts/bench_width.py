"""Steps/s of the host-bounded anchor width against the fixed width N, on the same batches, one process.

The collator names each batch's width (the smallest of `draft.anchor_widths` allowed widths that
holds every row's valid anchors); the fixed-width run gets the same batches without it. The two
trainers start from the same weights and alternate step by step, so both see the same machine state.
Prints the distribution of widths the data produced and ends with one summary line.

    python scripts/bench_width.py                      # the embedded default (its preset; regenerated data cached)
    python scripts/bench_width.py --steps 40 key=value ...
    python scripts/bench_width.py --tiny               # a tiny random target and rows (CI smoke test)
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import datasets
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.config import TrainConfig  # noqa: E402
from dflash.data.corpus import training_data  # noqa: E402
from dflash.runtime import resolve_device, resolve_dtype  # noqa: E402
from dflash.target_model.loading import load_target  # noqa: E402
from dflash.trainer import DFlashTrainer  # noqa: E402


def _tiny(overrides: list[str]) -> tuple[TrainConfig, object, object, object]:
    """A 2-layer random Llama and rows of mixed reply lengths (no tokenizer, no files)."""
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, vocab_size=128))
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(64):
        n, reply = 64, int(torch.randint(4, 48, (), generator=g))
        rows.append({"input_ids": torch.randint(0, 120, (n,), generator=g).tolist(),
                     "loss_mask": [0] * (n - reply) + [1] * reply})
    cfg = TrainConfig.from_sources(None, ["target=tiny", "device=cpu", "dtype=float32", "draft.block_size=4",
                                          "draft.num_anchors=64", "draft.mask_token_id=127", "batch_size=4",
                                          "data.max_length=64", "ce_chunk_size=256", *overrides], presets=False)
    return cfg, target, None, datasets.Dataset.from_list(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant (after 2 warm-up steps)")
    p.add_argument("--tiny", action="store_true", help="tiny random target and rows (CPU smoke test)")
    p.add_argument("overrides", nargs="*", help="key=value settings (the embedded preset fills the rest)")
    args = p.parse_args()
    if args.tiny:
        cfg, model, tokenizer, dataset = _tiny(args.overrides)
    else:
        cfg = TrainConfig.from_sources(None, ["progress_bar=false", *args.overrides])
        model, tokenizer = load_target(cfg.target, resolve_dtype(cfg.dtype, resolve_device(cfg.device)))
        dataset = None
    bounded = DFlashTrainer(cfg, target=model, tokenizer=tokenizer)
    fixed = DFlashTrainer(cfg, target=model, tokenizer=tokenizer)
    fixed.draft.load_state_dict(bounded.draft.state_dict())
    corpus = training_data(dataset, cfg.data, tokenizer, model, cfg.target)
    batches = bounded._device_batches(corpus.train)
    widths: collections.Counter[int] = collections.Counter()
    seconds = {"bounded": 0.0, "fixed": 0.0}
    for step in range(args.steps + 2):
        batch = next(batches)
        plain = {k: v for k, v in batch.items() if k != "num_anchors"}
        for name, trainer, b in (("bounded", bounded, batch), ("fixed", fixed, plain)):
            start = time.perf_counter()
            trainer.train_step(b)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # a benchmark's own timing point, outside any training step
            if step >= 2:
                seconds[name] += time.perf_counter() - start
        if step >= 2:
            widths[batch["num_anchors"]] += 1
    losses = {name: t.metrics.flush()["loss"] for name, t in (("bounded", bounded), ("fixed", fixed))}
    n = cfg.draft.num_anchors
    print("anchor widths over", args.steps, "batches (N =", n, "):",
          ", ".join(f"{w}: {c}" for w, c in sorted(widths.items())))
    ratio = seconds["fixed"] / seconds["bounded"]
    print(f"bench_width: {args.steps / seconds['bounded']:.3f} steps/s bounded vs {args.steps / seconds['fixed']:.3f} "
          f"fixed N={n} (x{ratio:.2f}); mean width {sum(w * c for w, c in widths.items()) / args.steps:.1f}; "
          f"loss {losses['bounded']:.6f} vs {losses['fixed']:.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
