"""Sampling (runtime-spec §3): the numpy sampler against a literal loop transcription of the spec,
the xorshift64* generator, distributions, the cuts and greedy decoding."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ds4.engine.sampling import Rng, Sampler, SamplerParams, argmax, sample

F32 = np.float32


# ---- a literal transcription of §3, one token at a time -------------------------------------


def ref_rng(state):
    """xorshift64* on numpy uint64 (wrapping arithmetic), as a generator of uniforms."""
    x = np.uint64(state or 0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        while True:
            x ^= x >> np.uint64(12)
            x ^= x << np.uint64(25)
            x ^= x >> np.uint64(27)
            out = x * np.uint64(0x2545F4914F6CDD1D)
            yield int((out >> np.uint64(40)) & np.uint64(0xFFFFFF)) / 16777216.0


def ref_argmax(logits):
    best, best_i = -1e30, 0
    for i, v in enumerate(logits):
        if v > best:
            best, best_i = v, i
    return best_i


def ref_sample(logits, temperature, top_k, top_p, min_p, uniforms):
    logits = [F32(v) for v in logits]
    if temperature <= 0:
        return ref_argmax(logits)
    if not (0 < top_p <= 1):
        top_p = 1.0
    min_p = max(min_p, 0.0)
    top_k = min(top_k, 1024)
    finite = [i for i, v in enumerate(logits) if math.isfinite(v)]
    if top_k == 0 and top_p >= 1:
        m = max(logits[i] for i in finite)
        w = {i: F32(np.exp(F32((logits[i] - m) / F32(temperature)))) for i in finite}
        kept = [i for i in finite if w[i] >= F32(min_p)]
        total = F32(0)
        for i in kept:
            total = F32(total + w[i])
        r = F32(F32(next(uniforms)) * total)
        for i in kept:
            r = F32(r - w[i])
            if r <= 0:
                return i
        return ref_argmax(logits)
    order = sorted(finite, key=lambda i: (-logits[i], i))
    if top_k > 0:
        order = order[:top_k]
    m = logits[order[0]]
    w = [float(np.exp(F32((logits[i] - m) / F32(temperature)))) for i in order]
    total = sum(w)
    min_prob = (w[0] / total) * min_p
    kept, cum = [], 0.0
    for j, i in enumerate(order):
        if j > 0 and w[j] / total < min_prob:
            break
        kept.append(j)
        cum += w[j] / total
        if cum >= top_p:
            break
    filtered = sum(w[j] for j in kept)
    r = next(uniforms) * filtered
    for j in kept:
        r -= w[j]
        if r <= 0:
            return order[j]
    return order[kept[-1]]


# ---- tests -----------------------------------------------------------------------------------


def test_rng_matches_numpy_transcription():
    for seed in [0, 1, 42, 0xDEADBEEFCAFEBABE, (1 << 64) - 1]:
        ours = Rng(seed)
        ref = ref_rng(seed)
        for _ in range(200):
            u = ours.uniform()
            assert u == next(ref)
            assert 0.0 <= u < 1.0


def test_rng_zero_state_is_replaced():
    assert Rng(0).next_u64() == Rng(0x9E3779B97F4A7C15).next_u64()


@pytest.mark.parametrize(
    "params",
    [
        SamplerParams(1.0, 0, 1.0, 0.05),  # ds4 defaults
        SamplerParams(0.7, 0, 1.0, 0.0),
        SamplerParams(1.3, 0, 0.9, 0.05),
        SamplerParams(1.0, 0, 0.5, 0.0),
        SamplerParams(0.8, 5, 1.0, 0.1),
        SamplerParams(1.0, 20, 0.8, 0.02),
        SamplerParams(1.0, 2000, 1.0, 0.05),  # top_k clamped to 1024
        SamplerParams(1.0, 0, 1.5, -1.0),  # top_p outside (0,1] -> 1; min_p < 0 -> 0
    ],
)
def test_sampler_matches_reference(params):
    rng = np.random.default_rng(5)
    for trial in range(120):
        logits = (rng.standard_normal(64) * 3).astype(F32)
        if trial % 5 == 0:
            logits[rng.integers(0, 64, 3)] = -np.inf  # ignored
        if trial % 7 == 0:
            logits[rng.integers(0, 64)] = np.nan
        seed = 1000 + trial
        ours = sample(logits, params, Rng(seed))
        ref = ref_sample(logits, params.temperature, params.top_k, params.top_p, params.min_p, ref_rng(seed))
        assert ours == ref, (trial, params)


def test_full_vocab_matches_reference():
    rng = np.random.default_rng(9)
    logits = (rng.standard_normal(129280) * 2).astype(F32)
    for seed in range(1, 4):
        for params in [SamplerParams(), SamplerParams(1.0, 40, 0.95, 0.05)]:
            ours = sample(logits, params, Rng(seed))
            assert ours == ref_sample(logits, params.temperature, params.top_k, params.top_p, params.min_p, ref_rng(seed))


def test_greedy():
    logits = np.array([0.5, 2.0, 2.0, -1.0], dtype=F32)
    assert Sampler(temperature=0).sample(logits) == 1  # first of the equal maxima
    assert Sampler(temperature=-1).sample(logits) == 1
    assert argmax(np.full(5, -np.inf, dtype=F32)) == 0
    assert argmax(np.array([np.nan, -2e30, 3.0], dtype=F32)) == 2
    assert Sampler(temperature=0).greedy


def _frequencies(logits, n=20000, **kw):
    s = Sampler(seed=123, **kw)
    counts = np.bincount([s.sample(logits) for _ in range(n)], minlength=len(logits))
    return counts / n


def test_distribution_follows_softmax():
    logits = np.array([1.0, 0.0, -0.5, 0.5], dtype=F32)
    for t in (1.0, 0.5):
        freq = _frequencies(logits, temperature=t, min_p=0.0)
        p = np.exp(logits / t) / np.exp(logits / t).sum()
        assert np.abs(freq - p).max() < 0.015


def test_cuts():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], dtype=F32))
    # min_p relative to the best: 0.1/0.4 = 0.25 < 0.3 -> token 3 never drawn
    assert _frequencies(logits, min_p=0.3, n=4000)[3] == 0
    # top_k = 2: only the two best
    f = _frequencies(logits, top_k=2, min_p=0.0, n=4000)
    assert f[2] == f[3] == 0 and abs(f[0] - 4 / 7) < 0.03
    # top_p = 0.6: 0.4 then 0.7 >= 0.6 -> tokens 0 and 1
    f = _frequencies(logits, top_p=0.6, min_p=0.0, n=4000)
    assert f[2] == f[3] == 0 and f[1] > 0.3
    # top_p small: only the best
    assert _frequencies(logits, top_p=0.01, min_p=0.0, n=500)[0] == 1.0


def test_seeded_reproducible():
    logits = np.random.default_rng(0).standard_normal(1000).astype(F32)
    a = Sampler(seed=77)
    b = Sampler(seed=77)
    assert [a.sample(logits) for _ in range(50)] == [b.sample(logits) for _ in range(50)]
    c = Sampler(seed=78)
    a.reseed(77)
    assert [a.sample(logits) for _ in range(50)] != [c.sample(logits) for _ in range(50)]
