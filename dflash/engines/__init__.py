"""Serving engines dflash drives: vLLM's offline engine in this process (`vllm_engine`) and any
OpenAI-compatible server over HTTP (`openai_server`), behind one small interface (`Replier`).

Regeneration (`dflash.data.regenerate`) asks a `Replier` for the target's greedy replies; `dflash eval
--engine vllm` serves an export through vLLM (`dflash.evaluation.engine_eval`). Low in the stack: imports
only `dflash.preflight` (the missing-package error); never the data, evaluation, run or trainer layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable


class Reply(NamedTuple):
    """One greedy reply. `text`: up to its stop token (excluded); `finished`: it ended at a stop token before the
    budget; `token_ids`: the reply's ids as generated, the stop token included when finished (None: the engine
    gave text only); `prompt_token_ids`: the prompt as the engine ran it (None: the engine does not say), which
    regeneration checks against what it sent (`dflash.data.regenerate.check_replay`)."""

    text: str
    finished: bool
    token_ids: tuple[int, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None


def through_stop(token_ids: Sequence[int], stop: Sequence[int]) -> tuple[tuple[int, ...], bool]:
    """(an engine's generated ids up to and including the first stop token, whether there was one): a `Reply`'s
    `token_ids`; its text is their decoding without that token. The one cut every engine makes."""
    ids = tuple(token_ids)
    end = next((i for i, t in enumerate(ids) if t in stop), None)
    return (ids, False) if end is None else (ids[:end + 1], True)


class ReplayMismatch(ValueError):
    """An engine ran other token ids than dflash sent (its tokenizer or template added, dropped or changed tokens):
    the reply would continue another prompt than the row holds, so regeneration stops instead of shifting."""


@runtime_checkable
class Replier(Protocol):
    """Greedy replies to chat prompts already rendered with the target's chat template.

    `reply(prompts, max_new_tokens)`: one `Reply` per prompt (token ids), in order; a reply is cut at the
    first stop token, which it does not include, and `finished` is False when it ran into `max_new_tokens`
    first. `close()` frees what the engine holds (processes, memory, connections); a later `reply` may
    start it again."""

    def reply(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Reply]: ...

    def close(self) -> None: ...
