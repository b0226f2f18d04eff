"""Dense weight products for the CPU engine, straight from the stored form (no float32 copy).

    out = dense_matmul(w, x)     # w [O, K] float32 or half bits (uint16), x float32 [T, K]

Every output is summed in the one lane order of `ds4.gguf_tools.quants.fused` (64 lane sums over
k ≡ l mod 64 in increasing k, then a fixed halving tree), so the result for a token does not depend
on the batch it is in, on the thread that computed it, or on whether the weight was F16 or its
float32 conversion. `dense_matmul_ref` is the readable definition; tests hold the kernel to it bit
for bit. Used by `ds4.engine.kernels` (the forward pass's products, the MoE) and `ds4.engine.bench`
(`read_sum`, the bandwidth probe).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from ds4.gguf_tools.quants import fused
from ds4.thread_choice import timed_choice
from ds4.gguf_tools.quants.lanes import LANES, f16_fpext, f16_value  # noqa: F401
from ds4.gguf_tools.quants.lanes import dot_lanes as _dot_lanes  # noqa: F401
from ds4.gguf_tools.quants.lanes import dot_rows, lane_dots4
from ds4.gguf_tools.quants.lanes import tree as _tree
from ds4.gguf_tools.quants.lanes import weight_value as _weight_value

if nb.config.THREADING_LAYER == "default":
    # the order ds4/__init__.py sets through the environment, for programs that imported numba first
    nb.config.THREADING_LAYER_PRIORITY = ["omp", "workqueue", "tbb"]

# ---- dense weight products straight from the file ----------------------------------------------
# Weights are used as stored: float32 rows (F32 tensors, in-memory models) or IEEE half bits as
# uint16 rows (F16 tensors, a zero-copy view of the mmap), converted on the fly by the CPU's
# half → float instruction (one vcvtph2ps per 16 weights; `f16_fpext`). Half → float32 is exact, and every
# output is summed in the one lane order of `ds4.gguf_tools.quants.fused` (64 lane sums over
# k ≡ l mod 64 in increasing k, then a fixed halving tree), so an F16 model gives the same bits as
# its float32 conversion, quantized and dense products share one order, and a token's result does
# not depend on the batch it is in or on the thread that computed it. The lane kernels themselves
# (vector registers, `dot_lanes` / `lane_sums4`) live in `ds4.gguf_tools.quants.lanes`.


@nb.njit(cache=True)
def _f16_to_f32_flat(h, out):
    for i in range(h.shape[0]):
        out[i] = f16_value(h[i])


@nb.njit(inline="always")
def _to_f32(w, o, buf):
    for j in range(w.shape[1]):
        buf[j] = _weight_value(w[o, j])


def f16_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 values of an array of half bits (uint16), bit for bit numpy's float16 → float32 cast
    (NaN payloads included; tests check all 65536 codes). The products use `f16_fpext`, which
    agrees with it on every non-NaN code (tests check those too)."""
    h = np.ascontiguousarray(bits, dtype=np.uint16)
    out = np.empty(h.shape, np.float32)
    _f16_to_f32_flat(h.reshape(-1), out.reshape(-1))
    return out


@nb.njit(cache=True)
def _dense_rows(w, x, out, r0, r1, buf, p):
    """Outputs r0..r1 of every token. One token: convert-and-dot in one pass over each row. More:
    convert the row once into buf, then run the lane sums of 4 tokens at a time against it (same
    values, same order per token as the one-token pass). p: scratch [4, LANES].

    A compiled function of its own, not inlined: two inlined copies in one loop body (the MoE's
    gate and up) made LLVM's code for both about 5x slower."""
    T, K = x.shape
    lanes = p.reshape(4 * LANES)
    if T == 1:
        for o in range(r0, r1):
            out[0, o] = dot_rows(w, o, x, 0, lanes)
        return
    T4 = T - T % 4
    for o in range(r0, r1):
        _to_f32(w, o, buf)
        for t0 in range(0, T4, 4):
            lane_dots4(buf, x, t0, p, out, o)
        for t in range(T4, T):
            out[t, o] = dot_rows(buf, 0, x, t, lanes)


@nb.njit(cache=True)
def _dense_serial(w, x, out):
    buf = np.empty(x.shape[1], np.float32)
    p = np.empty((4, LANES), np.float32)
    _dense_rows(w, x, out, 0, w.shape[0], buf, p)


@nb.njit(cache=True, parallel=True)
def _dense_par(w, x, out, step):
    O = w.shape[0]
    for b in nb.prange((O + step - 1) // step):
        buf = np.empty(x.shape[1], np.float32)
        p = np.empty((4, LANES), np.float32)
        _dense_rows(w, x, out, b * step, min(O, (b + 1) * step), buf, p)


PARALLEL_MIN_WEIGHTS = 1 << 21  # weights × (tokens + 1) below which a thread launch costs more than it saves
# Decode (one token) may thread products of at least this many weights, while ds4.thread_choice
# measures the threaded form faster. Small, 2 threads, three interleaved runs each (decode t/s):
# only the head threaded 104.3; + the MoE's experts 107.9; + every product >= 1M weights 110.5.
DECODE_THREAD_MIN_WEIGHTS = 1 << 20


def dense_matmul(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """out[t, o] = x[t] · W[o] for W [O, K] stored as float32 or as half bits (uint16), in the lane
    order; threads take blocks of output rows (each output is computed by one thread, in order)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    O, K = w.shape
    threads = nb.get_num_threads()
    step = max(16, min(1024, O // (8 * threads)))
    if threads == 1 or O < 64:
        _dense_serial(w, x, out)
    elif x.shape[0] == 1:
        if O * K >= DECODE_THREAD_MIN_WEIGHTS:
            timed_choice(("dense", O, K, w.dtype.char, threads), lambda: _dense_serial(w, x, out),
                         lambda: _dense_par(w, x, out, step))
        else:
            _dense_serial(w, x, out)
    elif O * K * (x.shape[0] + 1) >= PARALLEL_MIN_WEIGHTS:
        _dense_par(w, x, out, step)
    else:
        _dense_serial(w, x, out)
    return out


def dense_matmul_ref(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Readable definition of `dense_matmul`: convert, then the lane-order product in numpy."""
    wf = w.view(np.float16).astype(np.float32) if w.dtype == np.uint16 else np.asarray(w, np.float32)
    return fused.lane_dot_reference(wf, x)


# ---- machine probe -----------------------------------------------------------------------------------
@nb.njit(cache=True)
def _read_block(a):
    p = np.zeros(LANES, np.float32)
    n = a.shape[0]
    full = n - n % LANES
    for j in range(0, full, LANES):
        for l in range(LANES):
            p[l] += a[j + l]
    return _tree(p)


@nb.njit(cache=True, parallel=True)
def _read_sum(a, blocks):
    step = a.shape[0] // blocks
    part = np.zeros(blocks, np.float32)
    for b in nb.prange(blocks):
        part[b] = _read_block(a[b * step:(b + 1) * step])
    return part.sum()


def read_sum(a: np.ndarray) -> float:
    """Sum of a large float32 array with numba's threads: a read-bandwidth probe (ds4.engine.bench)."""
    return float(_read_sum(a, 64 * nb.get_num_threads()))
