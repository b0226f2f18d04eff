"""The batched and lane forms of the _numeric searches against the scalar ones they replace
(tooling-spec §2.3): same returned floats bit for bit and the same codes, for the (n, nmax, rmin,
rdelta, nstep) of every caller, with and without importance-like weights, on data that exercises
the degenerate, one-signed, tied and min-updating branches; and IQ2_XXS's lane row kernel against
its block-at-a-time form. The scalar versions are themselves held to ggml's bytes by
test_quants_golden."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.gguf_tools.quants import _numeric as N

F32 = np.float32


def _groups(rng: np.random.Generator, n: int, count: int) -> list[np.ndarray]:
    out = []
    for t in range(count):
        kind = t % 8
        if kind == 0:
            x = rng.standard_normal(n) * 0.02
        elif kind == 1:
            x = np.abs(rng.standard_normal(n))  # one-signed: min clamps to 0
        elif kind == 2:
            x = -np.abs(rng.standard_normal(n)) * 1e3
        elif kind == 3:
            x = np.full(n, 0.75) if t % 16 == 3 else np.zeros(n)  # degenerate
        elif kind == 4:
            x = rng.integers(-3, 4, n) * 0.5  # exact ties on the code grid
        elif kind == 5:
            x = rng.standard_normal(n) * (rng.random(n) < 0.3)
        elif kind == 6:
            x = np.clip(rng.standard_t(2, n), -20, 20)
        else:
            x = rng.standard_normal(n) * 1e-20
        out.append(x.astype(F32))
    return out


@pytest.mark.parametrize("n,nmax", [(16, 15), (8, 63), (32, 4)])
def test_batched_make_qp_equals_scalar(n, nmax):
    rng = np.random.default_rng(nmax)
    S = N.trial_scratch(n)
    for t, x in enumerate(_groups(rng, n, 1200)):
        x = np.abs(x) if t % 5 else x  # make_qp sees non-negative scales/mins (and the odd negative)
        qw = (rng.random(n) * (rng.random(n) < 0.9)).astype(F32)
        L1, L2 = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
        a = N.make_qp(n, nmax, x, L1, qw)
        b = N.make_qp_batched(n, nmax, x, L2, qw, S)
        assert F32(a).view(np.uint32) == F32(b).view(np.uint32), (t, x)
        np.testing.assert_array_equal(L1, L2, err_msg=f"group {t}")


LANE_CASES = [  # (name, scalar, lanes version, n, nmax, rmin, rdelta, nstep)
    ("qkx2_mad_q2k", N.make_qkx2_mad, N.make_qkx2_mad_lanes, 16, 3, -0.5, 0.1, 15),
    ("qkx3_q2k", N.make_qkx3, N.make_qkx3_lanes, 16, 3, -0.9, 0.05, 36),
    ("qkx2_q4k", N.make_qkx2, N.make_qkx2_lanes, 32, 15, -1.0, 0.1, 20),
    ("qkx3_q4k", N.make_qkx3, N.make_qkx3_lanes, 32, 15, -0.9, 0.05, 36),
]


@pytest.mark.parametrize("lanes", [1, 37, 640])
@pytest.mark.parametrize("case", LANE_CASES, ids=[c[0] for c in LANE_CASES])
def test_lane_make_qkx_equals_scalar(case, lanes):
    """Groups searched in lock step (one lane each) give the scalar search's floats and codes."""
    _, scalar, lane_fn, n, nmax, rmin, rdelta, nstep = case
    rng = np.random.default_rng(lanes + n)
    X = np.stack(_groups(rng, n, lanes))
    kind = np.arange(lanes)[:, None] % 3
    W = np.where(kind == 0, np.abs(X), np.where(kind == 1, rng.random(X.shape) ** 3, X * X)).astype(F32)
    XT, WT = np.ascontiguousarray(X.T), np.ascontiguousarray(W.T)
    LT, LA = np.zeros_like(XT), np.zeros_like(XT)
    scale, the_min = np.zeros(lanes, F32), np.zeros(lanes, F32)
    lane_fn(n, nmax, XT, WT, LT, F32(rmin), F32(rdelta), nstep, LA, scale, the_min)
    for g in range(lanes):
        L, Laux = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
        want = np.array(scalar(n, nmax, X[g], W[g], L, Laux, F32(rmin), F32(rdelta), nstep), F32)
        got = np.array([scale[g], the_min[g]], F32)
        assert want.view(np.uint32).tolist() == got.view(np.uint32).tolist(), (g, X[g])
        np.testing.assert_array_equal(L, LT[:, g].astype(np.uint8), err_msg=f"lane {g}")


@pytest.mark.parametrize("rows,cols", [(3, 256), (2, 768), (2, 4096)])
def test_iq2_xxs_lane_rows_equal_blockwise_search(rows, cols):
    """IQ2_XXS's row kernel (groups in lock step) gives the block-at-a-time search's bytes."""
    from ds4.gguf_tools.quants import iq2_xxs

    rng = np.random.default_rng(rows * cols)
    x = (rng.standard_normal((rows, cols)) * rng.gamma(1.0, 0.05, (rows, 1))).astype(F32)
    x[0, : cols // 4] = 0  # whole zero groups (no scale) beside live ones
    x[-1] *= rng.random(cols) < 0.3
    imp = (rng.gamma(0.5, 1.0, cols) * (rng.random(cols) < 0.9)).astype(F32)
    for importance in (imp, None):
        np.testing.assert_array_equal(iq2_xxs.quantize(x, importance), iq2_xxs.quantize_blockwise(x, importance))


@pytest.mark.parametrize("lanes", [1, 37, 640])
@pytest.mark.parametrize("n,nmax", [(32, 4), (16, 15), (8, 63)])
def test_lane_make_qp_equals_scalar(n, nmax, lanes):
    """make_qp for many groups in lock step (refit sweeps run while any lane changes) equals the
    scalar make_qp of each group: scale bits and the codes ggml's uint8 stores leave."""
    rng = np.random.default_rng(lanes * n + nmax)
    X = np.stack(_groups(rng, n, lanes))
    X = np.where(np.arange(lanes)[:, None] % 5 == 0, X, np.abs(X)).astype(F32)  # some negative values
    W = (rng.random(X.shape) * (rng.random(X.shape) < 0.9)).astype(F32)
    XT, WT = np.ascontiguousarray(X.T), np.ascontiguousarray(W.T)
    LT = np.zeros(XT.shape, np.int32)
    scale = np.zeros(lanes, F32)
    N.make_qp_lanes(n, nmax, XT, WT, LT, scale)
    for g in range(lanes):
        L = np.zeros(n, np.uint8)
        want = N.make_qp(n, nmax, X[g], L, W[g])
        assert F32(want).view(np.uint32) == scale[g : g + 1].view(np.uint32)[0], (g, X[g])
        np.testing.assert_array_equal(L, LT[:, g].astype(np.uint8), err_msg=f"lane {g}")
