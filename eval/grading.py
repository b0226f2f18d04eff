"""Answer extraction and grading for ds4-eval (tooling-spec §7.4, §7.6).

Three extractor rule sets live here, chosen with `--extractor`:

* ``head``   — ds4-eval at 8d57664, byte for byte, quirks included (§7.4): the first
  case-insensitive `answer` substring anchors the search; COMPSEC `9 15` reads as `9,5`,
  `17–20` (en dash) as `17,20`, `line 10, because CWE-122` as `10,122`.
* ``pr185``  — the unmerged PR185 rule (§7.6): anchor at the **last** answer *marker*
  (`answer` as a word, optional whitespace, then `:`), else the first `answer` substring;
  everything else as ``head``.
* ``careful`` (default) — what a careful human grader would read. Differences from ds4,
  all deliberate:
    - anchor: last `answer:` marker (markdown `**Answer:**`, `Answer**:` allowed); else the
      last `\\boxed{}`; else the first `answer` word that yields a candidate;
    - text is NFKC-normalised first, so fullwidth `Ｂ` or math-bold `𝐁` read as `B`;
    - multiple choice: an article/pronoun (`a`, `A good…`, `I think`, `I'm`) loses to a real
      letter later in the window; a letter after `not`, `neither`, `nor`, `rather than` or
      `instead of` (`not A but B`) is never picked;
      the backward fallback ignores lower-case letters (so prose "a" is never an answer);
    - integer: a `\\boxed{}` in the window wins; thousands separators are joined
      (`1,234` → 1234); on an `x = … = 70` answer line the value after the last `=` is taken;
    - COMPSEC: `9 15` → `9,15`; en/em dash, `to`, `through`, `..` make ranges; `CWE-122` /
      `CVE-2021-1234` are not line numbers; a parenthetical or `because …` after the line
      numbers is ignored; an empty `Answer:` line reads the next non-empty line.
  Grading itself (what counts as correct) is identical in every mode.

Grading (§7.4): multiple choice passes when the first character of the pick equals the key
letter; integer when both strip to the same digits; COMPSEC when the picked line set is
non-empty and a subset of the accepted lines (numbers clamped to 0..255).
"""

from __future__ import annotations

import re
import unicodedata

EXTRACTORS = ("careful", "pr185", "head")
THINK_CLOSE = "</think>"
UNKNOWN = "?"


def visible_text(raw: str) -> str:
    """The text after the first `</think>` (the whole output if there is none)."""
    cut = raw.find(THINK_CLOSE)
    return raw if cut < 0 else raw[cut + len(THINK_CLOSE):]


def strip_zeros(digits: str) -> str:
    stripped = digits.lstrip("0")
    return stripped if stripped else ("0" if digits else "")


# --------------------------------------------------------------------------------------------
# ds4 HEAD / PR185 rules. They work on UTF-8 bytes, as the C code does: windows count bytes and
# "alphabetic" means an ASCII letter (a UTF-8 continuation byte is not alphabetic).
# --------------------------------------------------------------------------------------------

def _is_alpha(b: int) -> bool:
    return 65 <= b <= 90 or 97 <= b <= 122


def _is_digit(b: int) -> bool:
    return 48 <= b <= 57


def _head_anchor(vis: bytes, marker_rule: bool) -> int:
    """Byte offset of `answer` that anchors the search, or -1."""
    low = vis.lower()
    if marker_rule:
        last = -1
        pos = low.find(b"answer")
        while pos >= 0:
            end = pos + 6
            before_ok = pos == 0 or not _is_alpha(low[pos - 1])
            after_ok = end >= len(low) or not _is_alpha(low[end])
            if before_ok and after_ok:
                j = end
                while j < len(low) and low[j] in b" \t\r\n":
                    j += 1
                if j < len(low) and low[j] == ord(":"):
                    last = pos
            pos = low.find(b"answer", pos + 1)
        if last >= 0:
            return last
    return low.find(b"answer")


def _head_standalone(vis: bytes, i: int, valid: bytes) -> bool:
    c = vis[i]
    up = c - 32 if 97 <= c <= 122 else c
    if up not in valid:
        return False
    prev = vis[i - 1] if i > 0 else 32
    nxt = vis[i + 1] if i + 1 < len(vis) else 32
    return not _is_alpha(prev) and not _is_alpha(nxt)


def head_letter(raw: str, n_choices: int, marker_rule: bool = False) -> str:
    vis = visible_text(raw).encode("utf-8")
    valid = bytes(range(65, 65 + n_choices))
    pos = _head_anchor(vis, marker_rule)
    if pos >= 0:
        for i in range(pos, min(pos + 96, len(vis))):
            if _head_standalone(vis, i, valid):
                return chr(vis[i]).upper()
    for i in range(len(vis) - 1, -1, -1):
        if _head_standalone(vis, i, valid):
            return chr(vis[i]).upper()
    return UNKNOWN


def _head_digit_runs(vis: bytes, start: int, stop: int) -> list[bytes]:
    runs, i = [], start
    while i < stop:
        if _is_digit(vis[i]):
            j = i
            while j < len(vis) and _is_digit(vis[j]):
                j += 1
            runs.append(vis[i:j])
            i = j
        else:
            i += 1
    return runs


def head_integer(raw: str, marker_rule: bool = False) -> str:
    vis = visible_text(raw).encode("utf-8")
    pos = _head_anchor(vis, marker_rule)
    run = b""
    if pos >= 0:
        runs = _head_digit_runs(vis, pos, min(pos + 160, len(vis)))
        run = runs[0] if runs else b""
    if not run:
        runs = _head_digit_runs(vis, 0, len(vis))
        run = runs[-1] if runs else b""
    if not run:
        return UNKNOWN
    return strip_zeros(run.decode())[:31]


def head_normalize_line_spec(window: bytes) -> str:
    """ds4's normalize_compsec_line_spec, including its skip-one-character quirk."""
    out = bytearray()
    i, n = 0, len(window)
    while i < n:
        if not _is_digit(window[i]):
            i += 1
            continue
        j = i
        while j < n and _is_digit(window[j]):
            j += 1
        if out and out[-1:] != b"-":
            out += b","
        out += window[i:j]
        i = j
        while i < n and window[i] == 32:
            i += 1
        if i < n and window[i] == ord("-"):
            i += 1
            while i < n and window[i] == 32:
                i += 1
            out += b"-"
            if i < n and _is_digit(window[i]):
                j = i
                while j < n and _is_digit(window[j]):
                    j += 1
                out += window[i:j]
                i = j
            continue
        i += 1          # the quirk: the character after the spaces is consumed unexamined
    spec = out.decode().rstrip(",-")
    return spec if spec else UNKNOWN


def head_line_spec(raw: str, marker_rule: bool = False) -> str:
    vis = visible_text(raw).encode("utf-8")
    pos = _head_anchor(vis, marker_rule)
    spec = UNKNOWN
    if pos >= 0:
        window = vis[pos:pos + 160]
        nl = window.find(b"\n")
        if nl >= 0:
            window = window[:nl]
        spec = head_normalize_line_spec(window)
    if spec == UNKNOWN:
        spec = head_integer(raw, marker_rule)
    return spec


# --------------------------------------------------------------------------------------------
# The careful rules.
# --------------------------------------------------------------------------------------------

_MARKER = re.compile(r"(?<![^\W\d_])answer(?![^\W\d_])[\s*_`]*:", re.IGNORECASE)
_ANSWER_WORD = re.compile(r"(?<![^\W\d_])answer(?![^\W\d_])", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\s*\{")
_NEGATION = re.compile(r"(?:\bnot|n't|\bnor|\bneither|\brather\s+than|\binstead\s+of)\s+"
                       r"(?:option\s+|choice\s+|answer\s+)?[(\[*]*$", re.IGNORECASE)


def _normalize(text: str) -> str:
    return unicodedata.normalize("NFKC", text)


def _boxed_contents(text: str) -> list[tuple[int, str]]:
    """(offset, content) of every `\\boxed{…}` with balanced braces."""
    out = []
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append((m.start(), text[m.end():i - 1]))
    return out


def _careful_windows(vis: str):
    """Candidate answer texts, most authoritative first."""
    markers = list(_MARKER.finditer(vis))
    if markers:
        yield markers[-1].end()
    boxed = _boxed_contents(vis)
    if boxed:
        yield boxed[-1][0]
    for m in _ANSWER_WORD.finditer(vis):
        yield m.end()


def _letter_candidates(text: str, valid: str):
    """(tier, letter) for each standalone letter; tier 0 strong, 1 weak (article/pronoun)."""
    for i, c in enumerate(text):
        if c.upper() not in valid or not c.isalpha():
            continue
        prev = text[i - 1] if i > 0 else " "
        nxt = text[i + 1] if i + 1 < len(text) else " "
        if prev.isalpha() or nxt.isalpha():
            continue
        if _NEGATION.search(text[max(0, i - 24):i]):
            continue
        after = text[i + 1:i + 3]
        weak = c.islower() or (c in "AI" and (re.match(r" [a-z]", after) is not None
                                               or after[:1] in "'’"))
        yield (1 if weak else 0), c.upper()


def careful_letter(raw: str, n_choices: int) -> str:
    vis = _normalize(visible_text(raw))
    valid = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:n_choices]
    for start in _careful_windows(vis):
        window = vis[start:start + 96]
        line_end = window.find("\n")
        first_line = window[:line_end] if line_end >= 0 else window
        for text in (first_line, window):
            found = sorted(_letter_candidates(text, valid), key=lambda t: t[0])
            if found:
                return found[0][1]
    strong = [c for tier, c in _letter_candidates(vis, valid) if tier == 0]
    return strong[-1] if strong else UNKNOWN


_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?!\d)|\d+")


def _careful_integer_in(text: str) -> str | None:
    boxed = _boxed_contents(text)
    if boxed:
        text = boxed[0][1]
    line = next((ln for ln in text.split("\n") if ln.strip()), "")
    if "=" in line and _NUMBER.search(line.rsplit("=", 1)[1]):
        text = line.rsplit("=", 1)[1]
    m = _NUMBER.search(text)
    return strip_zeros(m.group().replace(",", ""))[:31] if m else None


def careful_integer(raw: str) -> str:
    vis = _normalize(visible_text(raw))
    for start in _careful_windows(vis):
        window = vis[start:start + 160].lstrip(" \t*_`:\n")
        got = _careful_integer_in(window)
        if got is not None:
            return got
    boxed = _boxed_contents(vis)
    for _, content in reversed(boxed):
        got = _careful_integer_in(content)
        if got is not None:
            return got
    runs = _NUMBER.findall(vis)
    return strip_zeros(runs[-1].replace(",", ""))[:31] if runs else UNKNOWN


_NOT_A_LINE = re.compile(r"\b(?:CWE|CVE|GHSA|RFC)[-‐‑_ ]?\d+(?:-\d+)*", re.IGNORECASE)
_RANGE_SEP = r"\s*(?:-|–|—|‒|−|\.\.|\bto\b|\bthrough\b|\bthru\b)\s*"
_LINE_ITEM = re.compile(r"(\d+)(?:" + _RANGE_SEP + r"(?:lines?\s+)?(\d+))?", re.IGNORECASE)
_TRAILER = re.compile(r"\(|;|\bbecause\b|\bsince\b|\bwhere\b|\bas\b|\bwhich\b|\.\s", re.IGNORECASE)


def careful_normalize_line_spec(text: str) -> str:
    text = _NOT_A_LINE.sub(" ", text)
    first = re.search(r"\d", text)
    if first is None:
        return UNKNOWN
    cut = _TRAILER.search(text, first.end())
    if cut is not None:
        text = text[:cut.start()]
    parts = []
    for m in _LINE_ITEM.finditer(text):
        parts.append(f"{int(m.group(1))}-{int(m.group(2))}" if m.group(2) else str(int(m.group(1))))
    return ",".join(parts) if parts else UNKNOWN


def careful_line_spec(raw: str) -> str:
    vis = _normalize(visible_text(raw))
    for start in _careful_windows(vis):
        lines = vis[start:start + 400].split("\n")
        spec = careful_normalize_line_spec(lines[0][:160])
        if spec == UNKNOWN and not re.sub(r"(?i)\blines?\b|[\s*_`:]", "", lines[0]):
            following = next((ln for ln in lines[1:] if ln.strip()), "")
            spec = careful_normalize_line_spec(following[:160])
        if spec != UNKNOWN:
            return spec
    return careful_integer(raw)


# --------------------------------------------------------------------------------------------
# Dispatch and grading.
# --------------------------------------------------------------------------------------------

def extract(raw: str, answer_kind: str, n_choices: int = 0, mode: str = "careful") -> str:
    """The answer picked from a raw model output (thinking included), or `?`."""
    if mode not in EXTRACTORS:
        raise ValueError(f"unknown extractor {mode!r}")
    if answer_kind == "multiple_choice":
        return careful_letter(raw, n_choices) if mode == "careful" else \
            head_letter(raw, n_choices, marker_rule=mode == "pr185")
    if answer_kind == "integer":
        return careful_integer(raw) if mode == "careful" else \
            head_integer(raw, marker_rule=mode == "pr185")
    if answer_kind == "line_set":
        return careful_line_spec(raw) if mode == "careful" else \
            head_line_spec(raw, marker_rule=mode == "pr185")
    raise ValueError(f"unknown answer kind {answer_kind!r}")


def parse_line_set(spec: str) -> set[int]:
    """ds4's compsec spec → set: digit runs and `a-b` ranges (swapped if a > b), clamped 0..255."""
    out: set[int] = set()
    for m in re.finditer(r"(\d+)(?:\s*-\s*(\d+))?", spec):
        a = min(int(m.group(1)), 255)
        b = min(int(m.group(2)), 255) if m.group(2) else a
        if a > b:
            a, b = b, a
        out.update(range(a, b + 1))
    return out


def is_correct(picked: str, answer_kind: str, key: str, accepted=None) -> bool:
    if not picked or picked == UNKNOWN:
        return False
    if answer_kind == "multiple_choice":
        return picked[0] == key[0]
    if answer_kind == "integer":
        return picked.isdigit() and strip_zeros(picked) == strip_zeros(key)
    if answer_kind == "line_set":
        allowed = set(accepted) if accepted else parse_line_set(key)
        got = parse_line_set(picked)
        return bool(got) and got <= allowed
    raise ValueError(f"unknown answer kind {answer_kind!r}")


def grade(question, raw: str, mode: str = "careful") -> tuple[str, bool]:
    """(picked, passed) for one Question and its raw output."""
    picked = extract(raw, question.answer_kind, len(question.choices or ()), mode)
    return picked, is_correct(picked, question.answer_kind, question.answer, question.accepted)
