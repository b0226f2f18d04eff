"""The fixed lane order every CPU weight product uses, and its kernels in vector registers.

A dot product w · x is summed in 64 lane sums (lane l takes the products of elements k ≡ l mod 64
in increasing k), then a fixed halving tree (lane l += lane l + 32, += l + 16, …, += l + 1). The
order does not depend on the batch, the thread or the weight's storage (float32, IEEE half bits,
or a quantized row decoded into float32), so decode == prefill bit for bit in the engine.

`dot_rows(a, i, b, j, p)` (a[i] · b[j]), `dot_lanes(w, x, p)` (1-D), `lane_sums4(buf, x, t0, full, p)`
(four tokens against one row) and `tree_row(p, r)` are the numba entry points (numba only). They
address rows by index, never by building a row view: a view per row costs two atomic reference
count updates, which measured 5x slower products inside larger kernels (the MoE).
Contiguous arrays go through LLVM intrinsics that keep the lanes in four <16 x float> registers:
numba's scalar loop keeps them in the scratch array (it cannot prove the scratch does not alias
the weights), which costs a load and a store per 16 lanes and halves the speed. Each lane still
gets `lane += w * x` (an IEEE multiply, then an add: no fused multiply-add, no reassociation) in
increasing k, and the tree pairs lanes exactly as `tree`, so the bits equal the scalar loop's
(tests hold both to `ds4.gguf_tools.quants.fused.lane_dot_reference`). Other layouts take the loop.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic, overload

LANES = 64


@intrinsic
def f16_value(typingctx, h):
    """float32 value of the IEEE half whose bits are h (uint16), exact for every code.

    Branch-free 32-bit integer code (written in LLVM IR because numba widens integer arithmetic
    to 64 bits, which halves the SIMD width): shifting the 15 magnitude bits into a float32
    exponent/mantissa and multiplying by 2^112 rebias normals and subnormals alike (a power-of-two
    product, exact); exponent 31 (inf, NaN with its payload) is selected apart; the sign is or-ed in.
    """
    sig = nb.types.float32(nb.types.uint16)

    def codegen(context, builder, signature, args):
        i32, f32 = ir.IntType(32), ir.FloatType()
        a = builder.zext(args[0], i32)
        m = builder.shl(builder.and_(a, ir.Constant(i32, 0x7FFF)), ir.Constant(i32, 13))
        v = builder.bitcast(builder.fmul(builder.bitcast(m, f32), ir.Constant(f32, 2.0 ** 112)), i32)
        special = builder.icmp_unsigned(">=", m, ir.Constant(i32, 0x0F800000))
        v = builder.select(special, builder.or_(m, ir.Constant(i32, 0x7F800000)), v)
        sign = builder.shl(builder.and_(a, ir.Constant(i32, 0x8000)), ir.Constant(i32, 16))
        return builder.bitcast(builder.or_(v, sign), f32)

    return sig, codegen


@intrinsic
def f16_fpext(typingctx, h):
    """float32 of half bits h through LLVM's half → float extension (vcvtph2ps with F16C/AVX-512):
    the same value as `f16_value` for every non-NaN code (NaN stays NaN, possibly quietened)."""
    sig = nb.types.float32(nb.types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


def weight_value(v):
    """A stored weight as float32 (uint16: half bits; float32: itself). numba only."""
    raise NotImplementedError


@overload(weight_value)
def _weight_value_impl(v):
    if isinstance(v, nb.types.Integer):
        return lambda v: f16_fpext(v)
    return lambda v: v


@nb.njit(inline="always")
def tree(p):
    """The halving tree over the 64 lane sums (lane l += lane l + h for h = 32, 16, …, 1), written
    out so LLVM unrolls and vectorises it."""
    for l in range(32):
        p[l] += p[l + 32]
    for l in range(16):
        p[l] += p[l + 16]
    for l in range(8):
        p[l] += p[l + 8]
    for l in range(4):
        p[l] += p[l + 4]
    for l in range(2):
        p[l] += p[l + 2]
    return p[0] + p[1]


# ---- the lane sums in vector registers (see the module doc) ------------------------------------
_V16 = ir.VectorType(ir.FloatType(), 16)


def _i64(builder, v):
    i64 = ir.IntType(64)
    return v if v.type.width == 64 else builder.sext(v, i64)


def _emit_lane_sums(builder, w_data, half, x_rows, n_full):
    """IR: for each x row pointer, the four 16-lane sum registers of w · x over the first n_full
    (a multiple of 64) elements; one weight load serves every row."""
    i64 = ir.IntType(64)
    w_vec_ptr = ir.PointerType(ir.VectorType(ir.HalfType() if half else ir.FloatType(), 16))
    x_vec_ptr = ir.PointerType(_V16)
    accs = [[cgutils.alloca_once_value(builder, ir.Constant(_V16, None)) for _ in range(4)] for _ in x_rows]
    chunks = builder.udiv(_i64(builder, n_full), ir.Constant(i64, LANES))
    with cgutils.for_range(builder, chunks) as loop:
        base = builder.mul(loop.index, ir.Constant(i64, LANES))
        for i in range(4):
            at = builder.add(base, ir.Constant(i64, 16 * i))
            wv = builder.load(builder.bitcast(builder.gep(w_data, [at]), w_vec_ptr), align=2 if half else 4)
            if half:
                wv = builder.fpext(wv, _V16)
            for x_data, row_accs in zip(x_rows, accs):
                xv = builder.load(builder.bitcast(builder.gep(x_data, [at]), x_vec_ptr), align=4)
                acc = row_accs[i]
                builder.store(builder.fadd(builder.load(acc), builder.fmul(wv, xv)), acc)
    return [[builder.load(acc) for acc in row_accs] for row_accs in accs]


def _emit_tree(builder, accs):
    """IR: `tree` over four 16-lane registers (lanes 0-15, 16-31, 32-47, 48-63)."""
    a0, a1, a2, a3 = accs
    v = builder.fadd(builder.fadd(a0, a2), builder.fadd(a1, a3))     # p[l] += p[l + 32]; += p[l + 16]
    for width in (8, 4, 2):                                           # p[l] += p[l + width]
        idx = ir.VectorType(ir.IntType(32), width)
        lo = builder.shuffle_vector(v, v, ir.Constant(idx, list(range(width))))
        hi = builder.shuffle_vector(v, v, ir.Constant(idx, list(range(width, 2 * width))))
        v = builder.fadd(lo, hi)
    i32 = ir.IntType(32)
    return builder.fadd(builder.extract_element(v, ir.Constant(i32, 0)),
                        builder.extract_element(v, ir.Constant(i32, 1)))


def _store_lanes(builder, p_data, accs):
    for i, acc in enumerate(accs):
        ptr = builder.gep(p_data, [ir.Constant(ir.IntType(64), 16 * i)])
        builder.store(acc, builder.bitcast(ptr, ir.PointerType(_V16)), align=4)


def _is_c_array(a, ndim, dtypes):
    return isinstance(a, nb.types.Array) and a.ndim == ndim and a.layout == "C" and a.dtype in dtypes


_WEIGHT_DTYPES = (nb.types.uint16, nb.types.float32)


def _row_data(context, builder, ty, val, index):
    """Pointer to row `index` of a C-contiguous 2-D array, or to a 1-D array's data (index unused):
    no array view is built, so no reference count is touched per row."""
    arr = context.make_array(ty)(context, builder, val)
    if ty.ndim == 1:
        return arr.data
    cols = builder.extract_value(arr.shape, 1)
    return builder.gep(arr.data, [builder.mul(_i64(builder, index), cols)])


def _rows_typing(a, b, n_full):
    """a: weights (float32 or half bits), b: float32; each 1-D or 2-D, C-contiguous."""
    return (isinstance(a, nb.types.Array) and a.ndim in (1, 2) and a.layout == "C" and a.dtype in _WEIGHT_DTYPES
            and isinstance(b, nb.types.Array) and b.ndim in (1, 2) and b.layout == "C"
            and b.dtype == nb.types.float32 and isinstance(n_full, nb.types.Integer))


@intrinsic
def _lane_dot_at(typingctx, a, i, b, j, n_full):
    """a[i] · b[j] over n_full elements (a multiple of 64, = the whole row: no tail), lane order."""
    if not _rows_typing(a, b, n_full):
        return None
    sig = nb.types.float32(a, i, b, j, n_full)

    def codegen(context, builder, signature, args):
        a_ty, _, b_ty = signature.args[:3]
        a_data = _row_data(context, builder, a_ty, args[0], args[1])
        b_data = _row_data(context, builder, b_ty, args[2], args[3])
        (accs,) = _emit_lane_sums(builder, a_data, a_ty.dtype == nb.types.uint16, [b_data], args[4])
        return _emit_tree(builder, accs)

    return sig, codegen


@intrinsic
def _lane_sums_at(typingctx, a, i, b, j, n_full, p):
    """p[0:64] = the lane sums of a[i] · b[j] over the first n_full elements (a multiple of 64)."""
    if not (_rows_typing(a, b, n_full) and _is_c_array(p, 1, (nb.types.float32,))):
        return None
    sig = nb.types.void(a, i, b, j, n_full, p)

    def codegen(context, builder, signature, args):
        a_ty, _, b_ty, _, _, p_ty = signature.args
        a_data = _row_data(context, builder, a_ty, args[0], args[1])
        b_data = _row_data(context, builder, b_ty, args[2], args[3])
        (accs,) = _emit_lane_sums(builder, a_data, a_ty.dtype == nb.types.uint16, [b_data], args[4])
        _store_lanes(builder, context.make_array(p_ty)(context, builder, args[5]).data, accs)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _lane_sums4_vec(typingctx, w, x, t0, n_full, p):
    """p[tt, 0:64] = the lane sums of w · x[t0 + tt] over the first n_full elements, tt = 0..3
    (x [T, K] C-contiguous, K ≥ n_full; one pass over w for the four tokens)."""
    if not (_is_c_array(w, 1, _WEIGHT_DTYPES) and _is_c_array(x, 2, (nb.types.float32,))
            and _is_c_array(p, 2, (nb.types.float32,)) and isinstance(t0, nb.types.Integer)
            and isinstance(n_full, nb.types.Integer)):
        return None
    sig = nb.types.void(w, x, t0, n_full, p)

    def codegen(context, builder, signature, args):
        w_ty, x_ty, _, _, p_ty = signature.args
        w_data = context.make_array(w_ty)(context, builder, args[0]).data
        xa = context.make_array(x_ty)(context, builder, args[1])
        K = builder.extract_value(xa.shape, 1)
        rows = [builder.gep(xa.data, [builder.mul(builder.add(_i64(builder, args[2]),
                                                              ir.Constant(ir.IntType(64), tt)), K)])
                for tt in range(4)]
        per_token = _emit_lane_sums(builder, w_data, w_ty.dtype == nb.types.uint16, rows, args[3])
        p_data = context.make_array(p_ty)(context, builder, args[4]).data
        for tt, accs in enumerate(per_token):
            _store_lanes(builder, builder.gep(p_data, [ir.Constant(ir.IntType(64), LANES * tt)]), accs)
        return context.get_dummy_value()

    return sig, codegen


def dot_rows(a, i, b, j, p):
    """a[i] · b[j] in the fixed lane order; a float32 or half bits (converted on the fly), b float32,
    each 2-D (row i / j) or 1-D (the index is ignored); p: a float32[LANES] scratch. numba only:
    C-contiguous arrays go through the vector-register intrinsics, others the scalar loop."""
    raise NotImplementedError


def dot_lanes(w, x, p):
    """w · x for 1-D w (float32 or half bits) and x (float32): `dot_rows(w, 0, x, 0, p)`."""
    raise NotImplementedError


def _at(a, i, k):
    """a[i, k] for 2-D a, a[k] for 1-D a. numba only."""
    raise NotImplementedError


@overload(_at, inline="always")
def _at_impl(a, i, k):
    if a.ndim == 1:
        return lambda a, i, k: a[k]
    return lambda a, i, k: a[i, k]


def _dot_rows_loop(a, i, b, j, p):
    n = a.shape[a.ndim - 1]
    for l in range(LANES):
        p[l] = 0.0
    full = n - n % LANES
    for k in range(0, full, LANES):
        for l in range(LANES):
            p[l] += weight_value(_at(a, i, k + l)) * _at(b, j, k + l)
    for l in range(n - full):
        p[l] += weight_value(_at(a, i, full + l)) * _at(b, j, full + l)
    return tree(p)


def _dot_rows_vec(a, i, b, j, p):
    n = a.shape[a.ndim - 1]
    full = n - n % LANES
    if full == n:
        return _lane_dot_at(a, i, b, j, n)
    _lane_sums_at(a, i, b, j, full, p)
    for l in range(n - full):
        p[l] += weight_value(_at(a, i, full + l)) * _at(b, j, full + l)
    return tree(p)


@overload(dot_rows, inline="always")
def _dot_rows_impl(a, i, b, j, p):
    if _rows_typing(a, b, nb.types.int64) and _is_c_array(p, 1, (nb.types.float32,)):
        return _dot_rows_vec
    return _dot_rows_loop


@overload(dot_lanes, inline="always")
def _dot_lanes_impl(w, x, p):
    return lambda w, x, p: dot_rows(w, 0, x, 0, p)


def tree_row(p, r):
    """`tree` of the lane sums in row r of a 2-D p (indexing in place: no row view). numba only."""
    raise NotImplementedError


@overload(tree_row, inline="always")
def _tree_row_impl(p, r):
    def impl(p, r):
        for l in range(32):
            p[r, l] += p[r, l + 32]
        for l in range(16):
            p[r, l] += p[r, l + 16]
        for l in range(8):
            p[r, l] += p[r, l + 8]
        for l in range(4):
            p[r, l] += p[r, l + 4]
        for l in range(2):
            p[r, l] += p[r, l + 2]
        return p[r, 0] + p[r, 1]
    return impl


def lane_sums4(buf, x, t0, full, p):
    """p[tt] = lane sums of buf · x[t0 + tt] over the first `full` elements, tt = 0..3. numba only."""
    raise NotImplementedError


def _lane_sums4_loop(buf, x, t0, full, p):
    for tt in range(4):
        for l in range(LANES):
            p[tt, l] = 0.0
    for j in range(0, full, LANES):
        for tt in range(4):
            for l in range(LANES):
                p[tt, l] += buf[j + l] * x[t0 + tt, j + l]


def _lane_sums4_regs(buf, x, t0, full, p):
    _lane_sums4_vec(buf, x, t0, full, p)


@overload(lane_sums4, inline="always")
def _lane_sums4_impl(buf, x, t0, full, p):
    if _is_c_array(buf, 1, _WEIGHT_DTYPES) and _is_c_array(x, 2, (nb.types.float32,)) \
            and _is_c_array(p, 2, (nb.types.float32,)):
        return _lane_sums4_regs
    return _lane_sums4_loop


@nb.njit(inline="always")
def lane_dots4(buf, x, t0, p, out, o):
    """out[t0 + tt, o] = buf · x[t0 + tt] for tt = 0..3 in the lane order: one pass over buf for
    four tokens, then each token's tail and tree. p: a float32 [4, LANES] scratch. numba only."""
    K = x.shape[1]
    full = K - K % LANES
    lane_sums4(buf, x, t0, full, p)
    for tt in range(4):
        for l in range(K - full):
            p[tt, l] += buf[full + l] * x[t0 + tt, full + l]
        out[t0 + tt, o] = tree_row(p, tt)


# ---- Q8_0 rows straight from their blocks (decode: one token, no float32 row buffer) -------------
# A Q8_0 block is 34 bytes: an IEEE half scale d, then 32 int8 codes; its weights are d * code in
# float32 (`fused._decode_q8_0`). Two blocks fill one 64-lane step: the weights are formed in
# registers (one float32 multiply each, the decoder's) and enter the lanes as in `dot_rows`.
Q8_0_BLOCK_BYTES = 34


def _emit_q8_0_lane_sums(builder, row, x_data, n_full):
    i64, i32 = ir.IntType(64), ir.IntType(32)
    accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16, None)) for _ in range(4)]
    chunks = builder.udiv(_i64(builder, n_full), ir.Constant(i64, LANES))
    zeros16 = ir.Constant(ir.VectorType(i32, 16), [0] * 16)
    with cgutils.for_range(builder, chunks) as loop:
        for half in range(2):
            block = builder.add(builder.mul(loop.index, ir.Constant(i64, 2)), ir.Constant(i64, half))
            at = builder.mul(block, ir.Constant(i64, Q8_0_BLOCK_BYTES))
            bits = builder.load(builder.bitcast(builder.gep(row, [at]), ir.PointerType(ir.IntType(16))), align=1)
            d = builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())
            dv = builder.insert_element(ir.Constant(_V16, None), d, ir.Constant(i32, 0))
            dv = builder.shuffle_vector(dv, dv, zeros16)
            for q in range(2):
                codes_at = builder.add(at, ir.Constant(i64, 2 + 16 * q))
                codes = builder.load(builder.bitcast(builder.gep(row, [codes_at]),
                                                     ir.PointerType(ir.VectorType(ir.IntType(8), 16))), align=1)
                w = builder.fmul(dv, builder.sitofp(codes, _V16))
                x_at = builder.add(builder.mul(loop.index, ir.Constant(i64, LANES)), ir.Constant(i64, 32 * half + 16 * q))
                xv = builder.load(builder.bitcast(builder.gep(x_data, [x_at]), ir.PointerType(_V16)), align=4)
                acc = accs[2 * half + q]
                builder.store(builder.fadd(builder.load(acc), builder.fmul(w, xv)), acc)
    return [builder.load(acc) for acc in accs]


def _q8_0_typing(raw, x, n_full):
    return (_is_c_array(raw, 2, (nb.types.uint8,)) and isinstance(x, nb.types.Array) and x.ndim in (1, 2)
            and x.layout == "C" and x.dtype == nb.types.float32 and isinstance(n_full, nb.types.Integer))


@intrinsic
def _q8_0_dot_at(typingctx, raw, r, x, t, n_full):
    """Q8_0 row r of raw · x[t] over n_full elements (a multiple of 64, = the whole row)."""
    if not _q8_0_typing(raw, x, n_full):
        return None
    sig = nb.types.float32(raw, r, x, t, n_full)

    def codegen(context, builder, signature, args):
        row = _row_data(context, builder, signature.args[0], args[0], args[1])
        x_data = _row_data(context, builder, signature.args[2], args[2], args[3])
        return _emit_tree(builder, _emit_q8_0_lane_sums(builder, row, x_data, args[4]))

    return sig, codegen


@intrinsic
def _q8_0_sums_at(typingctx, raw, r, x, t, n_full, p):
    """p[0:64] = the lane sums of Q8_0 row r of raw · x[t] over the first n_full elements."""
    if not (_q8_0_typing(raw, x, n_full) and _is_c_array(p, 1, (nb.types.float32,))):
        return None
    sig = nb.types.void(raw, r, x, t, n_full, p)

    def codegen(context, builder, signature, args):
        row = _row_data(context, builder, signature.args[0], args[0], args[1])
        x_data = _row_data(context, builder, signature.args[2], args[2], args[3])
        accs = _emit_q8_0_lane_sums(builder, row, x_data, args[4])
        _store_lanes(builder, context.make_array(signature.args[5])(context, builder, args[5]).data, accs)
        return context.get_dummy_value()

    return sig, codegen


@nb.njit(inline="always")
def q8_0_dot(raw, r, x, t, p):
    """dequant(raw)[r] · x[t] in the lane order for Q8_0 blocks raw [rows, row_bytes] (uint8, C order)
    and x [T, K] float32: the bits of decoding the row and then `dot_rows`. p: float32[LANES] scratch."""
    K = x.shape[1]
    full = K - K % LANES
    if full == K:
        return _q8_0_dot_at(raw, r, x, t, K)
    _q8_0_sums_at(raw, r, x, t, full, p)
    o = full // 32 * Q8_0_BLOCK_BYTES  # the one remaining block (K % 64 == 32)
    d = f16_value(np.uint16(np.int32(raw[r, o]) | (np.int32(raw[r, o + 1]) << 8)))
    for l in range(K - full):
        c = np.int32(raw[r, o + 2 + l])
        w = d * np.float32(c - 256 if c > 127 else c)
        p[l] += w * x[t, full + l]
    return tree(p)
