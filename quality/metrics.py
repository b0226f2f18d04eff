"""Scoring math for `ds4-quality score` (tooling-spec §4.3, §4.4).

Per case: teacher-forced over the official continuation t_0..t_{T-1}. At step i, with the model's
next-token logits: greedy = argmax, logprob(t_i) = log-softmax (natural log, float64 log-sum-exp
over the finite logits), NLL += −logprob(t_i), then t_i is fed.
  first_match = greedy at step 0 == t_0
  greedy_lcp  = number of leading steps where greedy == t_i (stops at the first mismatch)
Overall: avg_nll = Σ nll / Σ target tokens (token-weighted), first_match = count, avg_lcp = mean.
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCORE_COLUMNS = ("id", "prompt_tokens", "target_tokens", "nll", "avg_nll", "first_match", "greedy_lcp")
TIE_EPS = 1e-9


class ScoreFormatError(ValueError):
    pass


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log-softmax along the last axis in float64; non-finite logits are excluded (→ -inf)."""
    x = np.asarray(logits, dtype=np.float64)
    finite = np.isfinite(x)
    xm = np.where(finite, x, -np.inf)
    m = xm.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(xm - m).sum(axis=-1, keepdims=True))
    return np.where(finite, x - lse, -np.inf)


@dataclass
class CaseScore:
    id: str
    prompt_tokens: int
    target_tokens: int
    nll: float
    first_match: int
    greedy_lcp: int

    @property
    def avg_nll(self) -> float:
        return self.nll / self.target_tokens if self.target_tokens else 0.0


class TeacherForcedScorer:
    """Accumulates one case step by step: call `step(logits, target)` before feeding `target`."""

    def __init__(self) -> None:
        self.nll = 0.0
        self.steps = 0
        self.first_match = 0
        self.greedy_lcp = 0
        self._lcp_open = True
        self.token_nll: list[float] = []

    def step(self, logits: np.ndarray, target: int) -> float:
        lp = log_softmax(logits)
        tok_lp = float(lp[target])
        greedy = int(np.argmax(logits))
        if self.steps == 0:
            self.first_match = int(greedy == target)
        if self._lcp_open:
            if greedy == target:
                self.greedy_lcp += 1
            else:
                self._lcp_open = False
        self.nll -= tok_lp
        self.token_nll.append(-tok_lp)
        self.steps += 1
        return tok_lp

    def result(self, case_id: str, prompt_tokens: int) -> CaseScore:
        return CaseScore(case_id, prompt_tokens, self.steps, self.nll, self.first_match, self.greedy_lcp)


def score_logits(case_id: str, prompt_tokens: int, logits: np.ndarray, targets) -> CaseScore:
    """Score a whole case from stacked logits [T, V] (row i = logits predicting targets[i])."""
    sc = TeacherForcedScorer()
    for row, t in zip(np.asarray(logits), targets):
        sc.step(row, int(t))
    return sc.result(case_id, prompt_tokens)


@dataclass
class Summary:
    cases: int
    tokens: int
    nll: float
    first_match: int
    lcp_sum: int

    @property
    def avg_nll(self) -> float:
        return self.nll / self.tokens if self.tokens else 0.0

    @property
    def avg_lcp(self) -> float:
        return self.lcp_sum / self.cases if self.cases else 0.0

    def line(self) -> str:
        return (f"summary cases={self.cases} tokens={self.tokens} avg_nll={self.avg_nll:.9f} "
                f"first_match={self.first_match} avg_lcp={self.avg_lcp:.3f}")


def summarize(scores: list[CaseScore]) -> Summary:
    return Summary(cases=len(scores), tokens=sum(s.target_tokens for s in scores),
                   nll=sum(s.nll for s in scores), first_match=sum(s.first_match for s in scores),
                   lcp_sum=sum(s.greedy_lcp for s in scores))


# ----------------------------------------------------------------------------------------------
# Score TSV: one reader, one writer


def format_scores(scores: list[CaseScore]) -> str:
    out = io.StringIO()
    out.write("\t".join(SCORE_COLUMNS) + "\n")
    for s in scores:
        out.write(f"{s.id}\t{s.prompt_tokens}\t{s.target_tokens}\t{s.nll:.9f}\t{s.avg_nll:.9f}\t"
                  f"{s.first_match}\t{s.greedy_lcp}\n")
    return out.getvalue()


def write_scores(path: str | os.PathLike, scores: list[CaseScore]) -> None:
    from ds4.test_vectors.formats import write_text_atomic
    write_text_atomic(path, format_scores(scores))


def read_scores(path: str | os.PathLike) -> list[CaseScore]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise ScoreFormatError(f"{path}: not UTF-8 text") from None
    rows = [r for r in csv.reader(io.StringIO(text), delimiter="\t") if r and not r[0].startswith("#")]
    if not rows or tuple(rows[0][:len(SCORE_COLUMNS)]) != SCORE_COLUMNS:
        raise ScoreFormatError(f"{path}: not a score file (header must be {' '.join(SCORE_COLUMNS)})")
    out = []
    for n, r in enumerate(rows[1:], 2):
        try:
            out.append(CaseScore(id=r[0], prompt_tokens=int(r[1]), target_tokens=int(r[2]), nll=float(r[3]),
                                 first_match=int(r[5]), greedy_lcp=int(r[6])))
        except (IndexError, ValueError):
            raise ScoreFormatError(f"{path}: row {n} is malformed") from None
    return out


# ----------------------------------------------------------------------------------------------
# OLD vs NEW (tooling-spec §4.4)


@dataclass
class ScoreComparison:
    cases: int
    tokens: int
    old_avg_nll: float
    new_avg_nll: float
    wins_new: int
    wins_old: int
    ties: int
    first_old: int
    first_new: int
    lcp_old: float
    lcp_new: float
    deltas: list[tuple[str, float, int, float, float]]  # id, Δnll, tokens, old avg, new avg

    @property
    def delta(self) -> float:
        return self.new_avg_nll - self.old_avg_nll

    @property
    def relative_change_pct(self) -> float:
        return (self.new_avg_nll / self.old_avg_nll - 1.0) * 100.0 if self.old_avg_nll else float("nan")

    def report(self, n_best: int = 8) -> str:
        lines = [
            f"cases\t{self.cases}",
            f"tokens\t{self.tokens}",
            f"old_avg_nll\t{self.old_avg_nll:.9f}",
            f"new_avg_nll\t{self.new_avg_nll:.9f}",
            f"delta_new_minus_old\t{self.delta:.9f}",
            f"relative_nll_change\t{self.relative_change_pct:.3f}%",
            f"case_wins_new_old_ties\t{self.wins_new}\t{self.wins_old}\t{self.ties}",
            f"first_token_matches_old_new\t{self.first_old}\t{self.first_new}",
            f"avg_greedy_lcp_old_new\t{self.lcp_old:.3f}\t{self.lcp_new:.3f}",
        ]
        ordered = sorted(self.deltas, key=lambda d: d[1])
        for title, rows in (("new best cases:", ordered[:n_best]),
                            ("old best cases:", ordered[::-1][:n_best])):
            lines.append(title)
            for cid, d, t, o, nw in rows:
                lines.append(f"{cid}\tdelta_nll={d:.6f}\ttokens={t}\told={o:.6f}\tnew={nw:.6f}")
        return "\n".join(lines) + "\n"


def compare_scores(old: list[CaseScore], new: list[CaseScore]) -> ScoreComparison:
    new_by_id = {s.id: s for s in new}
    pairs = [(o, new_by_id[o.id]) for o in old if o.id in new_by_id]
    if not pairs:
        raise ScoreFormatError("no common case ids between the two score files")
    for o, n in pairs:
        if o.target_tokens != n.target_tokens:
            raise ScoreFormatError(f"case {o.id}: target_tokens differ ({o.target_tokens} vs {n.target_tokens})")
    tokens = sum(o.target_tokens for o, _ in pairs)
    deltas = [(o.id, n.nll - o.nll, o.target_tokens, o.avg_nll, n.avg_nll) for o, n in pairs]
    return ScoreComparison(
        cases=len(pairs), tokens=tokens,
        old_avg_nll=sum(o.nll for o, _ in pairs) / tokens, new_avg_nll=sum(n.nll for _, n in pairs) / tokens,
        wins_new=sum(d[1] < -TIE_EPS for d in deltas), wins_old=sum(d[1] > TIE_EPS for d in deltas),
        ties=sum(abs(d[1]) <= TIE_EPS for d in deltas),
        first_old=sum(o.first_match for o, _ in pairs), first_new=sum(n.first_match for _, n in pairs),
        lcp_old=sum(o.greedy_lcp for o, _ in pairs) / len(pairs),
        lcp_new=sum(n.greedy_lcp for _, n in pairs) / len(pairs),
        deltas=deltas,
    )
