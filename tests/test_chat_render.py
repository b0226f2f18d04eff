"""Chat rendering (runtime-spec §2): the literal examples of §2.9 byte for byte, the retention rules,
DSML tool calls and results, the engine renderers, and the official test-vector prompt counts."""

from __future__ import annotations

import json

import pytest

from ds4.engine.chat import (
    MAX_PREFIX,
    THINK_MAX_MIN_CONTEXT,
    ThinkMode,
    chat_append_assistant_prefix,
    chat_append_message,
    dsml_invoke,
    dsml_tool_calls,
    encode_chat_prompt,
    json_object_items,
    minify_json,
    render_chat,
    render_completion_prompt,
    think_mode_for_context,
    tool_schema_line,
    tools_prompt,
)
from ds4.paths import data_dir

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"

# §2.4, transcribed from the spec's one-line form (the \n there are newlines)
TOOLS_BLOCK_SPEC = (
    r'## Tools\n\nYou have access to a set of tools to help answer the user question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="$TOOL_NAME">\n<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n<｜DSML｜invoke name="$TOOL_NAME2">\n...\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nString parameters should be specified as raw text and set `string="true"`. Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters with XML or HTML entity escapes. Only if a string value itself contains the exact closing parameter tag `</｜DSML｜parameter>`, write that tag as `&lt;/｜DSML｜parameter>` inside the value. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n{SCHEMAS}\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. Use the exact parameter names from the schemas.'
).replace(r"\n", "\n")

MAX_PREFIX_SPEC = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

SIMPLE = [{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": "What is 2+2?"}]

WEATHER_REQUEST = json.loads(
    r'''{"messages":[{"role":"system","content":"Be brief."},
 {"role":"user","content":"Weather in Rome?"},
 {"role":"assistant","content":"","reasoning_content":"Need the tool.",
  "tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Rome\",\"days\":2}"}}]},
 {"role":"tool","tool_call_id":"call_1","content":"{\"temp_c\":21}"}],
 "tools":[{"type":"function","function":{"name":"get_weather","description":"Get weather for a city.","parameters":{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}},"required":["city"]}}}]}'''
)
WEATHER_SCHEMA = '{"name":"get_weather","description":"Get weather for a city.","parameters":{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}},"required":["city"]}}'
WEATHER_CALL = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)


# ---- §2.9 literal examples -------------------------------------------------------------------


def test_simple_prompt_three_modes(tok):
    tail = "You are a helpful assistant<｜User｜>What is 2+2?<｜Assistant｜>"
    assert render_chat(SIMPLE, think=ThinkMode.NONE) == BOS + tail + "</think>"
    assert render_chat(SIMPLE, think=ThinkMode.HIGH) == BOS + tail + "<think>"
    assert render_chat(SIMPLE, think=ThinkMode.MAX, ctx=THINK_MAX_MIN_CONTEXT) == BOS + MAX_PREFIX_SPEC + tail + "<think>"
    # §1.8: the MAX prompt is 95 tokens, of which the prefix is 79
    ids = tok.encode_chat(render_chat(SIMPLE, think=ThinkMode.MAX, ctx=THINK_MAX_MIN_CONTEXT))
    assert len(ids) == 95 and ids[:7] == [0, 77666, 288, 9504, 482, 28, 65174]
    assert len(tok.encode(MAX_PREFIX)) == 79


def test_think_max_needs_context():
    assert MAX_PREFIX == MAX_PREFIX_SPEC
    assert think_mode_for_context(ThinkMode.MAX, THINK_MAX_MIN_CONTEXT - 1) == ThinkMode.HIGH
    assert think_mode_for_context(ThinkMode.MAX, THINK_MAX_MIN_CONTEXT) == ThinkMode.MAX
    assert think_mode_for_context(ThinkMode.NONE, 10) == ThinkMode.NONE
    # below 384 Ki the server silently renders HIGH
    assert render_chat(SIMPLE, think=ThinkMode.MAX, ctx=32768) == render_chat(SIMPLE, think=ThinkMode.HIGH)


def test_tools_block_text():
    assert tools_prompt(["A", "B"]) == TOOLS_BLOCK_SPEC.replace("{SCHEMAS}", "A\nB")
    assert not tools_prompt(["x"]).endswith("\n")


def test_weather_tool_conversation(tok):
    msgs, tools = WEATHER_REQUEST["messages"], WEATHER_REQUEST["tools"]
    expected = (
        BOS + TOOLS_BLOCK_SPEC.replace("{SCHEMAS}", WEATHER_SCHEMA) + "\n\nBe brief."
        + USER + "Weather in Rome?" + ASSISTANT + "<think>Need the tool.</think>" + WEATHER_CALL + EOS
        + USER + '<tool_result>{"temp_c":21}</tool_result>' + ASSISTANT + "<think>"
    )
    text = render_chat(msgs, tools, ThinkMode.HIGH)
    assert text == expected
    assert len(tok.encode_chat(text)) == 431
    # NONE mode: no reasoning, prompt ends with </think>
    none = render_chat(msgs, tools, ThinkMode.NONE)
    assert ASSISTANT + "</think>" + WEATHER_CALL + EOS in none
    assert none.endswith(ASSISTANT + "</think>") and "Need the tool." not in none


def test_raw_schema_bytes_are_kept():
    raw = '{"name": "f",  "parameters": {"type": "object"}}'  # client spacing survives
    assert tool_schema_line(raw) == raw
    assert raw in render_chat([{"role": "user", "content": "x"}], [raw])


def test_anthropic_equivalent():
    msgs = [
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "use ls"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "."}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.c\nb.c"},
            {"type": "text", "text": "Now summarize."}]},
    ]
    text = render_chat(msgs, think=ThinkMode.HIGH)
    call = dsml_tool_calls([{"name": "ls", "input": {"path": "."}}])
    assert text.endswith(
        "<｜Assistant｜><think>use ls</think>Checking." + call + EOS
        + "<｜User｜><tool_result>a.c\nb.c</tool_result>Now summarize.<｜Assistant｜><think>"
    )
    assert call.startswith("\n\n<｜DSML｜tool_calls>") and call.endswith("</｜DSML｜tool_calls>")


def test_responses_equivalent():
    msgs = [
        {"role": "user", "content": "pwd?"},
        {"role": "assistant", "reasoning": "run pwd", "content": "",
         "tool_calls": [{"name": "shell", "arguments": '{"command":"pwd"}'}]},
        {"role": "tool", "content": "/home"},
    ]
    text = render_chat(msgs, think=ThinkMode.HIGH)
    assert text == (BOS + "<｜User｜>pwd?<｜Assistant｜><think>run pwd</think>"
                    + dsml_tool_calls(msgs[1]["tool_calls"]) + EOS
                    + "<｜User｜><tool_result>/home</tool_result><｜Assistant｜><think>")


# ---- §2.2/§2.3 rules -------------------------------------------------------------------------


def test_reasoning_dropped_without_tools():
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "first answer", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "q2"},
    ]
    text = render_chat(msgs, think=ThinkMode.HIGH)
    assert text == BOS + "<｜User｜>q1<｜Assistant｜></think>first answer" + EOS + "<｜User｜>q2<｜Assistant｜><think>"


def test_reasoning_kept_after_last_user_and_with_tool_history():
    # an assistant message after the last user message keeps its reasoning; the prompt ends in EOS
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    assert render_chat(msgs, think=ThinkMode.HIGH) == BOS + "<｜User｜>q<｜Assistant｜><think>r</think>a" + EOS
    # tool history without schemas still keeps every turn's reasoning (empty -> <think></think>)
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "", "reasoning_content": "tool reasoning",
         "tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "content": "/tmp"},
    ]
    text = render_chat(msgs, think=ThinkMode.HIGH)
    assert "<｜Assistant｜><think></think>a1" in text
    assert "<think>tool reasoning</think>" in text and "<tool_result>/tmp</tool_result>" in text
    assert "## Tools" not in text
    # NONE mode always renders </think>
    assert "<think>" not in render_chat(msgs, think=ThinkMode.NONE)


def test_system_hoisting_and_order():
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "dev rules"},
        {"role": "system", "content": [{"type": "text", "text": "sys "}, {"type": "image_url"}, "two"]},
    ]
    text = render_chat(msgs, ["T"], ThinkMode.NONE)
    assert text.startswith(BOS + TOOLS_BLOCK_SPEC.replace("{SCHEMAS}", "T") + "\n\ndev rules\n\nsys two<｜User｜>hi")


def test_tool_runs_and_odd_roles():
    msgs = [
        {"role": "tool", "content": "one"},
        {"role": "function", "content": "two </tool_result> <x> & ｜DSML｜"},
        {"role": "narrator", "content": "ignored"},
        {"role": "user", "content": None},
        {"role": "assistant", "content": "x"},
        {"role": "assistant", "content": "y"},  # not pending: no marker
    ]
    text = render_chat(msgs, think=ThinkMode.NONE)
    assert text == (BOS + "<｜User｜><tool_result>one</tool_result><tool_result>two &lt;/tool_result> <x> & ｜DSML｜"
                    "</tool_result><｜User｜><｜Assistant｜></think>x" + EOS + "y" + EOS)


def test_completion_prompt():
    assert render_completion_prompt("Once", ThinkMode.NONE) == (
        BOS + "You are a helpful assistant<｜User｜>Once<｜Assistant｜></think>")


# ---- §2.5 DSML ---------------------------------------------------------------------------------


def test_dsml_arguments():
    assert dsml_invoke("x", "{}") == '<｜DSML｜invoke name="x">\n</｜DSML｜invoke>\n'
    assert dsml_invoke("x", "") == '<｜DSML｜invoke name="x">\n</｜DSML｜invoke>\n'
    assert dsml_invoke('a&b"<>', "{}").startswith('<｜DSML｜invoke name="a&amp;b&quot;&lt;&gt;">')
    # key order kept, non-strings minified from the client's own text
    args = '{"description": "d", "command": "ls && echo 2>&1", "n": 1.50, "list": [1, 2, {"k": "v w"}]}'
    out = dsml_invoke("run", args)
    assert out == (
        '<｜DSML｜invoke name="run">\n'
        '<｜DSML｜parameter name="description" string="true">d</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="command" string="true">ls && echo 2>&1</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="n" string="false">1.50</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="list" string="false">[1,2,{"k":"v w"}]</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
    )
    # the closing tag inside values
    out = dsml_invoke("w", '{"s": "a</｜DSML｜parameter>b", "o": ["</｜DSML｜parameter>"]}')
    assert "a&lt;/｜DSML｜parameter>b</｜DSML｜parameter>" in out
    assert '["\\u003c/｜DSML｜parameter>"]</｜DSML｜parameter>' in out
    # not an object: one raw string parameter
    assert dsml_invoke("f", "[1, 2]") == ('<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="arguments" '
                                          'string="true">[1, 2]</｜DSML｜parameter>\n</｜DSML｜invoke>\n')
    # parsed objects are accepted too
    assert dsml_invoke("f", {"a": [1, 2], "b": "t"}) == dsml_invoke("f", '{"a":[1,2],"b":"t"}')
    # string escapes are decoded for string parameters
    assert '>tab\there "q"<' in dsml_invoke("f", r'{"s":"tab\there \"q\""}')


def test_json_helpers():
    assert minify_json(' [ 1 , "a b" , { "k" : null } ] ') == '[1,"a b",{"k":null}]'
    assert json_object_items('{"a":1,"a":2}') == [("a", "1", False), ("a", "2", False)]
    assert json_object_items("[1]") is None
    assert json_object_items('{"a":') is None


def test_raw_dsml_replayed_verbatim():
    raw = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="x">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "raw_dsml": raw + "  ", "tool_calls": [{"name": "x", "arguments": "{}"}]}]
    assert raw + "  " + EOS in render_chat(msgs, think=ThinkMode.NONE)


# ---- §2.7 engine renderers ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", [ThinkMode.NONE, ThinkMode.HIGH, ThinkMode.MAX])
@pytest.mark.parametrize("system", ["You are a helpful assistant", ""])
def test_engine_renderer_agrees_with_server(tok, mode, system):
    prompt = "Explain the <b>difference</b> between 2+2 and 2*2, in 三 words.\n"
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    server = tok.encode_chat(render_chat(msgs, think=mode))
    assert encode_chat_prompt(tok, system, prompt, mode) == server


def test_engine_renderer_keeps_user_specials_as_text(tok):
    ids = encode_chat_prompt(tok, "", "say <think> now", ThinkMode.NONE)
    assert ids.count(tok.think_open_id) == 0 and ids[-1] == tok.think_close_id


def test_chat_append_message(tok):
    ids = [tok.bos_id]
    chat_append_message(tok, ids, "system", "S")
    chat_append_message(tok, ids, "user", "hi")
    chat_append_message(tok, ids, "assistant", "hello")
    chat_append_message(tok, ids, "tool", "out")
    chat_append_assistant_prefix(tok, ids, ThinkMode.HIGH)
    assert ids == ([0] + tok.encode("S") + [tok.user_id] + tok.encode("hi") + [tok.assistant_id, tok.think_close_id]
                   + tok.encode("hello") + [tok.user_id] + tok.encode("Tool: ") + tok.encode("out")
                   + [tok.assistant_id, tok.think_open_id])
    ids = chat_append_message(tok, [], "assistant", "</think>done")
    assert ids == [tok.assistant_id] + tok.encode("</think>done")
    with pytest.raises(ValueError):
        chat_append_message(tok, [], "narrator", "x")


# ---- official test vectors (tooling-spec §5): prompt = encode_chat_prompt("", text, NONE) ----------


def test_official_vector_prompt_counts(tok):
    root = data_dir() / "test-vectors"
    manifest = json.loads((root / "manifest.json").read_text())
    assert len(manifest["prompts"]) == 5
    for case in manifest["prompts"]:
        text = (root / case["prompt_file"]).read_text(encoding="utf-8")
        assert len(text) == case["prompt_chars"]
        official = json.loads((root / case["official_file"]).read_text(encoding="utf-8"))
        assert official["request"]["thinking"]["type"] == "disabled"
        assert [m["role"] for m in official["request"]["messages"]] == ["user"]
        expected = official["usage"]["prompt_tokens"]
        engine_ids = encode_chat_prompt(tok, "", text, ThinkMode.NONE)
        server_ids = tok.encode_chat(render_chat(official["request"]["messages"], think=ThinkMode.NONE))
        assert len(engine_ids) == expected, case["id"]
        assert server_ids == engine_ids
