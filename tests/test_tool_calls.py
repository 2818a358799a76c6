"""Conversations with tool calls: normalized with their tool keys, the assistant's calls supervised and the tools'
results not, malformed tool rows counted, a chat template that drops tool calls refused in one line before any row
is tokenized, and regeneration of tool conversations refused."""

from __future__ import annotations

import copy
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_sources import write_jsonl
from test_tokenization import supervised_pieces

from dflash.cli.dry_run import phases
from dflash.config import DataSettings, TrainConfig
from dflash.data import corpus, tokenization
from dflash.data.corpus import TOOL_REGENERATION, prepare_corpus
from dflash.data.sources import dataset_report, load_conversations, normalize_row
from dflash.data.tokenization import build_dataset, tokenize_conversation
from dflash.evaluation.evaluate import prompt_ids

# A ChatML template that renders tools the Qwen / Hermes way: the schemas in a "# Tools" system block, an assistant's
# calls as <tool_call> JSON, and each tool result as a user turn in <tool_response>.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}{% if message.content or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{% if call.function.arguments is string %}{{ call.function.arguments }}"
    "{% else %}{{ call.function.arguments | tojson }}{% endif %}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _text(arguments: str | dict) -> str:
    """A call's arguments as JSON text (the template renders text as it is and an object as its JSON)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _call(city: str, call_id: str, text_arguments: bool = False) -> dict:
    arguments = json.dumps({"city": city}) if text_arguments else {"city": city}
    return {"type": "function", "id": call_id, "function": {"name": "get_weather", "arguments": arguments}}


# Two rounds: two calls answered by two results (arguments as an object and as JSON text), then a call with text.
TOOL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("Paris", "c1"), _call("Rome", "c2", True)]},
    {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 25}'},
    {"role": "assistant", "content": "Paris: 21 degrees. Rome: 25 degrees."},
    {"role": "user", "content": "And Oslo?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [_call("Oslo", "c3")]},
    {"role": "tool", "tool_call_id": "c3", "content": '{"temp": 9}'},
    {"role": "assistant", "content": "Oslo: 9 degrees."},
]
CALLS = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>',
         "Paris: 21 degrees. Rome: 25 degrees.<|im_end|>",
         'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
         "Oslo: 9 degrees.<|im_end|>"]


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer):
    """The embedded tokenizer with a chat template that renders tools, tool calls and tool results."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOL_TEMPLATE
    return tok


def test_tool_keys_are_kept_as_given_and_a_call_may_have_no_text():
    messages = normalize_row({"messages": TOOL_CHAT})
    assert messages[2] == {"role": "assistant", "content": "", "tool_calls": TOOL_CHAT[2]["tool_calls"]}
    assert messages[3] == TOOL_CHAT[3] and messages[4] == TOOL_CHAT[4]
    assert messages[7] == TOOL_CHAT[7]
    assert all(set(m) == {"role", "content"} for m in messages if m["role"] in ("system", "user"))


def test_tool_calls_are_supervised_as_the_assistants_and_tool_results_are_not(tool_tokenizer):
    messages = normalize_row({"messages": TOOL_CHAT})
    row = tokenize_conversation(messages, tool_tokenizer, max_length=1024, tools=TOOLS)
    assert row["input_ids"] == tool_tokenizer.apply_chat_template(messages, tools=TOOLS, return_dict=True)["input_ids"]
    assert supervised_pieces(row, tool_tokenizer) == CALLS and row["unlocated_turns"] == 0
    context = tool_tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if not m])
    assert "# Tools" in context and '"description": "The weather in a city."' in context  # the tools block: context
    for result in ('{"temp": 21}', '{"temp": 25}', '{"temp": 9}'):  # every tool result is context, never supervised
        assert f"<tool_response>\n{result}\n</tool_response>" in context
        assert not any(result in piece for piece in supervised_pieces(row, tool_tokenizer))


def test_tool_sources_build_the_same_rows_from_jsonl_and_parquet(tmp_path, tool_tokenizer):
    """Through `build_dataset`: tools reach the template, and arguments given as an object in one row and as text
    in another survive (Arrow could not hold both in one column); Parquet's nulls for absent keys are dropped."""
    plain = {"id": "plain", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    write_jsonl(tmp_path / "tools.jsonl", [{"id": "t", "messages": TOOL_CHAT, "tools": TOOLS}, plain])
    ds = build_dataset(tmp_path / "tools.jsonl", tool_tokenizer, max_length=1024, cache_dir=tmp_path / "cache")
    assert len(ds) == 2 and supervised_pieces(ds[0], tool_tokenizer) == CALLS
    assert ds[0]["input_ids"] == tokenize_conversation(normalize_row({"messages": TOOL_CHAT}), tool_tokenizer, 1024,
                                                       tools=TOOLS)["input_ids"]
    assert supervised_pieces(ds[1], tool_tokenizer) == ["Hello!<|im_end|>"]
    # Parquet: every message gets every key (null where absent); arguments and tools as JSON text.
    text_chat = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _text(c["function"]["arguments"])}}
                                      for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in TOOL_CHAT]
    pq.write_table(pa.Table.from_pylist([{"messages": text_chat, "tools": json.dumps(TOOLS)}]), tmp_path / "t.parquet")
    (conversation,), report = load_conversations(tmp_path / "t.parquet")
    assert conversation["tools"] == TOOLS and report.skipped == {}
    assert all(None not in m.values() for m in conversation["messages"])
    assert set(conversation["messages"][1]) == {"role", "content"}
    parquet = build_dataset(tmp_path / "t.parquet", tool_tokenizer, max_length=1024, cache_dir=tmp_path / "cache")
    assert parquet[0]["loss_mask"] == ds[0]["loss_mask"] and parquet[0]["input_ids"] == ds[0]["input_ids"]


def test_malformed_tool_rows_are_counted_and_named(tmp_path):
    user, reply = {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}

    def chat(*middle, **row):
        return {"messages": [user, *middle, reply], **row}

    def called(call):
        return {"role": "assistant", "content": "", "tool_calls": [call]}

    good = _call("Paris", "c1")
    rows = [
        chat(called(good), {"role": "tool", "tool_call_id": "c1", "content": "r"}, tools=TOOLS),  # line 1: good
        chat(called("get_weather(Paris)")),  # line 2: a call is text
        chat(called({"type": "function", "function": {"name": " ", "arguments": "{}"}})),  # line 3
        chat(called({"function": {"name": "f", "arguments": 3}})),  # line 4
        chat(called({**good, "type": "retrieval"})),  # line 5
        chat({"role": "assistant", "content": "", "tool_calls": {"name": "f"}}),  # line 6: not a list
        chat({"role": "user", "content": "x", "tool_calls": [good]}),  # line 7: calls on a user turn
        chat({"role": "tool", "content": "r"}),  # line 8: a result nobody asked for
        chat(called(good), {"role": "tool", "tool_call_id": "c9", "content": "r"}),  # line 9: answers no call
        chat(called(good), {"role": "tool", "name": 7, "content": "r"}),  # line 10
        chat(tools={"name": "f"}),  # line 11
        chat(tools="[{not json"),  # line 12
        chat({"role": "assistant", "content": None}),  # line 13: no text and no call
    ]
    write_jsonl(tmp_path / "bad.jsonl", rows)
    loaded, report = load_conversations(tmp_path / "bad.jsonl")
    assert len(loaded) == 1 and loaded[0]["tools"] == TOOLS
    assert report.skipped == {"malformed tool call": 6, "tool result without a tool call": 2,
                              "malformed tool result": 1, "malformed tools": 2, "empty content": 1}
    where = f"{tmp_path / 'bad.jsonl'} line"
    assert report.first_bad["malformed tool call"] == f"{where} 2: a call is a str, not an object"
    assert report.first_bad["tool result without a tool call"] == (
        f"{where} 8: a tool message must follow an assistant message with tool_calls")
    assert report.first_bad["malformed tool result"] == f"{where} 10: tool_call_id and name must be strings"
    assert report.first_bad["malformed tools"] == f"{where} 11: tools must be a list of JSON schemas (objects)"
    assert report.first_bad["empty content"] == f"{where} 13"
    details = {str(e) for e in _row_errors(rows)}
    assert {"malformed tool call: no function name", "malformed tool call: the arguments of 'f' are int, not a JSON "
            "string or an object", "malformed tool call: type 'retrieval' (expected 'function')",
            "malformed tool call: tool_calls is a dict, not a list", "malformed tool call: tool_calls on a user message",
            "tool result without a tool call: tool_call_id 'c9' answers no call of the assistant turn before it"} <= details


def _row_errors(rows):
    """The BadRow of each row that normalize_row refuses."""
    for row in rows:
        try:
            normalize_row(row)
        except ValueError as e:
            yield e


def test_a_template_that_drops_tool_calls_is_refused_in_one_line_before_tokenizing(tmp_path, tokenizer, monkeypatch):
    """The embedded SmolLM2 template renders an assistant's content only: its tool calls would train as empty
    replies. The probe refuses it before a row is tokenized, naming what is missing and the fix."""
    write_jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_CHAT}])
    tokenized = []
    monkeypatch.setattr(tokenization, "_tokenize_batch", lambda *a, **k: tokenized.append(1))
    with pytest.raises(ValueError) as refused:
        build_dataset(tmp_path / "tools.jsonl", tokenizer, max_length=256, cache_dir=tmp_path / "cache")
    message = str(refused.value)
    assert "\n" not in message and tokenized == []
    assert message.startswith(f"the chat template of {tokenizer.name_or_path} does not render tool calls (missing "
                              "from the text of a probe conversation: the tool call's name, its arguments)")
    assert "(Qwen3, Llama 3.1, Hermes-style templates)" in message and "input_ids + loss_mask rows" in message
    write_jsonl(tmp_path / "listed.jsonl", [{"messages": TOOL_CHAT[:2] + [TOOL_CHAT[5]], "tools": TOOLS}])
    with pytest.raises(ValueError, match=r"missing from the text of a probe conversation: the tools list\)"):
        build_dataset(tmp_path / "listed.jsonl", tokenizer, max_length=256, cache_dir=tmp_path / "cache")
    broken = copy.deepcopy(tokenizer)
    broken.chat_template = "{% for m in messages %}{{ m.tool_calls[0].nothing.name }}{% endfor %}"
    with pytest.raises(ValueError, match=r"^the chat template of .* cannot render tool calls \(UndefinedError"):
        build_dataset(tmp_path / "tools.jsonl", broken, max_length=256, cache_dir=tmp_path / "cache")


def test_regenerating_tool_conversations_is_refused_in_one_line(tmp_path, tool_tokenizer, monkeypatch):
    chats = [[TOOL_CHAT[0], {"role": "user", "content": f"Day {i}: weather in Paris and Rome?"}, *TOOL_CHAT[2:]]
             for i in range(4)]
    rows = [{"id": str(i), "messages": chat, "tools": TOOLS} for i, chat in enumerate(chats)]
    write_jsonl(tmp_path / "tools.jsonl", rows)
    settings = DataSettings(source=str(tmp_path / "tools.jsonl"), eval_size=1, cache_dir=str(tmp_path / "cache"))
    monkeypatch.setattr(corpus, "make_replier", lambda *a, **k: pytest.fail("a replier was made"))
    with pytest.raises(ValueError) as refused:
        prepare_corpus(settings, tool_tokenizer, None, "some-target")
    assert str(refused.value) == TOOL_REGENERATION == (
        "conversations with tool calls are regenerated whole (data.regenerate_turns=all); set data.regenerate=false "
        "to train their recorded assistant turns")
    settings.regenerate = False
    prepared = prepare_corpus(settings, tool_tokenizer, None, "some-target")
    assert len(prepared.train) == 3 and supervised_pieces(prepared.train[0], tool_tokenizer) == CALLS
    # The held-out prompt is rendered with the conversation's tools, as serving renders it.
    (held,) = prepared.held_out_conversations
    (ids,) = prompt_ids(tool_tokenizer, [held], num_prompts=1)
    assert ids == tool_tokenizer.apply_chat_template(chats[int(held["id"])][:2], tools=TOOLS, add_generation_prompt=True,
                                                     return_dict=True)["input_ids"]
    assert "# Tools" in tool_tokenizer.decode(ids)
    # The dry run counts the tool source, and refuses its regeneration as the run does.
    config = TrainConfig()
    config.data = settings
    assert phases(config)["phase_regeneration"] == "off (data.regenerate=false: the data's own replies)"
    config.data.regenerate = True
    with pytest.raises(ValueError, match="regenerated whole"):
        phases(config)


def test_the_report_of_a_tool_source_counts_its_rows(tmp_path, tool_tokenizer):
    write_jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_CHAT, "tools": TOOLS}, {"messages": [TOOL_CHAT[1]]}])
    report = dataset_report(build_dataset(tmp_path / "tools.jsonl", tool_tokenizer, 1024, cache_dir=tmp_path / "c"))
    assert report.conversations == report.rows == 1 and report.skipped == {"no assistant turn": 1}
    assert report.summary().startswith(f"{tmp_path / 'tools.jsonl'}: 1 conversations from 2 rows")
