"""numba versions of the forward pass's hot loops; same signatures as the `*_ref` functions in
`ds4.engine.forward`, which stay the readable definition. Tests hold each kernel to its reference on
fresh random input.

No fastmath anywhere: every kernel's arithmetic order is fixed by its source (explicit partial
sums where SIMD needs them), so a token's result is the same bits whether it is computed alone
(decode), in a batch (prefill), serially or in a thread. That batch invariance is what makes
decode, prefill and chunked prefill bit-identical through the FP8/FP4 roundings, whose
discontinuities would otherwise turn last-bit differences into visible ones.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

if nb.config.THREADING_LAYER == "default":
    # GNU OpenMP worker threads spin after each parallel region and starve the BLAS calls that
    # run between kernels (measured 5x slower matmuls on 2 cores); the workqueue layer sleeps.
    nb.config.THREADING_LAYER = "workqueue"



@nb.njit(cache=True)
def compressor_scan(kv, score, pos0, ratio, state_kv, state_score, out):
    """Stream T tokens into a compressor frontier; emit pooled rows into out; return their count."""
    T, width = kv.shape
    d = width // 2 if ratio == 4 else width
    n = 0
    for t in range(T):
        p = pos0 + t
        row = ratio + p % ratio if ratio == 4 else p % ratio
        for j in range(width):
            state_kv[row, j] = kv[t, j]
            state_score[row, j] = score[t, j]
        if (p + 1) % ratio != 0:
            continue
        for j in range(d):
            m = -np.inf
            if ratio == 4:
                for i in range(4):
                    m = max(m, state_score[i, j], state_score[4 + i, d + j])
                s = 0.0
                for i in range(4):
                    s += math.exp(state_score[i, j] - m) + math.exp(state_score[4 + i, d + j] - m)
                acc = 0.0
                for i in range(4):
                    acc += state_kv[i, j] * (math.exp(state_score[i, j] - m) / s)
                    acc += state_kv[4 + i, d + j] * (math.exp(state_score[4 + i, d + j] - m) / s)
            else:
                for i in range(ratio):
                    m = max(m, state_score[i, j])
                s = 0.0
                for i in range(ratio):
                    s += math.exp(state_score[i, j] - m)
                acc = 0.0
                for i in range(ratio):
                    acc += state_kv[i, j] * (math.exp(state_score[i, j] - m) / s)
            out[n, j] = acc
        n += 1
        if ratio == 4:
            for i in range(4):
                for j in range(width):
                    state_kv[i, j] = state_kv[4 + i, j]
                    state_score[i, j] = state_score[4 + i, j]
                    state_kv[4 + i, j] = 0.0
                    state_score[4 + i, j] = -np.inf
        else:
            for i in range(ratio):
                for j in range(width):
                    state_kv[i, j] = 0.0
                    state_score[i, j] = -np.inf
    return n


PARALLEL_MIN_WORK = 1 << 21  # multiply-adds below which a thread launch costs more than it saves


@nb.njit(cache=True, inline="always")
def _dot(a, b):
    """a · b with 8 explicit partial sums combined in a fixed order: SIMD-friendly and the same
    bits in every caller (serial or threaded), which fastmath reassociation would not promise."""
    n = a.shape[0]
    p0 = p1 = p2 = p3 = p4 = p5 = p6 = p7 = np.float32(0.0)
    n8 = n - n % 8
    for j in range(0, n8, 8):
        p0 += a[j] * b[j]
        p1 += a[j + 1] * b[j + 1]
        p2 += a[j + 2] * b[j + 2]
        p3 += a[j + 3] * b[j + 3]
        p4 += a[j + 4] * b[j + 4]
        p5 += a[j + 5] * b[j + 5]
        p6 += a[j + 6] * b[j + 6]
        p7 += a[j + 7] * b[j + 7]
    for j in range(n8, n):
        p0 += a[j] * b[j]
    return ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))


@nb.njit(cache=True)
def _indexer_rows(q, w, keys, out, lo, hi):
    Hi = q.shape[1]
    N = keys.shape[0]
    for tc in range(lo, hi):
        t, c = tc // N, tc % N
        total = np.float32(0.0)
        for h in range(Hi):
            dot = _dot(q[t, h], keys[c])
            if dot > 0:
                total += w[t, h] * dot
        out[t, c] = total


@nb.njit(cache=True, parallel=True)
def _indexer_par(q, w, keys, out, step):
    n = out.shape[0] * out.shape[1]
    for b in nb.prange((n + step - 1) // step):
        _indexer_rows(q, w, keys, out, b * step, min(n, (b + 1) * step))


def indexer_scores(q, w, keys):
    """score[t, c] = Σ_h w[t, h] · ReLU(q[t, h] · keys[c])."""
    T, Hi, di = q.shape
    out = np.zeros((T, keys.shape[0]), np.float32)
    if T * keys.shape[0] * Hi * di < PARALLEL_MIN_WORK:
        _indexer_rows(q, w, keys, out, 0, out.size)
    else:
        _indexer_par(q, w, keys, out, max(1, out.size // 64))
    return out


@nb.njit(cache=True)
def _attend_rows(q, keys, mask, sinks, scale, out, lo, hi):
    H, d = q.shape[1], q.shape[2]
    N = keys.shape[0]
    s = np.empty(N, np.float32)
    for th in range(lo, hi):
        t, h = th // H, th % H
        m = np.float32(sinks[h])
        for n in range(N):
            if mask[t, n]:
                dot = _dot(q[t, h], keys[n]) * scale
                s[n] = dot
                if dot > m:
                    m = dot
        denom = math.exp(sinks[h] - m)
        for n in range(N):
            if mask[t, n]:
                e = math.exp(s[n] - m)
                s[n] = e
                denom += e
        inv = 1.0 / denom
        for n in range(N):
            if mask[t, n]:
                p = np.float32(s[n] * inv)
                for j in range(d):
                    out[t, h, j] += p * keys[n, j]


@nb.njit(cache=True, parallel=True)
def _attend_par(q, keys, mask, sinks, scale, out, step):
    n = q.shape[0] * q.shape[1]
    for b in nb.prange((n + step - 1) // step):
        _attend_rows(q, keys, mask, sinks, scale, out, b * step, min(n, (b + 1) * step))


def attend(q, keys, mask, sinks, scale):
    """Attention with a per-head sink in the denominator, K = V; q [T,H,d], keys [N,d], mask [T,N].
    Every (query, head) is computed by the same serial loop, alone or in a thread."""
    T, H, d = q.shape
    out = np.zeros((T, H, d), np.float32)
    sinks = np.ascontiguousarray(sinks, dtype=np.float32)
    if T * H * keys.shape[0] * d < PARALLEL_MIN_WORK:
        _attend_rows(q, keys, mask, sinks, np.float32(scale), out, 0, T * H)
    else:
        _attend_par(q, keys, mask, sinks, np.float32(scale), out, 1)
    return out


@nb.njit(cache=True)
def _matmul_block(x, wt, out, o0, n):
    """Outputs o0..o0+n of every row: each accumulates k = 0..K−1 in order (no FMA contraction)."""
    T, K = x.shape
    acc = np.zeros((4, n), np.float32)
    for t0 in range(0, T, 4):
        nt = min(T - t0, 4)
        acc[:] = 0
        for k in range(K):
            w = wt[k, o0:o0 + n]
            for tt in range(nt):
                xv = x[t0 + tt, k]
                a = acc[tt]
                for j in range(n):
                    a[j] += xv * w[j]
        for tt in range(nt):
            out[t0 + tt, o0:o0 + n] = acc[tt, :n]


@nb.njit(cache=True, parallel=True)
def _matmul_par(x, wt, out, OB):
    O = wt.shape[1]
    for ob in nb.prange((O + OB - 1) // OB):
        _matmul_block(x, wt, out, ob * OB, min(O - ob * OB, OB))


@nb.njit(cache=True)
def _matmul_serial(x, wt, out, OB):
    O = wt.shape[1]
    for ob in range((O + OB - 1) // OB):
        _matmul_block(x, wt, out, ob * OB, min(O - ob * OB, OB))


def matmul_t(x, wt):
    """out[t, o] = Σ_k x[t, k] · wt[k, o] with wt = Wᵀ ([K, O], contiguous).

    Batch-invariant by construction: every output accumulates k = 0..K−1 strictly in order (no
    fastmath, no FMA contraction), vectorised across o, so a row's result does not depend on how
    many rows are multiplied with it or on threading. That makes prefill, chunked prefill and
    decode bit-identical even through the discontinuous FP8/FP4 roundings (BLAS gemm/gemv blocking
    is not). Blocks of 4 rows × 512 outputs keep the accumulators in L1; threads split the blocks.
    """
    T, K = x.shape
    O = wt.shape[1]
    out = np.empty((T, O), np.float32)
    if T * K * O < PARALLEL_MIN_WORK or O <= 512:
        _matmul_serial(x, wt, out, 512)
    else:
        _matmul_par(x, wt, out, 512)
    return out


@nb.njit(cache=True)
def _matmul_rows_serial(x, w, out):
    for t in range(x.shape[0]):
        for o in range(w.shape[0]):
            out[t, o] = _dot(x[t], w[o])


@nb.njit(cache=True, parallel=True)
def _matmul_rows_par(x, w, out):
    for o in nb.prange(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, o] = _dot(x[t], w[o])


NARROW = 128  # outputs up to which the dot form (W rows) beats the axpy form (Wᵀ rows)


def matmul_w(x, w):
    """out[t, o] = x[t] · w[o] for a narrow row-major W [O, K] (HC mixes, router, indexer weights,
    grouped output): dot products with fixed 8-lane partial sums, batch-invariant like matmul_t."""
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    if x.shape[0] * x.shape[1] * w.shape[0] < PARALLEL_MIN_WORK:
        _matmul_rows_serial(x, w, out)
    else:
        _matmul_rows_par(x, w, out)
    return out


# ---- weight products used by the forward pass (same names as forward._RefKernels) --------------
def _quant_matmul(qtype, raw, x):
    """Fused dequantize-and-multiply from the GGUF blocks (gguf_tools.quants: per-output fixed order,
    so batch-invariant as well)."""
    from ds4.gguf_tools import quants

    return np.asarray(quants.matmul(qtype, raw, x), dtype=np.float32)


def matmul(model, name, x):
    """x[T, in] @ W.T for the model's 2-D weight `name` (the form is chosen by W's shape only)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    qt = model.quantized(name)
    if qt is not None:
        return _quant_matmul(qt, model.raw(name), x)
    w = model.w(name) if model.shape(name)[0] <= NARROW else None
    return matmul_w(x, w) if w is not None else matmul_t(x, model.transposed(name))


def expert_matmul(model, name, e, x):
    """x[T, in] @ W[e].T for expert e of a 3-D expert tensor."""
    qt = model.quantized(name)
    if qt is not None:
        return _quant_matmul(qt, model.raw(name)[e], np.ascontiguousarray(x, dtype=np.float32))
    return matmul_t(np.ascontiguousarray(x, dtype=np.float32), model.transposed(name)[e])


def group_matmul(model, name, groups, x):
    """Grouped output projection: x [T, G, in_g] → [T, G, out_g], group g using rows g·out_g.. of W."""
    rows = model.shape(name)[0] // groups
    out = np.empty((x.shape[0], groups, rows), np.float32)
    qt = model.quantized(name)
    if qt is not None:
        raw = model.raw(name)
        for g in range(groups):
            out[:, g] = _quant_matmul(qt, raw[g * rows:(g + 1) * rows], np.ascontiguousarray(x[:, g], dtype=np.float32))
        return out
    if rows <= NARROW:
        w = model.w(name)
        for g in range(groups):
            out[:, g] = matmul_w(np.ascontiguousarray(x[:, g], dtype=np.float32), w[g * rows:(g + 1) * rows])
        return out
    wt = model.transposed(name, groups=groups)
    for g in range(groups):
        out[:, g] = matmul_t(np.ascontiguousarray(x[:, g], dtype=np.float32), wt[g])
    return out
