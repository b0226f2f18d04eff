"""Q2_K: 256 weights per 84-byte block (tooling-spec §2.6).

Layout: 16 scale bytes (low nibble scale, high nibble min, one per sub-block of 16), 64 bytes of
2-bit codes, f16 d, f16 dmin. w = d*(s & 15)*q - dmin*(s >> 4).

Without importance weights this is ggml's `quantize_row_q2_K_ref` (make_qkx2 with mean absolute
error); with them `quantize_row_q2_K_impl` (make_qkx3 + make_qp, scales re-read from f16).

Speed: the 16 sub-block searches of every block of a row run in lock step, one lane per
sub-block (`_numeric.make_qkx_lanes`): each lane performs ggml's float32 operations in ggml's
order, so the bytes are identical, while the CPU works on 16 x blocks-per-row searches at once
instead of waiting on one chain of sequential sums at a time.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._numeric import (F32, QK_K, fp16_bits_to_fp32, fp32_to_fp16_bits, make_qkx2_mad_lanes,
                       make_qkx3_lanes, make_qp_batched, nearest_int, trial_scratch)
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
def _block_ref(x, out, o, L, s, scales, mins):
    """quantize_row_q2_K_ref after the sub-block searches: scales[j], mins[j] and the codes L."""
    max_scale = F32(0.0)
    max_min = F32(0.0)
    for j in range(16):
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
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
def _block_weighted(x, out, o, L, S, s, scales, mins, sw, Ls, Lm):
    """quantize_row_q2_K_impl after the sub-block searches: the two make_qp scale grids."""
    dm = make_qp_batched(16, 15, scales, Ls, sw, S)
    mm = make_qp_batched(16, 15, mins, Lm, sw, S)
    for j in range(16):
        s[j] = np.uint8((np.int32(Ls[j]) | (np.int32(Lm[j]) << 4)) & 0xFF)
    _finish_block(x, out, o, L, s, fp32_to_fp16_bits(dm), fp32_to_fp16_bits(mm))


@njit(error_model="numpy")
def _row_searches(xr, QT, weighted, XT, WT, LT, LA, scales, mins, sw):
    """The make_qkx searches of every sub-block of one row, run in lock step (`make_qkx_lanes`):
    sub-block g (16 per block) is lane g; XT/WT/LT are [16, lanes] (element i of lane g at [i, g])."""
    lanes = XT.shape[1]
    for g in range(lanes):
        for i in range(16):
            XT[i, g] = xr[16 * g + i]
    if weighted:
        nb = lanes // 16
        for b in range(nb):
            sum_x2 = F32(0.0)
            for i in range(QK_K):
                sum_x2 += xr[QK_K * b + i] * xr[QK_K * b + i]
            sigma2 = sum_x2 / F32(256.0)
            for j in range(16):
                scales[16 * b + j] = sigma2  # scratch until the search writes the scales
        for i in range(16):
            for g in range(lanes):
                WT[i, g] = QT[i, g] * np.sqrt(scales[g] + XT[i, g] * XT[i, g])
        for g in range(lanes):
            sw[g] = WT[0, g]
        for i in range(1, 16):
            for g in range(lanes):
                sw[g] += WT[i, g]
        make_qkx3_lanes(16, 3, XT, WT, LT, F32(-0.9), F32(0.05), 36, LA, scales, mins)
    else:
        for i in range(16):
            for g in range(lanes):
                WT[i, g] = abs(XT[i, g])
        make_qkx2_mad_lanes(16, 3, XT, WT, LT, F32(-0.5), F32(0.1), 15, LA, scales, mins)


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_rows(x, qw, weighted, out):
    rows, cols = x.shape
    nb = cols // QK_K
    lanes = 16 * nb
    QT = np.empty((16, lanes), dtype=np.float32)  # importance, transposed like XT
    for g in range(lanes):
        for i in range(16):
            QT[i, g] = qw[16 * g + i] if weighted else F32(0.0)
    for r in prange(rows):
        L = np.zeros(QK_K, dtype=np.uint8)
        S = np.zeros(TRIAL_SCRATCH, dtype=np.float32)
        s = np.zeros(16, dtype=np.uint8)
        Ls = np.zeros(16, dtype=np.uint8)
        Lm = np.zeros(16, dtype=np.uint8)
        XT = np.empty((16, lanes), dtype=np.float32)
        WT = np.empty((16, lanes), dtype=np.float32)
        LT = np.empty((16, lanes), dtype=np.float32)
        LA = np.empty((16, lanes), dtype=np.float32)
        scales = np.empty(lanes, dtype=np.float32)
        mins = np.empty(lanes, dtype=np.float32)
        sw = np.empty(lanes, dtype=np.float32)
        _row_searches(x[r], QT, weighted, XT, WT, LT, LA, scales, mins, sw)
        for b in range(nb):
            xb = x[r, b * QK_K : (b + 1) * QK_K]
            for j in range(16):
                for i in range(16):
                    L[16 * j + i] = np.uint8(LT[i, 16 * b + j])
            sb = scales[16 * b : 16 * b + 16]
            mb = mins[16 * b : 16 * b + 16]
            if weighted:
                _block_weighted(xb, out[r], b * BLOCK_BYTES, L, S, s, sb, mb, sw[16 * b : 16 * b + 16], Ls, Lm)
            else:
                _block_ref(xb, out[r], b * BLOCK_BYTES, L, s, sb, mb)


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
