"""Serving engines dflash drives: vLLM's offline engine in this process (`vllm_engine`) and any
OpenAI-compatible server over HTTP (`openai_server`), behind one small interface (`Replier`).

Regeneration (`dflash.data.regenerate`) asks a `Replier` for the target's greedy replies; `dflash eval
--engine vllm` serves an export through vLLM (`dflash.evaluation.engine_eval`). Low in the stack: imports
only `dflash.preflight` (the missing-package error); never the data, evaluation, run or trainer layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

Reply = tuple[str, bool]  # (reply text up to its end-of-turn token, finished: it ended before the budget)


@runtime_checkable
class Replier(Protocol):
    """Greedy replies to chat prompts already rendered with the target's chat template.

    `reply(prompts, max_new_tokens)`: one `Reply` per prompt (token ids), in order; a reply is cut at the
    first stop token, which it does not include, and `finished` is False when it ran into `max_new_tokens`
    first. `close()` frees what the engine holds (processes, memory, connections); a later `reply` may
    start it again."""

    def reply(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Reply]: ...

    def close(self) -> None: ...
