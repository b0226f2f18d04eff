"""IQ2_XXS's vector neighbour search (16 candidates a register, transposed lists) against the scalar
scan it replaces: the same candidate for every search, including equal scores (the first in ggml's
list order must win), zero and uniform weights, and the longest lists. The scalar scan is the one
test_quants_golden holds to ggml's bytes."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.gguf_tools.quants import iq2_xxs as q
from ds4.gguf_tools.quants import iq2_xxs_search as S

F32 = np.float32


def test_vector_tables_hold_every_list_in_order():
    chunk0 = q.NB_CHUNK0
    vt = q.NB_VTERMS.reshape(-1, 2, S.CHUNK, 4).transpose(0, 1, 3, 2).reshape(-1, 8, S.CHUNK)  # [chunk, i, lane]
    terms = q.NB_TERMS.reshape(-1, 8)
    for u in np.nonzero(q.NB_COUNT)[0][::7]:
        n, s = q.NB_COUNT[u], q.NB_START[u]
        nch = (n + S.CHUNK - 1) // S.CHUNK
        flat = vt[chunk0[u] : chunk0[u] + nch].transpose(0, 2, 1).reshape(-1, 8)  # [candidate, i]
        np.testing.assert_array_equal(flat[:n], terms[s : s + n])
        assert (flat[n:] == S.PAD_TERM).all()


def _searches(rng, n, weights):
    codes = np.nonzero(q.NB_COUNT)[0]
    longest = codes[np.argsort(q.NB_COUNT[codes])[-50:]]
    u = np.concatenate([rng.choice(codes, n - 200), np.repeat(longest, 4)])
    scale = (rng.random(n) * 0.9 + 0.05).astype(F32)
    x = (np.abs(rng.standard_normal((n, 8))) * scale[:, None] * 3).astype(F32)
    tied = rng.random(n) < 0.3  # x midway between levels: diff = +-scale, many equal scores
    x[tied] = (scale[tied, None] * rng.choice([2.0, 4.0], (int(tied.sum()), 8))).astype(F32)
    if weights == "uniform":
        w = np.ones((n, 8), F32)
    elif weights == "zero":
        w = np.zeros((n, 8), F32)  # every score 0: the first candidate
    else:
        w = np.sqrt(rng.gamma(0.5, 1.0, (n, 8)) * (rng.random((n, 8)) < 0.8)).astype(F32)
        w[tied] = 1.0
    return u, x.reshape(-1), w.reshape(-1), scale


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("weights", ["importance", "uniform", "zero"])
def test_vector_search_equals_scalar_scan(weights, portable):
    rng = np.random.default_rng(len(weights) + portable)
    n = 20000
    u, x, w, scale = _searches(rng, n, weights)
    o = np.arange(0, 8 * n, 8, dtype=np.int64)
    got, want = np.zeros(n, np.int64), np.zeros(n, np.int64)
    S.positions_vector(q.NB_VTERMS, q.NB_CHUNK0[u], q.NB_COUNT[u], x, w, o, scale, got, portable)
    S.positions_scalar(q.NB_START[u], q.NB_COUNT[u], q.NB_TERMS, x, w, o, scale, want)
    np.testing.assert_array_equal(got, want)
    if weights == "zero":
        assert (got == 0).all()


@pytest.mark.parametrize("with_importance", [True, False])
def test_quantize_on_tied_data_equals_blockwise_reference(with_importance):
    """Whole rows whose values sit on a coarse lattice (many equal neighbour scores in every
    trial), quantized by the fast row kernel and by the block-at-a-time scalar search."""
    rng = np.random.default_rng(7 + with_importance)
    x = (rng.integers(-4, 5, (6, 1024)) * 0.25).astype(F32)
    x[1] = np.abs(x[1])  # one-signed row
    x[2, :512] = 0.5  # constant groups
    imp = (rng.integers(0, 3, 1024) * 0.5).astype(F32) if with_importance else None  # zero weights too
    np.testing.assert_array_equal(q.quantize(x, imp), q.quantize_blockwise(x, imp))
