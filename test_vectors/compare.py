"""The pass rules of tooling-spec §5.3, applied to one step at a time.

A step passes when
  (1) the bytes of the local greedy token equal the recorded selected bytes, and
  (2) every recorded alternative (after the .vec filter) is among the local top-k by logit, with
      |local logprob − recorded logprob| ≤ tolerance (4.0 nats by default).

The official API spells end-of-sentence with doubled bars (`<｜｜end▁of▁sentence｜｜>`); the
tokenizer's EOS is `<｜end▁of▁sentence｜>`. Both spellings mean EOS, so they compare equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .formats import TopEntry, VectorStep

EOS_BYTES = "<｜end▁of▁sentence｜>".encode("utf-8")
API_EOS_BYTES = "<｜｜end▁of▁sentence｜｜>".encode("utf-8")
DEFAULT_TOLERANCE = 4.0
DEFAULT_TOP_K = 20


def canonical_token(b: bytes) -> bytes:
    """Map the API's spelling of special tokens to the tokenizer's."""
    return EOS_BYTES if b == API_EOS_BYTES else b


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Natural-log softmax in float64 over finite logits (non-finite entries get -inf)."""
    x = np.asarray(logits, dtype=np.float64)
    finite = np.isfinite(x)
    m = x[finite].max()
    lse = m + np.log(np.exp(x[finite] - m).sum())
    out = np.full_like(x, -np.inf)
    out[finite] = x[finite] - lse
    return out


def argmax_first(logits: np.ndarray) -> int:
    """Greedy token: the first index holding the largest value (np.argmax already breaks ties so)."""
    return int(np.argmax(logits))


def top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits, best first; equal logits keep the lower id first."""
    x = np.asarray(logits)
    k = min(k, x.shape[0])
    part = np.argpartition(-x, k - 1)[:k] if k < x.shape[0] else np.arange(x.shape[0])
    # stable sort on (-logit, id)
    order = np.lexsort((part, -x[part]))
    return part[order]


def local_top(logits: np.ndarray, token_bytes, k: int = DEFAULT_TOP_K) -> list[TopEntry]:
    """Top-k by raw logit with log-softmax logprobs; `token_bytes(id) -> bytes`."""
    lp = log_softmax(logits)
    return [TopEntry(token_bytes(int(i)), float(lp[i])) for i in top_k_ids(logits, k)]


@dataclass
class StepCheck:
    index: int
    expected: bytes
    got: bytes
    expected_logprob: float | None  # local logprob of the expected token, when it is in the local top-k
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _show(b: bytes) -> str:
    return repr(b.decode("utf-8", errors="backslashreplace"))


def check_step(expected: VectorStep, got: bytes, top: list[TopEntry],
               tolerance: float = DEFAULT_TOLERANCE) -> StepCheck:
    """Compare one recorded step with the local greedy token `got` and local top-k `top`."""
    want = canonical_token(expected.selected)
    got_c = canonical_token(got)
    local = {canonical_token(t.token): t.logprob for t in top}
    res = StepCheck(index=expected.index, expected=want, got=got_c, expected_logprob=local.get(want))
    if got_c != want:
        res.problems.append(f"greedy token {_show(got_c)} != expected {_show(want)}")
    for alt in expected.top:
        tb = canonical_token(alt.token)
        if tb not in local:
            res.problems.append(f"{_show(tb)} not in local top-{len(top)}")
        elif abs(local[tb] - alt.logprob) > tolerance:
            res.problems.append(
                f"{_show(tb)} logprob {local[tb]:.3f} vs {alt.logprob:.3f} (|Δ| > {tolerance:g})")
    return res
