"""Fused quantized matmuls for the CPU engine: multiply straight from GGUF blocks, no float32 copy.

    y = matmul(QuantType.Q4_K, raw, x)      # raw uint8 [rows, row_bytes], x float32 [T, cols]

Each output is out[t, o] = x[t] · dequant(raw)[o] summed in one fixed order, whatever T is:
64 lane sums, lane l taking the products of columns k ≡ l (mod 64) in increasing k, then a fixed
halving tree (lane l += lane l + 32, l += l + 16, …, 1). A token therefore gets the same bits alone
(decode) as in any batch (prefill) or thread split, which keeps the engine's decode == prefill
guarantee through its FP8/FP4 roundings. The lane sums run in vector registers (`.lanes`:
four <16 x float> per token, four tokens per pass over a decoded row).

Per output row the kernel decodes the row's blocks once into a float32 buffer (the exact values of
`dequantize`, with branch-free decoders written for SIMD), then runs the lane sums for every
token of the batch against it, so prefill decodes each weight once per call. Rows are split
across threads for large products.

The readable definition is `matmul_reference` (dequantize, then the same lane order in numpy);
tests hold the kernels to it bit for bit and to a float64 product within rounding.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange

from ds4.thread_choice import timed_choice

from ..constants import QuantType
from . import iq2_xxs
from ._numeric import F32, fp16_bits_to_fp32
from .lanes import LANES, dot_rows, lane_dots4, q8_0_dot

FUSED = (QuantType.Q8_0, QuantType.Q2_K, QuantType.Q4_K, QuantType.IQ2_XXS)
_Q8_0, _Q2_K, _Q4_K, _IQ2_XXS = (int(q) for q in FUSED)
_SHAPE = {QuantType.Q8_0: (32, 34), QuantType.Q2_K: (256, 84), QuantType.Q4_K: (256, 144),
          QuantType.IQ2_XXS: (256, 66)}  # (weights, bytes) per block
PARALLEL_MIN_WORK = 1 << 21  # multiply-adds below which a thread launch costs more than it saves
DECODE_THREAD_MIN_WEIGHTS = 1 << 23  # one-token products threaded only from this size (ds4.engine.dense)

# IQ2_XXS decoding tables as float32: grid magnitudes [256, 8] and sign factors ±1 [128, 8]
_IQ2_GRID = iq2_xxs.GRID_DECODE.astype(np.float32)
_IQ2_SIGN = np.where((iq2_xxs.KSIGNS[:, None] >> np.arange(8)) & 1, np.float32(-1), np.float32(1)).astype(np.float32)


# ---------------------------------------------------------------- block decoders (SIMD-friendly)


@njit(inline="always")
def _f16_at(raw, r, o):
    return fp16_bits_to_fp32(np.int32(raw[r, o]) | (np.int32(raw[r, o + 1]) << 8))


@njit(inline="always")
def _decode_q8_0(raw, codes, r, o, buf, bo):
    d = _f16_at(raw, r, o)
    for j in range(32):
        buf[bo + j] = d * F32(codes[r, o + 2 + j])


@njit(inline="always")
def _q4_k_scale_min(raw, r, s, j):
    if j < 4:
        return np.int32(raw[r, s + j]) & 63, np.int32(raw[r, s + j + 4]) & 63
    sc = (np.int32(raw[r, s + j + 4]) & 0xF) | ((np.int32(raw[r, s + j - 4]) >> 6) << 4)
    m = (np.int32(raw[r, s + j + 4]) >> 4) | ((np.int32(raw[r, s + j]) >> 6) << 4)
    return sc, m


@njit(inline="always")
def _decode_q4_k(raw, r, o, buf, bo):
    d_all = _f16_at(raw, r, o)
    m_all = _f16_at(raw, r, o + 2)
    for p in range(4):
        sc0, m0 = _q4_k_scale_min(raw, r, o + 4, 2 * p)
        sc1, m1 = _q4_k_scale_min(raw, r, o + 4, 2 * p + 1)
        d0 = d_all * F32(sc0)
        dm0 = m_all * F32(m0)
        d1 = d_all * F32(sc1)
        dm1 = m_all * F32(m1)
        q = o + 16 + 32 * p
        for i in range(32):
            c = np.int32(raw[r, q + i])
            buf[bo + 64 * p + i] = d0 * F32(c & 0xF) - dm0
            buf[bo + 64 * p + 32 + i] = d1 * F32(c >> 4) - dm1


@njit(inline="always")
def _decode_q2_k(raw, r, o, buf, bo):
    d_all = _f16_at(raw, r, o + 80)
    m_all = _f16_at(raw, r, o + 82)
    for h in range(2):
        for half in range(2):
            q = o + 16 + 32 * h + 16 * half
            j = 8 * h + half  # sub-blocks j, j+2, j+4, j+6 take the 2-bit fields at shifts 0, 2, 4, 6
            s0, s1, s2, s3 = np.int32(raw[r, o + j]), np.int32(raw[r, o + j + 2]), np.int32(raw[r, o + j + 4]), np.int32(raw[r, o + j + 6])
            d0, m0 = d_all * F32(s0 & 0xF), m_all * F32(s0 >> 4)
            d1, m1 = d_all * F32(s1 & 0xF), m_all * F32(s1 >> 4)
            d2, m2 = d_all * F32(s2 & 0xF), m_all * F32(s2 >> 4)
            d3, m3 = d_all * F32(s3 & 0xF), m_all * F32(s3 >> 4)
            for i in range(16):
                c = np.int32(raw[r, q + i])
                buf[bo + 16 * j + i] = d0 * F32(c & 3) - m0
                buf[bo + 16 * j + 32 + i] = d1 * F32((c >> 2) & 3) - m1
                buf[bo + 16 * j + 64 + i] = d2 * F32((c >> 4) & 3) - m2
                buf[bo + 16 * j + 96 + i] = d3 * F32(c >> 6) - m3


@njit(inline="always")
def _decode_iq2_xxs(raw, r, o, buf, bo, grid, sign):
    d = _f16_at(raw, r, o)
    for g in range(8):
        p = o + 2 + 8 * g
        sw = np.int64(raw[r, p + 4]) | (np.int64(raw[r, p + 5]) << 8) | (np.int64(raw[r, p + 6]) << 16) | (np.int64(raw[r, p + 7]) << 24)
        db = d * (F32(0.5) + F32(sw >> 28)) * F32(0.25)
        for k in range(4):
            gi = np.int64(raw[r, p + k])
            si = (sw >> (7 * k)) & 127
            for i in range(8):
                buf[bo + 32 * g + 8 * k + i] = (db * grid[gi, i]) * sign[si, i]


@njit(inline="always")
def _decode_row(qt, raw, codes, r, buf, grid, sign):
    """Row r of the raw blocks → buf[0 : cols], the values `dequantize` gives (bit for bit). Rows and
    blocks are addressed by index: a view per row or block costs atomic reference-count updates."""
    nbytes = raw.shape[1]
    if qt == _Q8_0:
        for b in range(nbytes // 34):
            _decode_q8_0(raw, codes, r, 34 * b, buf, 32 * b)
    elif qt == _Q4_K:
        for b in range(nbytes // 144):
            _decode_q4_k(raw, r, 144 * b, buf, 256 * b)
    elif qt == _Q2_K:
        for b in range(nbytes // 84):
            _decode_q2_k(raw, r, 84 * b, buf, 256 * b)
    else:
        for b in range(nbytes // 66):
            _decode_iq2_xxs(raw, r, 66 * b, buf, 256 * b, grid, sign)


@njit(cache=True, error_model="numpy")
def _rows(qt, raw, codes, x, out, r0, r1, grid, sign):
    T, K = x.shape
    buf = np.empty(K, np.float32)
    p = np.empty((4, LANES), np.float32)
    lanes = np.empty(LANES, np.float32)
    if qt == _Q8_0 and T < 4:  # few tokens: form the weights in registers, no row buffer
        for o in range(r0, r1):
            for t in range(T):
                out[t, o] = q8_0_dot(raw, o, x, t, lanes)
        return
    T4 = T - T % 4
    for o in range(r0, r1):
        _decode_row(qt, raw, codes, o, buf, grid, sign)
        for t0 in range(0, T4, 4):  # four tokens per pass over the decoded row
            lane_dots4(buf, x, t0, p, out, o)
        for t in range(T4, T):
            out[t, o] = dot_rows(buf, 0, x, t, lanes)


@njit(cache=True, parallel=True, error_model="numpy")
def _rows_par(qt, raw, codes, x, out, step, grid, sign):
    O = raw.shape[0]
    for b in prange((O + step - 1) // step):
        _rows(qt, raw, codes, x, out, b * step, min(O, (b + 1) * step), grid, sign)


@njit(cache=True, parallel=True, error_model="numpy")
def _decode_par(qt, raw, codes, out, grid, sign):
    for o in prange(raw.shape[0]):
        _decode_row(qt, raw, codes, o, out[o], grid, sign)


def _check(qtype: QuantType, raw: np.ndarray, cols: int) -> tuple[int, np.ndarray]:
    qtype = QuantType(qtype)
    if qtype not in FUSED:
        raise ValueError(f"{qtype.name} has no fused kernel")
    qk, nbytes = _SHAPE[qtype]
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    if raw.ndim != 2 or cols % qk or raw.shape[1] != cols // qk * nbytes:
        raise ValueError(f"{qtype.name}: raw rows {raw.shape} do not hold {cols} weights each")
    return int(qtype), np.ascontiguousarray(raw)


def matmul(qtype: QuantType, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """out[t, o] = x[t] · dequant(raw)[o] for raw [rows, row_bytes], x [T, cols], fixed lane order."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"fused matmul wants x of shape [T, cols], got {x.shape}")
    qt, raw = _check(qtype, raw, x.shape[1])
    out = np.empty((x.shape[0], raw.shape[0]), np.float32)
    codes = raw.view(np.int8)
    O = raw.shape[0]

    def serial():
        _rows(qt, raw, codes, x, out, 0, O, _IQ2_GRID, _IQ2_SIGN)

    def threaded():
        _rows_par(qt, raw, codes, x, out, max(1, min(64, O // 16)), _IQ2_GRID, _IQ2_SIGN)

    threads = get_num_threads()
    # decoding costs about as much as a few multiply-adds per weight: count it as 4 extra tokens
    if threads == 1 or O * x.shape[1] * (x.shape[0] + 4) < PARALLEL_MIN_WORK:
        serial()
    elif x.shape[0] == 1:  # decode: only the head-sized, and while the clock says it pays
        if O * x.shape[1] >= DECODE_THREAD_MIN_WEIGHTS:
            timed_choice(("fused", qt, O, x.shape[1], threads), serial, threaded)
        else:
            serial()
    else:
        threaded()
    return out


def decode(qtype: QuantType, raw: np.ndarray, cols: int) -> np.ndarray:
    """The fused kernels' decoder on its own: raw [rows, row_bytes] → float32 [rows, cols]
    (equal to `quants.dequantize`, which tests check)."""
    qt, raw = _check(qtype, raw, cols)
    out = np.empty((raw.shape[0], cols), np.float32)
    _decode_par(qt, raw, raw.view(np.int8), out, _IQ2_GRID, _IQ2_SIGN)
    return out


def lane_dot_reference(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """numpy: out[t, o] = x[t] · w[o] in the kernels' lane order (float32 throughout)."""
    w = np.asarray(w, dtype=np.float32)
    x = np.asarray(x, dtype=np.float32)
    K = w.shape[1]
    pad = (-K) % LANES  # padding adds +0.0 to lanes that are never -0.0: the sums do not change
    wp = np.pad(w, ((0, 0), (0, pad))).reshape(w.shape[0], -1, LANES)
    xp = np.pad(x, ((0, 0), (0, pad))).reshape(x.shape[0], -1, LANES)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    for t in range(x.shape[0]):
        prod = wp * xp[t][None]  # [O, groups, LANES]
        p = np.zeros((w.shape[0], LANES), np.float32)
        for j in range(prod.shape[1]):  # lane sums in increasing k
            p += prod[:, j]
        half = LANES // 2
        while half >= 1:
            p[:, :half] += p[:, half:2 * half]
            half //= 2
        out[t] = p[:, 0]
    return out


def matmul_reference(qtype: QuantType, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Readable definition of `matmul`: dequantize, then the lane-order product in numpy."""
    from . import dequantize

    x = np.asarray(x, dtype=np.float32)
    return lane_dot_reference(dequantize(QuantType(qtype), raw, x.shape[1]), x)
