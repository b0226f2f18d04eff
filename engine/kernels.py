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

from ds4.engine.dense import (LANES, _dense_rows, _dot_lanes, _tree, dense_matmul, dense_matmul_ref, dot_rows,  # noqa: F401
                              f16_fpext, f16_to_f32, f16_value, read_sum)
from ds4.gguf_tools.quants import fused
from ds4.thread_choice import timed_choice


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


@nb.njit(cache=True)
def _indexer_rows(q, w, keys, out, lo, hi):
    Hi = q.shape[1]
    N = keys.shape[0]
    p = np.empty(LANES, np.float32)
    q2 = q.reshape(q.shape[0] * Hi, q.shape[2])
    for tc in range(lo, hi):
        t, c = tc // N, tc % N
        total = np.float32(0.0)
        for h in range(Hi):
            dot = dot_rows(q2, t * Hi + h, keys, c, p)
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
    lanes = np.empty(LANES, np.float32)
    q2 = q.reshape(q.shape[0] * H, d)
    for th in range(lo, hi):
        t, h = th // H, th % H
        m = np.float32(sinks[h])
        for n in range(N):
            if mask[t, n]:
                dot = dot_rows(q2, th, keys, n, lanes) * scale
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
    if T == 1 or T * H * keys.shape[0] * d < PARALLEL_MIN_WORK // 4 or nb.get_num_threads() == 1:
        _attend_rows(q, keys, mask, sinks, np.float32(scale), out, 0, T * H)
    else:
        _attend_par(q, keys, mask, sinks, np.float32(scale), out, 1)
    return out


@nb.njit(cache=True)
def _attend_decode(q, ring, first, n_win, comp, comp_mask, sinks, scale, out):
    """`_attend_rows` for one query whose keys are the ring rows of positions first..first+n_win-1
    (row = position mod ring size) followed by the visible compressed rows: the same operations in
    the same key order, without assembling the key matrix."""
    H, d = q.shape
    cap = ring.shape[0]
    nc = comp.shape[0]
    s = np.empty(n_win + nc, np.float32)
    lanes = np.empty(LANES, np.float32)
    for h in range(H):
        m = np.float32(sinks[h])
        for i in range(n_win + nc):
            if i < n_win:
                dot = dot_rows(q, h, ring, (first + i) % cap, lanes) * scale
            elif comp_mask[i - n_win]:
                dot = dot_rows(q, h, comp, i - n_win, lanes) * scale
            else:
                continue
            s[i] = dot
            if dot > m:
                m = dot
        denom = math.exp(sinks[h] - m)
        for i in range(n_win + nc):
            if i < n_win or comp_mask[i - n_win]:
                e = math.exp(s[i] - m)
                s[i] = e
                denom += e
        inv = 1.0 / denom
        for i in range(n_win):
            p = np.float32(s[i] * inv)
            row = (first + i) % cap
            for j in range(d):
                out[h, j] += p * ring[row, j]
        for c in range(nc):
            if comp_mask[c]:
                p = np.float32(s[n_win + c] * inv)
                for j in range(d):
                    out[h, j] += p * comp[c, j]


def attend_decode(q, ring, pos, window, comp, comp_mask, sinks, scale):
    """`attend` for one decoded token at `pos` (q [1, H, d]) whose own key row is already in the
    ring: keys = the window's ring rows in position order, then comp rows where comp_mask."""
    first = max(0, pos - window + 1)
    out = np.zeros(q.shape, np.float32)
    args = (np.ascontiguousarray(q[0], dtype=np.float32), ring, first, pos + 1 - first,
            np.ascontiguousarray(comp, dtype=np.float32), np.ascontiguousarray(comp_mask, dtype=np.bool_),
            np.ascontiguousarray(sinks, dtype=np.float32), np.float32(scale), out[0])
    _attend_decode(*args)  # threading it over heads measured no faster (2 threads, small)
    return out




# ---- MoE routing after the router's product (forward.route's numpy is the reference) ---------------
@nb.njit(cache=True)
def _route_rows(s, bias, has_bias, ids, k, denom_min, scale, w):
    """Per token: unless ids are given (hash layers), the k largest of s + bias in descending
    order, ties to the lowest expert (`forward.topk_rows`); then w = s[ids] / max(Σ, denom_min) ·
    scale with the sum in slot order (numpy's for fewer than 8 values). Returns False when a row
    holds a NaN (the caller then takes the numpy path, whose NaN order this does not copy)."""
    T, E = s.shape
    taken = np.zeros(E, np.bool_)
    for t in range(T):
        for e in range(E):
            if np.isnan(s[t, e]) or (has_bias and np.isnan(s[t, e] + bias[e])):
                return False
        if has_bias or k > 0:
            taken[:] = False
            for j in range(ids.shape[1]):
                best = -1
                bv = np.float32(0.0)
                for e in range(E):
                    v = s[t, e] + bias[e] if has_bias else s[t, e]
                    if not taken[e] and (best < 0 or v > bv):
                        best, bv = e, v
                taken[best] = True
                ids[t, j] = best
        total = np.float32(0.0)
        for j in range(ids.shape[1]):
            total += s[t, ids[t, j]]
        denom = max(total, denom_min)
        for j in range(ids.shape[1]):
            w[t, j] = s[t, ids[t, j]] / denom * scale
    return True


def route_select(s, bias, ids, k, denom_min, scale):
    """(ids [T, k] int64, w [T, k] float32) from the router scores s [T, E] (forward.route):
    ids given (hash layers) or the top k of s + bias (bias may be None); None when the numpy path
    must run (8 or more slots: numpy sums those pairwise; NaN scores)."""
    if k >= 8:
        return None
    s = np.ascontiguousarray(s, dtype=np.float32)
    T = s.shape[0]
    select = ids is None
    ids = np.empty((T, k), np.int64) if select else np.ascontiguousarray(ids, dtype=np.int64)
    has_bias = bias is not None
    b = np.ascontiguousarray(bias, dtype=np.float32) if has_bias else np.zeros(s.shape[1], np.float32)
    w = np.empty((T, k), np.float32)
    if not _route_rows(s, b, has_bias, ids, k if select else 0, np.float32(denom_min), np.float32(scale), w):
        return None
    return ids, w


# ---- weight products used by the forward pass (same names as forward._RefKernels) --------------
def _quant_matmul(qtype, raw, x):
    """Fused dequantize-and-multiply from the GGUF blocks (gguf_tools.quants: per-output fixed order,
    so batch-invariant as well)."""
    return np.asarray(fused.matmul(qtype, raw, x), dtype=np.float32)


def matmul(model, name, x):
    """x[T, in] @ W.T for the model's 2-D weight `name`, from the stored form (no float32 copy)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    qt = model.quantized(name)
    if qt is not None:
        return _quant_matmul(qt, model.raw(name), x)
    return dense_matmul(model.dense(name), x)


def expert_matmul(model, name, e, x):
    """x[T, in] @ W[e].T for expert e of a 3-D expert tensor."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    qt = model.quantized(name)
    if qt is not None:
        return _quant_matmul(qt, model.raw(name)[e], x)
    return dense_matmul(model.dense(name)[e], x)


@nb.njit(cache=True)
def _group_rows(w, x, out):
    """out[:, g] = x[:, g] · W[g·R:(g+1)·R]ᵀ for every group g in one call (`_dense_rows` per group:
    the bits of `dense_matmul` on each group)."""
    T, G, Kg = x.shape
    R = w.shape[0] // G
    buf = np.empty(Kg, np.float32)
    p = np.empty((4, LANES), np.float32)
    xg = np.empty((T, Kg), np.float32)
    og = np.empty((T, R), np.float32)
    for g in range(G):
        xg[:, :] = x[:, g, :]
        _dense_rows(w[g * R:(g + 1) * R], xg, og, 0, R, buf, p)
        out[:, g, :] = og


def group_matmul(model, name, groups, x):
    """Grouped output projection: x [T, G, in_g] → [T, G, out_g], group g using rows g·out_g.. of W."""
    rows = model.shape(name)[0] // groups
    out = np.empty((x.shape[0], groups, rows), np.float32)
    qt = model.quantized(name)
    w = model.raw(name) if qt is not None else model.dense(name)
    if qt is None and x.shape[0] == 1:  # decode: one call for all groups
        _group_rows(w, np.ascontiguousarray(x, dtype=np.float32), out)
        return out
    for g in range(groups):
        xg = np.ascontiguousarray(x[:, g], dtype=np.float32)
        wg = w[g * rows:(g + 1) * rows]
        out[:, g] = _quant_matmul(qt, wg, xg) if qt is not None else dense_matmul(wg, xg)
    return out


# ---- mHC hyper-connections, one call per sublayer --------------------------------------------------
@nb.njit(inline="always")
def _sigmoid(v):
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-v))


@nb.njit(inline="always")
def _rms_scale(x, eps, p):
    """1 / sqrt(mean(x²) + eps) with the sum of squares in the lane order."""
    n = x.shape[0]
    for l in range(LANES):
        p[l] = 0.0
    full = n - n % LANES
    for j in range(0, full, LANES):
        for l in range(LANES):
            p[l] += x[j + l] * x[j + l]
    for l in range(n - full):
        p[l] += x[full + l] * x[full + l]
    ms = _tree(p) / np.float32(n)
    return np.float32(1.0) / np.sqrt(ms + np.float32(eps))


@nb.njit(inline="always")
def _hc_pre_token(X, fn, scale, base, norm, rms_eps, hc_eps, iters, a, post, comb, flat, mix, p):
    n, D = X.shape
    for i in range(n):
        for j in range(D):
            flat[i * D + j] = X[i, j]
    inv = _rms_scale(flat, rms_eps, p)
    for j in range(flat.shape[0]):
        flat[j] = flat[j] * inv
    for r in range(fn.shape[0]):
        mix[r] = dot_rows(fn, r, flat, 0, p)
    for i in range(n):
        post[i] = np.float32(2.0) * _sigmoid(mix[n + i] * scale[1] + base[n + i])
    for r in range(n):
        m = -np.inf
        for c in range(n):
            v = mix[2 * n + r * n + c] * scale[2] + base[2 * n + r * n + c]
            comb[r, c] = v
            m = max(m, v)
        s = np.float32(0.0)
        for c in range(n):
            comb[r, c] = np.exp(comb[r, c] - m)
            s += comb[r, c]
        for c in range(n):
            comb[r, c] = comb[r, c] / s + np.float32(hc_eps)
    for it in range(iters):
        if it > 0:  # rows (over c), then columns (over r); the first pass does columns only
            for r in range(n):
                s = np.float32(0.0)
                for c in range(n):
                    s += comb[r, c]
                s += np.float32(hc_eps)
                for c in range(n):
                    comb[r, c] = comb[r, c] / s
        for c in range(n):
            s = np.float32(0.0)
            for r in range(n):
                s += comb[r, c]
            s += np.float32(hc_eps)
            for r in range(n):
                comb[r, c] = comb[r, c] / s
    # u = Σ_i pre_i · X_i, then RMSNorm(u) · norm
    for j in range(D):
        a[j] = np.float32(0.0)
    for i in range(n):
        pre = _sigmoid(mix[i] * scale[0] + base[i]) + np.float32(hc_eps)
        for j in range(D):
            a[j] += pre * X[i, j]
    inv = _rms_scale(a, rms_eps, p)
    for j in range(D):
        a[j] = a[j] * inv * norm[j]


@nb.njit(cache=True, parallel=True)
def _hc_pre_par(X, fn, scale, base, norm, rms_eps, hc_eps, iters, a, post, comb):
    T, n, D = X.shape
    for t in nb.prange(T):
        flat = np.empty(n * D, np.float32)
        mix = np.empty(fn.shape[0], np.float32)
        p = np.empty(LANES, np.float32)
        _hc_pre_token(X[t], fn, scale, base, norm, rms_eps, hc_eps, iters, a[t], post[t], comb[t], flat, mix, p)


@nb.njit(cache=True)
def _hc_pre_serial(X, fn, scale, base, norm, rms_eps, hc_eps, iters, a, post, comb):
    T, n, D = X.shape
    flat = np.empty(n * D, np.float32)
    mix = np.empty(fn.shape[0], np.float32)
    p = np.empty(LANES, np.float32)
    for t in range(T):
        _hc_pre_token(X[t], fn, scale, base, norm, rms_eps, hc_eps, iters, a[t], post[t], comb[t], flat, mix, p)


def hc_pre_norm(X, fn, scale, base, norm, rms_eps, hc_eps, iters):
    """mHC pre + the sublayer's RMSNorm in one call, per token (forward.hc_pre then rms_norm is the
    reference): X [T, n, D], fn [(2+n)·n, n·D] (float32 or half bits) → a [T, D], post [T, n],
    comb [T, n, n]."""
    T, n, D = X.shape
    a = np.empty((T, D), np.float32)
    post = np.empty((T, n), np.float32)
    comb = np.empty((T, n, n), np.float32)
    args = (np.ascontiguousarray(X, dtype=np.float32), fn, np.asarray(scale, np.float32),
            np.asarray(base, np.float32), np.asarray(norm, np.float32), np.float32(rms_eps), np.float32(hc_eps),
            int(iters), a, post, comb)
    if T > 1 and nb.get_num_threads() > 1:
        _hc_pre_par(*args)
    else:
        _hc_pre_serial(*args)
    return a, post, comb


@nb.njit(cache=True)
def _hc_post(X, y, post, comb, out):
    T, n, D = X.shape
    for t in range(T):
        for b in range(n):
            for j in range(D):
                s = comb[t, 0, b] * X[t, 0, j]
                for i in range(1, n):
                    s = s + comb[t, i, b] * X[t, i, j]
                out[t, b, j] = post[t, b] * y[t, j] + s


def hc_post(X, y, post, comb):
    """X'[b] = post_b · y + Σ_a comb[a, b] · X[a] (forward.hc_post is the reference)."""
    out = np.empty(X.shape, np.float32)
    _hc_post(np.ascontiguousarray(X, dtype=np.float32), np.ascontiguousarray(y, dtype=np.float32), post, comb, out)
    return out


# ---- MoE: routed experts and the shared expert in one call -----------------------------------------
@nb.njit(inline="always")
def _swiglu_rows(g, u, limit, scale_rows, h):
    """h = silu(min(g, limit)) · clip(u, ±limit) · scale_rows[t]  (forward._swiglu · weight)."""
    lim = np.float32(limit)
    for t in range(g.shape[0]):
        for j in range(g.shape[1]):
            gv = min(g[t, j], lim)
            uv = min(max(u[t, j], -lim), lim)
            h[t, j] = (gv * _sigmoid(gv)) * uv * scale_rows[t]


@nb.njit(inline="always")
def _expert(Wg, Wu, Wd, x, limit, wts, y, g, u, h, buf, hbuf, p):
    """y [n, D] = down(swiglu(gate·x, up·x) · wts) for one expert's rows x [n, D]."""
    n = x.shape[0]
    _dense_rows(Wg, x, g, 0, Wg.shape[0], buf, p)
    _dense_rows(Wu, x, u, 0, Wu.shape[0], buf, p)
    _swiglu_rows(g, u, limit, wts, h)
    _dense_rows(Wd, h, y, 0, Wd.shape[0], hbuf, p)


@nb.njit(cache=True)
def _moe_plan(ids, E):
    """Slots grouped by expert: count[e], start[e], order (slot ids t·k+s in (token, slot) order
    within each expert) and the list of experts that have slots."""
    T, k = ids.shape
    count = np.zeros(E, np.int64)
    for t in range(T):
        for s in range(k):
            count[ids[t, s]] += 1
    start = np.zeros(E + 1, np.int64)
    for e in range(E):
        start[e + 1] = start[e] + count[e]
    order = np.empty(T * k, np.int64)
    fill = start[:E].copy()
    for t in range(T):
        for s in range(k):
            e = ids[t, s]
            order[fill[e]] = t * k + s
            fill[e] += 1
    active = np.empty(E, np.int64)
    n_active = 0
    for e in range(E):
        if count[e] > 0:
            active[n_active] = e
            n_active += 1
    return count, start, order, active[:n_active]


@nb.njit(cache=True)
def _moe_experts(Wg, Wu, Wd, x, wts, limit, count, start, order, experts, ys, mid, want_mid):
    """Each listed expert multiplies the rows routed to it (a weight row is decoded once per call);
    results go to ys[t, slot] (and the down inputs to mid[t, slot])."""
    D = x.shape[1]
    k = ys.shape[1]
    F = Wg.shape[1]
    buf = np.empty(D, np.float32)
    hbuf = np.empty(F, np.float32)
    p = np.empty((4, LANES), np.float32)
    for e in experts:
        n = count[e]
        xe = np.empty((n, D), np.float32)
        we = np.empty(n, np.float32)
        for i in range(n):
            slot = order[start[e] + i]
            xe[i] = x[slot // k]
            we[i] = wts[slot // k, slot % k]
        g = np.empty((n, F), np.float32)
        u = np.empty((n, F), np.float32)
        h = np.empty((n, F), np.float32)
        ye = np.empty((n, D), np.float32)
        _expert(Wg[e], Wu[e], Wd[e], xe, limit, we, ye, g, u, h, buf, hbuf, p)
        for i in range(n):
            slot = order[start[e] + i]
            ys[slot // k, slot % k] = ye[i]
            if want_mid:
                mid[slot // k, slot % k] = h[i]


@nb.njit(cache=True)
def _moe_finish(Sg, Su, Sd, x, ids, limit, ys, out):
    """out[t] = (Σ routed results in ascending expert order, stable in slot order) + shared expert."""
    T, D = x.shape
    k = ids.shape[1]
    Fs = Sg.shape[0]
    gs = np.empty((T, Fs), np.float32)
    us = np.empty((T, Fs), np.float32)
    hs = np.empty((T, Fs), np.float32)
    ysh = np.empty((T, D), np.float32)
    ones = np.ones(T, np.float32)
    buf = np.empty(D, np.float32)
    hbuf = np.empty(Fs, np.float32)
    p = np.empty((4, LANES), np.float32)
    _expert(Sg, Su, Sd, x, limit, ones, ysh, gs, us, hs, buf, hbuf, p)
    slots = np.empty(k, np.int64)
    for t in range(T):
        for s in range(k):  # insertion sort of the token's slots by expert id (stable)
            slots[s] = s
            j = s
            while j > 0 and ids[t, slots[j - 1]] > ids[t, slots[j]]:
                slots[j - 1], slots[j] = slots[j], slots[j - 1]
                j -= 1
        for j in range(D):
            acc = np.float32(0.0)
            for s in range(k):
                acc += ys[t, slots[s], j]
            out[t, j] = acc + ysh[t, j]


@nb.njit(cache=True, parallel=True)
def _moe_experts_par(Wg, Wu, Wd, x, wts, limit, count, start, order, experts, ys, mid, want_mid):
    for i in nb.prange(experts.shape[0]):
        _moe_experts(Wg, Wu, Wd, x, wts, limit, count, start, order, experts[i:i + 1], ys, mid, want_mid)


def moe_dense(Wg, Wu, Wd, Sg, Su, Sd, x, ids, wts, limit, want_mid=False):
    """The whole MoE of forward.moe for float weights (float32 or half bits): routed experts
    Wg/Wu [E, F, D], Wd [E, D, F] on ids/wts [T, k], plus the shared expert Sg/Su [F, D], Sd [D, F].
    Returns (out [T, D], mid [T, k, F] or None: the routed down-projection inputs)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    T, k = ids.shape
    out = np.empty_like(x)
    mid = np.zeros((T, k, Wg.shape[1]), np.float32) if want_mid else np.zeros((1, 1, 1), np.float32)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    wts = np.ascontiguousarray(wts, dtype=np.float32)
    limit = np.float32(limit)
    count, start, order, experts = _moe_plan(ids, Wg.shape[0])
    ys = np.empty((T, k, x.shape[1]), np.float32)
    args = (Wg, Wu, Wd, x, wts, limit, count, start, order, experts, ys, mid, want_mid)
    threads = nb.get_num_threads()
    if threads == 1 or len(experts) < 2:
        _moe_experts(*args)
    elif T == 1:  # decode: threaded while the clock says it pays (ds4.thread_choice; same bits)
        timed_choice(("moe", Wg.shape, Wg.dtype.char, threads), lambda: _moe_experts(*args),
                     lambda: _moe_experts_par(*args))
    else:
        _moe_experts_par(*args)
    _moe_finish(Sg, Su, Sd, x, ids, limit, ys, out)
    return out, (mid if want_mid else None)


@nb.njit(cache=True)
def _swiglu_call(g, u, limit, scale_rows, h):
    _swiglu_rows(g, u, limit, scale_rows, h)


def swiglu(g, u, limit, scale_rows=None):
    """silu(min(g, limit)) · clip(u, ±limit) · scale_rows[:, None] (the MoE kernel's arithmetic)."""
    g = np.ascontiguousarray(g, dtype=np.float32)
    u = np.ascontiguousarray(u, dtype=np.float32)
    s = np.ones(g.shape[0], np.float32) if scale_rows is None else np.ascontiguousarray(scale_rows, dtype=np.float32)
    h = np.empty_like(g)
    _swiglu_call(g, u, np.float32(limit), s, h)
    return h


def unit_rms(x, eps):
    """x / sqrt(mean(x²) + eps) per row, as hc_pre_norm computes it (the HC mix's input)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    _unit_rms_rows_eps(x, np.float32(eps), out)
    return out


@nb.njit(cache=True)
def _unit_rms_rows_eps(x, eps, out):
    p = np.empty(LANES, np.float32)
    for t in range(x.shape[0]):
        inv = _rms_scale(x[t], eps, p)
        for j in range(x.shape[1]):
            out[t, j] = x[t, j] * inv


# ---- sublayer entry points used by the forward pass (model + tensor names) -------------------------
def hc_block(model, X, fn_name, scale_name, base_name, norm_name):
    """mHC pre of X [T, n, D] with the named weights, then the sublayer's RMSNorm: (a, post, comb)."""
    key = ("hc", fn_name)
    w = model.plans.get(key)
    if w is None:
        w = model.plans[key] = (model.dense(fn_name), np.asarray(model.w(scale_name), np.float32),
                                np.asarray(model.w(base_name), np.float32), np.asarray(model.w(norm_name), np.float32))
    cfg = model.config
    return hc_pre_norm(X, *w, cfg.rms_eps, cfg.hc_eps, cfg.sinkhorn_iters)


def moe(model, li, b, ids, w, limit, want_mid):
    """Routed + shared experts of layer li in one kernel when every expert weight is a float
    tensor; None when some are block-quantized (the forward then runs its per-expert loop)."""
    key = ("moe", li)
    if key not in model.plans:
        from ds4.gguf_tools import constants as C

        L = C.LayerTensor
        names = [C.blk(li, t) for t in (L.FFN_GATE_EXPS, L.FFN_UP_EXPS, L.FFN_DOWN_EXPS,
                                        L.FFN_GATE_SHEXP, L.FFN_UP_SHEXP, L.FFN_DOWN_SHEXP)]
        ws = None
        if all(model.quantized(n) is None for n in names):
            ws = [model.dense(n) for n in names]
            if len({a.dtype for a in ws[:3]}) != 1 or len({a.dtype for a in ws[3:]}) != 1:
                ws = None
        model.plans[key] = ws
    ws = model.plans[key]
    if ws is None:
        return None
    return moe_dense(*ws, b, ids, w, limit, want_mid)


# ---- norms and the official KV rounding, one call each (numerics.py is the reference) ------------
@nb.njit(cache=True)
def _rms_norm_rows(x, w, has_w, eps, out):
    p = np.empty(LANES, np.float32)
    for r in range(x.shape[0]):
        inv = _rms_scale(x[r], eps, p)
        for j in range(x.shape[1]):
            v = x[r, j] * inv
            out[r, j] = v * w[j] if has_w else v


def rms_norm(x, weight, eps):
    """numerics.rms_norm over the last axis in one call (sum of squares in the lane order)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat = x.reshape(-1, x.shape[-1])
    out = np.empty_like(flat)
    has_w = weight is not None
    w = np.asarray(weight, np.float32) if has_w else flat[0]
    _rms_norm_rows(flat, w, has_w, np.float32(eps), out)
    return out.reshape(x.shape)


@nb.njit(inline="always")
def _pow2_ceil(v):
    m, e = math.frexp(v)
    if m == 0.5:
        e -= 1
    return np.float32(math.ldexp(1.0, e))


@nb.njit(cache=True)
def _fp8_rows(x, n_nope, out):
    """numerics.fp8_kv_round, the same float32 operations per value."""
    for r in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[r, j] = x[r, j]
        for b0 in range(0, n_nope, 64):
            amax = np.float32(0.0)
            for j in range(64):
                amax = max(amax, abs(x[r, b0 + j]))
            amax = max(amax, np.float32(1e-4))
            scale = _pow2_ceil(np.float32(amax / np.float32(448.0)))
            for j in range(64):
                q = np.float32(x[r, b0 + j] / scale)
                q = min(max(q, np.float32(-448.0)), np.float32(448.0))
                aq = abs(q)
                e = math.frexp(aq if aq > 0 else np.float32(1.0))[1]
                e = max(e - 1, -6)
                step = np.float32(math.ldexp(1.0, e - 3))
                out[r, b0 + j] = np.float32(np.rint(np.float32(q / step)) * step) * scale


def fp8_kv_round(x, n_nope):
    """numerics.fp8_kv_round in one call (bit for bit; tests check)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat = x.reshape(-1, x.shape[-1])
    out = np.empty_like(flat)
    _fp8_rows(flat, int(n_nope), out)
    return out.reshape(x.shape)


@nb.njit(cache=True)
def _rope_tail(x, cos, sin, rope_dim, sign, out):
    """x [T, M, hd] → out: pairs (x[2i], x[2i+1]) of the last rope_dim dims rotated by ±angle."""
    T, M, hd = x.shape
    base = hd - rope_dim
    for t in range(T):
        for m in range(M):
            for j in range(base):
                out[t, m, j] = x[t, m, j]
            for i in range(rope_dim // 2):
                c = cos[t, i]
                s = sin[t, i] * sign
                x0 = x[t, m, base + 2 * i]
                x1 = x[t, m, base + 2 * i + 1]
                out[t, m, base + 2 * i] = x0 * c - x1 * s
                out[t, m, base + 2 * i + 1] = x0 * s + x1 * c


def apply_tail(x, cos, sin, rope_dim, inverse=False):
    """rope.apply_tail in one call (the same float32 operations: bit for bit)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat = x.reshape(x.shape[0], -1, x.shape[-1])
    out = np.empty_like(flat)
    _rope_tail(flat, np.ascontiguousarray(cos, dtype=np.float32), np.ascontiguousarray(sin, dtype=np.float32),
               int(rope_dim), np.float32(-1.0 if inverse else 1.0), out)
    return out.reshape(x.shape)


@nb.njit(cache=True)
def _indexer_qat_rows(x, inv_sqrt_n, out):
    """numerics.indexer_qat per row: Walsh-Hadamard butterflies (a+b, a−b), scale, then FP4 e2m1
    per 32 values with a power-of-two scale; the same float32 operations as the numpy version."""
    n = x.shape[1]
    for r in range(x.shape[0]):
        y = out[r]
        for j in range(n):
            y[j] = x[r, j]
        h = 1
        while h < n:
            for s in range(0, n, 2 * h):
                for i in range(h):
                    a = y[s + i]
                    b = y[s + h + i]
                    y[s + i] = a + b
                    y[s + h + i] = a - b
            h *= 2
        for j in range(n):
            y[j] = y[j] * inv_sqrt_n
        for b0 in range(0, n, 32):
            amax = np.float32(0.0)
            for j in range(32):
                amax = max(amax, abs(y[b0 + j]))
            amax = max(amax, np.float32(6.0 * 2.0 ** -126))
            scale = _pow2_ceil(np.float32(amax / np.float32(6.0)))
            for j in range(32):
                q = np.float32(y[b0 + j] / scale)
                q = min(max(q, np.float32(-6.0)), np.float32(6.0))
                aq = abs(q)
                e = math.frexp(aq if aq > 0 else np.float32(1.0))[1]
                e = max(e - 1, 0)
                step = np.float32(math.ldexp(1.0, e - 1))
                y[b0 + j] = np.float32(np.rint(np.float32(q / step)) * step) * scale


def indexer_qat(x):
    """numerics.indexer_qat (Hadamard + FP4) in one call, bit for bit (tests check)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat = x.reshape(-1, x.shape[-1])
    out = np.empty_like(flat)
    _indexer_qat_rows(flat, np.float32(1.0 / np.sqrt(x.shape[-1])), out)
    return out.reshape(x.shape)
