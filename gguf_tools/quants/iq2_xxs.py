"""IQ2_XXS: 256 weights per 66-byte block, 2.0625 bits per weight (tooling-spec §2.7).

Layout: f16 d, then per group of 32 weights two little-endian u32 words: `a` holds four 8-bit
indices into a 256-entry grid of 8-vectors with levels {1, 3, 5} (decoded as 0x08/0x19/0x2b),
`b` holds four 7-bit sign fields (the 8th sign is the parity) and a 4-bit group scale in bits 28..31.

The quantizer is always weighted. ds4 quantizes without an imatrix by passing the column energy
of the weight matrix as importance (`synthetic_importance`); `quantize(x, None)` does that.

Speed: the search is ggml's (13 trial scales x 4 sub-groups, snapping off-grid codes to the best
of their precomputed neighbours), with the same float32 operations in the same order, so the bytes
are identical. What is faster: rows run in parallel; all groups of 32 of a row are searched in lock
step, one vector lane per group (`_quantize_row_lanes`: setup, make_qp, trial codes, sums and the
choice of the best trial for every group at once, each lane in ggml's float32 order); a trial's
codes stay packed, one 16-bit grid code per sub-group; and the neighbour searches of the off-grid
sub-groups, collected per trial, run two at a time in `iq2_xxs_search`, 16 candidates per vector
register over transposed neighbour lists (each candidate still sums its eight terms in ggml's
order; the first of equal minima wins, as in ggml). `_best_neighbour` is the scalar scan and
`quantize_blockwise` the straight block-at-a-time form of the whole search, kept as the
references the fast forms are tested against.

numba's on-disk cache of these kernels is keyed on this file's text only: after changing the
vector search's IR in `iq2_xxs_search`, bump SEARCH_IR_REVISION below so cached kernels recompile.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._numeric import F32, GROUP_MAX_EPS, QK_K, _iclamp, fp16_bits_to_fp32, fp32_to_fp16_bits, make_qp, make_qp_lanes, nearest_int
from ._rows import dequantize_blocks, empty_blocks, float_rows
from .iq2_xxs_search import best_position, best_positions2, vector_tables

BLOCK_BYTES = 66
BLOCK_DTYPE = np.dtype([("d", "<f2"), ("qs", "<u2", (32,))])
assert BLOCK_DTYPE.itemsize == BLOCK_BYTES

SEARCH_IR_REVISION = 4  # see the module doc (numba cache)
MAP_SIZE = 43692  # codes u < 4**8 whose 2-bit fields can be 0..2 (max is 0b1010...10 = 43690)
FLT_MAX = np.float32(3.4028234663852886e38)
STEP_LANES = 16  # the 13 trial scales of the search, padded to a 16-lane vector
GRID_BYTES = np.array([0x08, 0x19, 0x2B], dtype=np.uint8)  # decoder magnitude of level 0/1/2


# ---------------------------------------------------------------- tables


def _kgrid() -> np.ndarray:
    """The 256 grid points as 16-bit codes (2 bits per dimension), taken from the gguf package."""
    from gguf.quants import IQ2_XXS as _GG

    return np.frombuffer(bytes.fromhex(_GG.grid_hex.decode()), dtype="<u2").astype(np.int32)


def _levels(codes: np.ndarray) -> np.ndarray:
    """[n] 16-bit codes -> [n, 8] levels 0..3."""
    return (codes[:, None] >> (2 * np.arange(8))) & 3


def _ksigns() -> np.ndarray:
    """7-bit sign field -> 8 sign bits (bit 7 = parity of the 7)."""
    v = np.arange(128, dtype=np.int32)
    parity = np.array([bin(i).count("1") & 1 for i in range(128)], dtype=np.int32)
    return (v | (parity << 7)).astype(np.uint8)


def build_tables():
    """Grid, code->grid map and neighbour lists (ggml's iq2xs_init_impl construction).

    For an off-grid code u the neighbours are all grid points within the two smallest distinct
    squared distances from u's level vector (2l+1 per dimension), ordered by (distance, index).
    Only codes with levels 0..2 are ever looked up, so only those get lists.
    Returns (grid_q int8 [256, 8] with values 1/3/5, map int32 [MAP_SIZE] (-1 off grid),
    nb_start, nb_count int32 [MAP_SIZE], nb_index int32 [total], nb_terms uint8 [total*8]).
    nb_terms[8*e + i] = 3*i + level_i of neighbour entry e: where its dimension i finds its term
    in the 24-entry table of the neighbour search.
    """
    kgrid = _kgrid()
    grid_q = (2 * _levels(kgrid) + 1).astype(np.int8)
    gmap = np.full(MAP_SIZE, -1, dtype=np.int32)
    gmap[kgrid] = np.arange(256, dtype=np.int32)

    all_codes = np.arange(MAP_SIZE, dtype=np.int32)
    lv = _levels(all_codes)
    usable = (lv <= 2).all(axis=1) & (gmap < 0)
    codes = all_codes[usable]
    pos = 2 * lv[usable] + 1  # [m, 8]
    d2 = ((pos[:, None, :] - grid_q[None, :, :].astype(np.int32)) ** 2).sum(-1)  # [m, 256]
    nb_start = np.zeros(MAP_SIZE, dtype=np.int32)
    nb_count = np.zeros(MAP_SIZE, dtype=np.int32)
    idx_parts = []
    total = 0
    for row, u in enumerate(codes):
        order = np.lexsort((np.arange(256), d2[row]))  # by distance, then index
        dist_sorted = d2[row][order]
        shells = np.unique(dist_sorted)[:2]
        chosen = order[dist_sorted <= shells[-1]]
        nb_start[u] = total
        nb_count[u] = len(chosen)
        total += len(chosen)
        idx_parts.append(chosen.astype(np.int32))
    nb_index = np.concatenate(idx_parts)
    nb_terms = (3 * np.arange(8)[None, :] + (grid_q[nb_index].astype(np.int32) - 1) // 2).astype(np.uint8)
    return grid_q, gmap, nb_start, nb_count, nb_index, nb_terms.reshape(-1)


GRID_Q, GRID_MAP, NB_START, NB_COUNT, NB_INDEX, NB_TERMS = build_tables()

NB_CHUNK0, NB_VTERMS = vector_tables(NB_START, NB_COUNT, NB_TERMS)
GRID_F = GRID_Q.astype(np.float32)
NB_CODE = _kgrid()[NB_INDEX].astype(np.int32)  # each neighbour entry's 16-bit grid code
KSIGNS = _ksigns()


def synthetic_importance(w: np.ndarray) -> np.ndarray:
    """ds4's stand-in for a missing imatrix: imp[c] = sum over rows of W[r, c]^2, float32, row order."""
    w = np.asarray(w, dtype=np.float32)
    imp = np.zeros(w.shape[-1], dtype=np.float32)
    for r in range(w.shape[0]):
        imp += w[r] * w[r]
    return imp


# ---------------------------------------------------------------- numpy reference (decoding)


def dequantize_reference(raw: np.ndarray) -> np.ndarray:
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    b = raw.reshape(-1, BLOCK_BYTES).view(BLOCK_DTYPE).reshape(-1)
    words = b["qs"].copy().view("<u4").reshape(-1, 8, 2)  # [nb, group, (a, b)]
    a, s = words[..., 0], words[..., 1]
    db = b["d"].astype(np.float32)[:, None] * (np.float32(0.5) + (s >> 28).astype(np.float32)) * np.float32(0.25)
    k = np.arange(4, dtype=np.uint32)
    gidx = (a[..., None] >> (8 * k)) & 0xFF  # [nb, 8, 4]
    signs = KSIGNS[(s[..., None] >> (7 * k)) & 127]  # [nb, 8, 4]
    mags = GRID_BYTES[(GRID_Q[gidx] - 1) // 2].astype(np.float32)  # [nb, 8, 4, 8]
    neg = (signs[..., None] >> np.arange(8, dtype=np.uint8)) & 1
    y = db[..., None, None] * mags * np.where(neg == 1, np.float32(-1), np.float32(1))
    return y.reshape(*raw.shape[:-1], raw.shape[-1] // BLOCK_BYTES * QK_K)


# ---------------------------------------------------------------- numba kernels


@njit(inline="always")
def _best_neighbour(u, xval, waux, g0, scale, nb_start, nb_count, nb_index, nb_terms, T):
    """Index of the neighbour of off-grid code u closest to xval[g0:g0+8] (first minimum wins).

    ggml sums d2 = sum_i waux_i * (scale*g_i - x_i)^2 over i = 0..7 for each candidate. g_i takes
    only the values 1, 3, 5, so the 24 possible terms are computed once (same float ops), and each
    candidate adds its 8 terms in the same order: the same float32 sums. (Stopping a candidate
    once its partial sum reaches the best would also be exact, terms being >= 0, but the branch
    costs more than it saves.)
    """
    for i in range(8):
        xi = xval[g0 + i]
        wi = waux[g0 + i]
        for lv in range(3):
            diff = scale * F32(2 * lv + 1) - xi
            T[3 * i + lv] = wi * diff * diff
    start = nb_start[u]
    n = nb_count[u]
    best = FLT_MAX
    best_c = 0
    for c in range(n):
        e = 8 * (start + c)
        acc = F32(0.0)
        for i in range(8):
            acc += T[nb_terms[e + i]]
        if acc < best:
            best = acc
            best_c = c
    return nb_index[start + best_c]


@njit(error_model="numpy")
def _quantize_block(x, qw, out, o, grid_q, gmap, nb_start, nb_count, nb_index, nb_terms, weight, waux, xval, L, Laux, Lqp, T,
                    scales, words, signs, wx, wq2, Q, U, SF):
    """One 256-block: ggml's quantize_row_iq2_xxs_impl, operation for operation.

    The trailing arguments are per-thread scratch. wx[i] = w_i*xval_i and wq2[3i+l] = (w_i*q)*q
    for q = 2l+1 are the products ggml forms first in its sumqx/sumq2 loops, hoisted (same
    operations, same order, same values). Q [32 x STEP_LANES] holds the codes of every trial scale,
    U [4 x STEP_LANES] their sub-group grid codes, SF the per-trial inverse scale, scale and sums.
    """
    sinv = SF[0:STEP_LANES]
    sscale = SF[STEP_LANES : 2 * STEP_LANES]
    sqx = SF[2 * STEP_LANES : 3 * STEP_LANES]
    sq2 = SF[3 * STEP_LANES : 4 * STEP_LANES]
    for j in range(16):
        words[j] = 0
    max_scale = F32(0.0)
    sumx2 = F32(0.0)
    for i in range(QK_K):
        sumx2 += x[i] * x[i]
    sigma2 = sumx2 / F32(256.0)

    for ib in range(8):
        xb = x[32 * ib : 32 * ib + 32]
        for i in range(32):
            weight[i] = qw[32 * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i])
        for i in range(32):
            waux[i] = np.sqrt(weight[i])
        for k in range(4):
            nflip = 0
            s = 0
            for i in range(8):
                v = xb[8 * k + i]
                if v >= 0:
                    xval[8 * k + i] = v
                else:
                    xval[8 * k + i] = -v
                    nflip += 1
                    s |= 1 << i
            if nflip % 2:
                imin = 0
                vmin = weight[8 * k] * xb[8 * k] * xb[8 * k]
                for i in range(1, 8):
                    ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i]
                    if ax < vmin:
                        vmin = ax
                        imin = i
                xval[8 * k + imin] = -xval[8 * k + imin]
                s ^= 1 << imin
            signs[k] = s & 127
        mx = xval[0]
        for i in range(1, 32):
            mx = mx if mx > xval[i] else xval[i]
        if mx < GROUP_MAX_EPS:
            scales[ib] = F32(0.0)
            continue
        for i in range(32):
            w = weight[i]
            wx[i] = w * xval[i]
            for lv in range(3):
                q = F32(2 * lv + 1)
                wq2[3 * i + lv] = w * q * q
        scale = make_qp(32, 4, xval, Lqp, weight)
        eff_max = scale * F32(3.0)
        if eff_max <= 0:
            scales[ib] = F32(0.0)
            continue
        # The 13 trial scales, batched: lane c of each 16-wide row is trial step c - 6. Codes for
        # every trial first (one vector op per element), then the off-grid snaps trial by trial,
        # then both sums of every trial together, each adding its 32 terms in ggml's order.
        for c in range(STEP_LANES):
            inv = (F32(5.0) + F32(min(c, 12) - 6) * F32(0.1)) / eff_max
            sinv[c] = inv
            sscale[c] = F32(1.0) / inv
            sqx[c] = F32(0.0)
            sq2[c] = F32(0.0)
        for k in range(4):
            for c in range(STEP_LANES):
                U[STEP_LANES * k + c] = 0
            for i in range(8):
                xi = xval[8 * k + i]
                row = STEP_LANES * (8 * k + i)
                for c in range(STEP_LANES):
                    q = max(np.int32(0), min(np.int32(2), nearest_int(F32(0.5) * (sinv[c] * xi - F32(1.0)))))
                    Q[row + c] = q
                    U[STEP_LANES * k + c] |= q << (2 * i)
        for c in range(13):
            for k in range(4):
                u = U[STEP_LANES * k + c]
                if gmap[u] < 0:
                    gi = _best_neighbour(u, xval, waux, 8 * k, sscale[c], nb_start, nb_count, nb_index, nb_terms, T)
                    for i in range(8):
                        Q[STEP_LANES * (8 * k + i) + c] = (grid_q[gi, i] - 1) // 2
        for i in range(32):
            wxi = wx[i]
            wi = weight[i]
            row = STEP_LANES * i
            for c in range(STEP_LANES):
                q = F32(2 * Q[row + c] + 1)
                sqx[c] += wxi * q
                sq2[c] += wi * q * q
        best = F32(0.0)
        for c in range(13):
            sumqx = sqx[c]
            sumq2 = sq2[c]
            if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                scale = sumqx / sumq2
                best = scale * sumqx
                for i in range(32):
                    L[i] = Q[STEP_LANES * i + c]
        if scale > 0:
            inv = F32(1.0) / scale
            for k in range(4):
                u = 0
                for i in range(8):
                    q = nearest_int(F32(0.5) * (inv * xval[8 * k + i] - F32(1.0)))
                    q = max(0, min(2, q))
                    u |= q << (2 * i)
                gi = gmap[u]
                if gi < 0:
                    gi = _best_neighbour(u, xval, waux, 8 * k, scale, nb_start, nb_count, nb_index, nb_terms, T)
                for i in range(8):
                    L[8 * k + i] = (grid_q[gi, i] - 1) // 2
            sumqx = F32(0.0)
            sumq2 = F32(0.0)
            for i in range(32):
                sumqx += wx[i] * F32(2 * L[i] + 1)
                sumq2 += wq2[3 * i + L[i]]
            if sumq2 > 0:
                scale = sumqx / sumq2
        if scale < 0:
            scale = -scale
            for k in range(4):
                signs[k] = (~signs[k]) & 127
        a = np.uint32(0)
        b = np.uint32(0)
        for k in range(4):
            u = 0
            for i in range(8):
                u |= L[8 * k + i] << (2 * i)
            a |= np.uint32(gmap[u]) << np.uint32(8 * k)
            b |= np.uint32(signs[k]) << np.uint32(7 * k)
        words[2 * ib] = a
        words[2 * ib + 1] = b
        scales[ib] = scale
        max_scale = max_scale if max_scale > scale else scale

    if max_scale == 0:
        for j in range(BLOCK_BYTES):
            out[o + j] = 0
        return
    d = max_scale / F32(31.0)
    dh = fp32_to_fp16_bits(d)
    out[o] = dh & 0xFF
    out[o + 1] = dh >> 8
    inv_d = F32(1.0) / d
    for ib in range(8):
        q = nearest_int(F32(0.5) * (inv_d * scales[ib] - F32(1.0)))
        q = max(0, min(15, q))
        words[2 * ib + 1] |= np.uint32(q) << np.uint32(28)
    for j in range(16):
        wv = words[j]
        for t in range(4):
            out[o + 2 + 4 * j + t] = (wv >> np.uint32(8 * t)) & np.uint32(0xFF)


@njit(error_model="numpy")
def _row_setup(xr, qw, Wf, XV, WT, WX, XVr, WAr, signs):
    """ggml's per-group setup for every group of a row, in loops LLVM vectorises: weights
    qw*sqrt(sigma2 + x^2) and their roots, sign-folded values, then each 8-value sub-group's sign
    field (an odd count of negatives flips the value of least w*x*x, the first such, back), then
    the [32, lanes] transposes the lane search reads."""
    nb = xr.shape[0] // QK_K
    for b in range(nb):
        sumx2 = F32(0.0)
        for i in range(QK_K):
            sumx2 += xr[QK_K * b + i] * xr[QK_K * b + i]
        sigma2 = sumx2 / F32(256.0)
        for j in range(QK_K * b, QK_K * b + QK_K):
            v = xr[j]
            w = qw[j] * np.sqrt(sigma2 + v * v)
            Wf[j] = w
            WAr[j] = np.sqrt(w)
            XVr[j] = v if v >= 0 else -v
    for t in range(xr.shape[0] // 8):
        o = 8 * t
        sg = 0
        nflip = 0
        vmin = Wf[o] * xr[o] * xr[o]
        imin = 0
        for i in range(8):
            v = xr[o + i]
            neg = 0 if v >= 0 else 1
            sg |= neg << i
            nflip += neg
            ax = Wf[o + i] * v * v
            lt = ax < vmin
            vmin = ax if lt else vmin
            imin = i if lt else imin
        odd = nflip & 1
        sg ^= odd << imin
        xm = XVr[o + imin]
        XVr[o + imin] = -xm if odd else xm
        signs[t] = sg & 127
    for g in range(xr.shape[0] // 32):
        for i in range(32):
            w = Wf[32 * g + i]
            xv = XVr[32 * g + i]
            XV[i, g] = xv
            WT[i, g] = w
            WX[i, g] = w * xv


@njit(error_model="numpy")
def _group_finish(g, scale, BU, gmap, nb_start, nb_count, nb_code, vterms, chunk0, XVr, WAr, WT, WX, signs, words):
    """ggml's last requantization of group g at its best scale, then its two words; returns the
    scale. BU[k, g] holds the 16-bit grid code of sub-group k (the best trial's; replaced here by
    the requantized one when the scale is positive)."""
    o = 32 * g
    if scale > 0:
        inv = F32(1.0) / scale
        for k in range(4):
            u = 0
            for i in range(8):
                q = nearest_int(F32(0.5) * (inv * XVr[o + 8 * k + i] - F32(1.0)))
                u |= max(0, min(2, q)) << (2 * i)
            if gmap[u] < 0:
                u = nb_code[nb_start[u] + best_position(vterms, chunk0[u], nb_count[u], XVr, WAr, o + 8 * k, scale)]
            BU[k, g] = u
        sumqx = F32(0.0)
        sumq2 = F32(0.0)
        for k in range(4):
            u = BU[k, g]
            for i in range(8):
                q = F32(2 * ((u >> (2 * i)) & 3) + 1)
                sumqx += WX[8 * k + i, g] * q
                sumq2 += WT[8 * k + i, g] * q * q
        if sumq2 > 0:
            scale = sumqx / sumq2
    if scale < 0:
        scale = -scale
        for k in range(4):
            signs[4 * g + k] = (~signs[4 * g + k]) & 127
    a = np.uint32(0)
    b = np.uint32(0)
    for k in range(4):
        a |= np.uint32(gmap[BU[k, g]]) << np.uint32(8 * k)
        b |= np.uint32(signs[4 * g + k]) << np.uint32(7 * k)
    words[2 * g] = a
    words[2 * g + 1] = b
    return scale


@njit(error_model="numpy")
def _quantize_row_lanes(xr, qw, outr, gmap, nb_start, nb_count, nb_code, vterms, chunk0,
                        XV, WT, WX, XVr, WAr, Wf, U, BU, LQ, P, scales, words, signs, jobs):
    """One row, its groups of 32 in lock step: group g (8 per block) is lane g of the transposed
    [32, lanes] arrays. Each lane performs `_quantize_block`'s float32 operations in its order
    (make_qp by `make_qp_lanes`; the 13 trial scales one after the other, every lane at once).
    A trial's codes live packed, one 16-bit grid code per sub-group (U[k, g], 2 bits a value):
    the off-grid ones are collected, searched back to back (`best_position`) and replaced by the
    chosen neighbour's code; the sums read the levels back with shifts."""
    nb = xr.shape[0] // QK_K
    lanes = 8 * nb
    _row_setup(xr, qw, Wf, XV, WT, WX, XVr, WAr, signs)
    eff = P[0]
    inv = P[1]
    tsc = P[2]
    sqx = P[3]
    sq2 = P[4]
    best = P[5]
    scale = P[6]
    up = P[7]
    make_qp_lanes(32, 4, XV, WT, LQ, scale)
    for g in range(lanes):
        eff[g] = scale[g] * F32(3.0)
        best[g] = F32(0.0)
    for step in range(-6, 7):
        for g in range(lanes):
            inv[g] = (F32(5.0) + F32(step) * F32(0.1)) / eff[g]
            tsc[g] = F32(1.0) / inv[g]
            sqx[g] = F32(0.0)
            sq2[g] = F32(0.0)
        for k in range(4):
            for g in range(lanes):
                U[k, g] = 0
            for i in range(8):
                r = 8 * k + i
                for g in range(lanes):
                    q = _iclamp(nearest_int(F32(0.5) * (inv[g] * XV[r, g] - F32(1.0))), np.int32(2))
                    ug = U[k, g]
                    U[k, g] = ug | (q << (2 * i))
        # the off-grid sub-groups first (branch-free), then their searches back to back
        nj = 0
        for g in range(lanes):
            live = eff[g] > 0
            for k in range(4):
                jobs[nj] = 4 * g + k
                nj += 1 if (live and gmap[U[k, g]] < 0) else 0
        for t in range(0, nj - 1, 2):  # two searches a pass: their dependency chains interleave
            ga = jobs[t] >> 2
            ka = jobs[t] & 3
            gb = jobs[t + 1] >> 2
            kb = jobs[t + 1] & 3
            ua = U[ka, ga]
            ub = U[kb, gb]
            pa, pb = best_positions2(vterms, XVr, WAr, chunk0[ua], nb_count[ua], 32 * ga + 8 * ka, tsc[ga],
                                     chunk0[ub], nb_count[ub], 32 * gb + 8 * kb, tsc[gb])
            U[ka, ga] = nb_code[nb_start[ua] + pa]
            U[kb, gb] = nb_code[nb_start[ub] + pb]
        if nj % 2:
            g = jobs[nj - 1] >> 2
            k = jobs[nj - 1] & 3
            u = U[k, g]
            U[k, g] = nb_code[nb_start[u] + best_position(vterms, chunk0[u], nb_count[u], XVr, WAr, 32 * g + 8 * k, tsc[g])]
        for k in range(4):
            for i in range(8):
                r = 8 * k + i
                for g in range(lanes):
                    q = F32(2 * ((U[k, g] >> (2 * i)) & 3) + 1)
                    sqx[g] += WX[r, g] * q
                    sq2[g] += WT[r, g] * q * q
        for g in range(lanes):
            # selects between loaded values (LLVM vectorises these, not `a[g] = b if c else a[g]`)
            qx = sqx[g]
            q2 = sq2[g]
            b = best[g]
            sc = scale[g]
            better = (q2 > 0) & (qx * qx > b * q2)
            new_scale = qx / q2
            scale[g] = new_scale if better else sc
            best[g] = new_scale * qx if better else b
            up[g] = F32(1.0) if better else F32(0.0)
        for k in range(4):
            for g in range(lanes):
                a = U[k, g]
                b = BU[k, g]
                BU[k, g] = a if up[g] != 0 else b
    for g in range(lanes):
        if eff[g] > 0:
            scales[g] = _group_finish(g, scale[g], BU, gmap, nb_start, nb_count, nb_code, vterms, chunk0,
                                      XVr, WAr, WT, WX, signs, words)
        else:
            scales[g] = F32(0.0)
            words[2 * g] = 0
            words[2 * g + 1] = 0
    for b in range(nb):
        o = BLOCK_BYTES * b
        max_scale = F32(0.0)
        for ib in range(8):
            sc = scales[8 * b + ib]
            max_scale = max_scale if max_scale > sc else sc
        if max_scale == 0:
            for j in range(BLOCK_BYTES):
                outr[o + j] = 0
            continue
        d = max_scale / F32(31.0)
        dh = fp32_to_fp16_bits(d)
        outr[o] = dh & 0xFF
        outr[o + 1] = dh >> 8
        inv_d = F32(1.0) / d
        for ib in range(8):
            g = 8 * b + ib
            q = nearest_int(F32(0.5) * (inv_d * scales[g] - F32(1.0)))
            q = max(0, min(15, q))
            for t in range(2):
                wv = words[2 * g + t]
                if t == 1:
                    wv |= np.uint32(q) << np.uint32(28)
                for byte in range(4):
                    outr[o + 2 + 8 * ib + 4 * t + byte] = (wv >> np.uint32(8 * byte)) & np.uint32(0xFF)


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_rows_lanes(x, qw, out, gmap, nb_start, nb_count, nb_code, vterms, chunk0):
    rows, cols = x.shape
    lanes = cols // 32
    for r in prange(rows):
        XV = np.empty((32, lanes), dtype=np.float32)
        WT = np.empty((32, lanes), dtype=np.float32)
        WX = np.empty((32, lanes), dtype=np.float32)
        XVr = np.empty(cols, dtype=np.float32)
        WAr = np.empty(cols, dtype=np.float32)
        Wf = np.empty(cols, dtype=np.float32)
        U = np.zeros((4, lanes), dtype=np.int32)
        BU = np.zeros((4, lanes), dtype=np.int32)
        LQ = np.zeros((32, lanes), dtype=np.int32)
        P = np.zeros((8, lanes), dtype=np.float32)
        scales = np.zeros(lanes, dtype=np.float32)
        words = np.zeros(2 * lanes, dtype=np.uint32)
        signs = np.zeros(4 * lanes, dtype=np.int32)
        jobs = np.zeros(4 * lanes, dtype=np.int32)
        _quantize_row_lanes(x[r], qw, out[r], gmap, nb_start, nb_count, nb_code, vterms, chunk0,
                            XV, WT, WX, XVr, WAr, Wf, U, BU, LQ, P, scales, words, signs, jobs)


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_rows(x, qw, out, grid_q, gmap, nb_start, nb_count, nb_index, nb_terms):
    rows, cols = x.shape
    nb = cols // QK_K
    for r in prange(rows):
        weight = np.zeros(32, dtype=np.float32)
        waux = np.zeros(32, dtype=np.float32)
        xval = np.zeros(32, dtype=np.float32)
        L = np.zeros(32, dtype=np.int32)
        Laux = np.zeros(32, dtype=np.int32)
        Lqp = np.zeros(32, dtype=np.uint8)
        T = np.zeros(24, dtype=np.float32)
        scales = np.zeros(8, dtype=np.float32)
        words = np.zeros(16, dtype=np.uint32)
        signs = np.zeros(4, dtype=np.int32)
        wx = np.zeros(32, dtype=np.float32)
        wq2 = np.zeros(96, dtype=np.float32)
        Q = np.zeros(32 * STEP_LANES, dtype=np.int32)
        U = np.zeros(4 * STEP_LANES, dtype=np.int32)
        SF = np.zeros(4 * STEP_LANES, dtype=np.float32)
        for b in range(nb):
            _quantize_block(
                x[r, b * QK_K : (b + 1) * QK_K], qw[b * QK_K : (b + 1) * QK_K], out[r], b * BLOCK_BYTES,
                grid_q, gmap, nb_start, nb_count, nb_index, nb_terms, weight, waux, xval, L, Laux, Lqp, T,
                scales, words, signs, wx, wq2, Q, U, SF,
            )


@njit(inline="always")
def _decode_block(raw_row, o, buf, grid_bytes, ksigns):
    d = fp16_bits_to_fp32(np.int32(raw_row[o]) | (np.int32(raw_row[o + 1]) << 8))
    for g in range(8):
        p = o + 2 + 8 * g
        sw = np.uint32(raw_row[p + 4]) | (np.uint32(raw_row[p + 5]) << 8) | (np.uint32(raw_row[p + 6]) << 16) | (np.uint32(raw_row[p + 7]) << 24)
        db = d * (F32(0.5) + F32(sw >> np.uint32(28))) * F32(0.25)
        for k in range(4):
            gi = raw_row[p + k]
            sg = ksigns[(sw >> np.uint32(7 * k)) & np.uint32(127)]
            for i in range(8):
                v = db * F32(grid_bytes[gi, i])
                buf[32 * g + 8 * k + i] = -v if (sg >> i) & 1 else v


@njit(parallel=True, cache=True, error_model="numpy")
def _dequantize_rows(raw, out, grid_bytes, ksigns):
    nb = raw.shape[1] // BLOCK_BYTES
    for r in prange(raw.shape[0]):
        for b in range(nb):
            _decode_block(raw[r], b * BLOCK_BYTES, out[r, b * QK_K : (b + 1) * QK_K], grid_bytes, ksigns)


GRID_DECODE = GRID_BYTES[(GRID_Q.astype(np.int32) - 1) // 2]  # [256, 8] decoder magnitudes


# ---------------------------------------------------------------- public


def quantize(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """Rows [rows, cols] -> raw blocks. Without `importance`, uses `synthetic_importance(x)`."""
    x = float_rows(x, QK_K, "IQ2_XXS")
    qw = synthetic_importance(x) if importance is None else np.ascontiguousarray(importance, dtype=np.float32)
    out = empty_blocks(x, QK_K, BLOCK_BYTES)
    _quantize_rows_lanes(x, qw, out, GRID_MAP, NB_START, NB_COUNT, NB_CODE, NB_VTERMS, NB_CHUNK0)
    return out


def quantize_blockwise(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """`quantize` one 256-block at a time (`_quantize_block`): the straight form of the search that
    the lane-parallel `quantize` is tested against."""
    x = float_rows(x, QK_K, "IQ2_XXS")
    qw = synthetic_importance(x) if importance is None else np.ascontiguousarray(importance, dtype=np.float32)
    out = empty_blocks(x, QK_K, BLOCK_BYTES)
    _quantize_rows(x, qw, out, GRID_Q.astype(np.int32), GRID_MAP, NB_START, NB_COUNT, NB_INDEX, NB_TERMS)
    return out


def dequantize(raw: np.ndarray) -> np.ndarray:
    return dequantize_blocks(_dequantize_rows, raw, QK_K, BLOCK_BYTES, GRID_DECODE, KSIGNS)
