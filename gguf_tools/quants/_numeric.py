"""Float32 building blocks shared by the k-quant and IQ2 searches (tooling-spec §2.1, §2.3): the
scalar searches (ggml's functions, one group at a time), make_qp with its trials batched, and the
lane forms that run the searches of many groups in lock step (`make_qkx*_lanes`, `make_qp_lanes`).

Byte-identity with ggml depends on doing every operation in float32, in the same order as the C
source evaluates it, with the same rounding. Numba promotes `float32 * int64` to float64, so every
integer that meets a float here is converted with `F32(...)` first; literals are float32 constants.
No fastmath anywhere: LLVM must neither reassociate sums nor fuse multiply-adds.

The scalar and batched searches take their output code arrays as arguments (no allocation in hot
loops); the lane forms allocate their per-lane rows once per call (one call covers a whole row).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)
QK_K = 256


@intrinsic
def f32_bits(typingctx, x):
    """Bit pattern of a float32 as int32 (C: memcpy float -> int)."""
    sig = types.int32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def bits_f32(typingctx, x):
    """float32 whose bit pattern is the given int32."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@njit(inline="always")
def nearest_int(v):
    """ggml's magic-number rounding: add 1.5*2^23 in float32, read the low mantissa bits.

    Round half to even for |v| <= 4194303; outside that range it reproduces ggml's garbage exactly.
    """
    val = F32(v + F32(12582912.0))
    return np.int32((f32_bits(val) & 0x007FFFFF) - 0x00400000)


@njit(inline="always")
def roundf(v):
    """C roundf on float32: round half away from zero."""
    r = np.trunc(v)
    if abs(v - r) >= F32(0.5):
        r += F32(1.0) if v > 0 else F32(-1.0)
    return r


@njit(inline="always")
def fp32_to_fp16_bits(x):
    """IEEE f32 -> f16 bits, round to nearest even; overflow -> inf; NaN -> 0x7E00 | sign."""
    bits = np.int64(f32_bits(x)) & 0xFFFFFFFF
    sign = np.uint16((bits >> 16) & 0x8000)
    mag = bits & 0x7FFFFFFF
    if mag > 0x7F800000:
        return np.uint16(sign | 0x7E00)
    if mag >= 0x477FF000:  # >= 65520 rounds to infinity
        return np.uint16(sign | 0x7C00)
    if mag < 0x38800000:  # below the smallest normal half: subnormal (exact scaling by 2^24)
        scaled = bits_f32(np.int32(mag)) * F32(16777216.0)
        return np.uint16(sign | nearest_int(scaled))
    h = (mag >> 13) - (112 << 10)
    rest = mag & 0x1FFF
    if rest > 0x1000 or (rest == 0x1000 and (h & 1)):
        h += 1
    return np.uint16(sign | h)


@njit(inline="always")
def fp16_bits_to_fp32(h):
    h = np.int32(h) & 0xFFFF
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    if exp == 0:
        v = F32(mant) * F32(5.960464477539063e-08)  # 2^-24
        return -v if sign else v
    if exp == 31:
        return bits_f32(np.int32(sign | 0x7F800000 | (mant << 13)))
    return bits_f32(np.int32(sign | ((exp + 112) << 23) | (mant << 13)))


@njit(inline="always")
def fp16_round(x):
    """Value of x after a round trip through f16 (what a reader of the stored field sees)."""
    return fp16_bits_to_fp32(fp32_to_fp16_bits(x))


def _make_qkx_variant(use_mad: bool, qkx3: bool):
    """make_qkx2_quants / make_qkx3_quants (tooling-spec §2.3): asymmetric (scale, min) search.

    Compiled once per (use_mad, qkx3) so the per-element branches fold away. `qkx3` only changes
    the degenerate test (max <= min instead of max == min).
    Arguments: x, w float32[n]; L (result) and Laux (scratch) uint8[n]; rmin, rdelta float32.
    Returns (scale, the_min) with the_min >= 0.
    """

    @njit(error_model="numpy")
    def make_qkx(n, nmax, x, w, L, Laux, rmin, rdelta, nstep):
        fnmax = F32(nmax)
        mn = x[0]
        mx = x[0]
        sum_w = w[0]
        sum_x = sum_w * x[0]
        for i in range(1, n):
            if x[i] < mn:
                mn = x[i]
            if x[i] > mx:
                mx = x[i]
            wi = w[i]
            sum_w += wi
            sum_x += wi * x[i]
        if mn > 0:
            mn = F32(0.0)
        if (mx <= mn) if qkx3 else (mx == mn):
            for i in range(n):
                L[i] = 0
            return F32(0.0), -mn
        iscale = fnmax / (mx - mn)
        scale = F32(1.0) / iscale
        for i in range(n):
            L[i] = max(0, min(nmax, nearest_int(iscale * (x[i] - mn))))
        best_error = F32(0.0)
        for i in range(n):
            diff = scale * F32(L[i]) + mn - x[i]
            best_error += w[i] * (abs(diff) if use_mad else diff * diff)
        if nstep < 1:
            return scale, -mn
        for step in range(nstep + 1):
            iscale = (rmin + rdelta * F32(step) + fnmax) / (mx - mn)
            changed = step == 0
            for i in range(n):
                q = max(0, min(nmax, nearest_int(iscale * (x[i] - mn))))
                changed |= q != Laux[i]
                Laux[i] = q
            if not changed:
                # Same codes as the previous step give the same error, which was already compared
                # against a best_error that can only have decreased since: ggml's outcome is a no-op.
                continue
            sum_l = F32(0.0)
            sum_l2 = F32(0.0)
            sum_xl = F32(0.0)
            for i in range(n):
                q = F32(Laux[i])
                wl = w[i] * q
                sum_l += wl
                sum_l2 += wl * q
                sum_xl += wl * x[i]
            D = sum_w * sum_l2 - sum_l * sum_l
            if D > 0:
                this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
                this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
                if this_min > 0:
                    this_min = F32(0.0)
                    this_scale = sum_xl / sum_l2
                cur_error = F32(0.0)
                for i in range(n):
                    diff = this_scale * F32(Laux[i]) + this_min - x[i]
                    cur_error += w[i] * (abs(diff) if use_mad else diff * diff)
                if cur_error < best_error:
                    for i in range(n):
                        L[i] = Laux[i]
                    best_error = cur_error
                    scale = this_scale
                    mn = this_min
        return scale, -mn

    return make_qkx


make_qkx2 = _make_qkx_variant(use_mad=False, qkx3=False)
make_qkx2_mad = _make_qkx_variant(use_mad=True, qkx3=False)
make_qkx3 = _make_qkx_variant(use_mad=False, qkx3=True)


@njit(error_model="numpy")
def make_qp(n, nmax, x, L, qw):
    """make_qp_quants (tooling-spec §2.3): symmetric scale for non-negative data, with 5 refit sweeps.

    L is a uint8 array: ggml stores unclamped (possibly negative) codes into uint8, and the sweeps
    read them back wrapped; numba's uint8 stores wrap the same way. Returns the scale.
    """
    fnmax = F32(nmax)
    mx = F32(0.0)
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F32(0.0)
    iscale = fnmax / mx
    for i in range(n):
        L[i] = np.uint8(nearest_int(iscale * x[i]) & 0xFF)
    scale = F32(1.0) / iscale
    best_mse = F32(0.0)
    for i in range(n):
        diff = x[i] - scale * F32(L[i])
        best_mse += qw[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (F32(0.1) * F32(step) + fnmax) / mx
        scale_is = F32(1.0) / iscale_is
        mse = F32(0.0)
        for i in range(n):
            q = min(nmax, nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * F32(q)
            mse += qw[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        q = min(nmax, nearest_int(iscale * x[i]))
        L[i] = np.uint8(q & 0xFF)
        wi = qw[i]
        sumlx += wi * x[i] * F32(q)
        suml2 += wi * F32(q) * F32(q)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            wi = qw[i]
            li = np.int32(L[i])
            slx = sumlx - wi * x[i] * F32(li)
            sl2 = suml2 - wi * F32(li) * F32(li)
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != li:
                    slx += wi * x[i] * F32(new_l)
                    sl2 += wi * F32(new_l) * F32(new_l)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = np.uint8(new_l & 0xFF)
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > F32(0.0) else F32(0.0)



# ---------------------------------------------------------------- searches batched across trial steps
#
# make_qp's 8 trial scales are independent of one another until the "is it better?" comparison,
# yet each is a chain of sequential float32 sums that ggml runs to the end before starting the
# next. The batched version keeps one accumulator per trial and advances all of them element by
# element (inner loops over the trial axis), so every trial's sum still adds the same terms in the
# same order: the same float32 values. The comparisons then run over the trials in ggml's order.
# Scratch is one flat float32 array (`trial_scratch`), rows of TRIALS addressed by constant
# offsets from one base.

TRIALS = 16  # trials evaluated together: one 16-lane (or two 8-lane) vector per accumulator
_ISC, _SL, _SL2, _SXL, _D, _TS, _TM, _ERR, _CODES = (k * TRIALS for k in range(9))


def trial_scratch(n: int = 32) -> np.ndarray:
    """Scratch for the batched searches on groups of up to n elements."""
    return np.zeros(_CODES + n * TRIALS, dtype=np.float32)


@njit(error_model="numpy")
def make_qp_batched(n, nmax, x, L, qw, S):
    """`make_qp` with its 8 trial scales batched (S = trial_scratch()); same result."""
    fnmax = F32(nmax)
    mx = F32(0.0)
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F32(0.0)
    iscale = fnmax / mx
    for i in range(n):
        L[i] = np.uint8(nearest_int(iscale * x[i]) & 0xFF)
    scale = F32(1.0) / iscale
    best_mse = F32(0.0)
    for i in range(n):
        diff = x[i] - scale * F32(L[i])
        best_mse += qw[i] * diff * diff
    # trials is = -4..-1, 1..4 in lanes 0..7
    for c in range(8):
        S[_ISC + c] = (F32(0.1) * F32(c - 4 if c < 4 else c - 3) + fnmax) / mx
    for c in range(8):
        S[_TS + c] = F32(1.0) / S[_ISC + c]
        S[_ERR + c] = F32(0.0)
    for i in range(n):
        xi = x[i]
        wi = qw[i]
        for c in range(8):
            q = min(nmax, nearest_int(S[_ISC + c] * xi))
            diff = xi - S[_TS + c] * F32(q)
            S[_ERR + c] += wi * diff * diff
    for c in range(8):
        if S[_ERR + c] < best_mse:
            best_mse = S[_ERR + c]
            iscale = S[_ISC + c]
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        q = min(nmax, nearest_int(iscale * x[i]))
        L[i] = np.uint8(q & 0xFF)
        wi = qw[i]
        sumlx += wi * x[i] * F32(q)
        suml2 += wi * F32(q) * F32(q)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            wi = qw[i]
            li = np.int32(L[i])
            slx = sumlx - wi * x[i] * F32(li)
            sl2 = suml2 - wi * F32(li) * F32(li)
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != li:
                    slx += wi * x[i] * F32(new_l)
                    sl2 += wi * F32(new_l) * F32(new_l)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = np.uint8(new_l & 0xFF)
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > F32(0.0) else F32(0.0)


# ---------------------------------------------------------------- searches batched across groups
#
# A row holds many independent groups (Q2_K: 16 sub-blocks per 256-block), each searched by ggml
# one after the other. `make_qkx_lanes` runs the same search for all of them in lock step: group
# g is lane g, element i of every group lives in row i of a transposed [n, lanes] array, and each
# operation of the scalar search becomes a loop over lanes (vectorised by LLVM). Every lane does
# exactly the scalar search's float32 operations in its order, including the sequential trial
# loop with the `min` carried from one improvement to the next trials, so the results are equal
# bit for bit; the data-dependent branches become per-lane selects. Rows are addressed as A[i, g],
# never through a row view (each view costs reference-count updates inside the hot loops).


@njit(inline="always")
def _imin(a, b):
    """min of two int32 as a plain select (the builtin's generic form keeps LLVM from vectorising)."""
    return a if a < b else b


@njit(inline="always")
def _iclamp(q, hi):
    """max(0, min(hi, q)) for int32, as selects."""
    q = q if q < hi else hi
    return q if q > np.int32(0) else np.int32(0)


def _make_qkx_lanes_variant(use_mad: bool, qkx3: bool):
    """make_qkx2 / make_qkx3 over lanes: XT, WT float32 [n, lanes] (element i of group g at [i, g]),
    LT float32 [n, lanes] receives the codes, LA float32 [n, lanes] is scratch; scale_out and
    min_out (float32 [lanes]) receive what make_qkx returns (scale, the_min). nstep >= 1."""

    @njit(error_model="numpy")
    def make_qkx_lanes(n, nmax, XT, WT, LT, rmin, rdelta, nstep, LA, scale_out, min_out):
        lanes = XT.shape[1]
        fnmax = F32(nmax)
        inmax = np.int32(nmax)
        # separate allocations, not rows of one array: LLVM then vectorises loops touching several
        mn = np.empty(lanes, dtype=np.float32)
        mx = np.empty(lanes, dtype=np.float32)
        sum_w = np.empty(lanes, dtype=np.float32)
        sum_x = np.empty(lanes, dtype=np.float32)
        best = np.empty(lanes, dtype=np.float32)
        scale = np.empty(lanes, dtype=np.float32)
        isc = np.empty(lanes, dtype=np.float32)
        sl = np.empty(lanes, dtype=np.float32)
        sl2 = np.empty(lanes, dtype=np.float32)
        sxl = np.empty(lanes, dtype=np.float32)
        ts = np.empty(lanes, dtype=np.float32)
        tm = np.empty(lanes, dtype=np.float32)
        err = np.empty(lanes, dtype=np.float32)
        dd = np.empty(lanes, dtype=np.float32)
        mn_start = np.empty(lanes, dtype=np.float32)
        for g in range(lanes):
            mn[g] = XT[0, g]
            mx[g] = XT[0, g]
            sum_w[g] = WT[0, g]
            sum_x[g] = WT[0, g] * XT[0, g]
        for i in range(1, n):
            for g in range(lanes):
                # selects between values already loaded: LLVM vectorises these, not `a[g] = b if c else a[g]`
                v = XT[i, g]
                lo = mn[g]
                hi = mx[g]
                mn[g] = v if v < lo else lo
                mx[g] = v if v > hi else hi
                sum_w[g] += WT[i, g]
                sum_x[g] += WT[i, g] * v
        for g in range(lanes):
            if mn[g] > 0:
                mn[g] = F32(0.0)
            mn_start[g] = mn[g]
            isc[g] = fnmax / (mx[g] - mn[g])
            scale[g] = F32(1.0) / isc[g]
            best[g] = F32(0.0)
        for i in range(n):
            for g in range(lanes):
                q = F32(_iclamp(nearest_int(isc[g] * (XT[i, g] - mn[g])), inmax))
                LT[i, g] = q
                diff = scale[g] * q + mn[g] - XT[i, g]
                best[g] += WT[i, g] * (abs(diff) if use_mad else diff * diff)
        for step in range(nstep + 1):
            for g in range(lanes):
                isc[g] = (rmin + rdelta * F32(step) + fnmax) / (mx[g] - mn[g])
                sl[g] = F32(0.0)
                sl2[g] = F32(0.0)
                sxl[g] = F32(0.0)
                err[g] = F32(0.0)
            for i in range(n):
                for g in range(lanes):
                    q = F32(_iclamp(nearest_int(isc[g] * (XT[i, g] - mn[g])), inmax))
                    LA[i, g] = q
                    wl = WT[i, g] * q
                    sl[g] += wl
                    sl2[g] += wl * q
                    sxl[g] += wl * XT[i, g]
            for g in range(lanes):
                D = sum_w[g] * sl2[g] - sl[g] * sl[g]
                this_scale = (sum_w[g] * sxl[g] - sum_x[g] * sl[g]) / D
                this_min = (sl2[g] * sum_x[g] - sl[g] * sxl[g]) / D
                clamp = this_min > 0
                dd[g] = D
                ts[g] = sxl[g] / sl2[g] if clamp else this_scale
                tm[g] = F32(0.0) if clamp else this_min
            for i in range(n):
                for g in range(lanes):
                    diff = ts[g] * LA[i, g] + tm[g] - XT[i, g]
                    err[g] += WT[i, g] * (abs(diff) if use_mad else diff * diff)
            # dd becomes the update mask: 1 where this trial improves the lane (one array written
            # per loop: LLVM vectorises these, not a loop that writes several rows of V)
            for g in range(lanes):
                d = dd[g]
                e = err[g]
                b = best[g]
                dd[g] = F32(1.0) if (d > 0) & (e < b) else F32(0.0)
            for g in range(lanes):
                e = err[g]
                b = best[g]
                best[g] = e if dd[g] != 0 else b
            for g in range(lanes):
                t = ts[g]
                v = scale[g]
                scale[g] = t if dd[g] != 0 else v
            for g in range(lanes):
                t = tm[g]
                v = mn[g]
                mn[g] = t if dd[g] != 0 else v
            for i in range(n):
                for g in range(lanes):
                    a = LA[i, g]
                    b = LT[i, g]
                    LT[i, g] = a if dd[g] != 0 else b
        for g in range(lanes):
            m0 = mn_start[g]
            m1 = mn[g]
            sc = scale[g]
            degenerate = (mx[g] <= m0) if qkx3 else (mx[g] == m0)
            scale_out[g] = F32(0.0) if degenerate else sc
            min_out[g] = -m0 if degenerate else -m1
            dd[g] = F32(1.0) if degenerate else F32(0.0)
        for i in range(n):
            for g in range(lanes):
                b = LT[i, g]
                LT[i, g] = F32(0.0) if dd[g] != 0 else b

    return make_qkx_lanes


make_qkx2_lanes = _make_qkx_lanes_variant(use_mad=False, qkx3=False)
make_qkx2_mad_lanes = _make_qkx_lanes_variant(use_mad=True, qkx3=False)
make_qkx3_lanes = _make_qkx_lanes_variant(use_mad=False, qkx3=True)


@njit(error_model="numpy")
def make_qp_lanes(n, nmax, XT, WT, LT, scale_out):
    """make_qp over lanes (layout as make_qkx_lanes; LT int32 [n, lanes] gets the codes as ggml's
    uint8 stores leave them). The refit sweeps run while any
    lane still changes: a sweep that changes nothing in a lane leaves it as it was, so a lane
    that ggml would have stopped goes on unchanged."""
    lanes = XT.shape[1]
    fnmax = F32(nmax)
    inmax = np.int32(nmax)
    mx = np.empty(lanes, dtype=np.float32)
    iscale = np.empty(lanes, dtype=np.float32)
    best = np.empty(lanes, dtype=np.float32)
    isc = np.empty(lanes, dtype=np.float32)
    ssc = np.empty(lanes, dtype=np.float32)
    mse = np.empty(lanes, dtype=np.float32)
    sumlx = np.empty(lanes, dtype=np.float32)
    suml2 = np.empty(lanes, dtype=np.float32)
    changed = np.empty(lanes, dtype=np.float32)
    for g in range(lanes):
        mx[g] = F32(0.0)
    for i in range(n):
        for g in range(lanes):
            m = mx[g]
            v = XT[i, g]
            mx[g] = m if m > v else v
    for g in range(lanes):
        iscale[g] = fnmax / mx[g]
        ssc[g] = F32(1.0) / iscale[g]
        best[g] = F32(0.0)
    for i in range(n):
        for g in range(lanes):
            li = F32(nearest_int(iscale[g] * XT[i, g]) & 0xFF)
            diff = XT[i, g] - ssc[g] * li
            best[g] += WT[i, g] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        for g in range(lanes):
            isc[g] = (F32(0.1) * F32(step) + fnmax) / mx[g]
            ssc[g] = F32(1.0) / isc[g]
            mse[g] = F32(0.0)
        for i in range(n):
            for g in range(lanes):
                q = _imin(inmax, nearest_int(isc[g] * XT[i, g]))
                diff = XT[i, g] - ssc[g] * F32(q)
                mse[g] += WT[i, g] * diff * diff
        for g in range(lanes):
            e = mse[g]
            b = best[g]
            a = isc[g]
            c = iscale[g]
            iscale[g] = a if e < b else c
        for g in range(lanes):
            e = mse[g]
            b = best[g]
            best[g] = e if e < b else b
    for g in range(lanes):
        sumlx[g] = F32(0.0)
        suml2[g] = F32(0.0)
    for i in range(n):
        for g in range(lanes):
            q = _imin(inmax, nearest_int(iscale[g] * XT[i, g]))
            LT[i, g] = q & 0xFF
            sumlx[g] += WT[i, g] * XT[i, g] * F32(q)
            suml2[g] += WT[i, g] * F32(q) * F32(q)
    for _ in range(5):
        for g in range(lanes):
            changed[g] = F32(0.0)
        for i in range(n):
            for g in range(lanes):
                w = WT[i, g]
                x = XT[i, g]
                l_old = LT[i, g]
                lf = F32(l_old)
                sx_old = sumlx[g]
                s2_old = suml2[g]
                ch_old = changed[g]
                slx = sumlx[g] - w * x * lf
                sl2 = suml2[g] - w * lf * lf
                new_l = _imin(inmax, nearest_int(x * sl2 / slx))
                slx_new = slx + w * x * F32(new_l)
                sl2_new = sl2 + w * F32(new_l) * F32(new_l)
                accept = ((slx > 0) & (sl2 > 0) & (new_l != l_old)
                          & (slx_new * slx_new * s2_old > sx_old * sx_old * sl2_new))
                LT[i, g] = (new_l & 0xFF) if accept else l_old
                sumlx[g] = slx_new if accept else sx_old
                suml2[g] = sl2_new if accept else s2_old
                changed[g] = F32(1.0) if accept else ch_old
        any_changed = False
        for g in range(lanes):
            any_changed |= changed[g] != 0
        if not any_changed:
            break
    for g in range(lanes):
        zero = mx[g] < GROUP_MAX_EPS
        sx = sumlx[g]
        s2 = suml2[g]
        scale_out[g] = F32(0.0) if zero | (not s2 > F32(0.0)) else sx / s2
        changed[g] = F32(1.0) if zero else F32(0.0)
    for i in range(n):
        for g in range(lanes):
            b = LT[i, g]
            LT[i, g] = 0 if changed[g] != 0 else b
