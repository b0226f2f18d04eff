"""The lane-order kernels in vector registers (ds4.gguf_tools.quants.lanes) against the readable
lane-order reference, and against their own scalar fallback (strided arrays take the loop)."""

from __future__ import annotations

import numba as nb
import numpy as np
import pytest

from ds4.gguf_tools.quants.fused import lane_dot_reference
from ds4.gguf_tools.quants.lanes import LANES, dot_lanes, dot_rows, lane_sums4, tree_row

F32 = np.float32


@nb.njit
def _dots(w, x):
    """Rows addressed by index (dot_rows on the 2-D arrays)."""
    p = np.empty(LANES, np.float32)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    for t in range(x.shape[0]):
        for o in range(w.shape[0]):
            out[t, o] = dot_rows(w, o, x, t, p)
    return out


@nb.njit
def _dots_1d(w, x):
    """Rows as 1-D arrays (dot_lanes)."""
    p = np.empty(LANES, np.float32)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    for t in range(x.shape[0]):
        for o in range(w.shape[0]):
            out[t, o] = dot_lanes(w[o], x[t], p)
    return out


@nb.njit
def _dots4(w, x):
    """Four tokens per call of lane_sums4, the tail and the tree added here (T a multiple of 4)."""
    K = x.shape[1]
    full = K - K % LANES
    p = np.empty((4, LANES), np.float32)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    for o in range(w.shape[0]):
        for t0 in range(0, x.shape[0], 4):
            lane_sums4(w[o], x, t0, full, p)
            for tt in range(4):
                for l in range(K - full):
                    p[tt, l] += w[o, full + l] * x[t0 + tt, full + l]
                out[t0 + tt, o] = tree_row(p, tt)
    return out


def _case(K, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((37, K)).astype(F32)
    x = rng.standard_normal((8, K)).astype(F32)
    return w, x


@pytest.mark.parametrize("K", [64, 100, 512, 7, 1000])
def test_register_kernels_equal_the_lane_reference(K):
    w, x = _case(K, K)
    ref = lane_dot_reference(w, x)
    np.testing.assert_array_equal(_dots(w, x), ref)
    np.testing.assert_array_equal(_dots_1d(w, x), ref)
    np.testing.assert_array_equal(_dots4(w, x), ref)
    half = w.astype(np.float16)
    np.testing.assert_array_equal(_dots(half.view(np.uint16), x), lane_dot_reference(half.astype(F32), x))


@pytest.mark.parametrize("K", [128, 200])
def test_strided_arrays_take_the_loop_and_give_the_same_bits(K):
    w, x = _case(K, 7 + K)
    wide_w = np.zeros((w.shape[0], 2 * K), F32)
    wide_w[:, ::2] = w
    wide_x = np.zeros((x.shape[0], K + 5), F32)
    wide_x[:, :K] = x
    strided_w, strided_x = wide_w[:, ::2], wide_x[:, :K]   # numba layout 'A': the scalar loop
    assert not strided_w.flags.c_contiguous and not strided_x.flags.c_contiguous
    ref = _dots(w, x)
    np.testing.assert_array_equal(_dots(strided_w, strided_x), ref)
    np.testing.assert_array_equal(_dots_1d(strided_w, strided_x), ref)
    np.testing.assert_array_equal(_dots4(w, strided_x), ref)
    assert np.abs(ref - x.astype(np.float64) @ w.astype(np.float64).T).max() < 1e-3


def test_no_fused_multiply_add():
    """lane += w * x rounds the product before the add. Lane 0 holds -1 after the first 64
    elements; then w = x = 1 + 2^-12, whose square 1 + 2^-11 + 2^-24 rounds (tie to even) to
    1 + 2^-11, so the lane ends at exactly 2^-11; a fused multiply-add would keep 2^-11 + 2^-24."""
    a = np.zeros((1, 128), F32)
    b = np.zeros((4, 128), F32)
    a[0, 0], b[:, 0] = -1.0, 1.0
    a[0, 64] = b[:, 64] = F32(1 + 2 ** -12)
    assert lane_dot_reference(a, b[:1])[0, 0] == F32(2 ** -11)
    assert _dots(a, b[:1])[0, 0] == F32(2 ** -11)
    assert (_dots4(a, b)[:, 0] == F32(2 ** -11)).all()


@pytest.mark.parametrize("K", [32, 96, 512, 160])
def test_q8_0_rows_from_blocks_equal_decode_then_dot(K):
    """The one-to-three-token Q8_0 path (weights formed in registers) against dequantize + the lane
    reference, on raw blocks with every code -128..127 and random finite half scales."""
    from ds4.gguf_tools.constants import QuantType
    from ds4.gguf_tools.quants import fused

    rng = np.random.default_rng(K)
    rows = 40
    raw = rng.integers(0, 256, (rows, K // 32 * 34), dtype=np.uint8)
    scales = (rng.standard_normal((rows, K // 32)) * 0.01).astype(np.float16).view(np.uint8)
    blocks = raw.reshape(rows, K // 32, 34)
    blocks[:, :, 0:2] = scales.reshape(rows, K // 32, 2)
    for T in (1, 2, 3, 4):
        x = rng.standard_normal((T, K)).astype(F32)
        got = fused.matmul(QuantType.Q8_0, raw, x)
        np.testing.assert_array_equal(got, fused.matmul_reference(QuantType.Q8_0, raw, x))
