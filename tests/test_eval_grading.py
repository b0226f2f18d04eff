"""ds4-eval answer extraction and grading (tooling-spec §7.4, §7.6) and question loading."""

from __future__ import annotations

import json

import pytest

from ds4.eval.grading import EXTRACTORS, extract, grade, head_normalize_line_spec, \
    is_correct, parse_line_set, visible_text
from ds4.eval.questions import QuestionsError, load_questions, parse_only, select_questions
from ds4.eval.selftest import CASES, n_expectations, run_self_test
from ds4_tool_util import QUESTIONS, run_cli


@pytest.fixture(scope="module")
def questions():
    return load_questions(QUESTIONS)


# ---- the extractor table ------------------------------------------------------------------------

def test_self_test_table_is_large_and_passes():
    assert len(CASES) >= 40
    assert run_self_test() == []


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_extractor_table_row(case):
    for mode, want in case.expect.items():
        assert extract(case.raw, case.kind, case.n_choices, mode) == want, mode


def test_self_test_cli_exit_status():
    done = run_cli("--self-test-extractors")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "answer extractor self-tests passed" in done.stdout
    assert f"{n_expectations()} expectations" in done.stdout


def test_spec_head_picks_for_the_pr185_cases():
    # §7.6: "HEAD extracts H, F, F, 80, 82 and 10,122 for these six cases"
    heads = [c.expect["head"] for c in CASES[:6]]
    assert heads == ["H", "F", "F", "80", "82", "10,122"]
    assert [extract(c.raw, c.kind, c.n_choices, "pr185") for c in CASES[:6]] == \
        ["F", "F", "F", "82", "82", "10"]


@pytest.mark.parametrize("window,spec", [
    # the §7.4 normalisation examples, HEAD quirks included
    ("Answer: 9 15", "9,5"), ("Answer: 9, 15", "9,15"), ("Answer: 9 and 15", "9,15"),
    ("Answer: 10 - 12", "10-12"), ("Answer: 17–20", "17,20"), ("Answer: 3,13-15", "3,13-15"),
    ("Answer: 10-", "10"), ("Answer: none", "?"),
])
def test_head_line_spec_normalisation(window, spec):
    assert head_normalize_line_spec(window.encode()) == spec


def test_visible_text_is_after_first_think_close():
    assert visible_text("a</think>b</think>c") == "b</think>c"
    assert visible_text("no close") == "no close"


# ---- grading on recorded answers ------------------------------------------------------------------

def _format_answer(q):
    return q.answer


def test_every_key_grades_correct_in_every_mode(questions):
    for q in questions:
        raw = f"Let me think about it.</think>Reasoning done.\nAnswer: {_format_answer(q)}"
        for mode in EXTRACTORS:
            picked, ok = grade(q, raw, mode)
            assert ok, (q.label, mode, picked)


def test_wrong_answers_fail(questions):
    for q in questions:
        if q.answer_kind == "multiple_choice":
            wrong = "A" if q.answer != "A" else "B"
        elif q.answer_kind == "integer":
            wrong = str(int(q.answer) + 1)
        else:
            wrong = str(max(q.accepted) + 1)
        picked, ok = grade(q, f"x</think>Answer: {wrong}", "careful")
        assert not ok and picked == wrong, q.label


def test_wider_letter_sets(questions):
    wide = [q for q in questions if q.choices and len(q.choices) > 4]
    assert {len(q.choices) for q in wide} == {8, 9, 10}
    for q in wide:
        last = q.valid_letters[-1]
        assert extract(f"x</think>Answer: {last}", q.answer_kind, len(q.choices)) == last
        beyond = chr(ord(last) + 1)     # one past the valid set: not a letter answer
        assert extract(f"x</think>Answer: {beyond}", q.answer_kind, len(q.choices)) == "?"
    four = next(q for q in questions if q.choices and len(q.choices) == 4)
    assert extract("x</think>Answer: F", "multiple_choice", 4) == "?"
    assert grade(four, f"x</think>Answer: ({four.answer})")[1]


def test_integer_leading_zeros_and_boxed(questions):
    q = next(q for q in questions if q.id == "aime2025-01")    # key 70
    for raw in ("x</think>Answer: 070", "x</think>Answer: $\\boxed{70}$",
                "x</think>so the total is \\boxed{070}.", "x</think>Answer: 0070"):
        assert grade(q, raw)[1], raw
    assert not grade(q, "x</think>Answer: 700")[1]
    assert not grade(q, "x</think>Answer: 7")[1]


def test_compsec_accepted_ranges_and_subsets(questions):
    by_id = {q.id: q for q in questions}
    q76 = by_id["compsec-076"]          # accepted {17..20}
    assert grade(q76, "x</think>Answer: 18")[1]
    assert grade(q76, "x</think>Answer: 17-20")[1]
    assert grade(q76, "x</think>Answer: 20, 17")[1]
    assert not grade(q76, "x</think>Answer: 16-18")[1]       # one extra line fails
    assert not grade(q76, "x</think>Answer: 0")[1]           # "safe" is never right here
    q86 = by_id["compsec-086"]          # accepted {3, 13, 14, 15}
    assert grade(q86, "x</think>Answer: 3, 13-15")[1]
    assert grade(q86, "x</think>Answer: 15 - 13")[1]          # reversed range
    assert not grade(q86, "x</think>Answer: 3-15")[1]
    q82 = by_id["compsec-082"]          # accepted {9, 10}
    # ds4 HEAD reads "9 10" as "9,0" (skip-one quirk) and fails it; the careful grader passes.
    assert grade(q82, "x</think>Answer: 9 10", "head") == ("9,0", False)
    assert grade(q82, "x</think>Answer: 9 10", "careful") == ("9,10", True)


def test_line_set_parsing_clamps_and_swaps():
    assert parse_line_set("17-20") == {17, 18, 19, 20}
    assert parse_line_set("20-17") == {17, 18, 19, 20}
    assert parse_line_set("3,13-15") == {3, 13, 14, 15}
    assert parse_line_set("1000") == {255}
    assert parse_line_set("?") == set()
    assert not is_correct("?", "line_set", "17-20")
    assert not is_correct("", "multiple_choice", "A")


# ---- question loading ---------------------------------------------------------------------------

def test_load_the_shared_question_set(questions):
    assert len(questions) == 92
    counts = {}
    for q in questions:
        counts[q.source] = counts.get(q.source, 0) + 1
    assert counts == {"GPQA Diamond": 25, "SuperGPQA": 25, "AIME2025": 25, "COMPSEC": 17}
    assert [q.index for q in questions] == list(range(1, 93))


def test_selection(questions):
    assert [q.index for q in select_questions(questions, 3)] == [1, 2, 3]
    assert [q.index for q in select_questions(questions, None, parse_only("5,2,76-78"))] == \
        [5, 2, 76, 77, 78]
    assert [q.index for q in select_questions(questions, 2, parse_only("9,8,7"))] == [9, 8]
    with pytest.raises(QuestionsError):
        select_questions(questions, None, [93])
    with pytest.raises(QuestionsError):
        parse_only("3-1")
    with pytest.raises(QuestionsError):
        parse_only("x")


@pytest.mark.parametrize("content,needle", [
    ('{"index": 1', "malformed JSON"),
    ("[1, 2]\n", "expected a JSON object"),
    ("", "no questions"),
    (None, "missing field 'answer'"),
    ("MC_BAD", "is not one of ABCD"),
])
def test_malformed_questions_file_is_one_line_exit_2(tmp_path, content, needle):
    path = tmp_path / "q.jsonl"
    good = json.loads(QUESTIONS.read_text().splitlines()[0])
    if content is None:
        del good["answer"]
        content = json.dumps(good) + "\n"
    elif content == "MC_BAD":
        good["answer"] = "F"
        content = json.dumps(good) + "\n"
    path.write_text(content)
    done = run_cli("--questions-file", str(path), "--plain", "-m", "/nonexistent.gguf")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in done.stderr
    assert lines[0].startswith("ds4-eval: ")


@pytest.mark.parametrize("args,needle", [
    (("--tokens", "0"), "--tokens must be > 0"),
    (("--tokens", "2000000"), "--tokens must be <= 1000000"),
    (("--tokens", "100", "--hard-limit-reply-budget", "100"), "must be < --tokens"),
    (("--tokens", "100", "--hard-limit-reply-budget", "50", "--soft-limit-reply-budget", "10"),
     "must be >="),
    (("--only", "0"), "--only"),
    (("--questions", "0"), "--questions must be > 0"),
    (("-m", "/nonexistent/model.gguf"), "no such model file"),
])
def test_bad_flags_exit_2(args, needle):
    done = run_cli("--plain", *args)
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr and "Traceback" not in done.stderr


def test_extractors_never_raise_on_arbitrary_text():
    """Model output is arbitrary: every extractor returns a string on random soups of the
    characters the rules look at (fixed seed, so a failure reproduces)."""
    import random

    rng = random.Random(1234)
    alphabet = list("Answer: answer ANSWER </think> \\boxed{ } ( ) - – — , . 0 7 9 12 255 1000 "
                    "A B J a i I not nor rather than CWE-122 CVE-2021-3156 line lines to ** ` \n"
                    "Ｂ ７ 𝐂 é 中") + ["\\boxed{", "</think>", "Answer:", "answer is", "\n\n"]
    for _ in range(1500):
        raw = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        for mode in EXTRACTORS:
            for kind, n in (("multiple_choice", 10), ("integer", 0), ("line_set", 0)):
                got = extract(raw, kind, n, mode)
                assert isinstance(got, str) and got
                if kind == "line_set" and got != "?":
                    assert set(got) <= set("0123456789,-")
                if kind == "integer" and got != "?":
                    assert got.isdigit() and (got == "0" or not got.startswith("0"))
