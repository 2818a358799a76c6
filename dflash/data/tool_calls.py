"""Conversations with tool calls (the OpenAI / Hugging Face chat-template shape): their checks, and the chat template's.

An assistant message may carry ``tool_calls``, ``[{"type": "function", "function": {"name": str, "arguments": str |
dict}, "id"?: str}]`` (its content may then be empty or null); a message of role ``tool`` carries a tool's result
(string content, optional ``tool_call_id`` and ``name``) and answers a call of the assistant turn before it; a row's
``tools`` lists the tools' JSON schemas. These keys are kept as given, so the chat template renders them, and the
markup it renders for an assistant's calls is supervised as that assistant's reply (`dflash.data.tokenization`).
:func:`check_tool_template` refuses a template that would drop them, before any row is tokenized.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from dflash.data.rows import BadRow

BAD_CALL = "malformed tool call"
BAD_RESULT = "malformed tool result"
ORPHAN_RESULT = "tool result without a tool call"
BAD_TOOLS = "malformed tools"
# The probe's markers: words no template writes by itself, so each one found in the text is the part it marks.
_CALLED, _ARGUMENT, _RESULT, _LISTED = "dflashprobecalled", "dflashprobeargument", "dflashproberesult", "dflashprobelisted"
_PROBE_ID = "call00001"  # 9 alphanumeric characters: Mistral's templates refuse other tool call ids


def _check_call(call: Any) -> None:
    """Raise :class:`BadRow` unless `call` is ``{"type"?: "function", "function": {"name", "arguments"}, "id"?}``."""
    if not isinstance(call, Mapping):
        raise BadRow(BAD_CALL, f"a call is a {type(call).__name__}, not an object")
    if call.get("type") not in (None, "function"):
        raise BadRow(BAD_CALL, f"type {call['type']!r} (expected 'function')")
    function = call.get("function")
    if not isinstance(function, Mapping):
        raise BadRow(BAD_CALL, "no 'function' object")
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise BadRow(BAD_CALL, "no function name")
    if not isinstance(function.get("arguments"), (str, Mapping)):
        raise BadRow(BAD_CALL, f"the arguments of {name!r} are {type(function.get('arguments')).__name__}, "
                               "not a JSON string or an object")
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise BadRow(BAD_CALL, f"the id of {name!r} is not a string")


def tool_fields(message: Mapping[str, Any], role: str, before: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The tool keys of one OpenAI-style message of (normalized) `role`, checked and as given: an assistant's
    non-empty ``tool_calls``; a tool result's ``tool_call_id`` and ``name``. `before`: the conversation's normalized
    messages so far (a result answers a call of the assistant turn before it). Raises :class:`BadRow`."""
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        raise BadRow(BAD_CALL, f"tool_calls on a {role} message")
    if role == "assistant":
        if calls is None:
            return {}
        if not isinstance(calls, list):
            raise BadRow(BAD_CALL, f"tool_calls is a {type(calls).__name__}, not a list")
        for call in calls:
            _check_call(call)
        return {"tool_calls": calls} if calls else {}
    if role != "tool":
        return {}
    fields = {key: message[key] for key in ("tool_call_id", "name") if message.get(key) is not None}
    if not all(isinstance(value, str) for value in fields.values()):
        raise BadRow(BAD_RESULT, "tool_call_id and name must be strings")
    asker = next((m for m in reversed(before) if m["role"] != "tool"), None)
    if asker is None or "tool_calls" not in asker:
        raise BadRow(ORPHAN_RESULT, "a tool message must follow an assistant message with tool_calls")
    ids = {call.get("id") for call in asker["tool_calls"]} - {None}
    if ids and "tool_call_id" in fields and fields["tool_call_id"] not in ids:
        raise BadRow(ORPHAN_RESULT, f"tool_call_id {fields['tool_call_id']!r} answers no call of the assistant "
                                    "turn before it")
    return fields


def row_tools(row: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """A row's ``tools`` (a list of JSON schemas, or its JSON text as Parquet files often hold it), None when it
    has none; raises :class:`BadRow`."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise BadRow(BAD_TOOLS, f"tools is text but not JSON ({e.msg})") from None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, Mapping) for tool in tools):
        raise BadRow(BAD_TOOLS, "tools must be a list of JSON schemas (objects)")
    return tools


def calls_tools(conversation: Mapping[str, Any]) -> bool:
    """Whether a normalized conversation holds an assistant's tool calls or a tool's result."""
    return any(m["role"] == "tool" or "tool_calls" in m for m in conversation.get("messages", ()))


def uses_tools(conversation: Mapping[str, Any]) -> bool:
    """Whether a normalized conversation holds tool calls, tool results or a tools list."""
    return calls_tools(conversation) or bool(conversation.get("tools"))


def check_tool_template(tokenizer: Any, conversations: Sequence[Mapping[str, Any]]) -> None:
    """Refuse, in one line and before any row is tokenized, a chat template that cannot render the tool turns of
    `conversations` (the one probe of a template's tool support; nothing when none uses tools).

    The probe renders a user turn, an assistant tool call whose function name and arguments are unique markers,
    the tool's result (a marker) and, when a conversation lists tools, a tools list whose one schema is named by a
    marker; a marker missing from the text is a part the template drops. SmolLM2's template renders an
    assistant's content only: its tool calls would train as empty replies. Raises ValueError naming what is
    missing and the fix."""
    calls, listed = any(map(calls_tools, conversations)), any(c.get("tools") for c in conversations)
    if not (calls or listed):
        return
    call = {"type": "function", "id": _PROBE_ID, "function": {"name": _CALLED, "arguments": {"query": _ARGUMENT}}}
    probe = [{"role": "user", "content": "Look it up."}, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": _PROBE_ID, "content": _RESULT}]
    schema = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
    tools = [{"type": "function", "function": {"name": _LISTED, "description": "Look up.", "parameters": schema}}]
    name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    fix = ("train a target whose chat template renders tool calls (Qwen3, Llama 3.1, Hermes-style templates), or "
           "convert the rows to pre-tokenized input_ids + loss_mask rows (trained as given)")
    try:
        text = tokenizer.apply_chat_template(probe, tools=tools if listed else None, tokenize=False)
    except Exception as e:  # a template that refuses tool turns outright
        raise ValueError(f"the chat template of {name} cannot render tool calls ({type(e).__name__}: {e}), and the "
                         f"data holds conversations that use tools: {fix}") from None
    parts = [("the tool call's name", _CALLED, calls), ("its arguments", _ARGUMENT, calls),
             ("the tool result", _RESULT, calls), ("the tools list", _LISTED, listed)]
    if missing := [part for part, marker, asked in parts if asked and marker not in text]:
        raise ValueError(f"the chat template of {name} does not render tool calls (missing from the text of a probe "
                         f"conversation: {', '.join(missing)}), and the data holds conversations that use tools: {fix}")
