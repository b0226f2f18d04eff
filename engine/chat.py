"""DeepSeek V4 chat prompt rendering as ds4 does it (runtime-spec §2).

Two renderers, as in ds4:

* the **server renderer** `render_chat(messages, tools, think)` builds the prompt *text*
  (system region with the tools block, user/assistant/tool turns, DSML tool calls, tool results);
  tokenize it with `Tokenizer.encode_chat`, which turns the protocol specials into their ids;
* the **engine renderers** `encode_chat_prompt`, `chat_append_message`,
  `chat_append_assistant_prefix` build token lists directly, BPE-encoding each piece of text on its
  own with plain `Tokenizer.encode` (no special token is recognised inside user text).

Both agree byte for byte on simple prompts. Messages are OpenAI-style dicts:
`{"role", "content", "reasoning_content" | "reasoning", "tool_calls", "tool_call_id"}`; Anthropic
content blocks (`text`, `thinking`, `tool_use`, `tool_result`) are understood too.
"""

from __future__ import annotations

import json
from enum import IntEnum

from ds4.gguf_tools.constants import (
    ASSISTANT_TEXT,
    BOS_TEXT,
    EOS_TEXT,
    THINK_CLOSE_TEXT,
    THINK_OPEN_TEXT,
    USER_TEXT,
)


class ThinkMode(IntEnum):
    NONE = 0
    HIGH = 1
    MAX = 2

    @property
    def enabled(self) -> bool:
        return self != ThinkMode.NONE


THINK_MAX_MIN_CONTEXT = 393216  # Think-Max needs at least 384 Ki tokens of context

MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)

DEFAULT_SYSTEM = "You are a helpful assistant"

DSML = "｜DSML｜"
TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
PARAMETER_CLOSE = f"</{DSML}parameter>"
TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"

TOOLS_PROMPT_HEAD = (
    "## Tools\n\nYou have access to a set of tools to help answer the user question. You can invoke "
    f'tools by writing a "{TOOL_CALLS_OPEN}" block like the following:\n\n'
    f"{TOOL_CALLS_OPEN}\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_CLOSE}\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"{TOOL_CALLS_CLOSE}\n\n"
    'String parameters should be specified as raw text and set `string="true"`. Preserve characters '
    "such as `>`, `&`, and `&&` exactly; never replace normal string characters with XML or HTML "
    "entity escapes. Only if a string value itself contains the exact closing parameter tag "
    f"`{PARAMETER_CLOSE}`, write that tag as `&lt;/{DSML}parameter>` inside the value. For all other "
    "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_PROMPT_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls. Use the exact parameter names from the schemas."
)


def think_mode_for_context(mode: ThinkMode, ctx: int | None) -> ThinkMode:
    """MAX with a context below 393216 becomes HIGH (ds4_think_mode_for_context)."""
    mode = ThinkMode(mode)
    if mode == ThinkMode.MAX and ctx is not None and ctx < THINK_MAX_MIN_CONTEXT:
        return ThinkMode.HIGH
    return mode


def generation_prefix(mode: ThinkMode) -> str:
    """What follows the last user turn: the assistant marker and the think tag."""
    return ASSISTANT_TEXT + (THINK_OPEN_TEXT if ThinkMode(mode).enabled else THINK_CLOSE_TEXT)


# ---------------------------------------------------------------------------------------------
# JSON helpers that keep the client's bytes: ds4 renders schemas and non-string tool arguments
# from the raw request JSON, not from a re-serialisation.


def _compact_json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def minify_json(raw: str) -> str:
    """Remove whitespace outside JSON strings (ds4 keeps numbers and escapes as the client wrote
    them)."""
    out = []
    in_string = False
    escaped = False
    for ch in raw:
        if in_string:
            out.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            out.append(ch)
        elif ch not in " \t\r\n":
            out.append(ch)
    return "".join(out)


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def _scan_string(s: str, i: int) -> int:
    """Index just past the JSON string starting at s[i] == '"'; -1 if unterminated."""
    i += 1
    while i < len(s):
        if s[i] == "\\":
            i += 2
        elif s[i] == '"':
            return i + 1
        else:
            i += 1
    return -1


def _scan_value(s: str, i: int) -> int:
    """Index just past the non-string JSON value starting at s[i]; -1 if malformed."""
    depth = 0
    start = i
    while i < len(s):
        ch = s[i]
        if ch == '"':
            i = _scan_string(s, i)
            if i < 0:
                return -1
            continue
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            if depth == 0:
                break
            depth -= 1
            if depth == 0:
                i += 1
                break
        elif ch == "," and depth == 0:
            break
        i += 1
    if depth != 0 or i == start:
        return -1
    return i


def json_object_items(raw: str) -> list[tuple[str, str, bool]] | None:
    """Top-level (key, value, is_string) triples of a JSON object text, in order, duplicates kept.
    String values are decoded; other values are the client's text minified. None if `raw` is not
    an object."""
    s = raw
    i = _skip_ws(s, 0)
    if i >= len(s) or s[i] != "{":
        return None
    i = _skip_ws(s, i + 1)
    items = []
    try:
        while i < len(s) and s[i] != "}":
            if s[i] != '"':
                return None
            end = _scan_string(s, i)
            if end < 0:
                return None
            key = json.loads(s[i:end])
            i = _skip_ws(s, end)
            if i >= len(s) or s[i] != ":":
                return None
            i = _skip_ws(s, i + 1)
            if i < len(s) and s[i] == '"':
                end = _scan_string(s, i)
                if end < 0:
                    return None
                items.append((key, json.loads(s[i:end]), True))
            else:
                end = _scan_value(s, i)
                if end < 0:
                    return None
                items.append((key, minify_json(s[i:end]), False))
            i = _skip_ws(s, end)
            if i < len(s) and s[i] == ",":
                i = _skip_ws(s, i + 1)
    except json.JSONDecodeError:
        return None
    if i >= len(s) or s[i] != "}":
        return None
    return items


# ---------------------------------------------------------------------------------------------
# tools block, DSML tool calls, tool results


def tool_schema_line(tool) -> str:
    """One schema line of the tools block. A string is taken as the client's raw JSON bytes;
    an OpenAI `{"type":"function","function":{...}}` renders its `function` object; Responses
    `tool_search` and `namespace` entries are synthesised as ds4 does; anything else renders as
    itself (compact JSON, key order kept)."""
    if isinstance(tool, str):
        return tool
    if isinstance(tool, dict):
        kind = tool.get("type")
        if kind == "function" and isinstance(tool.get("function"), dict):
            return _compact_json(tool["function"])
        if kind == "tool_search":
            return _compact_json(
                {
                    "name": "tool_search",
                    "description": tool.get("description") or "Search available tools.",
                    "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
                }
            )
    return _compact_json(tool)


def tool_schema_lines(tools) -> list[str]:
    lines = []
    for tool in tools or []:
        if isinstance(tool, dict) and tool.get("type") == "namespace":
            ns = tool.get("name", "")
            for inner in tool.get("tools", []):
                fn = inner.get("function", inner) if isinstance(inner, dict) else {}
                lines.append(
                    _compact_json(
                        {
                            "name": ns + fn.get("name", ""),
                            "description": fn.get("description", ""),
                            "parameters": fn.get("parameters", {"type": "object", "properties": {}}),
                        }
                    )
                )
        else:
            lines.append(tool_schema_line(tool))
    return lines


def tools_prompt(schema_lines: list[str]) -> str:
    """The tools block of §2.4 (no trailing newline)."""
    return TOOLS_PROMPT_HEAD + "\n".join(schema_lines) + TOOLS_PROMPT_TAIL


def escape_attr(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def escape_parameter_text(text: str) -> str:
    """Only the closing parameter tag is protected inside a string value."""
    return text.replace(PARAMETER_CLOSE, "&lt;" + PARAMETER_CLOSE[1:])


def escape_parameter_json(text: str) -> str:
    return text.replace(PARAMETER_CLOSE, "\\u003c" + PARAMETER_CLOSE[1:])


def escape_tool_result(text: str) -> str:
    return text.replace(TOOL_RESULT_CLOSE, "&lt;" + TOOL_RESULT_CLOSE[1:])


def _call_name_and_arguments(call: dict) -> tuple[str, object]:
    """(name, arguments) of an OpenAI, Anthropic (tool_use) or plain tool call."""
    if isinstance(call.get("function"), dict):
        fn = call["function"]
        return fn.get("name", ""), fn.get("arguments", "")
    if "input" in call:
        return call.get("name", ""), call["input"]
    return call.get("name", ""), call.get("arguments", "")


def dsml_invoke(name: str, arguments) -> str:
    """One `<｜DSML｜invoke>` element in ds4's canonical form (§2.5)."""
    raw = arguments if isinstance(arguments, str) else _compact_json(arguments if arguments is not None else {})
    out = [f'<{DSML}invoke name="{escape_attr(name)}">\n']
    items = json_object_items(raw) if raw.strip() else []
    if items is None:  # not a JSON object: the whole text as one string parameter
        out.append(f'<{DSML}parameter name="arguments" string="true">{escape_parameter_text(raw)}{PARAMETER_CLOSE}\n')
    else:
        for key, value, is_string in items:
            body = escape_parameter_text(value) if is_string else escape_parameter_json(value)
            flag = "true" if is_string else "false"
            out.append(f'<{DSML}parameter name="{escape_attr(key)}" string="{flag}">{body}{PARAMETER_CLOSE}\n')
    out.append(f"</{DSML}invoke>\n")
    return "".join(out)


def dsml_tool_calls(calls: list[dict], raw_dsml: str | None = None) -> str:
    """The DSML block that follows an assistant message's content; `raw_dsml` (the exact sampled
    block, when known) is replayed verbatim instead."""
    if not calls:
        return ""
    if raw_dsml:
        return raw_dsml
    body = "".join(dsml_invoke(*_call_name_and_arguments(c)) for c in calls)
    return f"\n\n{TOOL_CALLS_OPEN}\n{body}{TOOL_CALLS_CLOSE}"


def tool_result(text: str) -> str:
    return TOOL_RESULT_OPEN + escape_tool_result(text) + TOOL_RESULT_CLOSE


# ---------------------------------------------------------------------------------------------
# message normalisation


def content_text(content) -> str:
    """OpenAI/Anthropic content -> text: strings and `text` fields concatenated with no separator,
    Anthropic `tool_result` blocks wrapped as tool results, everything else (images…) dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        content = [content]
    parts = []
    for item in content:
        if isinstance(item, str):
            parts.append(item)
        elif isinstance(item, dict):
            kind = item.get("type")
            if kind == "tool_result":
                parts.append(tool_result(content_text(item.get("content"))))
            elif kind in (None, "text", "input_text", "output_text") and isinstance(item.get("text"), str):
                parts.append(item["text"])
    return "".join(parts)


def _message_parts(message: dict) -> tuple[str, str, list[dict]]:
    """(content, reasoning, tool_calls) of one message, Anthropic blocks included."""
    content = message.get("content")
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        reasoning = message.get("reasoning")
    calls = list(message.get("tool_calls") or [])
    if isinstance(content, list):
        thinking = [b.get("thinking", "") for b in content if isinstance(b, dict) and b.get("type") == "thinking"]
        if thinking and reasoning is None:
            reasoning = "".join(thinking)
        calls += [b for b in content if isinstance(b, dict) and b.get("type") == "tool_use"]
    return content_text(content), reasoning or "", calls


# ---------------------------------------------------------------------------------------------
# server renderer (§2.2)


def _is_system(role: str) -> bool:
    return role in ("system", "developer")


def _is_tool(role: str) -> bool:
    return role in ("tool", "function")


def render_chat(
    messages: list[dict],
    tools: list | None = None,
    think: ThinkMode = ThinkMode.HIGH,
    ctx: int | None = None,
) -> str:
    """The prompt text ds4's server renders for a chat request (tokenize with `encode_chat`).

    `tools`: tool definitions (dicts or raw JSON schema strings, see `tool_schema_line`); `think`:
    the requested think mode; `ctx`: the allocated context, used to downgrade MAX to HIGH below
    393216 (None: the mode is taken as already resolved)."""
    think = think_mode_for_context(think, ctx)
    schema_lines = tool_schema_lines(tools)
    parts = [tools_prompt(schema_lines)] if schema_lines else []
    for m in messages:
        if _is_system(m.get("role", "")):
            parts.append(content_text(m.get("content")))
    system = "\n\n".join(parts)

    normalised = [(m.get("role", ""), m) for m in messages]
    tool_context = bool(schema_lines) or any(
        _is_tool(role) or (role == "assistant" and _message_parts(m)[2]) for role, m in normalised
    )
    last_user_idx = max((i for i, (role, _) in enumerate(normalised) if role == "user" or _is_tool(role)), default=-1)

    out = [BOS_TEXT]
    if think == ThinkMode.MAX:
        out.append(MAX_PREFIX)
    out.append(system)
    pending_assistant = False
    pending_tool_result = False
    for i, (role, m) in enumerate(normalised):
        if role == "user":
            out.append(USER_TEXT + content_text(m.get("content")))
            pending_assistant, pending_tool_result = True, False
        elif _is_tool(role):
            if not pending_tool_result:
                out.append(USER_TEXT)
            out.append(tool_result(content_text(m.get("content"))))
            pending_assistant = pending_tool_result = True
        elif role == "assistant":
            content, reasoning, calls = _message_parts(m)
            if pending_assistant:
                out.append(ASSISTANT_TEXT)
                if think.enabled and (tool_context or i > last_user_idx):
                    out.append(THINK_OPEN_TEXT + reasoning + THINK_CLOSE_TEXT)
                else:
                    out.append(THINK_CLOSE_TEXT)
            out.append(content + dsml_tool_calls(calls, m.get("raw_dsml")) + EOS_TEXT)
            pending_assistant = pending_tool_result = False
        # any other role (and system/developer, hoisted above) renders nothing here
    if pending_assistant:
        out.append(generation_prefix(think))
    return "".join(out)


def render_completion_prompt(prompt: str, think: ThinkMode = ThinkMode.HIGH, ctx: int | None = None) -> str:
    """What ds4's `/v1/completions` renders around a raw prompt."""
    think = think_mode_for_context(think, ctx)
    prefix = MAX_PREFIX if think == ThinkMode.MAX else ""
    return BOS_TEXT + prefix + DEFAULT_SYSTEM + USER_TEXT + prompt + generation_prefix(think)


# ---------------------------------------------------------------------------------------------
# engine renderers (§2.7): token level, every text piece BPE'd on its own


def encode_chat_prompt(tokenizer, system: str | None, prompt: str, mode: ThinkMode) -> list[int]:
    """[BOS] + BPE(MAX prefix)? + BPE(system)? + [User] + BPE(prompt) + [Assistant] + think tag."""
    mode = ThinkMode(mode)
    ids = [tokenizer.bos_id]
    if mode == ThinkMode.MAX:
        ids += tokenizer.encode(MAX_PREFIX)
    if system:
        ids += tokenizer.encode(system)
    ids.append(tokenizer.user_id)
    ids += tokenizer.encode(prompt)
    chat_append_assistant_prefix(tokenizer, ids, mode)
    return ids


def chat_append_assistant_prefix(tokenizer, ids: list[int], mode: ThinkMode) -> list[int]:
    ids.append(tokenizer.assistant_id)
    ids.append(tokenizer.think_open_id if ThinkMode(mode).enabled else tokenizer.think_close_id)
    return ids


def chat_append_message(tokenizer, ids: list[int], role: str, content: str) -> list[int]:
    """Append one message the way ds4's engine helper does (no tool_result wrapper on this path)."""
    if _is_system(role):
        ids += tokenizer.encode(content)
    elif role == "assistant":
        ids.append(tokenizer.assistant_id)
        if not (content.startswith(THINK_OPEN_TEXT) or content.startswith(THINK_CLOSE_TEXT)):
            ids.append(tokenizer.think_close_id)
        ids += tokenizer.encode(content)
    elif role == "user":
        ids.append(tokenizer.user_id)
        ids += tokenizer.encode(content)
    elif _is_tool(role):
        ids.append(tokenizer.user_id)
        ids += tokenizer.encode("Tool: ")
        ids += tokenizer.encode(content)
    else:
        raise ValueError(f"unknown chat role {role!r}")
    return ids
