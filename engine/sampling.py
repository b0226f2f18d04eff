"""Token sampling as ds4 does it (runtime-spec §3).

Order: temperature -> (top-k) -> min-p relative to the best token -> top-p cumulative -> draw.
Temperature <= 0 is greedy (first index of the largest logit). The random source is ds4's
xorshift64* generator, so a seed gives the same draws as ds4 would from the same weights.

Three paths, as in ds4:
* top_k == 0 and top_p >= 1 (the default): weights exp((l - max) / T) in vocabulary order, drop
  those below min_p, draw over the rest walking ids in vocabulary order;
* top_k == 0 and top_p < 1: all finite tokens sorted by logit, min-p and top-p cut in that order;
* top_k > 0: the top_k logits only (softmax over those), then the same cut.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np

MASK64 = (1 << 64) - 1
RNG_ZERO_STATE = 0x9E3779B97F4A7C15  # a zero state would stay zero
RNG_MULTIPLIER = 0x2545F4914F6CDD1D
TOP_K_MAX = 1024
NEG_FLOOR = -1e30  # logits at or below this never win the argmax

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MIN_P = 0.05
DEFAULT_TOP_K = 0


class Rng:
    """xorshift64* with ds4's constants; `uniform()` has 24 bits of resolution."""

    def __init__(self, seed: int):
        self.state = int(seed) & MASK64

    def next_u64(self) -> int:
        x = self.state or RNG_ZERO_STATE
        x ^= x >> 12
        x ^= (x << 25) & MASK64
        x ^= x >> 27
        self.state = x
        return (x * RNG_MULTIPLIER) & MASK64

    def uniform(self) -> float:
        return ((self.next_u64() >> 40) & 0xFFFFFF) / 16777216.0


def time_seed() -> int:
    """ds4's CLI seed when none is given: time ^ (pid << 32) ^ clock()."""
    return (int(time.time()) ^ (os.getpid() << 32) ^ int(time.process_time() * 1e6)) & MASK64


def argmax(logits: np.ndarray) -> int:
    """First index of the strictly largest value; 0 when every value is <= -1e30 (or NaN)."""
    logits = np.asarray(logits)
    valid = logits > NEG_FLOOR
    if not valid.any():
        return 0
    return int(np.argmax(np.where(valid, logits, -np.inf)))


@dataclass
class SamplerParams:
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    min_p: float = DEFAULT_MIN_P

    def clamped(self) -> "SamplerParams":
        """ds4's silent clamps: top_p outside (0, 1] -> 1, min_p < 0 -> 0, top_k capped at 1024."""
        top_p = self.top_p if 0.0 < self.top_p <= 1.0 else 1.0
        min_p = max(self.min_p, 0.0)
        top_k = min(max(int(self.top_k), 0), TOP_K_MAX)
        return SamplerParams(self.temperature, top_k, top_p, min_p)


def _draw_in_order(weights: np.ndarray, u: float) -> int:
    """Index where the running sum of `weights` (float32, in order) first reaches u * total;
    -1 if nothing has weight."""
    cumulative = np.cumsum(weights, dtype=np.float32)
    if cumulative.size == 0 or not cumulative[-1] > 0:
        return -1
    r = np.float32(u) * cumulative[-1]
    idx = int(np.searchsorted(cumulative, r, side="left"))
    return min(idx, cumulative.size - 1)


def _cut_sorted(weights: np.ndarray, top_p: float, min_p: float) -> int:
    """How many of the descending `weights` survive the min-p and top-p cuts (at least one)."""
    total = float(weights.sum(dtype=np.float64))
    if not total > 0:
        return 1
    shares = weights / total
    min_prob = shares[0] * min_p
    kept = 1
    cumulative = shares[0]
    while kept < len(weights) and cumulative < top_p:
        if shares[kept] < min_prob:
            break
        cumulative += shares[kept]
        kept += 1
    return kept


def sample(logits: np.ndarray, params: SamplerParams, rng: Rng) -> int:
    """One token id from `logits` (1-D) under `params`, drawing from `rng`."""
    logits = np.asarray(logits, dtype=np.float32)
    if not params.temperature > 0:
        return argmax(logits)
    p = params.clamped()
    inv_t = np.float32(1.0 / p.temperature)
    finite = np.isfinite(logits)
    if not finite.any():
        return 0
    best = argmax(logits)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        return _sample_finite(logits, finite, best, inv_t, p, rng)


def _sample_finite(logits, finite, best, inv_t, p: SamplerParams, rng: Rng) -> int:
    if p.top_k == 0 and p.top_p >= 1.0:
        m = logits[finite].max()
        weights = np.exp((logits - m) * inv_t).astype(np.float32)
        kept_ids = np.flatnonzero(finite & (weights >= np.float32(p.min_p)))
        idx = _draw_in_order(weights[kept_ids], rng.uniform())
        return best if idx < 0 else int(kept_ids[idx])

    ids = np.flatnonzero(finite)
    if p.top_k > 0:
        # top_k largest, equal logits keep the lower id first (stable sort on -logit)
        order = np.argsort(-logits[ids], kind="stable")[: p.top_k]
    else:
        order = np.argsort(-logits[ids], kind="stable")
    ids = ids[order]
    vals = logits[ids]
    weights = np.exp((vals - vals[0]) * inv_t).astype(np.float32)
    kept = _cut_sorted(weights, p.top_p, p.min_p)
    idx = _draw_in_order(weights[:kept], rng.uniform())
    return best if idx < 0 else int(ids[idx])


class Sampler:
    """Seeded sampler: `Sampler(temperature=0.7, seed=1).sample(logits)`."""

    def __init__(
        self,
        temperature: float = DEFAULT_TEMPERATURE,
        top_k: int = DEFAULT_TOP_K,
        top_p: float = DEFAULT_TOP_P,
        min_p: float = DEFAULT_MIN_P,
        seed: int | None = None,
    ):
        if math.isnan(temperature):
            raise ValueError("temperature is NaN")
        self.params = SamplerParams(temperature, top_k, top_p, min_p)
        self.seed = time_seed() if seed is None else int(seed)
        self.rng = Rng(self.seed)

    @property
    def greedy(self) -> bool:
        return not self.params.temperature > 0

    def reseed(self, seed: int | None = None) -> None:
        self.seed = time_seed() if seed is None else int(seed)
        self.rng = Rng(self.seed)

    def sample(self, logits: np.ndarray) -> int:
        return sample(logits, self.params, self.rng)

    __call__ = sample
