"""Q2_K: 256 weights per 84-byte block (tooling-spec §2.6).

Layout: 16 scale bytes (low nibble scale, high nibble min, one per sub-block of 16), 64 bytes of
2-bit codes, f16 d, f16 dmin. w = d*(s & 15)*q - dmin*(s >> 4).

Without importance weights this is ggml's `quantize_row_q2_K_ref` (make_qkx2 with mean absolute
error); with them `quantize_row_q2_K_impl` (make_qkx3 + make_qp, scales re-read from f16).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._numeric import (F32, QK_K, fp16_bits_to_fp32, fp32_to_fp16_bits, make_qkx2_mad_batched, make_qkx3_batched,
                       make_qp_batched, nearest_int, trial_scratch)
from ._rows import dequantize_blocks, empty_blocks, float_rows, importance_arg

BLOCK_BYTES = 84
BLOCK_DTYPE = np.dtype([("scales", "u1", (16,)), ("qs", "u1", (64,)), ("d", "<f2"), ("dmin", "<f2")])
assert BLOCK_DTYPE.itemsize == BLOCK_BYTES
TRIAL_SCRATCH = trial_scratch(16).size


# ---------------------------------------------------------------- numpy reference (decoding)


def dequantize_reference(raw: np.ndarray) -> np.ndarray:
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    b = raw.reshape(-1, BLOCK_BYTES).view(BLOCK_DTYPE).reshape(-1)
    dl = b["d"].astype(np.float32)[:, None] * (b["scales"] & 0xF).astype(np.float32)  # [nb, 16]
    ml = b["dmin"].astype(np.float32)[:, None] * (b["scales"] >> 4).astype(np.float32)
    qs = b["qs"].reshape(-1, 2, 1, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = ((qs >> shifts) & 3).reshape(-1, 16, 16).astype(np.float32)  # element j = 128h + 32g + l
    y = dl[..., None] * q - ml[..., None]
    return y.reshape(*raw.shape[:-1], raw.shape[-1] // BLOCK_BYTES * QK_K)


# ---------------------------------------------------------------- numba kernels


@njit(inline="always")
def _finish_block(x, out, o, L, s, dh, mh):
    """Write scales and header, requantize against the stored scales, pack 4 codes per byte."""
    for j in range(16):
        out[o + j] = s[j]
    out[o + 80] = dh & 0xFF
    out[o + 81] = dh >> 8
    out[o + 82] = mh & 0xFF
    out[o + 83] = mh >> 8
    d_all = fp16_bits_to_fp32(dh)
    m_all = fp16_bits_to_fp32(mh)
    for j in range(16):
        d = d_all * F32(s[j] & 0xF)
        if d == 0:
            continue
        m = m_all * F32(s[j] >> 4)
        for i in range(16):
            q = nearest_int((x[16 * j + i] + m) / d)
            L[16 * j + i] = max(0, min(3, q))
    for h in range(2):
        for i in range(32):
            base = 128 * h + i
            out[o + 16 + 32 * h + i] = L[base] | (L[base + 32] << 2) | (L[base + 64] << 4) | (L[base + 96] << 6)


@njit(error_model="numpy")
def _block_ref(x, out, o, L, S, w, s, scales, mins):
    max_scale = F32(0.0)
    max_min = F32(0.0)
    for j in range(16):
        xs = x[16 * j : 16 * j + 16]
        for i in range(16):
            w[i] = abs(xs[i])
        sc, mn = make_qkx2_mad_batched(16, 3, xs, w, L[16 * j : 16 * j + 16], F32(-0.5), F32(0.1), 15, S)
        scales[j] = sc
        mins[j] = mn
        if sc > max_scale:
            max_scale = sc
        if mn > max_min:
            max_min = mn
    if max_scale > 0:
        iscale = F32(15.0) / max_scale
        for j in range(16):
            s[j] = np.uint8(nearest_int(iscale * scales[j]) & 0xFF)
        dh = fp32_to_fp16_bits(max_scale / F32(15.0))
    else:
        s[:] = 0
        dh = fp32_to_fp16_bits(F32(0.0))
    if max_min > 0:
        iscale = F32(15.0) / max_min
        for j in range(16):
            s[j] = np.uint8((np.int32(s[j]) | (nearest_int(iscale * mins[j]) << 4)) & 0xFF)
        mh = fp32_to_fp16_bits(max_min / F32(15.0))
    else:
        mh = fp32_to_fp16_bits(F32(0.0))
    _finish_block(x, out, o, L, s, dh, mh)


@njit(error_model="numpy")
def _block_weighted(x, qw, out, o, L, S, w, s, scales, mins, sw, Ls, Lm):
    sum_x2 = F32(0.0)
    for i in range(QK_K):
        sum_x2 += x[i] * x[i]
    sigma2 = sum_x2 / F32(256.0)
    for j in range(16):
        xs = x[16 * j : 16 * j + 16]
        for i in range(16):
            w[i] = qw[16 * j + i] * np.sqrt(sigma2 + xs[i] * xs[i])
        acc = F32(0.0)
        for i in range(16):
            acc += w[i]
        sw[j] = acc
        sc, mn = make_qkx3_batched(16, 3, xs, w, L[16 * j : 16 * j + 16], F32(-0.9), F32(0.05), 36, S)
        scales[j] = sc
        mins[j] = mn
    dm = make_qp_batched(16, 15, scales, Ls, sw, S)
    mm = make_qp_batched(16, 15, mins, Lm, sw, S)
    for j in range(16):
        s[j] = np.uint8((np.int32(Ls[j]) | (np.int32(Lm[j]) << 4)) & 0xFF)
    _finish_block(x, out, o, L, s, fp32_to_fp16_bits(dm), fp32_to_fp16_bits(mm))


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_rows(x, qw, weighted, out):
    rows, cols = x.shape
    nb = cols // QK_K
    for r in prange(rows):
        L = np.zeros(QK_K, dtype=np.uint8)
        S = np.zeros(TRIAL_SCRATCH, dtype=np.float32)
        w = np.zeros(16, dtype=np.float32)
        s = np.zeros(16, dtype=np.uint8)
        scales = np.zeros(16, dtype=np.float32)
        mins = np.zeros(16, dtype=np.float32)
        sw = np.zeros(16, dtype=np.float32)
        Ls = np.zeros(16, dtype=np.uint8)
        Lm = np.zeros(16, dtype=np.uint8)
        for b in range(nb):
            xb = x[r, b * QK_K : (b + 1) * QK_K]
            if weighted:
                _block_weighted(xb, qw[b * QK_K : (b + 1) * QK_K], out[r], b * BLOCK_BYTES, L, S, w, s, scales, mins, sw, Ls, Lm)
            else:
                _block_ref(xb, out[r], b * BLOCK_BYTES, L, S, w, s, scales, mins)


@njit(inline="always")
def _decode_block(raw_row, o, buf):
    d_all = fp16_bits_to_fp32(np.int32(raw_row[o + 80]) | (np.int32(raw_row[o + 81]) << 8))
    m_all = fp16_bits_to_fp32(np.int32(raw_row[o + 82]) | (np.int32(raw_row[o + 83]) << 8))
    for h in range(2):
        for g in range(4):
            shift = 2 * g
            for half in range(2):
                j = 8 * h + 2 * g + half
                sc = raw_row[o + j]
                dl = d_all * F32(sc & 0xF)
                ml = m_all * F32(sc >> 4)
                for i in range(16):
                    q = (raw_row[o + 16 + 32 * h + 16 * half + i] >> shift) & 3
                    buf[16 * j + i] = dl * F32(q) - ml


@njit(parallel=True, cache=True, error_model="numpy")
def _dequantize_rows(raw, out):
    nb = raw.shape[1] // BLOCK_BYTES
    for r in prange(raw.shape[0]):
        for b in range(nb):
            _decode_block(raw[r], b * BLOCK_BYTES, out[r, b * QK_K : (b + 1) * QK_K])


# ---------------------------------------------------------------- public


def quantize(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    x = float_rows(x, QK_K, "Q2_K")
    out = empty_blocks(x, QK_K, BLOCK_BYTES)
    weighted, qw = importance_arg(importance, x.shape[1])
    _quantize_rows(x, qw, weighted, out)
    return out


def dequantize(raw: np.ndarray) -> np.ndarray:
    return dequantize_blocks(_dequantize_rows, raw, QK_K, BLOCK_BYTES)
