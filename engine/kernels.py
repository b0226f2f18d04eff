"""numba versions of the forward pass's hot loops; same signatures as the `*_ref` functions in
`ds4.engine.forward`, which stay the readable definition. Tests hold each kernel to its reference on
fresh random input.

fastmath is limited to reassociation/contraction (no ninf/nnan): the compressor frontier and
attention masks rely on −inf.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

if nb.config.THREADING_LAYER == "default":
    # GNU OpenMP worker threads spin after each parallel region and starve the BLAS calls that
    # run between kernels (measured 5x slower matmuls on 2 cores); the workqueue layer sleeps.
    nb.config.THREADING_LAYER = "workqueue"

FLAGS = {"reassoc", "contract", "nsz", "arcp"}


@nb.njit(cache=True, fastmath=FLAGS)
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


@nb.njit(cache=True, parallel=True, fastmath=FLAGS)
def indexer_scores(q, w, keys):
    """score[t, c] = Σ_h w[t, h] · ReLU(q[t, h] · keys[c])."""
    T, Hi, di = q.shape
    N = keys.shape[0]
    out = np.zeros((T, N), np.float32)
    for tc in nb.prange(T * N):
        t, c = tc // N, tc % N
        total = np.float32(0.0)
        for h in range(Hi):
            dot = np.float32(0.0)
            for j in range(di):
                dot += q[t, h, j] * keys[c, j]
            if dot > 0:
                total += w[t, h] * dot
        out[t, c] = total
    return out


@nb.njit(cache=True, parallel=True, fastmath=FLAGS)
def attend(q, keys, mask, sinks, scale):
    """Attention with a per-head sink in the denominator, K = V; q [T,H,d], keys [N,d], mask [T,N]."""
    T, H, d = q.shape
    N = keys.shape[0]
    out = np.zeros((T, H, d), np.float32)
    for th in nb.prange(T * H):
        t, h = th // H, th % H
        s = np.empty(N, np.float32)
        m = np.float32(sinks[h])
        for n in range(N):
            if mask[t, n]:
                dot = np.float32(0.0)
                for j in range(d):
                    dot += q[t, h, j] * keys[n, j]
                dot *= scale
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
    return out


@nb.njit(cache=True, parallel=True)
def matmul_t(x, wt):
    """out[t, o] = Σ_k x[t, k] · wt[k, o] with wt = Wᵀ ([K, O], contiguous).

    Batch-invariant by construction: every output accumulates k = 0..K−1 strictly in order (no
    fastmath, no FMA contraction), vectorised across o, so a row's result does not depend on how
    many rows are multiplied with it. That makes prefill, chunked prefill and decode bit-identical
    even through the discontinuous FP8/FP4 roundings (BLAS gemm/gemv blocking is not). Blocks of
    4 rows × 512 outputs keep the accumulators in L1; threads split the output blocks.
    """
    T, K = x.shape
    O = wt.shape[1]
    out = np.zeros((T, O), np.float32)
    OB = 512
    for ob in nb.prange((O + OB - 1) // OB):
        o0 = ob * OB
        n = min(O - o0, OB)
        acc = np.zeros((4, OB), np.float32)
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
    return out


# ---- weight products used by the forward pass (same names as forward._RefKernels) --------------
def matmul(model, name, x):
    """x[T, in] @ W.T for the model's 2-D weight `name`."""
    return matmul_t(np.ascontiguousarray(x, dtype=np.float32), model.transposed(name))


def expert_matmul(model, name, e, x):
    """x[T, in] @ W[e].T for expert e of a 3-D expert tensor."""
    return matmul_t(np.ascontiguousarray(x, dtype=np.float32), model.transposed(name)[e])


def group_matmul(model, name, groups, x):
    """Grouped output projection: x [T, G, in_g] → [T, G, out_g], group g using rows g·out_g.. of W."""
    wt = model.transposed(name, groups=groups)
    out = np.empty((x.shape[0], groups, wt.shape[2]), np.float32)
    for g in range(groups):
        out[:, g] = matmul_t(np.ascontiguousarray(x[:, g], dtype=np.float32), wt[g])
    return out
