"""Conversations -> chat template -> ``input_ids``, ``loss_mask``; the tokenized dataset cache.

A training row is ``{"input_ids": list[int], "loss_mask": list[int]}`` of one rendered
conversation: ``loss_mask`` is 1 exactly on the tokens of assistant replies (end-of-turn token
included; an assistant's tool calls as the template renders them), the positions a draft learns to
predict; tool results, user and system turns are context. A source of token rows (`dflash.data.rows`)
gives its rows as they are, cut to ``max_length``. :func:`build_dataset` tokenizes a source once
and keeps the result on disk, keyed by the source's content, the tokenizer and ``max_length``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import datasets

from dflash.anchors import has_valid_anchor
from dflash.data.rows import OUTSIDE_VOCABULARY, TOO_SHORT, is_token_row
from dflash.data.sources import DataReport, Message, dataset_report, load_conversations, local_files
from dflash.data.tool_calls import check_tool_template
from dflash.embedded import EMBEDDED_SOURCES, cache_root, cache_slug, chitchat_path
from dflash.report.console import quiet_datasets

logger = logging.getLogger(__name__)

# Bump when the tokenization or the cached layout changes: old caches then stop matching.
# 2: tool calls and tool results are conversations, and token rows a source (both were bad rows in version 1).
_CACHE_VERSION = 2
Tools = list[dict[str, Any]] | None  # a conversation's tool schemas, passed to the chat template


# --------------------------------------------------------------------------- tokenizing


def render_chat(tokenizer: Any, messages: Sequence[Message], generation_prompt: bool = False, tools: Tools = None) -> str:
    """The chat template's text for ``messages`` (with the conversation's ``tools``, when it has them)."""
    return tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )


def _assistant_spans(
    messages: Sequence[Message], tokenizer: Any, full: str, max_chars: int, tools: Tools = None
) -> tuple[list[tuple[int, int]], int]:
    """Character spans in ``full`` (the rendered conversation) of the assistant replies that start
    before ``max_chars``, and the number of replies that could not be located.

    For assistant message k, ``before`` = render(messages[:k], generation prompt) and ``through`` =
    render(messages[:k+1]); the reply is the text between them, less the trailing whitespace the
    template puts after the end-of-turn token (``"Hi<|im_end|>\\n"`` -> ``"Hi<|im_end|>"``), so the
    end-of-turn token is supervised and the template's newline is not. This holds for any template
    whose rendering of a prefix is a prefix of the full rendering. A reply where that fails (a
    template that renders the last reply differently, e.g. with an empty think block, or refuses
    the prefix) is left unsupervised and counted, never guessed. Each look renders a prefix, so
    replies past ``max_chars`` (cut by truncation) are not looked for: long chats stay linear. An
    assistant's tool calls are part of its reply (the markup the template renders between the two);
    a tool result, like a user turn, falls between replies and stays unsupervised.
    """
    spans: list[tuple[int, int]] = []
    unlocated = 0
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            before = render_chat(tokenizer, messages[:k], generation_prompt=True, tools=tools)
            through = render_chat(tokenizer, messages[: k + 1], tools=tools)
        except Exception:
            unlocated += 1
            continue
        if len(before) >= max_chars:
            break
        reply = through[len(before) :].rstrip()
        if full.startswith(before) and full.startswith(through) and reply:
            spans.append((len(before), len(before) + len(reply)))
        else:
            unlocated += 1
    return spans, unlocated


def char_budget(tokenizer: Any, max_length: int) -> int:
    """Characters of message text that can matter to ``max_length`` tokens: ``max_length`` times the
    longest vocabulary entry (a token covers at most as many characters as its entry has, byte-level
    or SentencePiece), plus a margin for the word the cut falls in. Text past it is truncated anyway."""
    return max_length * max(map(len, tokenizer.get_vocab())) + 1024


def cut_messages(messages: Sequence[Message], max_chars: int) -> list[Message]:
    """``messages`` with at most ``max_chars`` characters of content in all: the message that crosses the
    budget is cut and later ones dropped (truncation keeps the start). One 30 MB row took 5 GB to
    tokenize whole."""
    kept, left = [], max_chars
    for message in messages:
        if left <= 0:
            break
        kept.append(message if len(message["content"]) <= left else {**message, "content": message["content"][:left]})
        left -= len(message["content"])
    return kept


def tokenize_conversation(messages: Sequence[Message], tokenizer: Any, max_length: int,
                          max_chars: int | None = None, tools: Tools = None) -> dict[str, Any]:
    """Token ids of the chat-rendered conversation and its loss mask, both of length <= max_length.

    Returns ``{"input_ids": list[int], "loss_mask": list[int], "unlocated_turns": int,
    "truncated": bool}``. A token is supervised when its characters overlap an assistant reply span
    (:func:`_assistant_spans`). Offsets come from one tokenization of the full text, which is
    exactly what ``apply_chat_template(tokenize=True)`` produces; a token merged across the
    template/reply boundary is still placed, where diffing prefix tokenizations would disagree with
    the full one. Needs a fast tokenizer (offset mapping). Content past ``max_chars`` (default
    :func:`char_budget`) is cut first: it cannot reach the first ``max_length`` tokens. ``tools``: the
    conversation's tool schemas, rendered by the template wherever it puts them.
    """
    budget = char_budget(tokenizer, max_length) if max_chars is None else max_chars
    cut = sum(len(m["content"]) for m in messages) > budget
    messages = cut_messages(messages, budget) if cut else messages
    text = render_chat(tokenizer, messages, tools=tools)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoded["input_ids"])[:max_length]
    offsets = encoded["offset_mapping"]
    truncated = len(offsets) > max_length or cut
    # Characters from the first token cut by truncation on are never supervised.
    max_chars = offsets[max_length][0] if truncated else len(text) + 1
    spans, unlocated = _assistant_spans(messages, tokenizer, text, max_chars, tools)
    loss_mask = [0] * len(input_ids)
    span_index = 0
    for i, (start, end) in enumerate(offsets[:max_length]):
        # Spans and token offsets are both sorted and disjoint: one forward sweep suffices.
        while span_index < len(spans) and spans[span_index][1] <= start:
            span_index += 1
        if span_index < len(spans) and start < spans[span_index][1] and end > spans[span_index][0]:
            loss_mask[i] = 1
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "unlocated_turns": unlocated,
        "truncated": truncated,
    }


# Chat templates render in Python, row by row: from this many rows on, worker processes pay for their
# start-up and all cores are used.
_PARALLEL_ROWS = 2000


def _tokenize_batch(batch: dict[str, list[Any]], tokenizer: Any, max_length: int) -> dict[str, list[Any]]:
    """``datasets.map`` function: conversations (JSON text of ``{"messages", "tools"?}``) -> input_ids, loss_mask
    and per-row bookkeeping.

    ``problem`` is "" for a usable row, else the reason it is dropped (counted by the caller).
    """
    columns = ("input_ids", "loss_mask", "problem", "unlocated", "truncated")
    out: dict[str, list[Any]] = {k: [] for k in columns}
    max_chars = char_budget(tokenizer, max_length)  # once per batch: it reads the whole vocabulary
    for text in batch["conversation"]:
        conversation = json.loads(text)
        try:
            row = tokenize_conversation(conversation["messages"], tokenizer, max_length, max_chars,
                                        conversation.get("tools"))
        except Exception as e:  # the template refuses this conversation (e.g. roles out of order)
            row = {"input_ids": [], "loss_mask": [], "unlocated_turns": 0, "truncated": False}
            problem = f"chat template error: {type(e).__name__}: {e}"
        else:
            problem = "" if has_valid_anchor(row["loss_mask"]) else TOO_SHORT
        out["input_ids"].append(row["input_ids"])
        out["loss_mask"].append(row["loss_mask"])
        out["problem"].append(problem)
        out["unlocated"].append(row["unlocated_turns"])
        out["truncated"].append(row["truncated"])
    return out


# --------------------------------------------------------------------------- worker processes

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_WORKER: dict[str, Any] = {}  # in a worker process: what `_start_worker` was given (inherited through fork)


def die_with_parent(parent: int) -> None:
    """Make this (worker) process end when process `parent` ends, however it ends. A worker blocked on its
    task queue never notices a parent killed by SIGKILL, or by a SIGTERM with no handler yet (a launch
    still tokenizing): datasets' pool left its workers and its manager, about 1.2 GB each, running for good.
    Linux: the kernel sends SIGKILL on the parent's death (`PR_SET_PDEATHSIG`; strictly, on the end of the parent
    thread that started the worker: `_parallel_map` starts its pool and waits on it in one thread); elsewhere a
    thread polls the parent id. A parent gone before the setting took is caught by the id check that follows it."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    else:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, daemon=True, name="die-with-parent").start()
    if os.getppid() != parent:
        os._exit(1)


def _start_worker(parent: int, raw: Any, fn_kwargs: dict[str, Any], features: Any) -> None:
    """Pool initializer: die with the parent; keep the rows and the tokenizer, which a forked worker inherits
    (initargs are not pickled under fork: the tokenizer is not serialized once per worker)."""
    die_with_parent(parent)
    _WORKER.update(raw=raw, fn_kwargs=fn_kwargs, features=features)


def _tokenize_shard(index: int, num_shards: int, path: str) -> None:
    """Worker: tokenize contiguous shard `index` of `num_shards` of the rows into the Arrow file `path`."""
    shard = _WORKER["raw"].shard(num_shards, index, contiguous=True)
    shard.map(_tokenize_batch, batched=True, remove_columns=["conversation"], fn_kwargs=_WORKER["fn_kwargs"],
              features=_WORKER["features"], cache_file_name=path)


def _parallel_map(raw: Any, fn_kwargs: dict[str, Any], features: Any, num_proc: int, scratch: Path) -> Any:
    """`raw.map(_tokenize_batch, num_proc=num_proc)` through worker processes that die with this one
    (`die_with_parent`): contiguous shards, each written to an Arrow file under `scratch`, concatenated in
    order (the rows datasets' own parallel map gives). datasets' map takes no pool initializer, and its
    pool and manager outlived a killed launch."""
    paths = [str(scratch / f"shard-{i:05d}.arrow") for i in range(num_proc)]
    context = multiprocessing.get_context("fork")  # the rows and the tokenizer are inherited, not pickled
    with ProcessPoolExecutor(num_proc, mp_context=context, initializer=_start_worker,
                             initargs=(os.getpid(), raw, fn_kwargs, features)) as pool:
        for job in [pool.submit(_tokenize_shard, i, num_proc, path) for i, path in enumerate(paths)]:
            job.result()  # a worker's exception is raised here, with its traceback
    return datasets.concatenate_datasets([datasets.Dataset.from_file(path) for path in paths])


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of everything about a tokenizer that changes ``input_ids`` or ``loss_mask``."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    h.update(vocab.encode())
    h.update(str(tokenizer.chat_template).encode())
    h.update(repr(tokenizer.all_special_tokens).encode())
    return h.hexdigest()


def _source_fingerprint(source: Any, split: str) -> dict[str, Any]:
    """What identifies the content of a source without reading it: files by path, size, mtime."""
    if isinstance(source, str) and source in EMBEDDED_SOURCES:
        stat = chitchat_path().stat()
        return {source: [stat.st_size, stat.st_mtime_ns]}
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        if path.exists():
            files = local_files(path)
            return {"files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
        return {"hub": str(source), "split": split}
    fingerprint = getattr(source, "_fingerprint", None)
    if fingerprint is None:
        text = json.dumps(list(source), sort_keys=True, default=str)
        fingerprint = hashlib.sha256(text.encode()).hexdigest()
    return {"memory": fingerprint}


def dataset_cache_dir(
    source: Any, tokenizer: Any, max_length: int, split: str = "train", root: Path | None = None
) -> Path:
    """Cache folder of a tokenized dataset, keyed by (source content, tokenizer, max_length, version)."""
    key = {
        "source": _source_fingerprint(source, split),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_length": max_length,
        "version": _CACHE_VERSION,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    stem = Path(str(source)).stem if isinstance(source, (str, os.PathLike)) else "memory"
    return (root or cache_root() / "datasets") / f"{cache_slug(stem, 40)}-{digest}"


@quiet_datasets()  # its own log lines say what it did; datasets' map / filter / save bars stay off
def build_dataset(
    source: Any,
    tokenizer: Any,
    max_length: int,
    *,
    split: str = "train",
    cache_dir: str | os.PathLike[str] | None = None,
    num_proc: int | None = None,
) -> Any:
    """Tokenized training rows (``datasets.Dataset`` with columns input_ids int32, loss_mask int8), cached.

    The first call loads and normalizes ``source`` (:func:`load_conversations`), tokenizes it with
    ``datasets.map`` (``num_proc=None``: all cores, up to 16, for large sources) and saves it to
    :func:`dataset_cache_dir` (under ``cache_dir`` or ``<cache_root>/datasets``) through a temporary
    folder renamed when complete. Later calls with the same source content, tokenizer and
    max_length memory-map the saved copy. The :class:`DataReport` is logged and kept in
    ``dataset.info.description`` (see :func:`dataset_report`). Token rows are taken as given
    (:func:`_token_columns`). A chat template that cannot render the source's tool calls is refused
    before any row is tokenized (`tool_calls.check_tool_template`).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("build_dataset needs a fast tokenizer (offset mapping) to place the loss mask")
    root = Path(cache_dir) if cache_dir is not None else None
    folder = dataset_cache_dir(source, tokenizer, max_length, split, root)
    if (folder / "dataset_info.json").is_file():
        dataset = datasets.load_from_disk(str(folder))
        logger.info("tokenized dataset from cache %s: %s", folder, dataset_report(dataset).summary())
        return dataset

    conversations, report = load_conversations(source, split)
    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "loss_mask": datasets.List(datasets.Value("int8")),
            "problem": datasets.Value("string"),
            "unlocated": datasets.Value("int32"),
            "truncated": datasets.Value("bool"),
        }
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    if is_token_row(conversations[0]):  # one shape per source (`load_conversations`)
        rows = _token_columns(conversations, len(tokenizer), max_length)
        return _keep_usable(datasets.Dataset.from_dict(rows, features=features), conversations, report, folder)
    check_tool_template(tokenizer, conversations)
    # JSON text, not Arrow structs: Arrow would give every message every key of every other (a user turn
    # `tool_calls: None`, which templates test with `is defined`) and cannot hold arguments both as text and object.
    raw = datasets.Dataset.from_dict({"conversation": [json.dumps({k: row[k] for k in ("messages", "tools") if k in row})
                                                       for row in conversations]})
    if num_proc is None and len(raw) >= _PARALLEL_ROWS:
        num_proc = min(os.cpu_count() or 1, 16)
    num_proc = min(num_proc or 1, len(raw))
    fn_kwargs = {"tokenizer": tokenizer, "max_length": max_length}
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-map-", dir=folder.parent))  # the workers' shards
    try:
        if num_proc > 1:
            tokenized = _parallel_map(raw, fn_kwargs, features, num_proc, scratch)
        else:
            tokenized = raw.map(_tokenize_batch, batched=True, remove_columns=["conversation"], fn_kwargs=fn_kwargs,
                                features=features, desc="tokenizing")
        return _keep_usable(tokenized, conversations, report, folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _token_columns(rows: list[dict[str, Any]], vocab_size: int, max_length: int) -> dict[str, list[Any]]:
    """The columns `_tokenize_batch` gives, for token rows (`dflash.data.rows`, checked there): each row as given,
    cut to `max_length`. ``problem`` names a row holding an id at or past `vocab_size` (``len(tokenizer)``: tokens
    of another tokenizer) or one whose cut leaves no two consecutive supervised tokens; such a row keeps no ids."""
    out: dict[str, list[Any]] = {k: [] for k in ("input_ids", "loss_mask", "problem", "unlocated", "truncated")}
    for row in rows:
        ids, mask = row["input_ids"][:max_length], row["loss_mask"][:max_length]
        if (top := max(row["input_ids"])) >= vocab_size:
            problem = f"{OUTSIDE_VOCABULARY}: id {top} >= {vocab_size}, the tokenizer's size (another tokenizer's ids?)"
        else:
            problem = "" if has_valid_anchor(mask) else TOO_SHORT
        out["input_ids"].append([] if problem else ids)
        out["loss_mask"].append([] if problem else mask)
        out["problem"].append(problem)
        out["unlocated"].append(0)
        out["truncated"].append(len(row["input_ids"]) > max_length)
    return out


def _keep_usable(tokenized: Any, conversations: list[dict[str, Any]], report: DataReport, folder: Path) -> Any:
    """The usable rows of `tokenized` (each dropped one counted in `report`), saved to the cache `folder`
    through a temporary folder renamed when complete; the saved copy, memory-mapped."""
    for index, problem in enumerate(tokenized["problem"]):
        if problem:
            reason, _, detail = problem.partition(": ")
            report.skip(reason, conversations[index]["id"], detail)
    report.unlocated_turns = int(sum(tokenized["unlocated"]))
    report.truncated = int(sum(tokenized["truncated"]))
    kept = tokenized.filter(lambda problems: [not p for p in problems], input_columns="problem", batched=True)
    kept = kept.remove_columns(["problem", "unlocated", "truncated"])
    report.rows = len(kept)
    report.tokens = int(sum(len(ids) for ids in kept["input_ids"]))
    if report.rows == 0:
        raise ValueError(f"no rows with two consecutive supervised tokens in {report.summary()}")
    kept.info.description = report.to_json()

    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        kept.save_to_disk(str(tmp))
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / "dataset_info.json").is_file():  # not just a concurrent writer's copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    (logger.warning if report.skipped else logger.info)("tokenized %s", report.summary())
    return datasets.load_from_disk(str(folder))


def check_token_absent(dataset: Any, token_id: int, tokenizer: Any, *, max_rows: int = 20_000) -> None:
    """Refuse data in which the draft's mask token occurs as a real token (the draft could not tell the
    two apart); reads the first `max_rows` rows."""
    for i in range(min(len(dataset), max_rows)):
        if token_id in dataset[i]["input_ids"]:
            name = tokenizer.convert_ids_to_tokens(token_id) if tokenizer is not None else token_id
            raise ValueError(f"the mask token id {token_id} ({name!r}) appears in the training data (row {i}): "
                             "set draft.mask_token_id to a token that never occurs in the data")
