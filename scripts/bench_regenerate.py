"""Regeneration throughput of the engines on the same prompts: `transformers` (generate() in this process)
against `vllm` (vLLM's offline engine) and, with --url, an OpenAI-compatible server.

Each engine answers the training prompts of the same config (default: the embedded default's, as
`dflash generate` asks them) into a fresh cache of its own, through dflash's own regeneration loop. An
engine's start (vLLM: its processes, profiling and warm-up) is timed apart from the answering: one
one-token reply first, then the prompts. Then every engine's rows are compared with the first engine's
(greedy replies of the same weights: equal up to rounding ties). One summary line per engine:

    python scripts/bench_regenerate.py [--engines transformers,vllm] [--url URL] [key=value ...]

    engine=vllm prompts=431 written=431 start_s=61.2 answer_s=48.0 prompts_per_s=8.98 same_rows=431/431
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from dflash.config import TrainConfig
from dflash.data.corpus import _regenerate_part, _training_rows, split_conversations
from dflash.data.repliers import make_replier, target_identity
from dflash.runtime import resolve_device, resolve_dtype
from dflash.target_model.loading import load_target, load_tokenizer


def bench_engine(config: TrainConfig, engine: str, url: str | None, cache: Path) -> tuple[dict, dict[str, list]]:
    """(summary, prompt_id -> messages) of one engine answering the config's training prompts into `cache`."""
    settings = replace(config.data, regenerate_engine=engine, regenerate_url=url, cache_dir=str(cache))
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    identity = target_identity(settings, config.target)
    model = None
    if engine == "transformers":
        model, tokenizer = load_target(config.target, dtype)
        model.to(device)
    else:
        tokenizer = load_tokenizer(config.target)
    train, held, _, _ = split_conversations(settings)
    rows = _training_rows(train, held, settings)
    replier = make_replier(settings, config.target, tokenizer, identity, model=model, device=device, dtype=dtype)
    try:
        start = time.perf_counter()
        replier.reply([tokenizer("Hi", add_special_tokens=False)["input_ids"]], 1)  # the engine's start
        started = time.perf_counter()
        result = _regenerate_part(rows, settings, cache, replier, tokenizer, config.target, "train", identity.fingerprint)
        answered = time.perf_counter()
    finally:
        replier.close()
    out = [json.loads(line) for line in result.path.read_text().splitlines()]
    summary = {"engine": engine, "prompts": len(rows),
               "written": result.written, "start_s": round(started - start, 1), "answer_s": round(answered - started, 1),
               "prompts_per_s": round(result.written / max(answered - started, 1e-9), 2)}
    return summary, {row["prompt_id"]: row["messages"] for row in out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="transformers,vllm", help="comma-separated: transformers, vllm, openai")
    parser.add_argument("--url", help="the OpenAI-compatible server's base URL (engine openai)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. data.limit=200 data.regenerate_batch_size=64")
    args = parser.parse_args()
    config = TrainConfig.from_sources(None, args.overrides)
    reference: dict[str, list] | None = None
    with tempfile.TemporaryDirectory(prefix="dflash-bench-regenerate-") as tmp:
        for engine in args.engines.split(","):
            summary, rows = bench_engine(config, engine, args.url, Path(tmp) / engine)
            reference = rows if reference is None else reference
            same = sum(rows.get(pid) == messages for pid, messages in reference.items())
            print(" ".join(f"{k}={v}" for k, v in summary.items()) + f" same_rows={same}/{len(reference)}", flush=True)


if __name__ == "__main__":
    main()
