"""The ds4-eval trace file (tooling-spec §7.5): one writer and one reader, side by side.

The trace is plain text: a header of `key: value` lines, then one section per case, then a
summary. Prompts and the model output are stored as counted blocks
(`LABEL_BEGIN bytes=N`, the N raw UTF-8 bytes, a newline only when the text does not end with
one, `LABEL_END`), so text inside a block can never be mistaken for a marker by the reader.

The writer appends and flushes one whole case at a time, so an interrupted run leaves a trace
that the reader (and `--regrade-trace`) still accepts; the summary is written on close.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

TRACE_MAGIC = "# ds4-eval trace"
_CASE_RE = re.compile(rb"^===== CASE (\d+)/(\d+) (.*) =====$")
_BLOCK_RE = re.compile(rb"^([A-Z_]+)_BEGIN bytes=(\d+)$")
BLOCK_FIELDS = {"SYSTEM_PROMPT": "system_prompt", "QUESTION_PROMPT": "question_prompt",
                "MODEL_OUTPUT": "output"}


class TraceError(ValueError):
    """The file is not a ds4-eval trace (user mistake, exit 2)."""


@dataclass
class TraceCase:
    number: int
    total: int
    source: str
    id: str
    status: str
    picked: str = "?"
    expected: str = ""
    domain: str = ""
    title: str = ""
    timestamp_unix: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    elapsed_sec: float = 0.0
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.05
    think_mode_effective: str = "high"
    think_close: str = "none"
    think_close_token_index: int = 0
    think_close_remaining_budget: int = 0
    think_close_rank: int = 0
    error: str = ""
    choices: tuple[str, ...] | None = None
    system_prompt: str = ""
    question_prompt: str = ""
    output: str = ""
    extra: dict = field(default_factory=dict)   # keys the reader does not know, kept verbatim


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _block(label: str, text: str) -> bytes:
    data = text.encode("utf-8")
    tail = b"" if data.endswith(b"\n") else b"\n"
    return b"%s_BEGIN bytes=%d\n" % (label.encode(), len(data)) + data + tail + \
        b"%s_END\n" % label.encode()


def render_header(fields: dict) -> str:
    lines = [TRACE_MAGIC]
    lines += [f"{k}: {_one_line(v)}" for k, v in fields.items()]
    return "\n".join(lines) + "\n\n"


def render_case(case: TraceCase) -> str:
    """The text of one case section (blank line included)."""
    out = [f"===== CASE {case.number}/{case.total} {case.source}/{case.id} =====",
           f"timestamp_unix: {case.timestamp_unix}", f"source: {case.source}", f"id: {case.id}",
           f"domain: {_one_line(case.domain)}", f"title: {_one_line(case.title)}",
           f"status: {case.status}", f"picked: {case.picked or '?'}",
           f"expected: {case.expected}", f"prompt_tokens: {case.prompt_tokens}",
           f"generated_tokens: {case.generated_tokens}", f"elapsed_sec: {case.elapsed_sec:.3f}",
           f"temperature: {case.temperature:.6g}", f"top_p: {case.top_p:.6g}",
           f"min_p: {case.min_p:.6g}", f"think_mode_effective: {case.think_mode_effective}",
           f"think_close: {case.think_close}"]
    if case.think_close != "none":
        out += [f"think_close_token_index: {case.think_close_token_index}",
                f"think_close_remaining_budget: {case.think_close_remaining_budget}",
                f"think_close_rank: {case.think_close_rank}"]
    if case.error:
        out.append(f"error: {_one_line(case.error)}")
    out += [f"{k}: {_one_line(v)}" for k, v in case.extra.items()]
    if case.choices:
        out.append("choices:")
        out += [f"  {chr(65 + i)}. {_one_line(c)}" for i, c in enumerate(case.choices)]
    else:
        out.append("answer_kind: exact_integer")
    text = "\n".join(out) + "\n"
    blocks = _block("SYSTEM_PROMPT", case.system_prompt) + \
        _block("QUESTION_PROMPT", case.question_prompt) + _block("MODEL_OUTPUT", case.output)
    return text + blocks.decode("utf-8") + "\n"


class TraceWriter:
    """Append-only trace; each case is written and flushed whole."""

    def __init__(self, path: str | Path, header: dict):
        self.path = Path(path)
        self._fh = open(self.path, "w", encoding="utf-8", newline="\n")
        self._fh.write(render_header({"started_unix": int(time.time()), **header}))
        self._fh.flush()
        self.passed = self.failed = self.total = 0
        self.closed = False

    def write_case(self, case: TraceCase) -> None:
        self._fh.write(render_case(case))
        self._fh.flush()
        self.total += 1
        self.passed += case.status == "PASSED"
        self.failed += case.status == "FAILED"

    def close(self) -> None:
        if self.closed:
            return
        self._fh.write(f"===== SUMMARY =====\npassed: {self.passed}\nfailed: {self.failed}\n"
                       f"total: {self.total}\n")
        self._fh.close()
        self.closed = True


def _int(value: str, default: int = 0) -> int:
    try:
        return int(value)
    except ValueError:
        return default


def _float(value: str, default: float = 0.0) -> float:
    try:
        return float(value)
    except ValueError:
        return default


def _case_from_fields(number, total, label, fields, blocks) -> TraceCase:
    source, _, case_id = label.partition("/")
    case = TraceCase(number=number, total=total, source=fields.pop("source", source),
                     id=fields.pop("id", case_id), status=fields.pop("status", "?"))
    ints = {"timestamp_unix", "prompt_tokens", "generated_tokens", "think_close_token_index",
            "think_close_remaining_budget", "think_close_rank"}
    floats = {"elapsed_sec", "temperature", "top_p", "min_p"}
    for key, value in fields.items():
        if key in ints:
            setattr(case, key, _int(value))
        elif key in floats:
            setattr(case, key, _float(value))
        elif key in ("picked", "expected", "domain", "title", "think_mode_effective",
                     "think_close", "error"):
            setattr(case, key, value)
        elif key not in ("answer_kind", "choices"):
            case.extra[key] = value
    if "choices" in fields:
        case.choices = tuple(fields["choices"])
    for label_name, attr in BLOCK_FIELDS.items():
        if label_name in blocks:
            setattr(case, attr, blocks[label_name])
    return case


def parse_trace_text(text: str | bytes) -> tuple[list[TraceCase], list[str]]:
    """Read every case section. Returns (cases, parse errors)."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    cases: list[TraceCase] = []
    errors: list[str] = []
    pos, n = 0, len(data)
    current = None            # [number, total, label, fields, blocks, in_choices]
    header: dict = {}

    def finish():
        if current is not None:
            cases.append(_case_from_fields(*current[:5]))

    while pos < n:
        nl = data.find(b"\n", pos)
        end = n if nl < 0 else nl
        line = data[pos:end].rstrip(b"\r")
        pos = end + 1
        m = _CASE_RE.match(line)
        if m:
            finish()
            current = [int(m.group(1)), int(m.group(2)), m.group(3).decode("utf-8", "replace"),
                       {}, {}, False]
            continue
        if line == b"===== SUMMARY =====":
            finish()
            current = None
            continue
        m = _BLOCK_RE.match(line)
        if m and current is not None:
            label, count = m.group(1).decode(), int(m.group(2))
            end_marker = b"%s_END" % m.group(1)
            body = data[pos:pos + count]
            after = pos + count
            if not body.endswith(b"\n") and data[after:after + 1] == b"\n":
                after += 1
            if len(body) == count and data[after:after + len(end_marker)] == end_marker:
                pos = after + len(end_marker)
                if data[pos:pos + 1] == b"\n":
                    pos += 1
            else:   # byte count wrong (hand-edited trace): fall back to the end marker
                stop = data.find(b"\n" + end_marker, pos)
                if stop < 0:
                    errors.append(f"case {current[0]}: {label} block is not terminated")
                    body, pos = data[pos:], n
                else:
                    body = data[pos:stop]
                    pos = stop + 1 + len(end_marker) + 1
            current[4][label] = body.decode("utf-8", "replace")
            current[5] = False
            continue
        text_line = line.decode("utf-8", "replace")
        if current is None:
            key, sep, value = text_line.partition(": ")
            if sep:
                header[key] = value
            continue
        if current[5] and text_line.startswith("  "):
            current[3]["choices"].append(text_line[2:].split(". ", 1)[-1])
            continue
        current[5] = False
        if text_line == "choices:":
            current[3]["choices"] = []
            current[5] = True
            continue
        key, sep, value = text_line.partition(":")
        if sep and key and " " not in key:
            current[3][key] = value[1:] if value.startswith(" ") else value
    finish()
    return cases, errors


def read_trace(path: str | Path) -> tuple[dict, list[TraceCase], list[str]]:
    """(header fields, cases, parse errors) of a trace file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace ({exc.strerror or exc})") from None
    if not data.startswith(TRACE_MAGIC.encode()):
        raise TraceError(f"{path}: not a ds4-eval trace (no '{TRACE_MAGIC}' header)")
    header = {}
    for raw in data.split(b"\n\n", 1)[0].decode("utf-8", "replace").splitlines()[1:]:
        key, sep, value = raw.partition(": ")
        if sep:
            header[key] = value
    cases, errors = parse_trace_text(data)
    return header, cases, errors
