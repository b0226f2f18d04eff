"""Q4_K: 256 weights per 144-byte block (tooling-spec §2.5).

Layout: f16 d, f16 dmin, 12 bytes of packed 6-bit (scale, min) pairs for 8 sub-blocks of 32,
128 bytes of 4-bit codes. w = d*sc*q - dmin*m.

Without importance weights this is ggml's `quantize_row_q4_K_ref` (make_qkx2 per sub-block, then
a linear 6-bit scale grid); with them `quantize_row_q4_K_impl` (make_qkx3 + make_qp for the scales).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._numeric import F32, QK_K, fp16_bits_to_fp32, fp32_to_fp16_bits, make_qkx2, make_qkx3, make_qp, nearest_int
from ._rows import dequantize_blocks, empty_blocks, float_rows, importance_arg

BLOCK_BYTES = 144
BLOCK_DTYPE = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qs", "u1", (128,))])
assert BLOCK_DTYPE.itemsize == BLOCK_BYTES


# ---------------------------------------------------------------- numpy reference (decoding)


def unpack_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] packed bytes -> (sc[..., 8], m[..., 8]) 6-bit values."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), dtype=np.uint8)
    m = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    m[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    m[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, m


def dequantize_reference(raw: np.ndarray) -> np.ndarray:
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    b = raw.reshape(-1, BLOCK_BYTES).view(BLOCK_DTYPE).reshape(-1)
    sc, m = unpack_scale_min(b["scales"])
    d = b["d"].astype(np.float32)[:, None] * sc.astype(np.float32)  # [nb, 8]
    dm = b["dmin"].astype(np.float32)[:, None] * m.astype(np.float32)
    qs = b["qs"].reshape(-1, 4, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)
    y = d[..., None] * q - dm[..., None]
    return y.reshape(*raw.shape[:-1], raw.shape[-1] // BLOCK_BYTES * QK_K)


# ---------------------------------------------------------------- numba kernels


@njit(inline="always")
def _scale_min(s, j):
    if j < 4:
        return np.int32(s[j] & 63), np.int32(s[j + 4] & 63)
    sc = (np.int32(s[j + 4]) & 0xF) | ((np.int32(s[j - 4]) >> 6) << 4)
    m = (np.int32(s[j + 4]) >> 4) | ((np.int32(s[j]) >> 6) << 4)
    return sc, m


@njit(inline="always")
def _pack_scale_min(s, j, ls, lm):
    """Store 6-bit (ls, lm) of sub-block j into the 12 scale bytes (uint8 stores wrap like C)."""
    if j < 4:
        s[j] = np.uint8(ls & 0xFF)
        s[j + 4] = np.uint8(lm & 0xFF)
    else:
        s[j + 4] = np.uint8(((ls & 0xF) | ((lm & 0xF) << 4)) & 0xFF)
        s[j - 4] = np.uint8((np.int32(s[j - 4]) | ((ls >> 4) << 6)) & 0xFF)
        s[j] = np.uint8((np.int32(s[j]) | ((lm >> 4) << 6)) & 0xFF)


@njit(inline="always")
def _finish_block(x, out, o, L, s, dh, mh):
    """Write header and scales, requantize codes against the stored (f16, 6-bit) scales, pack nibbles."""
    out[o] = dh & 0xFF
    out[o + 1] = dh >> 8
    out[o + 2] = mh & 0xFF
    out[o + 3] = mh >> 8
    for j in range(12):
        out[o + 4 + j] = s[j]
    d_all = fp16_bits_to_fp32(dh)
    m_all = fp16_bits_to_fp32(mh)
    for j in range(8):
        sc, m = _scale_min(s, j)
        d = d_all * F32(sc)
        if d == 0:
            continue
        dm = m_all * F32(m)
        for i in range(32):
            q = nearest_int((x[32 * j + i] + dm) / d)
            L[32 * j + i] = max(0, min(15, q))
    for p in range(4):
        for i in range(32):
            out[o + 16 + 32 * p + i] = L[64 * p + i] | (L[64 * p + 32 + i] << 4)


@njit(error_model="numpy")
def _block_ref(x, out, o, L, Laux, w, s, scales, mins):
    max_scale = F32(0.0)
    max_min = F32(0.0)
    for j in range(8):
        xs = x[32 * j : 32 * j + 32]
        sum_x2 = F32(0.0)
        for i in range(32):
            sum_x2 += xs[i] * xs[i]
        av_x = np.sqrt(sum_x2 / F32(32.0))
        for i in range(32):
            w[i] = av_x + abs(xs[i])
        sc, mn = make_qkx2(32, 15, xs, w, L[32 * j : 32 * j + 32], Laux, F32(-1.0), F32(0.1), 20)
        scales[j] = sc
        mins[j] = mn
        if sc > max_scale:
            max_scale = sc
        if mn > max_min:
            max_min = mn
    inv_scale = F32(63.0) / max_scale if max_scale > 0 else F32(0.0)
    inv_min = F32(63.0) / max_min if max_min > 0 else F32(0.0)
    s[:] = 0
    for j in range(8):
        ls = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)
        lm = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
        _pack_scale_min(s, j, ls, lm)
    dh = fp32_to_fp16_bits(max_scale / F32(63.0))
    mh = fp32_to_fp16_bits(max_min / F32(63.0))
    _finish_block(x, out, o, L, s, dh, mh)


@njit(error_model="numpy")
def _block_weighted(x, qw, out, o, L, Laux, w, s, scales, mins, sw, Ls, Lm):
    sum_x2 = F32(0.0)
    for i in range(QK_K):
        sum_x2 += x[i] * x[i]
    sigma2 = F32(2.0) * sum_x2 / F32(256.0)
    for j in range(8):
        xs = x[32 * j : 32 * j + 32]
        for i in range(32):
            w[i] = qw[32 * j + i] * np.sqrt(sigma2 + xs[i] * xs[i])
        sumw = F32(0.0)
        for i in range(32):
            sumw += w[i]
        sw[j] = sumw
        sc, mn = make_qkx3(32, 15, xs, w, L[32 * j : 32 * j + 32], Laux, F32(-0.9), F32(0.05), 36)
        scales[j] = sc
        mins[j] = mn
    d_block = make_qp(8, 63, scales, Ls, sw)
    m_block = make_qp(8, 63, mins, Lm, sw)
    s[:] = 0
    for j in range(8):
        _pack_scale_min(s, j, np.int32(Ls[j]), np.int32(Lm[j]))
    _finish_block(x, out, o, L, s, fp32_to_fp16_bits(d_block), fp32_to_fp16_bits(m_block))


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_rows(x, qw, weighted, out):
    rows, cols = x.shape
    nb = cols // QK_K
    for r in prange(rows):
        L = np.zeros(QK_K, dtype=np.uint8)
        Laux = np.zeros(32, dtype=np.uint8)
        w = np.zeros(32, dtype=np.float32)
        s = np.zeros(12, dtype=np.uint8)
        scales = np.zeros(8, dtype=np.float32)
        mins = np.zeros(8, dtype=np.float32)
        sw = np.zeros(8, dtype=np.float32)
        Ls = np.zeros(8, dtype=np.uint8)
        Lm = np.zeros(8, dtype=np.uint8)
        for b in range(nb):
            xb = x[r, b * QK_K : (b + 1) * QK_K]
            ob = out[r]
            if weighted:
                _block_weighted(xb, qw[b * QK_K : (b + 1) * QK_K], ob, b * BLOCK_BYTES, L, Laux, w, s, scales, mins, sw, Ls, Lm)
            else:
                _block_ref(xb, ob, b * BLOCK_BYTES, L, Laux, w, s, scales, mins)


@njit(inline="always")
def _decode_block(raw_row, o, buf):
    d_all = fp16_bits_to_fp32(np.int32(raw_row[o]) | (np.int32(raw_row[o + 1]) << 8))
    m_all = fp16_bits_to_fp32(np.int32(raw_row[o + 2]) | (np.int32(raw_row[o + 3]) << 8))
    s = raw_row[o + 4 : o + 16]
    for p in range(4):
        sc0, m0 = _scale_min(s, 2 * p)
        sc1, m1 = _scale_min(s, 2 * p + 1)
        d0 = d_all * F32(sc0)
        dm0 = m_all * F32(m0)
        d1 = d_all * F32(sc1)
        dm1 = m_all * F32(m1)
        for i in range(32):
            q = raw_row[o + 16 + 32 * p + i]
            buf[64 * p + i] = d0 * F32(q & 0xF) - dm0
            buf[64 * p + 32 + i] = d1 * F32(q >> 4) - dm1


@njit(parallel=True, cache=True, error_model="numpy")
def _dequantize_rows(raw, out):
    nb = raw.shape[1] // BLOCK_BYTES
    for r in prange(raw.shape[0]):
        for b in range(nb):
            _decode_block(raw[r], b * BLOCK_BYTES, out[r, b * QK_K : (b + 1) * QK_K])


# ---------------------------------------------------------------- public


def quantize(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    x = float_rows(x, QK_K, "Q4_K")
    out = empty_blocks(x, QK_K, BLOCK_BYTES)
    weighted, qw = importance_arg(importance, x.shape[1])
    _quantize_rows(x, qw, weighted, out)
    return out


def dequantize(raw: np.ndarray) -> np.ndarray:
    return dequantize_blocks(_dequantize_rows, raw, QK_K, BLOCK_BYTES)
