"""Any OpenAI-compatible server as the target (`data.regenerate_engine: openai`): `vllm serve`, SGLang,
TGI, llama.cpp's server, a fleet behind one URL.

Each prompt goes as its token ids to the server's `/completions` (the chat template is the run's own,
applied here, so a server's template or BOS rule cannot change the prompt), greedy (temperature 0), at
most the reply budget, with the stop tokens and special tokens kept as dflash decodes them (`stop_token_ids`,
`skip_special_tokens: false`: the vLLM / SGLang extensions; a server that refuses unknown fields says so in
its error). Up to `concurrency` requests are in flight (the server batches them continuously); the `openai`
client retries refused, timed-out and 5xx requests with backoff (`retries` times) and gives each `timeout`
seconds. The prompts of one `reply` call are one regeneration batch: the cache is written after each, so
a server lost mid-run costs at most that batch, and a rerun resumes.

The weights behind a URL cannot be read from here: `served_identity` is what the server reports of its
model (`/models`: id, root, max_model_len), and the regeneration cache is keyed by it plus the fingerprint
the user gives (`data.regenerate_fingerprint`; without one the run says that it cannot verify the weights).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dflash.engines import Reply, through_stop
from dflash.preflight import ENGINE_PACKAGES, MissingDependencyError

log = logging.getLogger(__name__)

OPENAI_INSTALL = ENGINE_PACKAGES["openai"]


def _client(url: str, *, timeout: float, retries: int) -> Any:
    try:
        import openai  # optional: only a server-backed regeneration needs it
    except ImportError as e:
        raise MissingDependencyError(f"data.regenerate_engine=openai needs the openai client ({e}): {OPENAI_INSTALL}") from None
    # Most local servers take any key; a hosted one reads OPENAI_API_KEY like every OpenAI client.
    return openai.OpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"), timeout=timeout,
                         max_retries=retries)


def _unreachable(url: str, e: Exception) -> ValueError:
    return ValueError(f"the server at data.regenerate_url={url} did not answer ({type(e).__name__}: {e}); start it "
                      "(e.g. `vllm serve TARGET`) or fix the URL (it ends in /v1). Replies written so far are kept: "
                      "a rerun resumes")


def served_identity(url: str, model: str | None, *, timeout: float = 30.0, retries: int = 2) -> dict[str, Any]:
    """What the server at `url` reports of the model it serves (`GET /models`): {"id", "root", "max_model_len",
    "owned_by"} of `model`, or of its only model when `model` is None. A ValueError when the server does not
    answer, serves no such model, or serves several and `model` is None."""
    import openai  # `_client` checked it is installed

    client = _client(url, timeout=timeout, retries=retries)
    try:
        listed = [m.model_dump() for m in client.models.list()]
    except openai.OpenAIError as e:
        raise _unreachable(url, e) from None
    ids = [m.get("id") for m in listed]
    if model is None and len(listed) != 1:
        raise ValueError(f"the server at {url} serves {len(listed)} models ({', '.join(map(str, ids))}): set "
                         "data.regenerate_model to the target's")
    chosen = next((m for m in listed if model is None or m.get("id") == model), None)
    if chosen is None:
        raise ValueError(f"the server at {url} does not serve data.regenerate_model={model!r} (it serves "
                         f"{', '.join(map(str, ids))})")
    return {key: chosen.get(key) for key in ("id", "root", "max_model_len", "owned_by")}


def served_fingerprint(identity: dict[str, Any], user_fingerprint: str | None) -> str:
    """12 characters naming the served weights in the cache's file names: "s" and 11 hex digits of the
    server's model id and root plus the user's fingerprint. Without a user fingerprint another model served
    under the same name and root would reuse the replies; the caller says so."""
    key = json.dumps([identity.get("id"), identity.get("root"), user_fingerprint or ""])
    return "s" + hashlib.sha256(key.encode()).hexdigest()[:11]


class ServerReplier:
    """Regeneration through an OpenAI-compatible server: one `/completions` request per prompt, at most
    `concurrency` in flight."""

    def __init__(self, url: str, model: str, stop_token_ids: Sequence[int], *, concurrency: int = 32,
                 timeout: float = 600.0, retries: int = 4) -> None:
        self.url, self.model, self.stop = url, model, list(stop_token_ids)
        self.client = _client(url, timeout=timeout, retries=retries)
        self.concurrency = concurrency
        self.pool: ThreadPoolExecutor | None = None

    def _one(self, prompt: Sequence[int], max_new_tokens: int) -> Reply:
        # temperature 0 is greedy on every server; the extra fields keep the stop tokens and special tokens as
        # dflash's own decoding does (vLLM and SGLang read them), and ask for the token ids of the prompt as the
        # server ran it and of the reply (vLLM's `return_token_ids`): the prompt is checked against what was sent,
        # and a conversation's row is built from the reply's own ids.
        response = self.client.completions.create(
            model=self.model, prompt=list(prompt), max_tokens=max_new_tokens, temperature=0.0,
            extra_body={"stop_token_ids": self.stop, "skip_special_tokens": False, "return_token_ids": True})
        choice = response.choices[0]
        finished = choice.finish_reason != "length"
        prompt_ids, reply_ids = getattr(choice, "prompt_token_ids", None), getattr(choice, "token_ids", None)
        if reply_ids is not None:
            reply_ids, stopped = through_stop(reply_ids, self.stop)
            if finished and not stopped:  # the server left the stop token out of the ids: its reason names it
                reason = getattr(choice, "stop_reason", None)
                reply_ids = (*reply_ids, reason) if isinstance(reason, int) else None
        return Reply(choice.text, finished, reply_ids, None if prompt_ids is None else tuple(prompt_ids))

    def reply(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Reply]:
        import openai  # `_client` checked it is installed

        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="dflash-regenerate")
        try:
            return list(self.pool.map(lambda p: self._one(p, max_new_tokens), prompts))
        except (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError) as e:
            raise _unreachable(self.url, e) from None
        except openai.APIStatusError as e:  # 4xx: the server refused the request itself
            raise ValueError(f"the server at {self.url} refused a regeneration request ({e.status_code}: {e.message}); "
                             "it must take token-id prompts on /completions (vLLM, SGLang, llama.cpp do)") from None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
