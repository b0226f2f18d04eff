"""kernels.route_select: the MoE routing after the router's product in one kernel, bit for bit the
numpy of forward.route (top-k with ties to the lowest expert, weights normalised in slot order)."""

from __future__ import annotations

import numpy as np

from ds4.engine import forward, kernels

F32 = np.float32


def _numpy_route(s, bias, ids, k, scale):
    if ids is None:
        ids = forward.topk_rows(s + bias if bias is not None else s, k)
    w = np.take_along_axis(s, ids, axis=1)
    w = w / np.maximum(w.sum(axis=1, keepdims=True), F32(forward.ROUTE_DENOM_MIN)) * F32(scale)
    return ids, w.astype(F32)


def test_route_select_equals_the_numpy_route():
    rng = np.random.default_rng(0)
    for trial in range(400):
        T, E, k = int(rng.integers(1, 5)), int(rng.choice([8, 32, 256])), int(rng.integers(1, 8))
        s = np.sqrt(forward.softplus(rng.standard_normal((T, E)).astype(F32) * F32(rng.uniform(0.1, 5))))
        if trial % 3 == 0:
            s = (np.round(s * 4) / 4).astype(F32)          # many tied scores
        bias = (rng.standard_normal(E) * 0.1).astype(F32) if trial % 2 else None
        hashed = rng.integers(0, E, (T, k)) if trial % 5 == 0 else None
        want = _numpy_route(s, None if hashed is not None else bias, hashed, k, 1.5)
        got = kernels.route_select(s, None if hashed is not None else bias, hashed, k,
                                   forward.ROUTE_DENOM_MIN, 1.5)
        assert np.array_equal(got[0], want[0])
        assert np.array_equal(got[1].view(np.uint32), want[1].view(np.uint32))


def test_route_select_leaves_nan_rows_and_eight_slots_to_numpy():
    s = np.ones((2, 16), F32)
    s[1, 3] = np.nan
    assert kernels.route_select(s, None, None, 4, forward.ROUTE_DENOM_MIN, 1.0) is None
    assert kernels.route_select(np.ones((1, 16), F32), None, None, 8, forward.ROUTE_DENOM_MIN, 1.0) is None
