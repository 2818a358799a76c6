"""The target answers the dataset's prompts, so a draft learns the target's own replies (DESIGN §6).

Human replies teach a draft a distribution the target never produces when serving; the useful
data is the dataset's prompts with the target's greedy replies. :func:`regenerate` keeps the user
side of each conversation (a leading system message and the first ``turns`` user messages, human
replies dropped) and asks the target for its greedy reply to each user turn in sequence, each reply
becoming context for the next turn. ``turns=1`` is the single-turn recipe.

The output is a JSONL file of ``{"messages": [...], "prompt_id", "target", "source_id",
"truncated"}`` rows that :func:`dflash.data.sources.load_conversations` reads. It is written a batch at a
time and flushed, keyed by ``prompt_id`` (a hash of the prompt turns): a rerun skips the prompts
already answered, so an interrupted run resumes where it stopped and identical prompts (chat data
repeats its openers) are answered once. A damaged row of the cache (bytes that are not UTF-8 or not JSON, a
row without its fields: `damage_of`) is counted, moved to ``<file>.damaged`` and its prompt asked again, rather
than ending the run: the cache is dflash's to rebuild, and the lines a user may want to look at are kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout
from transformers import GenerationConfig

from dflash.data.reply_cache import complete_lines, described, read_cache, set_aside
from dflash.engines import ReplayMismatch, Replier, Reply, through_stop
from dflash.report.console import ProgressBar
from dflash.target_model.loading import load_target_config, target_location

logger = logging.getLogger(__name__)

Message = dict[str, str]


@dataclass
class RegenerateResult:
    """Where the rows are and what this run did: ``written`` new rows, ``reused`` rows already in
    the file, ``skipped`` prompts by reason."""

    path: Path
    written: int = 0
    reused: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    turns_reused: int = 0  # replies taken from ``earlier`` instead of generated
    damaged: int = 0  # damaged cache rows moved aside (`damage_of`): their prompts were asked again
    batches_split: int = 0  # batches halved after running out of accelerator memory

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


@dataclass
class _Chat:
    """One conversation being regenerated: the turns so far and the user turns still to answer."""

    prompt_id: str
    source_id: str
    messages: list[Message]
    todo: list[Message]
    truncated: bool = False
    stop_reason: str = ""  # why it ended before its last user turn ("" while going on)


def prompt_turns(messages: Sequence[Mapping[str, str]], turns: int | None = 1) -> list[Message]:
    """The user side of a conversation: a leading system message and the first ``turns`` user
    messages (all of them when ``turns`` is None), in order; assistant replies are dropped."""
    system = [dict(messages[0])] if messages and messages[0]["role"] == "system" else []
    users = [dict(m) for m in messages if m["role"] == "user"]
    return system + (users if turns is None else users[:turns])


def prompt_id(prompt: Sequence[Mapping[str, str]]) -> str:
    """Stable id of a prompt: 16 hex digits of the SHA-256 of its turns."""
    text = json.dumps([[m["role"], m["content"]] for m in prompt], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def answered_prompt_ids(path: Path, target: str, result: RegenerateResult | None = None) -> set[str]:
    """prompt_ids already in ``path``. A partial last row left by an interrupted run is cut off the file; a
    damaged row (`damage_of`) is moved to ``<path>.damaged``, counted in ``result.damaged`` and logged,
    and its prompt is asked again: the cache is regenerated rather than the run ended on it."""
    if not path.exists():
        return set()
    complete = complete_lines(path)
    if len(complete) < path.stat().st_size:
        logger.warning("%s: dropping a partial last row left by an interrupted run", path)
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    rows, damaged = read_cache(path, complete, target)
    if damaged:
        aside = set_aside(path, complete, damaged)
        logger.warning("%s: %d damaged rows (%s) moved to %s; their prompts are asked again", path, len(damaged),
                       described(damaged), aside)
        if result is not None:
            result.damaged += len(damaged)
    return {row["prompt_id"] for row in rows}


def _earlier_replies(path: Path, target: str) -> dict[str, tuple[list[str], bool]]:
    """prompt_id -> (replies in turn order, truncated) of the rows of ``path`` (a file regenerated with
    fewer turns by the same target). Its partial last row, if any, is ignored: that prompt is asked again;
    so are the prompts of its damaged rows (left in that file, which its own run repairs)."""
    rows, damaged = read_cache(path, complete_lines(path), target)
    if damaged:
        logger.warning("%s: %d damaged rows (%s) not taken over; their turns are asked again", path, len(damaged),
                       described(damaged))
    return {
        row["prompt_id"]: ([m["content"] for m in row["messages"] if m["role"] == "assistant"], bool(row.get("truncated")))
        for row in rows
    }


def _continue_from(chat: _Chat, known: Mapping[str, tuple[list[str], bool]]) -> int:
    """Move the longest prefix of ``chat``'s user turns answered in ``known`` into its messages, with
    those replies; a truncated last reply ends the conversation. Returns the number of replies taken."""
    system = chat.messages
    for turns in range(len(chat.todo), 0, -1):
        found = known.get(prompt_id(system + chat.todo[:turns]))
        if found is None:
            continue
        replies, truncated = found[0][:turns], found[1]  # a row over `turns` user turns has at most `turns` replies
        for reply in replies:
            chat.messages = [*chat.messages, chat.todo.pop(0), {"role": "assistant", "content": reply}]
        if truncated:
            chat.truncated, chat.stop_reason = True, "reply hit max_new_tokens"
        return len(replies)
    return 0


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Token ids that end a reply, sorted: the generation config's eos ids (when the model has a
    generation config) and the tokenizer's eos. Regeneration (every engine) and the speculative evaluation
    all stop on these. Raises when there is none: a reply would then only ever end at its token budget."""
    return generation_stop_ids(getattr(model, "generation_config", None), tokenizer)


def generation_stop_ids(generation_config: Any, tokenizer: Any) -> list[int]:
    """`stop_token_ids` from a generation config (None: the tokenizer's eos alone) rather than a model: an
    engine's target is a folder, not a loaded model."""
    configured = getattr(generation_config, "eos_token_id", None)
    ids = set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("neither the model's generation config nor the tokenizer defines an eos token")
    return sorted(ids)


def target_stop_ids(target: str, tokenizer: Any) -> list[int]:
    """`stop_token_ids` of `config.target` without loading its weights (an engine serves its folder): the folder's
    generation config, else the one transformers derives from the model config, as `from_pretrained` does."""
    try:
        generation = GenerationConfig.from_pretrained(target_location(target))
    except OSError:  # no generation_config.json
        generation = GenerationConfig.from_model_config(load_target_config(target))
    return generation_stop_ids(generation, tokenizer)


def _prompt_ids(tokenizer: Any, context: Sequence[Message]) -> list[int]:
    """Token ids of a chat context followed by the generation prompt (the assistant header)."""
    text = tokenizer.apply_chat_template(list(context), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _generate(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Reply]:
    """Greedy replies to token-id ``prompts`` in one batched ``generate``: (text, finished).

    Prompts are left-padded into a [B, P] batch, so every reply starts at column P; ``finished`` is
    False when a reply ran into ``max_new_tokens`` before an end-of-turn token.
    """
    eos = stop_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    width = max(len(ids) for ids in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, ids in enumerate(prompts):
        input_ids[b, width - len(ids) :] = torch.tensor(ids)
        attention_mask[b, width - len(ids) :] = 1
    out = model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    replies = []
    for ids, row in zip(prompts, out[:, width:].tolist(), strict=True):
        kept, finished = through_stop(row, eos)  # the padding after a finished reply is cut with it
        replies.append(Reply(tokenizer.decode(kept[:-1] if finished else kept, skip_special_tokens=False), finished, kept,
                             tuple(ids)))
    return replies


class TransformersReplier:
    """The `Replier` of an HF model in this process (`data.regenerate_engine: transformers`): left-padded
    batches through `model.generate` (`_generate`)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer

    def reply(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Reply]:
        if self.model is None:
            raise ValueError("data.regenerate_engine=transformers answers with the target loaded in this process, and "
                             "none was given")
        return _generate(self.model.eval(), self.tokenizer, prompts, max_new_tokens)

    def close(self) -> None:
        """Nothing to free: the model is the run's."""


def check_replay(sent: Sequence[int], reply: Reply, where: str) -> None:
    """Raise `ReplayMismatch` when the engine reports having run other prompt ids than `sent` (exact replay): its
    tokenizer or template changed the prompt (a BOS added, a special token split), so its reply continues another
    text than the row would hold. An engine that does not report its prompt is not checked."""
    ran = reply.prompt_token_ids
    if ran is None or list(ran) == list(sent):
        return
    at = next((i for i, (a, b) in enumerate(zip(sent, ran, strict=False)) if a != b), min(len(sent), len(ran)))
    raise ReplayMismatch(
        f"exact replay failed for {where}: the engine ran a prompt of {len(ran)} token ids where {len(sent)} were sent, "
        f"first different at position {at} (sent {list(sent[at:at + 4])}, ran {list(ran[at:at + 4])}): it tokenized or "
        "templated the prompt itself. Serve the target with the run's tokenizer and no added special tokens (token-id "
        "prompts on /completions), or regenerate with data.regenerate_engine=transformers or vllm")


def _answer(chats: list[_Chat], replier: Replier, tokenizer: Any, max_new_tokens: int, max_prompt_tokens: int) -> None:
    """Answer every chat's user turns in sequence, batching the chats still going at each round."""
    while active := [c for c in chats if c.todo and not c.stop_reason]:
        asking, prompts = [], []
        for chat in active:
            ids = _prompt_ids(tokenizer, [*chat.messages, chat.todo[0]])
            if len(ids) > max_prompt_tokens:
                chat.stop_reason = "prompt longer than max_prompt_tokens"
            else:
                asking.append(chat)
                prompts.append(ids)
        if not asking:
            continue
        replies = replier.reply(prompts, max_new_tokens)
        for chat, ids, reply in zip(asking, prompts, replies, strict=True):
            check_replay(ids, reply, chat.source_id)
            if not reply.text.strip():
                chat.stop_reason = "empty reply"
                continue
            chat.messages += [chat.todo.pop(0), {"role": "assistant", "content": reply.text}]
            if not reply.finished:
                # Later turns would answer a cut-off reply: end the conversation, mark the row.
                chat.truncated = True
                chat.stop_reason = "reply hit max_new_tokens"


def _answer_in_memory(chats: list[_Chat], replier: Replier, tokenizer: Any, max_new_tokens: int,
                      max_prompt_tokens: int) -> int:
    """:func:`_answer`, halving the batch and answering each half when the accelerator runs out of
    memory. ``regenerate_batch_size`` is sized for short prompts; sorted by length, the last batches hold
    the longest ones, whose KV cache grows with prompt and reply length. A round that ran out of memory
    left its chats as they were, and rounds already answered stay answered. Returns how many times a
    batch was split."""
    try:
        _answer(chats, replier, tokenizer, max_new_tokens, max_prompt_tokens)
        return 0
    except torch.OutOfMemoryError:
        if len(chats) == 1:
            raise
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the failed round's blocks, before the halves ask again
    half = len(chats) // 2
    logger.warning("regeneration ran out of memory on a batch of %d prompts; answering it in halves", len(chats))
    return 1 + sum(_answer_in_memory(part, replier, tokenizer, max_new_tokens, max_prompt_tokens)
                   for part in (chats[:half], chats[half:]))


@contextmanager
def cache_writer(path: Path) -> Iterator[None]:
    """Hold ``path``'s lock (``<path>.lock``) while a process reads and then appends or rewrites it. Two
    runs sharing a cache (the seeds of a sweep started together) would otherwise both find no prompt
    answered, both ask every prompt and both append every row: each prompt twice in the file, and lines
    of the two interleaved where a flush spans several writes. The second waits and then finds the
    first's rows answered. The lock is advisory and per host (``flock``), like the run folder's."""
    lock = FileLock(f"{path}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("%s: another process is writing it; waiting for %s", path, lock.lock_file)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def regenerate(
    conversations: Iterable[Mapping[str, Any]],
    target: Any,
    tokenizer: Any,
    out_path: str | os.PathLike[str],
    *,
    batch_size: int = 16,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 2048,
    turns: int | None = 1,
    limit: int | None = None,
    target_name: str | None = None,
    earlier: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> RegenerateResult:
    """Write the target's greedy replies to the prompts of ``conversations`` to ``out_path`` (JSONL).

    ``conversations``: rows with ``messages`` (and optionally ``id``), e.g.
    :func:`dflash.data.sources.load_conversations` rows or :func:`dflash.embedded.chitchat_conversations`.
    Only the first ``limit`` are considered. Prompts already answered in ``out_path`` are skipped
    (resume); a user turn whose context exceeds ``max_prompt_tokens`` ends its conversation; a
    conversation with no reply (no user turn, empty reply, first prompt too long) is skipped and
    counted, and not recorded: a rerun asks again (a first prompt too long is counted, never asked).
    ``target``: who answers: an HF causal LM (in this process) or a `dflash.engines.Replier` (vLLM's engine, a
    server; the caller closes it). ``tokenizer`` renders the prompts with its chat template and counts their
    tokens, for every engine. ``target_name`` (default the model's ``name_or_path``; required with a `Replier`)
    is recorded in every row. Processes asking for the same
    file take turns (:func:`cache_writer`): the later ones reuse the first's rows. The ranks of one run
    still regenerate on one and let the others wait, rather than queue for the lock.

    ``earlier``: a file of the same target and reply budget regenerated with fewer turns. For each
    conversation, the longest prefix of its user turns answered there is taken with those replies, and
    only the later turns are generated (with a ``turns=N-1`` file, only turn N). A truncated reply
    taken over ends the conversation there, as if it had just been generated; a row that ended early
    for another reason (a prompt too long, an empty reply) has its next turn asked again.

    ``progress``: a progress bar over the prompts (rank 0, unless `dflash.report.console.set_progress_bars(False)`).
    """
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replier = target if isinstance(target, Replier) else TransformersReplier(target, tokenizer)
    if target_name is None and isinstance(target, Replier):
        raise ValueError("regenerate() through an engine needs target_name: the rows record which target answered")
    name = target_name or getattr(target, "name_or_path", "") or type(target).__name__
    result = RegenerateResult(path)
    with cache_writer(path):  # one writer: a second process waits, then reuses these rows
        answered = answered_prompt_ids(path, name, result)
        known = _earlier_replies(Path(earlier), name) if earlier and Path(earlier).exists() else {}
        seen: set[str] = set()
        queued: list[tuple[int, _Chat]] = []  # (prompt tokens, chat)
        for index, conv in enumerate(islice(conversations, limit)):
            prompt = prompt_turns(conv["messages"], turns)
            pid = prompt_id(prompt)
            if not any(m["role"] == "user" for m in prompt):
                result.skip("no user turn")
            elif pid in answered:
                result.reused += 1
            elif pid in seen:
                result.skip("duplicate prompt")
            else:
                seen.add(pid)
                system = [m for m in prompt if m["role"] == "system"]
                todo = [m for m in prompt if m["role"] == "user"]
                chat = _Chat(pid, str(conv.get("id", index)), system, todo)
                result.turns_reused += _continue_from(chat, known)
                length = len(_prompt_ids(tokenizer, [*chat.messages, *chat.todo[:1]]))
                if length > max_prompt_tokens and not any(m["role"] == "assistant" for m in chat.messages):
                    result.skip("prompt longer than max_prompt_tokens")  # no row either way: counted, not asked
                    continue
                queued.append((length, chat))

        # Batch prompts of similar length: one long prompt left-pads its whole batch, so every prompt in a
        # batch costs as much as its longest.
        pending = [chat for _, chat in sorted(queued, key=lambda item: item[0])]
        if result.reused:
            logger.info("%s: %d prompts already answered (cached), %d to ask", path, result.reused, len(pending))
        bar = ProgressBar(len(pending), desc="regenerating", unit="prompt", enabled=progress) if pending else None
        with open(path, "a", encoding="utf-8") as f:
            for start in range(0, len(pending), batch_size):
                batch = pending[start : start + batch_size]
                result.batches_split += _answer_in_memory(batch, replier, tokenizer, max_new_tokens, max_prompt_tokens)
                for chat in batch:
                    if not any(m["role"] == "assistant" for m in chat.messages):
                        result.skip(chat.stop_reason)
                        continue
                    row = {
                        "messages": chat.messages,
                        "prompt_id": chat.prompt_id,
                        "target": name,
                        "source_id": chat.source_id,
                        "truncated": chat.truncated,
                    }
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
                    result.written += 1
                f.flush()  # a finished batch survives an interruption
                bar.update(len(batch))  # the bar shows it; without one (other ranks, progress off) a log line does
                logger.log(logging.DEBUG if bar.enabled else logging.INFO, "regenerated %d/%d prompts",
                           min(start + batch_size, len(pending)), len(pending))
    if bar is not None:
        bar.close()
    taken = f" ({result.turns_reused} replies in them taken from {earlier})" if earlier is not None else ""
    damaged = f", {result.damaged} damaged rows moved to {path.name}.damaged and asked again" if result.damaged else ""
    logger.info("%s: %d new rows%s, %d reused%s, skipped %s, %d batches split for memory", path, result.written, taken,
                result.reused, damaged, result.skipped, result.batches_split)
    return result
