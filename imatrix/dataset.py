"""Calibration records → rendered chat text (tooling-spec §3.3).

A record is `{"messages": [...], "tools"?: [...], "mode"?: "think"|"nothink", "id"?, "category"?,
"source"?, "rendered"?}`; assistant messages may carry `reasoning` and `dsml` (the raw DSML block).
Rendering goes through the engine's server renderer (`ds4.engine.chat.render_chat`), in think mode,
no-think mode or both, every rendered line right-stripped, as ds4's dataset builder does. A record that
already has `rendered` text is taken as is unless asked to re-render.
"""

from __future__ import annotations

import hashlib

from ds4.imatrix.collect import Prompt, marker_line

MODES = ("nothink", "think")


class RecordError(ValueError):
    pass


def record_id(category: str, source: str, mode: str, rendered: str) -> str:
    key = "\0".join((category, source, mode, rendered[:4096])).encode("utf-8")
    return f"{category}-{hashlib.sha1(key).hexdigest()[:12]}"


def _messages_for_renderer(messages: list) -> list[dict]:
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise RecordError("every message must be an object with a 'role'")
        m = dict(m)
        dsml = m.pop("dsml", None)
        if dsml and not m.get("tool_calls"):
            # The raw DSML block follows the content verbatim (what the renderer emits for raw_dsml).
            m["content"] = (m.get("content") or "") + dsml
        out.append(m)
    return out


def render_messages(messages: list, mode: str, tools: list | None = None) -> str:
    from ds4.engine.chat import ThinkMode, render_chat

    if mode not in MODES:
        raise RecordError(f"mode must be one of {MODES}, got {mode!r}")
    think = ThinkMode.HIGH if mode == "think" else ThinkMode.NONE
    text = render_chat(_messages_for_renderer(messages), tools or None, think)
    return "\n".join(line.rstrip() for line in text.split("\n"))


def render_record(rec: dict, modes: tuple[str, ...] = MODES, index: int = 0, rerender: bool = False) -> list[Prompt]:
    """The prompts of one record: its recorded rendering, or one rendering per requested mode."""
    category = str(rec.get("category", "custom"))
    source = str(rec.get("source", ""))
    if rec.get("rendered") and not rerender:
        mode = str(rec.get("mode", ""))
        if mode and mode not in modes:
            return []
        text = str(rec["rendered"])
        return [Prompt(str(rec.get("id") or record_id(category, source, mode, text)), text, mode, category, source)]
    messages = rec.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RecordError(f"record {index}: needs a non-empty 'messages' list (or 'rendered' text)")
    wanted = [rec["mode"]] if rec.get("mode") else list(modes)
    out = []
    for mode in wanted:
        if mode not in modes:
            continue
        text = render_messages(messages, mode, rec.get("tools"))
        pid = str(rec.get("id")) if rec.get("id") and len(wanted) == 1 else record_id(category, source, mode, text)
        out.append(Prompt(pid, text, mode, category, source))
    return out


def rendered_file_text(prompts: list[Prompt]) -> str:
    """The marker format of rendered_prompts.txt: marker line + rendered text per prompt."""
    return "".join(marker_line(p) + p.text for p in prompts)
