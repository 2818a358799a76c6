"""Datasets -> chat template -> ``input_ids``, ``loss_mask``; padded, pinned, prefetched batches.

A data row is ``{"input_ids": list[int], "loss_mask": list[int]}`` of one rendered conversation:
``loss_mask`` is 1 exactly on the tokens of assistant replies (end-of-turn token included), the
positions a draft learns to predict. Loading is strict at start (an empty or unreadable file is an
error naming it) and forgiving per row (a bad row is counted, skipped and reported with the first
place it occurred), so bad data never surfaces as a crash deep into training.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Sampler

from dflash.embedded import cache_root, chitchat_conversations, chitchat_path

logger = logging.getLogger(__name__)

Message = dict[str, str]
FILE_SUFFIXES = (".json", ".jsonl", ".parquet")
# Bump when the tokenization or the cached layout changes: old caches then stop matching.
_CACHE_VERSION = 1
_ROLES = ("system", "user", "assistant")
# ShareGPT speaker names; OpenAI-style ``messages`` must use the three roles above.
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
}
_ID_KEYS = ("id", "prompt_id", "conversation_id")


# --------------------------------------------------------------------------- reports


@dataclass
class DataReport:
    """What loading and tokenizing kept and skipped; every skip has a reason and a first place."""

    source: str
    rows_read: int = 0
    conversations: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    first_bad: dict[str, str] = field(default_factory=dict)
    # Set by build_dataset:
    truncated: int = 0
    unlocated_turns: int = 0
    rows: int = 0
    tokens: int = 0

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        """Count one bad row under ``reason``; remember where the first one was."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.first_bad.setdefault(reason, f"{where}: {detail}" if detail else where)

    def summary(self) -> str:
        """One human-readable line, naming the first bad row of each reason."""
        text = f"{self.source}: {self.conversations} conversations from {self.rows_read} rows"
        if self.skipped:
            parts = [f"{n} {reason} (first: {self.first_bad[reason]})" for reason, n in self.skipped.items()]
            text += f"; skipped {sum(self.skipped.values())}: " + ", ".join(parts)
        if self.rows:
            text += f"; {self.rows} rows, {self.tokens} tokens"
        if self.truncated:
            text += f"; truncated {self.truncated} rows"
        if self.unlocated_turns:
            text += (
                f"; {self.unlocated_turns} assistant turns left unsupervised "
                "(the chat template renders them differently once the conversation goes on)"
            )
        return text

    def to_json(self) -> str:
        """JSON text of the report (stored with a cached dataset)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DataReport:
        """Inverse of :meth:`to_json`."""
        return cls(**json.loads(text))


def dataset_report(dataset: Any) -> DataReport:
    """The :class:`DataReport` stored in a dataset made by :func:`build_dataset`."""
    return DataReport.from_json(dataset.info.description)


# --------------------------------------------------------------------------- loading


class BadRow(ValueError):
    """A row that cannot become a conversation; ``reason`` is the category it is counted under."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class LoadedConversations(NamedTuple):
    """``rows``: ``[{"id": str, "messages": [{"role", "content"}, ...]}]``; ``report``: the counts."""

    rows: list[dict[str, Any]]
    report: DataReport


def _content_text(content: Any) -> str:
    """Text of a message content: a string, or OpenAI-style parts ``[{"type": "text", "text": ...}]``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRow("non-text content", type(content).__name__)


def _message(role: Any, content: Any, roles: Mapping[str, str]) -> Message:
    """One validated message; raises :class:`BadRow`."""
    if not isinstance(role, str) or not role:
        raise BadRow("missing role")
    if role.lower() not in roles:
        raise BadRow("unknown role", repr(role))
    if content is None:
        raise BadRow("empty content")
    text = _content_text(content)
    if not text.strip():
        raise BadRow("empty content")
    return {"role": roles[role.lower()], "content": text}


def normalize_row(row: Any, *, require_assistant: bool = True) -> list[Message]:
    """Messages of one dataset row, in any supported shape; raises :class:`BadRow`.

    Shapes: OpenAI ``messages`` [{role, content}]; ShareGPT ``conversations`` [{from, value}];
    ``prompt``/``response`` or ``instruction`` (+ ``input``)/``output`` pairs, with an optional
    ``system`` field. Trailing turns after the last assistant reply carry no supervision and are
    dropped. With ``require_assistant=False`` (prompts for regeneration) a user turn suffices.
    """
    if not isinstance(row, Mapping):
        raise BadRow("not a JSON object", type(row).__name__)
    if row.get("messages") is not None:
        raw, roles = row["messages"], dict(zip(_ROLES, _ROLES, strict=True))
    elif row.get("conversations") is not None:
        raw, roles = row["conversations"], _SHAREGPT_ROLES
    else:
        raw, roles = _pair_messages(row), dict(zip(_ROLES, _ROLES, strict=True))
    if not isinstance(raw, list) or not raw:
        raise BadRow("empty conversation")
    messages = []
    for m in raw:
        if not isinstance(m, Mapping):
            raise BadRow("message is not an object", type(m).__name__)
        role = m.get("role", m.get("from"))
        messages.append(_message(role, m.get("content", m.get("value")), roles))
    last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if require_assistant:
        if last_assistant < 0:
            raise BadRow("no assistant turn")
        messages = messages[: last_assistant + 1]
    elif not any(m["role"] == "user" for m in messages):
        raise BadRow("no user turn")
    return messages


def _pair_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Messages of a ``prompt``/``response`` or ``instruction``/``input``/``output`` row."""
    if "prompt" in row:
        prompt, reply = row["prompt"], row.get("response", row.get("completion"))
    elif "instruction" in row:
        prompt, reply = row["instruction"], row.get("output")
        extra = row.get("input")
        if isinstance(prompt, str) and isinstance(extra, str) and extra.strip():
            prompt = f"{prompt}\n\n{extra}"
    else:
        raise BadRow("no conversation fields", ", ".join(sorted(map(str, row))) or "empty object")
    messages = [{"role": "user", "content": prompt}]
    if row.get("system"):
        messages.insert(0, {"role": "system", "content": row["system"]})
    if reply is not None:
        messages.append({"role": "assistant", "content": reply})
    return messages


def _iter_json_lines(lines: Iterable[bytes], name: str, report: DataReport) -> Iterator[tuple[str, Any]]:
    """(where, object) for each JSON line; undecodable or malformed lines are counted and skipped."""
    for number, raw in enumerate(lines, 1):
        where = f"{name} line {number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            report.rows_read += 1
            report.skip("non-UTF-8 lines", where, str(e))
            continue
        if not text.strip():
            continue
        try:
            yield where, json.loads(text)
        except json.JSONDecodeError as e:
            report.rows_read += 1
            report.skip("malformed JSON lines", where, e.msg)


def _iter_file(path: Path, report: DataReport) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of one JSON / JSONL / Parquet file; errors name the file."""
    name = str(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except Exception as e:
            raise ValueError(f"cannot read {name}: {e}") from e
        index = 0
        for batch in parquet.iter_batches():
            for row in batch.to_pylist():
                yield f"{name} row {index}", row
                index += 1
        return
    data = path.read_bytes()
    if not data.strip():
        raise ValueError(f"{name} is empty")
    if path.suffix == ".json" and data.lstrip()[:1] == b"[":
        try:
            rows = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {name}: {e}") from e
        for index, row in enumerate(rows):
            yield f"{name} row {index}", row
        return
    # JSON lines (a .json file not holding an array is read as JSON lines, as datasets does).
    yield from _iter_json_lines(data.splitlines(), name, report)


def _local_files(path: Path) -> list[Path]:
    """The data files of a file or folder path; raises naming the path when there are none."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in FILE_SUFFIXES)
        if not files:
            raise ValueError(f"no {'/'.join(FILE_SUFFIXES)} files in {path}")
        return files
    if path.suffix not in FILE_SUFFIXES:
        raise ValueError(f"{path}: unsupported file type (expected {'/'.join(FILE_SUFFIXES)})")
    return [path]


def _looks_like_path(source: str) -> bool:
    """Whether a missing source was meant as a local path (a hub name is ``owner/name``)."""
    return source.endswith(FILE_SUFFIXES) or source.startswith(("/", ".", "~"))


def _source_rows(source: Any, split: str, report: DataReport) -> Iterator[tuple[str, Any]]:
    """(where, raw row) from any supported source."""
    if isinstance(source, str) and source == "chitchat":
        for conv in chitchat_conversations():
            yield f"chitchat {conv['id']}", conv
        return
    if not isinstance(source, (str, os.PathLike)):
        # An in-memory datasets.Dataset or a list of rows.
        for index, row in enumerate(source):
            yield f"row {index}", row
        return
    path = Path(source).expanduser()
    if path.exists():
        for file in _local_files(path):
            count, skipped = 0, sum(report.skipped.values())
            for item in _iter_file(file, report):
                count += 1
                yield item
            if count == 0 and sum(report.skipped.values()) == skipped:
                raise ValueError(f"{file} holds no rows")
        return
    if _looks_like_path(str(source)):
        raise FileNotFoundError(f"dataset file or folder not found: {path}")
    import datasets

    try:
        dataset = datasets.load_dataset(str(source), split=split)
    except Exception as e:
        raise ValueError(
            f"cannot load {source!r}: no such local file or folder, and datasets.load_dataset "
            f"failed ({type(e).__name__}: {e})"
        ) from e
    for index, row in enumerate(dataset):
        yield f"{source} row {index}", row


def load_conversations(
    source: Any, split: str = "train", *, require_assistant: bool = True
) -> LoadedConversations:
    """Conversations of a dataset, normalized to ``messages`` [{role, content}].

    ``source``: a JSON / JSONL / Parquet file, a folder of them (recursively, sorted), a
    ``datasets`` hub name (``split`` applies only there), ``"chitchat"``, or an in-memory
    ``datasets.Dataset`` / list of rows. Fails when nothing usable is left, naming the source;
    otherwise bad rows are counted in the report (logged as a warning) and skipped.
    """
    report = DataReport(source=_source_name(source))
    rows = []
    for where, raw in _source_rows(source, split, report):
        report.rows_read += 1
        try:
            messages = normalize_row(raw, require_assistant=require_assistant)
        except BadRow as e:
            report.skip(e.reason, where, e.detail)
            continue
        row_id = next((raw[k] for k in _ID_KEYS if isinstance(raw.get(k), (str, int))), where)
        rows.append({"id": str(row_id), "messages": messages})
    report.conversations = len(rows)
    if not rows:
        raise ValueError(f"no usable conversations in {report.summary()}")
    (logger.warning if report.skipped else logger.info)("loaded %s", report.summary())
    return LoadedConversations(rows, report)


def _source_name(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    return f"<{type(source).__name__} of {len(source)} rows>"


# --------------------------------------------------------------------------- tokenizing


def _render(tokenizer: Any, messages: Sequence[Message], generation_prompt: bool = False) -> str:
    """The chat template's text for ``messages``."""
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation_prompt
    )


def _assistant_spans(
    messages: Sequence[Message], tokenizer: Any, full: str, max_chars: int
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
    replies past ``max_chars`` (cut by truncation) are not looked for: long chats stay linear.
    """
    spans: list[tuple[int, int]] = []
    unlocated = 0
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            before = _render(tokenizer, messages[:k], generation_prompt=True)
            through = _render(tokenizer, messages[: k + 1])
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


def tokenize_conversation(messages: Sequence[Message], tokenizer: Any, max_length: int) -> dict[str, Any]:
    """Token ids of the chat-rendered conversation and its loss mask, both of length <= max_length.

    Returns ``{"input_ids": list[int], "loss_mask": list[int], "unlocated_turns": int,
    "truncated": bool}``. A token is supervised when its characters overlap an assistant reply span
    (:func:`_assistant_spans`). Offsets come from one tokenization of the full text, which is
    exactly what ``apply_chat_template(tokenize=True)`` produces; a token merged across the
    template/reply boundary is still placed, where diffing prefix tokenizations would disagree with
    the full one. Needs a fast tokenizer (offset mapping).
    """
    text = _render(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoded["input_ids"])[:max_length]
    offsets = encoded["offset_mapping"]
    truncated = len(offsets) > max_length
    # Characters from the first token cut by truncation on are never supervised.
    max_chars = offsets[max_length][0] if truncated else len(text) + 1
    spans, unlocated = _assistant_spans(messages, tokenizer, text, max_chars)
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


def has_supervised_pair(loss_mask: Sequence[int]) -> bool:
    """Whether some position i has ``loss_mask[i]`` and ``loss_mask[i + 1]`` (a valid anchor)."""
    return any(loss_mask[i] and loss_mask[i + 1] for i in range(len(loss_mask) - 1))


_TOO_SHORT = "no two consecutive supervised tokens"
# Chat templates render in Python at ~100 rows/s per core: from this many rows on, use all cores.
_PARALLEL_ROWS = 2000


def _tokenize_batch(batch: dict[str, list[Any]], tokenizer: Any, max_length: int) -> dict[str, list[Any]]:
    """``datasets.map`` function: messages -> input_ids, loss_mask and per-row bookkeeping.

    ``problem`` is "" for a usable row, else the reason it is dropped (counted by the caller).
    """
    columns = ("input_ids", "loss_mask", "problem", "unlocated", "truncated")
    out: dict[str, list[Any]] = {k: [] for k in columns}
    for messages in batch["messages"]:
        try:
            row = tokenize_conversation(messages, tokenizer, max_length)
        except Exception as e:  # the template refuses this conversation (e.g. roles out of order)
            row = {"input_ids": [], "loss_mask": [], "unlocated_turns": 0, "truncated": False}
            problem = f"chat template error: {type(e).__name__}: {e}"
        else:
            problem = "" if has_supervised_pair(row["loss_mask"]) else _TOO_SHORT
        out["input_ids"].append(row["input_ids"])
        out["loss_mask"].append(row["loss_mask"])
        out["problem"].append(problem)
        out["unlocated"].append(row["unlocated_turns"])
        out["truncated"].append(row["truncated"])
    return out


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
    if isinstance(source, str) and source == "chitchat":
        stat = chitchat_path().stat()
        return {"chitchat": [stat.st_size, stat.st_mtime_ns]}
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        if path.exists():
            files = _local_files(path)
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
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)[:40]
    return (root or cache_root() / "datasets") / f"{slug}-{digest}"


def build_dataset(
    source: Any,
    tokenizer: Any,
    max_length: int,
    *,
    split: str = "train",
    cache_dir: str | os.PathLike[str] | None = None,
    num_proc: int | None = None,
) -> Any:
    """Tokenized training rows (``datasets.Dataset`` with columns input_ids, loss_mask), cached.

    The first call loads and normalizes ``source`` (:func:`load_conversations`), tokenizes it with
    ``datasets.map`` (``num_proc=None``: all cores, up to 16, for large sources) and saves it to
    :func:`dataset_cache_dir` (under ``cache_dir`` or ``<cache_root>/datasets``) through a temporary
    folder renamed when complete. Later calls with the same source content, tokenizer and
    max_length memory-map the saved copy. The :class:`DataReport` is logged and kept in
    ``dataset.info.description`` (see :func:`dataset_report`).
    """
    import datasets

    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("build_dataset needs a fast tokenizer (offset mapping) to place the loss mask")
    root = Path(cache_dir) if cache_dir is not None else None
    folder = dataset_cache_dir(source, tokenizer, max_length, split, root)
    if (folder / "dataset_info.json").is_file():
        dataset = datasets.load_from_disk(str(folder))
        logger.info("tokenized dataset from cache %s: %s", folder, dataset_report(dataset).summary())
        return dataset

    conversations, report = load_conversations(source, split)
    raw = datasets.Dataset.from_dict({"messages": [row["messages"] for row in conversations]})
    if num_proc is None and len(raw) >= _PARALLEL_ROWS:
        num_proc = min(os.cpu_count() or 1, 16)
    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "loss_mask": datasets.List(datasets.Value("int8")),
            "problem": datasets.Value("string"),
            "unlocated": datasets.Value("int32"),
            "truncated": datasets.Value("bool"),
        }
    )
    tokenized = raw.map(
        _tokenize_batch,
        batched=True,
        remove_columns=["messages"],
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length},
        features=features,
        num_proc=num_proc,
        desc="tokenizing",
    )
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

    folder.parent.mkdir(parents=True, exist_ok=True)
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


# --------------------------------------------------------------------------- batches


class Collator:
    """Pads rows to a bucketed length so batch shapes repeat (static shapes for compile / graphs).

    ``rows[b]`` has ``input_ids`` and ``loss_mask`` of length L_b. The batch length is
    ``S = ceil(max L_b / bucket_multiple) * bucket_multiple``, capped at ``max_length`` (rows longer
    than S are cut). Right padding with ``pad_token_id``; ``loss_mask`` is False on padding.
    ``bucket_multiple = max_length`` gives one fixed shape.
    """

    def __init__(self, pad_token_id: int, bucket_multiple: int = 64, max_length: int | None = None) -> None:
        if bucket_multiple < 1:
            raise ValueError(f"bucket_multiple must be >= 1, got {bucket_multiple}")
        self.pad_token_id = pad_token_id
        self.bucket_multiple = bucket_multiple
        self.max_length = max_length

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, settings: Any) -> Collator:
        """The collator of `settings` (a `DataSettings`), padding with the tokenizer's pad token (else
        eos, else 0)."""
        pad = getattr(tokenizer, "pad_token_id", None)
        pad = pad if pad is not None else getattr(tokenizer, "eos_token_id", None) or 0
        return cls(pad, settings.bucket_multiple, settings.max_length)

    @property
    def num_lengths(self) -> int | None:
        """How many padded lengths S batches can have (None without ``max_length``: unbounded)."""
        return math.ceil(self.max_length / self.bucket_multiple) if self.max_length else None

    def length(self, longest: int) -> int:
        """Padded length S for a batch whose longest row has ``longest`` tokens."""
        padded = math.ceil(max(longest, 1) / self.bucket_multiple) * self.bucket_multiple
        return min(padded, self.max_length) if self.max_length else padded

    def __call__(self, rows: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, torch.Tensor]:
        """``{"input_ids": LongTensor[B, S], "loss_mask": BoolTensor[B, S]}``."""
        seq = self.length(max(len(r["input_ids"]) for r in rows))
        input_ids = torch.full((len(rows), seq), self.pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros((len(rows), seq), dtype=torch.bool)
        for b, row in enumerate(rows):
            n = min(len(row["input_ids"]), seq)
            input_ids[b, :n] = torch.as_tensor(row["input_ids"][:n], dtype=torch.long)
            loss_mask[b, :n] = torch.as_tensor(row["loss_mask"][:n]).bool()
        return {"input_ids": input_ids, "loss_mask": loss_mask}


def max_valid_anchors(loss_mask_cpu: torch.Tensor) -> int:
    """Largest per-row count of valid anchors (i with ``loss_mask[i]`` and ``loss_mask[i+1]``).

    ``loss_mask_cpu``: BoolTensor[B, S] on the host, read before the copy to the device, so
    bounding the anchor width costs no device sync.
    """
    if loss_mask_cpu.device.type != "cpu":
        raise ValueError("max_valid_anchors reads a host tensor; call it before the copy to the device")
    if loss_mask_cpu.numel() == 0:
        return 0
    from dflash.anchors import valid_anchor_mask  # the one valid-anchor rule

    return int(valid_anchor_mask(loss_mask_cpu).sum(dim=1).max())


class ResumableSampler(Sampler[int]):
    """Deterministic (optionally sharded) sample order that can start mid-epoch.

    Epoch e's order is a permutation seeded by (seed, e); rank r of w takes every w-th index
    (each rank gets ``n // w``). Each ``iter()`` plays the current epoch and then advances it, so a
    loop over epochs needs no ``set_epoch``. ``start`` indices of the first epoch played are skipped
    (``skip_batches * batch_size`` when resuming).
    """

    def __init__(
        self,
        num_samples: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        epoch: int = 0,
        start: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = epoch
        self.start = start
        self.rank = rank
        self.world_size = world_size

    def indices(self, epoch: int) -> list[int]:
        """This rank's full sample order of ``epoch``."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        per_rank = self.num_samples // self.world_size
        return order[self.rank :: self.world_size][:per_rank]

    def __iter__(self) -> Iterator[int]:
        order = self.indices(self.epoch)[self.start :]
        self.epoch += 1
        self.start = 0
        return iter(order)

    def __len__(self) -> int:
        return self.num_samples // self.world_size - self.start


def make_dataloader(
    dataset: Any,
    batch_size: int,
    collator: Collator,
    *,
    shuffle: bool = True,
    seed: int = 0,
    num_workers: int = 2,
    drop_last: bool = True,
    epoch: int = 0,
    skip_batches: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> DataLoader:
    """DataLoader over ``dataset`` with a deterministic, resumable order (:class:`ResumableSampler`).

    Resume at global batch k of an epoch with ``epoch=e, skip_batches=k``. Batches are pinned when
    a GPU exists (so the device copy can be ``non_blocking`` without a hidden sync) and workers
    persist across epochs.
    """
    sampler = ResumableSampler(
        len(dataset),
        shuffle=shuffle,
        seed=seed,
        epoch=epoch,
        start=skip_batches * batch_size,
        rank=rank,
        world_size=world_size,
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collator,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed),
    )


class DevicePrefetcher:
    """Iterates ``loader`` with each batch already on ``device``, the next one copying meanwhile.

    CUDA: copies run ``non_blocking`` from pinned memory on a side stream, one batch ahead; the
    consumer's stream waits for the copy (``wait_stream``) and the tensors are marked as used there
    (``record_stream``) so the allocator never recycles them early. Other devices: a plain ``.to``
    (a passthrough on CPU).
    """

    def __init__(self, loader: Iterable[Mapping[str, Any]], device: torch.device | str) -> None:
        self.loader = loader
        self.device = torch.device(device)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.device.type != "cuda":
            for batch in self.loader:
                yield {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            return
        stream = torch.cuda.Stream(self.device)
        batches = iter(self.loader)
        ahead = self._copy(next(batches, None), stream)
        while ahead is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(stream)
            for value in ahead.values():
                if torch.is_tensor(value):
                    value.record_stream(current)
            batch = ahead
            ahead = self._copy(next(batches, None), stream)
            yield batch

    def _copy(self, batch: Mapping[str, Any] | None, stream: torch.cuda.Stream) -> dict[str, Any] | None:
        """Start the host->device copy of ``batch`` on ``stream`` (pinning first if needed)."""
        if batch is None:
            return None
        with torch.cuda.stream(stream):
            return {
                k: (v if v.is_pinned() else v.pin_memory()).to(self.device, non_blocking=True)
                if torch.is_tensor(v)
                else v
                for k, v in batch.items()
            }
