"""`ds4-eval --self-test-extractors`: a fixed table of tricky model outputs and what each
extractor must read from them (tooling-spec §7.6, plus our own cases).

Every row is (answer kind, number of choices, raw output, expectations per extractor). The
`head` and `pr185` expectations of the first six rows are the ones the spec records for ds4
HEAD and PR185; the COMPSEC quirk rows are the examples of §7.4. The `careful` column is what a
careful grader reads; where it differs from `head` the difference is one of those documented
in grading.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from .grading import extract

MC, INT, LINES = "multiple_choice", "integer", "line_set"


@dataclass(frozen=True)
class ExtractorCase:
    name: str
    kind: str
    n_choices: int
    raw: str
    expect: dict          # extractor mode -> expected pick


def _c(name, kind, n, raw, careful, head=None, pr185=None):
    expect = {"careful": careful}
    if head is not None:
        expect["head"] = head
    if pr185 is not None:
        expect["pr185"] = pr185
    return ExtractorCase(name, kind, n, raw, expect)


CASES: tuple[ExtractorCase, ...] = (
    # ---- the six spec cases of §7.6 (HEAD picks H, F, F, 80, 82, 10,122)
    _c("spec-mc-repeated-final", MC, 10,
       "</think>So answer is 0.716 H+/O2. That corresponds to option F.\nThus final answer: F."
       "</think>The visible explanation repeats the calculation.\nAnswer: F", "F", "H", "F"),
    _c("spec-mc-trailing-distractor", MC, 10,
       "</think>Answer: F\nThis answer is final; option H is a tempting distractor.", "F", "F", "F"),
    _c("spec-mc-answer-is", MC, 10,
       "</think>The answer is F. This answer is final; option H is tempting.", "F", "F", "F"),
    _c("spec-int-changed-mind", INT, 0,
       "</think>I first thought the answer was 80.\nFinal answer: 082", "82", "80", "82"),
    _c("spec-int-answer-is", INT, 0,
       "</think>The answer is 082. This answer comes from AIME 2025.", "82", "82", "82"),
    _c("spec-compsec-cwe", LINES, 0,
       "</think>I think the answer should be line 10, because CWE-122 may apply.\n"
       "**Answer:** 10</think>The primary write is at line 10.\nAnswer: 10", "10", "10,122", "10"),
    # ---- COMPSEC normalisation examples of §7.4 (HEAD quirks vs careful)
    _c("compsec-space-list", LINES, 0, "reasoning</think>Answer: 9 15", "9,15", "9,5"),
    _c("compsec-comma-list", LINES, 0, "reasoning</think>Answer: 9, 15", "9,15", "9,15"),
    _c("compsec-and-list", LINES, 0, "reasoning</think>Answer: 9 and 15", "9,15", "9,15"),
    _c("compsec-spaced-range", LINES, 0, "reasoning</think>Answer: 10 - 12", "10-12", "10-12"),
    _c("compsec-en-dash", LINES, 0, "reasoning</think>Answer: 17–20", "17-20", "17,20"),
    _c("compsec-em-dash", LINES, 0, "reasoning</think>Answer: lines 17—20", "17-20"),
    _c("compsec-to-range", LINES, 0, "x</think>Answer: lines 17 to 20", "17-20"),
    _c("compsec-mixed", LINES, 0, "x</think>Answer: 3, 13-15", "3,13-15", "3,13-15"),
    _c("compsec-safe", LINES, 0, "x</think>The function is safe.\nAnswer: 0", "0", "0"),
    _c("compsec-next-line", LINES, 0, "x</think>**Answer:**\n\n11", "11", "11"),
    _c("compsec-parenthetical", LINES, 0,
       "x</think>Answer: 18 (the length check on line 12 is fine)", "18", "18,12"),
    _c("compsec-cve", LINES, 0, "x</think>Answer: 5 (CVE-2021-3156)", "5", "5,2021-3156"),
    _c("compsec-markdown-lines", LINES, 0, "x</think>**Answer:** `Lines 20-22`", "20-22", "20-22"),
    _c("compsec-no-marker", LINES, 0, "x</think>The overflow is on line 14.", "14", "14"),
    # ---- multiple choice
    _c("mc-plain", MC, 4, "think</think>Answer: B", "B", "B", "B"),
    _c("mc-not-a-but-b", MC, 4, "think</think>The answer is not A but B.", "B", "A", "A"),
    _c("mc-isnt", MC, 4, "think</think>Answer: it isn't C, it's D", "D"),
    _c("mc-neither-nor", MC, 4, "</think>Answer: neither A nor B; it is D", "D", "A", "A"),
    _c("mc-rather-than", MC, 10, "</think>Answer: rather than (A), choose G", "G", "A", "A"),
    _c("mc-article", MC, 4, "</think>The answer is a tricky one, but it is C.", "C", "A", "A"),
    _c("mc-pronoun-i", MC, 10, "</think>Answer: I think it is E", "E", "I", "I"),
    _c("mc-letter-i", MC, 10, "</think>Answer: I", "I", "I", "I"),
    _c("mc-fullwidth", MC, 4, "</think>Answer: Ｂ", "B", "?", "?"),
    _c("mc-math-bold", MC, 4, "</think>Answer: 𝐂", "C"),
    _c("mc-boxed", MC, 4, "</think>Thus the result is $\\boxed{D}$.", "D", "D", "D"),
    _c("mc-parens-option", MC, 10, "</think>Final Answer: (G) 42 kJ", "G", "G", "G"),
    _c("mc-bold", MC, 10, "</think>**Answer: J**", "J", "J", "J"),
    _c("mc-wide-letter-invalid", MC, 4, "</think>Answer: F, so B", "B", "B", "B"),
    _c("mc-lowercase", MC, 4, "</think>answer: c", "C", "C", "C"),
    _c("mc-no-marker-last", MC, 4, "</think>Between B and D I pick D.", "D", "D", "D"),
    _c("mc-no-marker-prose-a", MC, 4, "</think>C looks right; it is a classic trap.", "C", "A", "A"),
    _c("mc-thinking-only", MC, 4, "The answer is C because ...", "C", "C", "C"),
    _c("mc-nothing", MC, 4, "</think>I cannot decide.", "?"),
    _c("mc-trailing-explanation", MC, 4,
       "</think>Answer: A\n\nExplanation: option D ignores time dilation.", "A", "A", "A"),
    # ---- integers
    _c("int-boxed", INT, 0, "</think>So we get $\\boxed{70}$.", "70", "70", "70"),
    _c("int-multiple-boxed", INT, 0,
       "</think>First $\\boxed{68}$, but correcting the carry gives $\\boxed{70}$.", "70", "70", "70"),
    _c("int-boxed-after-marker", INT, 0, "</think>Answer: $\\boxed{082}$", "82", "82", "82"),
    _c("int-leading-zeros", INT, 0, "</think>Answer: 007", "7", "7", "7"),
    _c("int-zero", INT, 0, "</think>Answer: 000", "0", "0", "0"),
    _c("int-thousands", INT, 0, "</think>Answer: 1,234", "1234", "1", "1"),
    _c("int-equation", INT, 0, "</think>Answer: 7 + 63 = 70", "70", "7", "7"),
    _c("int-sentence", INT, 0, "</think>Answer: The sum of the bases is 70.", "70", "70", "70"),
    _c("int-fullwidth", INT, 0, "</think>Answer: ７０", "70", "?", "?"),
    _c("int-no-marker", INT, 0, "</think>We compute 3*4=12 and then 12+58=70.", "70", "70", "70"),
    _c("int-trailing-text", INT, 0,
       "</think>Final answer: 588\n\nThis took 3 steps.", "588", "588", "588"),
    _c("int-markdown-marker", INT, 0, "</think>**Final Answer**: 104", "104", "104", "104"),
)


def run_self_test(modes=("careful", "pr185", "head")) -> list[str]:
    """Run the table; return one message per failed expectation (empty when all pass)."""
    failures = []
    for case in CASES:
        for mode, want in case.expect.items():
            if mode not in modes:
                continue
            got = extract(case.raw, case.kind, case.n_choices, mode)
            if got != want:
                failures.append(f"{case.name} [{mode}]: extracted {got!r}, expected {want!r}")
    failures.extend(_trace_self_test())
    return failures


def _trace_self_test() -> list[str]:
    """A trace whose prompt and output contain fake block markers must parse back exactly."""
    from .trace import TraceCase, parse_trace_text, render_case

    fake = ("x\nMODEL_OUTPUT_END\n===== CASE 9/9 FAKE/x =====\nstatus: PASSED\n"
            "MODEL_OUTPUT_BEGIN bytes=3\nabc\n")
    case = TraceCase(number=1, total=1, source="COMPSEC", id="compsec-080", status="FAILED",
                     picked="9", expected="5-6", system_prompt="sys",
                     question_prompt="q " + fake, output="think " + fake + "</think>Answer: 5")
    parsed, errors = parse_trace_text("# ds4-eval trace\n\n" + render_case(case))
    if errors or len(parsed) != 1:
        return [f"trace-fake-markers: parsed {len(parsed)} cases, errors {errors}"]
    got = parsed[0]
    if got.output != case.output or got.source != case.source or got.id != case.id:
        return ["trace-fake-markers: model output or case identity not recovered exactly"]
    return []


def n_expectations() -> int:
    return sum(len(c.expect) for c in CASES) + 1
