"""Source formats: files, folders, saved datasets, hub datasets and in-memory rows -> normalized conversations
or token rows.

A conversation is ``{"id": str, "messages": [{"role", "content"}, ...], "tools"?: [schema, ...]}`` with the roles
system / user / assistant / tool; an assistant's ``tool_calls`` and a tool result's ``tool_call_id`` / ``name``
are kept as given (`dflash.data.tool_calls`). A source of pre-tokenized rows gives token rows instead,
``{"id": str, "input_ids": list[int], "loss_mask": list[int]}`` (`dflash.data.rows`), trained as given: one
shape per source, decided by its first usable row. Loading is strict at start (an empty or unreadable file is
an error naming it) and forgiving per row (a bad row is counted, skipped and reported with the first place it
occurred), so bad data never surfaces as a crash deep into training.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import datasets
import pyarrow.parquet as pq

from dflash.data.rows import BadRow, is_token_row, mixed_shape, token_row
from dflash.data.tool_calls import row_tools, tool_fields
from dflash.embedded import EMBEDDED_SOURCES, embedded_conversations

logger = logging.getLogger(__name__)

Message = dict[str, Any]  # {"role", "content"} and, on tool turns, their keys as given (`tool_calls.tool_fields`)
FILE_SUFFIXES = (".json", ".jsonl", ".parquet")
_ROLES = ("system", "user", "assistant")
_MESSAGE_ROLES = (*_ROLES, "tool")  # OpenAI-style ``messages``: a tool's result has its own role
# ShareGPT speaker names; OpenAI-style ``messages`` must use the roles above.
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
}
_ID_KEYS = ("id", "prompt_id", "conversation_id")
# What `datasets.Dataset.save_to_disk` (its state and info) and `DatasetDict.save_to_disk` write: a folder holding
# them is one dataset for `datasets.load_from_disk`, not a folder of .json data files (its metadata once read as
# "38 malformed JSON lines (dataset_info.json)").
_SAVED_DATASET = ("state.json", "dataset_info.json")
_SAVED_DATASET_DICT = "dataset_dict.json"


# --------------------------------------------------------------------------- reports


@dataclass
class DataReport:
    """What loading and tokenizing kept and skipped; every skip has a reason and a first place."""

    source: str
    rows_read: int = 0
    conversations: int = 0  # the usable rows: conversations, or token rows when `shape` says so
    shape: str = "conversations"
    skipped: dict[str, int] = field(default_factory=dict)
    first_bad: dict[str, str] = field(default_factory=dict)
    # Set by dflash.data.tokenization.build_dataset:
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
        text = f"{self.source}: {self.conversations} {self.shape} from {self.rows_read} rows"
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
    """The :class:`DataReport` stored in a dataset made by :func:`dflash.data.tokenization.build_dataset`."""
    return DataReport.from_json(dataset.info.description)


# --------------------------------------------------------------------------- loading


class LoadedConversations(NamedTuple):
    """``rows``: ``[{"id": str, "messages": [{"role", "content"}, ...], "tools"?: [...]}]``, or token rows
    ``[{"id": str, "input_ids": list[int], "loss_mask": list[int]}]``; ``report``: the counts."""

    rows: list[dict[str, Any]]
    report: DataReport


def _content_text(content: Any) -> str:
    """Text of a message content: a string, or OpenAI-style parts ``[{"type": "text", "text": ...}]``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRow("non-text content", type(content).__name__)


def _role(role: Any, roles: Mapping[str, str]) -> str:
    """The normalized name of a message's role; raises :class:`BadRow`."""
    if not isinstance(role, str) or not role:
        raise BadRow("missing role")
    if role.lower() not in roles:
        raise BadRow("unknown role", repr(role))
    return roles[role.lower()]


def _message(m: Mapping[str, Any], roles: Mapping[str, str], before: list[Message], openai: bool) -> Message:
    """One validated message (`before`: the conversation's messages so far); raises :class:`BadRow`. In OpenAI-style
    ``messages`` (`openai`) its tool keys come along (`tool_fields`), and an assistant's tool calls may stand
    without text."""
    role = _role(m.get("role", m.get("from")), roles)
    extra = tool_fields(m, role, before) if openai else {}
    content = m.get("content", m.get("value"))
    text = "" if content is None else _content_text(content)
    if not text.strip() and "tool_calls" not in extra:
        raise BadRow("empty content")
    return {"role": role, "content": text, **extra}


def normalize_row(row: Any, *, require_assistant: bool = True) -> list[Message]:
    """Messages of one dataset row, in any supported shape; raises :class:`BadRow`.

    Shapes: OpenAI ``messages`` [{role, content}] (with tool calls and tool results, `dflash.data.tool_calls`);
    ShareGPT ``conversations`` [{from, value}]; ``prompt``/``response`` or ``instruction`` (+ ``input``)/``output``
    pairs, with an optional ``system`` field. Trailing turns after the last assistant reply carry no supervision
    and are dropped. With ``require_assistant=False`` (prompts for regeneration) a user turn suffices.
    """
    if not isinstance(row, Mapping):
        raise BadRow("not a JSON object", type(row).__name__)
    if row.get("messages") is not None:
        raw, roles = row["messages"], dict(zip(_MESSAGE_ROLES, _MESSAGE_ROLES, strict=True))
    elif row.get("conversations") is not None:
        raw, roles = row["conversations"], _SHAREGPT_ROLES
    else:
        raw, roles = _pair_messages(row), dict(zip(_ROLES, _ROLES, strict=True))
    if not isinstance(raw, list) or not raw:
        raise BadRow("empty conversation")
    messages: list[Message] = []
    for m in raw:
        if not isinstance(m, Mapping):
            raise BadRow("message is not an object", type(m).__name__)
        messages.append(_message(m, roles, messages, openai=row.get("messages") is not None))
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
            row = json.loads(text)
        except json.JSONDecodeError as e:
            report.rows_read += 1
            report.skip("malformed JSON lines", where, e.msg)
            continue
        except RecursionError:  # no conversation nests this deep: a bad row, not a crash
            report.rows_read += 1
            report.skip("malformed JSON lines", where, "nested too deeply")
            continue
        yield where, row


def _iter_file(path: Path, report: DataReport) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of one JSON / JSONL / Parquet file; errors name the file."""
    name = str(path)
    if path.suffix == ".parquet":
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
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"cannot read {name}: {e}") from None
        for index, row in enumerate(rows):
            yield f"{name} row {index}", row
        return
    # JSON lines (a .json file not holding an array is read as JSON lines, as datasets does).
    yield from _iter_json_lines(data.splitlines(), name, report)


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a folder written by `datasets.Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return path.is_dir() and (all((path / name).is_file() for name in _SAVED_DATASET)
                              or (path / _SAVED_DATASET_DICT).is_file())


def local_files(path: Path) -> list[Path]:
    """The data files of a file or folder path (a saved dataset's: every file it holds, which is what
    identifies its content); raises naming the path when there are none."""
    if is_saved_dataset(path):
        return sorted(p for p in path.rglob("*") if p.is_file())
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in FILE_SUFFIXES)
        if not files:
            raise ValueError(f"no {'/'.join(FILE_SUFFIXES)} files in {path}")
        if saved := next((f.parent for f in files if is_saved_dataset(f.parent)), None):
            inner = saved.parent if (saved.parent / _SAVED_DATASET_DICT).is_file() else saved
            raise ValueError(f"{inner} inside {path} is a dataset saved with datasets' save_to_disk, not data files: "
                             f"give it as the source on its own (data.source={inner})")
        return files
    if path.suffix not in FILE_SUFFIXES:
        raise ValueError(f"{path}: unsupported file type (expected {'/'.join(FILE_SUFFIXES)})")
    return [path]


def _looks_like_path(source: str) -> bool:
    """Whether a missing source was meant as a local path (a hub name is ``owner/name``)."""
    return source.endswith(FILE_SUFFIXES) or source.startswith(("/", ".", "~"))


def local_source(source: str) -> list[Path] | None:
    """The data files of a `data.source` that is a local path, None for chitchat or a hub name. A missing
    path meant as one (a file suffix, or starting with / . ~) is a FileNotFoundError naming it: the one rule
    the run and the dry run both apply."""
    path = Path(source).expanduser()
    if source not in EMBEDDED_SOURCES and path.exists():
        return local_files(path)
    if source not in EMBEDDED_SOURCES and _looks_like_path(source):
        raise FileNotFoundError(f"dataset file or folder not found: {path}")
    return None


def _source_rows(source: Any, split: str, report: DataReport) -> Iterator[tuple[str, Any]]:
    """(where, raw row) from any supported source."""
    if isinstance(source, str) and (embedded := embedded_conversations(source)) is not None:
        for conv in embedded:
            yield f"{source} {conv['id']}", conv
        return
    if not isinstance(source, (str, os.PathLike)):
        # An in-memory datasets.Dataset or a list of rows.
        for index, row in enumerate(source):
            yield f"row {index}", row
        return
    files = local_source(str(source))
    if files is not None and is_saved_dataset(path := Path(source).expanduser()):
        yield from _saved_rows(path, split)
        return
    if files is not None:
        for file in files:
            count, skipped = 0, sum(report.skipped.values())
            for item in _iter_file(file, report):
                count += 1
                yield item
            if count == 0 and sum(report.skipped.values()) == skipped:
                raise ValueError(f"{file} holds no rows")
        return
    try:  # a hub name: datasets reads its local cache offline (HF_DATASETS_OFFLINE=1) once downloaded
        dataset = datasets.load_dataset(str(source), split=split)
    except Exception as e:
        raise ValueError(
            f"cannot load {source!r}: no such local file or folder, and datasets.load_dataset "
            f"failed ({type(e).__name__}: {e}); a hub dataset is read from its cache once downloaded online, or "
            "give a local file, a folder of them or a datasets save_to_disk folder"
        ) from e
    for index, row in enumerate(dataset):
        yield f"{source} row {index}", row


def _saved_rows(path: Path, split: str) -> Iterator[tuple[str, Any]]:
    """(where, row) of a `save_to_disk` folder, read with `datasets.load_from_disk`; a saved `DatasetDict`
    gives its `split`."""
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as e:  # a damaged arrow file or metadata: name the folder
        raise ValueError(f"cannot read {path}, a dataset saved with datasets' save_to_disk ({type(e).__name__}: "
                         f"{e}); save it again") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"{path} is a saved DatasetDict without a {split!r} split (it holds "
                             f"{', '.join(sorted(data))}); choose one with data.split")
        data = data[split]
    for index, row in enumerate(data):
        yield f"{path} row {index}", row


def load_conversations(
    source: Any, split: str = "train", *, require_assistant: bool = True
) -> LoadedConversations:
    """Conversations of a dataset, normalized to ``messages`` [{role, content}].

    ``source``: a JSON / JSONL / Parquet file, a folder of them (recursively, sorted), a
    ``datasets`` hub name (``split`` applies only there), ``"chitchat"``, or an in-memory
    ``datasets.Dataset`` / list of rows. Fails when nothing usable is left, naming the source;
    otherwise bad rows are counted in the report (logged as a warning) and skipped. A source of
    token rows (``input_ids`` + ``loss_mask``, `dflash.data.rows`) gives token rows; the first usable
    row decides the shape, and rows of the other shape are counted as bad (mixed shapes).
    """
    report = DataReport(source=_source_name(source))
    rows = []
    first = None  # where the first usable row was: it decided the source's shape (`report.shape`)
    for where, raw in _source_rows(source, split, report):
        report.rows_read += 1
        tokens = is_token_row(raw)
        try:
            if first is not None and tokens != (report.shape == "token rows"):
                raise mixed_shape(report.shape, first)
            row = token_row(raw) if tokens else _conversation(raw, require_assistant)
        except BadRow as e:
            report.skip(e.reason, where, e.detail)
            continue
        if first is None:
            first, report.shape = where, "token rows" if tokens else "conversations"
        row_id = next((raw[k] for k in _ID_KEYS if isinstance(raw.get(k), (str, int))), where)
        rows.append({"id": str(row_id), **row})
    report.conversations = len(rows)
    if not rows:
        raise ValueError(f"no usable conversations in {report.summary()}")
    (logger.warning if report.skipped else logger.info)("loaded %s", report.summary())
    return LoadedConversations(rows, report)


def _conversation(raw: Any, require_assistant: bool) -> dict[str, Any]:
    """``{"messages": [...], "tools"?: [...]}`` of a raw conversation row (`normalize_row`, `row_tools`); raises
    :class:`BadRow`."""
    messages = normalize_row(raw, require_assistant=require_assistant)
    tools = row_tools(raw)
    return {"messages": messages, **({"tools": tools} if tools else {})}


def _source_name(source: Any) -> str:
    """How a report names ``source``: its path or hub name, else the kind and size of the rows."""
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    return f"<{type(source).__name__} of {len(source)} rows>"
