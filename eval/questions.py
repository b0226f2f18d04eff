"""The ds4-eval question set: load `questions.jsonl` (tooling-spec §7.1) and select items.

Each line of the file is one case in ds4-eval order. We keep every field the grader needs and
rebuild nothing: `system_prompt` and `user_prompt` are exactly what ds4-eval sends (§7.2), and
`accepted` is what the grader accepts. Loading validates every line so a hand-edited or foreign
file fails with one clear message instead of a traceback half-way through a run.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

from ds4.paths import data_dir

ANSWER_KINDS = ("multiple_choice", "integer", "line_set")
QUESTIONS_FILE = "eval/questions.jsonl"


class QuestionsError(ValueError):
    """The questions file is missing, malformed or inconsistent (a user mistake, exit 2)."""


@dataclass(frozen=True)
class Question:
    index: int                 # 1-based position in ds4-eval order
    id: str
    source: str
    domain: str
    title: str
    question: str
    choices: tuple[str, ...] | None
    answer: str                # the raw key: letter, digits, or a line spec like "3,13-15"
    answer_kind: str           # one of ANSWER_KINDS
    accepted: tuple            # (letter,) | (normalised integer,) | sorted accepted line numbers
    system_prompt: str
    user_prompt: str

    @property
    def label(self) -> str:
        return f"{self.source}/{self.id}"

    @property
    def valid_letters(self) -> str:
        """The letters a multiple-choice answer may use: A..(A+n-1)."""
        return string.ascii_uppercase[: len(self.choices or ())]


_REQUIRED = {
    "index": int, "id": str, "source": str, "domain": str, "title": str, "question": str,
    "answer": str, "answer_kind": str, "accepted": list, "system_prompt": str, "user_prompt": str,
}


def _question_from_row(row: object, where: str) -> Question:
    if not isinstance(row, dict):
        raise QuestionsError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key, typ in _REQUIRED.items():
        if key not in row:
            raise QuestionsError(f"{where}: missing field {key!r}")
        if not isinstance(row[key], typ) or (typ is int and isinstance(row[key], bool)):
            raise QuestionsError(f"{where}: field {key!r} must be {typ.__name__}")
    kind = row["answer_kind"]
    if kind not in ANSWER_KINDS:
        raise QuestionsError(f"{where}: unknown answer_kind {kind!r}")
    choices = row.get("choices")
    if choices is not None:
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise QuestionsError(f"{where}: choices must be a list of strings or null")
        if not 1 <= len(choices) <= 26:
            raise QuestionsError(f"{where}: {len(choices)} choices (need 1..26)")
        choices = tuple(choices)
    accepted = tuple(row["accepted"])
    if kind == "multiple_choice":
        if not choices:
            raise QuestionsError(f"{where}: multiple_choice case without choices")
        letters = string.ascii_uppercase[: len(choices)]
        if len(row["answer"]) != 1 or row["answer"] not in letters:
            raise QuestionsError(f"{where}: answer {row['answer']!r} is not one of {letters}")
    elif kind == "integer":
        if not row["answer"].isdigit():
            raise QuestionsError(f"{where}: integer answer {row['answer']!r} is not digits")
    else:
        if not accepted or not all(isinstance(n, int) and 0 <= n <= 255 for n in accepted):
            raise QuestionsError(f"{where}: line_set accepted must be line numbers 0..255")
    return Question(
        index=row["index"], id=row["id"], source=row["source"], domain=row["domain"],
        title=row["title"], question=row["question"], choices=choices, answer=row["answer"],
        answer_kind=kind, accepted=accepted, system_prompt=row["system_prompt"],
        user_prompt=row["user_prompt"],
    )


def default_questions_path(data_directory: str | Path | None = None) -> Path:
    return data_dir(data_directory) / QUESTIONS_FILE


def load_questions(path: str | Path) -> list[Question]:
    """Read and validate every case of a questions.jsonl file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise QuestionsError(f"{path}: no such questions file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise QuestionsError(f"{path}: cannot read questions file ({exc})") from None
    questions: list[Question] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise QuestionsError(f"{where}: malformed JSON ({exc.msg})") from None
        questions.append(_question_from_row(row, where))
    if not questions:
        raise QuestionsError(f"{path}: no questions in file")
    seen: set[tuple[str, str]] = set()
    for q in questions:
        if (q.source, q.id) in seen:
            raise QuestionsError(f"{path}: duplicate case {q.label}")
        seen.add((q.source, q.id))
    return questions


def parse_only(spec: str) -> list[int]:
    """`--only 3,7,10-12` → [3, 7, 10, 11, 12] (1-based case indices)."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise QuestionsError(f"--only: {part!r} is not an index or a range") from None
        if a < 1 or b < a:
            raise QuestionsError(f"--only: bad range {part!r}")
        out.extend(range(a, b + 1))
    if not out:
        raise QuestionsError("--only: no indices given")
    return out


def select_questions(questions: list[Question], first: int | None = None,
                     only: list[int] | None = None) -> list[Question]:
    """Apply `--only` (by case index, in the given order) then `--questions N` (first N)."""
    chosen = questions
    if only:
        by_index = {q.index: q for q in questions}
        missing = [i for i in only if i not in by_index]
        if missing:
            raise QuestionsError(f"--only: no case with index {missing[0]} "
                                 f"(the file has {len(questions)} cases)")
        chosen = [by_index[i] for i in dict.fromkeys(only)]
    if first is not None:
        if first < 1:
            raise QuestionsError("--questions must be > 0")
        chosen = chosen[:first]
    return chosen


def find_case(questions: list[Question], source: str, case_id: str) -> Question | None:
    for q in questions:
        if q.source == source and q.id == case_id:
            return q
    return None
