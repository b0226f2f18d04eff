"""IQ2_XXS neighbour search, 16 candidates per vector register (tooling-spec §2.7).

ggml snaps an off-grid code u to the neighbour g (from u's precomputed list, in list order) that
minimises d2(g) = sum_{i=0..7} w_i * (scale*g_i - x_i)^2, summing the eight terms in order i = 0..7
and keeping the first of equal minima. Candidates are independent, so here 16 of them are scored at
once, one per vector lane, each lane doing exactly the scalar float32 operations in that order:

* g_i takes only the values 1, 3, 5, so the 24 possible terms t[3i + l] = (w_i*diff)*diff with
  diff = scale*(2l+1) - x_i are computed once per search (the same three operations the scalar
  loop performs, here in two 16-lane registers; slots 24..31 hold +inf for padding).
* `NB_VTERMS` stores each list transposed, 16 candidates a chunk: per chunk two 16-lane words,
  word h of lane c holding the slots 3i + l of candidate c for i = 4h..4h+3, one byte each (slot 24
  for the padding after the last candidate). Term i of 16 candidates is then a shift, a table
  permute (AVX-512 vpermi2ps: 32 float32 slots indexed by the low 5 bits) and a vector add.
* The first minimum: per lane, the running minimum and the chunk where it was first reached (strict
  `<`, as the scalar scan); then one unsigned 64-bit minimum over the lanes' (score bits, position)
  keys. Scores held are +0 .. FLT_MAX, whose bits order like their values, so equal scores resolve
  to the smallest position: ggml's first candidate.

`best_position(...)` and `best_positions2(...)` (two searches sharing one chunk loop, so that their
dependency chains interleave) are the numba entry points; they return the candidate's position in
u's list (nb_index[nb_start[u] + position] is the grid index). CPUs without AVX-512F use the same
IR with the permute written as selects (LLVM lowers it to whatever the CPU has).
`positions_scalar` is the plain scan the vector form is tested against (iq2_xxs._best_neighbour's).
"""

from __future__ import annotations

import numpy as np
import numba as nb
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba.extending import intrinsic, register_jitable

CHUNK = 16  # candidates per vector
PAD_TERM = 24  # term slot holding +inf: what a padding candidate adds
FLT_MAX = 3.4028234663852886e38


def _has_avx512f() -> bool:
    try:
        feats = llvm_binding.get_host_cpu_features()
        return bool(feats.get("avx512f", False))
    except Exception:  # features unknown: take the portable form
        return False


HAS_AVX512F = _has_avx512f()


def vector_tables(nb_start: np.ndarray, nb_count: np.ndarray, nb_terms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Transposed neighbour lists: (chunk0 int32 [MAP_SIZE], vterms uint8 [chunks * 8 * CHUNK]).

    The list of code u covers chunks chunk0[u] .. chunk0[u] + ceil(count/16) - 1; byte
    vterms[128*chunk + 64*(i // 4) + 4*lane + i % 4] is the term slot (3i + level_i) of candidate
    16*(chunk - chunk0[u]) + lane in dimension i, or PAD_TERM past the end of the list.
    """
    nchunks = (nb_count + CHUNK - 1) // CHUNK
    chunk0 = np.zeros_like(nb_count, dtype=np.int32)
    chunk0[1:] = np.cumsum(nchunks)[:-1]
    total = int(nchunks.sum())
    vt = np.full((total, 8, CHUNK), PAD_TERM, dtype=np.uint8)
    terms = nb_terms.reshape(-1, 8)
    for u in np.nonzero(nb_count)[0]:
        n = int(nb_count[u])
        s = int(nb_start[u])
        blk = np.full((int(nchunks[u]) * CHUNK, 8), PAD_TERM, dtype=np.uint8)
        blk[:n] = terms[s : s + n]
        vt[chunk0[u] : chunk0[u] + nchunks[u]] = blk.reshape(-1, CHUNK, 8).transpose(0, 2, 1)
    # [chunk][i][lane] -> [chunk][half][lane][i % 4]: dimensions 4h..4h+3 of a lane in one 32-bit word
    vt = vt.reshape(total, 2, 4, CHUNK).transpose(0, 1, 3, 2)
    return chunk0, np.ascontiguousarray(vt).reshape(-1)


# ---------------------------------------------------------------- the vector search (LLVM IR)

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_V16F = ir.VectorType(_F32, CHUNK)
_V16I = ir.VectorType(_I32, CHUNK)
_V16B = ir.VectorType(ir.IntType(8), CHUNK)
_V8F = ir.VectorType(_F32, 8)


def _const_i32(values):
    return ir.Constant(ir.VectorType(_I32, len(values)), list(values))


def _emit_term_tables(builder, x_ptr, w_ptr, scale):
    """The 32 term slots in two 16-lane registers: slot k < 24 is (w_i*diff)*diff with i = k // 3,
    diff = scale*(2*(k % 3) + 1) - x_i; slots 24..31 are +inf."""
    x8 = builder.load(builder.bitcast(x_ptr, _V8F.as_pointer()), align=4)
    w8 = builder.load(builder.bitcast(w_ptr, _V8F.as_pointer()), align=4)
    sv = builder.insert_element(ir.Constant(_V16F, None), scale, ir.Constant(_I32, 0))
    sv = builder.shuffle_vector(sv, sv, _const_i32([0] * CHUNK))
    halves = []
    for half in range(2):
        slots = range(CHUNK * half, CHUNK * half + CHUNK)
        dim = [min(k // 3, 7) for k in slots]
        xv = builder.shuffle_vector(x8, x8, _const_i32(dim))
        wv = builder.shuffle_vector(w8, w8, _const_i32(dim))
        q = ir.Constant(_V16F, [float(2 * (k % 3) + 1) for k in slots])
        diff = builder.fsub(builder.fmul(sv, q), xv)
        t = builder.fmul(builder.fmul(wv, diff), diff)
        if half == 1:
            live = ir.Constant(ir.VectorType(ir.IntType(1), CHUNK), [k < PAD_TERM for k in slots])
            t = builder.select(live, t, ir.Constant(_V16F, [float("inf")] * CHUNK))
        halves.append(t)
    return halves


def _emit_lookup(builder, lo, hi, idx):
    """Per lane: slot idx of the 32-slot table (lo = slots 0..15, hi = 16..31), AVX-512 vpermi2ps."""
    fnty = ir.FunctionType(_V16F, [_V16F, _V16I, _V16F])
    fn = builder.module.declare_intrinsic("llvm.x86.avx512.vpermi2var.ps.512", fnty=fnty)
    return builder.call(fn, [lo, idx, hi])  # reads bits 0..4 of each index: the slot


def _emit_lookup_select(builder, lo, hi, idx, i):
    """Portable form of the lookup for dimension i: the three slots 3i + l by selects, else +inf."""
    idx8 = builder.trunc(idx, _V16B)
    out = ir.Constant(_V16F, [float("inf")] * CHUNK)
    for lv in range(3):
        k = 3 * i + lv
        src = lo if k < CHUNK else hi
        lane = k % CHUNK
        val = builder.shuffle_vector(src, src, _const_i32([lane] * CHUNK))
        hit = builder.icmp_unsigned("==", idx8, ir.Constant(_V16B, [k] * CHUNK))
        out = builder.select(hit, val, out)
    return out


def _broadcast(builder, value, vec_ty):
    v = builder.insert_element(ir.Constant(vec_ty, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vec_ty, None), _const_i32([0] * CHUNK))


def _emit_searches(builder, vt_ptr, searches, avx512):
    """IR for one or more independent searches, each (chunk0, nchunks, x_ptr, w_ptr, scale) with i64
    chunk0/nchunks: returns each one's position of the first minimum (i64; 0 when no score is
    < FLT_MAX). The searches share one chunk loop (their chains interleave); a search whose list is
    shorter re-scores its last chunk, which cannot displace anything (a winner must be strictly less)."""
    from numba.core import cgutils

    state = []
    n_max = None
    for chunk0, nchunks, x_ptr, w_ptr, scale in searches:
        lo, hi = _emit_term_tables(builder, x_ptr, w_ptr, scale)
        best_v = cgutils.alloca_once_value(builder, ir.Constant(_V16F, [FLT_MAX] * CHUNK))
        best_c = cgutils.alloca_once_value(builder, ir.Constant(_V16I, [0] * CHUNK))
        state.append((chunk0, nchunks, lo, hi, best_v, best_c))
        n_max = nchunks if n_max is None else builder.select(builder.icmp_signed(">", nchunks, n_max), nchunks, n_max)
    with cgutils.for_range(builder, n_max) as loop:
        j = loop.index
        for chunk0, nchunks, lo, hi, best_v, best_c in state:
            last = builder.sub(nchunks, ir.Constant(_I64, 1))
            js = builder.select(builder.icmp_signed("<", j, nchunks), j, last)
            base = builder.mul(builder.add(chunk0, js), ir.Constant(_I64, 8 * CHUNK))
            words = [builder.load(builder.bitcast(builder.gep(vt_ptr, [builder.add(base, ir.Constant(_I64, 4 * CHUNK * h))]),
                                                  _V16I.as_pointer()), align=1) for h in range(2)]
            acc = None
            for i in range(8):
                idx = words[i // 4]
                if i % 4:
                    idx = builder.lshr(idx, ir.Constant(_V16I, [8 * (i % 4)] * CHUNK))
                t = _emit_lookup(builder, lo, hi, idx) if avx512 else _emit_lookup_select(builder, lo, hi, idx, i)
                # ggml starts from 0 + t0: that is t0 up to the sign of a zero, which no later sum
                # or comparison can tell apart (x + 0 == x + -0 for x != 0; zeros compare equal)
                acc = t if acc is None else builder.fadd(acc, t)
            bv = builder.load(best_v)
            lt = builder.fcmp_ordered("<", acc, bv)
            builder.store(builder.select(lt, acc, bv), best_v)
            builder.store(builder.select(lt, _broadcast(builder, builder.trunc(js, _I32), _V16I), builder.load(best_c)), best_c)
    # first minimum = smallest (score, position) key: scores are +0 .. FLT_MAX here (a NaN is never
    # stored, + 0.0 turns -0 into +0), so their bits order like the values; lanes that never won
    # keep (FLT_MAX, their position), and when none won the smallest key is position 0.
    v16q = ir.VectorType(_I64, CHUNK)
    umin = builder.module.declare_intrinsic("llvm.vector.reduce.umin.v16i64", fnty=ir.FunctionType(_I64, [v16q]))
    out = []
    for _, _, _, _, best_v, best_c in state:
        bv = builder.fadd(builder.load(best_v), ir.Constant(_V16F, [0.0] * CHUNK))
        pos = builder.add(builder.mul(builder.load(best_c), ir.Constant(_V16I, [CHUNK] * CHUNK)),
                          ir.Constant(_V16I, list(range(CHUNK))))
        key = builder.or_(builder.shl(builder.zext(builder.bitcast(bv, _V16I), v16q), ir.Constant(v16q, [32] * CHUNK)),
                          builder.zext(pos, v16q))
        out.append(builder.and_(builder.call(umin, [key]), ir.Constant(_I64, 0xFFFFFFFF)))
    return out


def _arrays_ok(vterms, x, w, ints):
    return (isinstance(vterms, nb.types.Array) and vterms.dtype == nb.types.uint8 and vterms.layout == "C"
            and all(isinstance(a, nb.types.Array) and a.dtype == nb.types.float32 and a.ndim == 1
                    and a.layout == "C" for a in (x, w))
            and all(isinstance(a, nb.types.Integer) for a in ints))


def _search_intrinsic(avx512: bool):
    @intrinsic
    def _search(typingctx, vterms, chunk0, nchunks, x, w, o, scale):
        """Position of the first minimum of one search (see `best_position`)."""
        if not _arrays_ok(vterms, x, w, (chunk0, nchunks, o)):
            return None
        sig = nb.types.int64(vterms, chunk0, nchunks, x, w, o, nb.types.float32)

        def codegen(context, builder, signature, args):
            vt, x_data, w_data = (context.make_array(signature.args[a])(context, builder, args[a]).data for a in (0, 3, 4))
            o64 = _i64(builder, args[5])
            search = (_i64(builder, args[1]), _i64(builder, args[2]), builder.gep(x_data, [o64]),
                      builder.gep(w_data, [o64]), args[6])
            return _emit_searches(builder, vt, [search], avx512)[0]

        return sig, codegen

    @intrinsic
    def _search2(typingctx, vterms, x, w, c0a, na, oa, sa, c0b, nb_, ob, sb):
        """Two searches at once (see `best_positions2`): position a | position b << 32."""
        if not _arrays_ok(vterms, x, w, (c0a, na, oa, c0b, nb_, ob)):
            return None
        sig = nb.types.int64(vterms, x, w, c0a, na, oa, nb.types.float32, c0b, nb_, ob, nb.types.float32)

        def codegen(context, builder, signature, args):
            vt, x_data, w_data = (context.make_array(signature.args[a])(context, builder, args[a]).data for a in (0, 1, 2))
            searches = []
            for c0, n, o, s in (args[3:7], args[7:11]):
                o64 = _i64(builder, o)
                searches.append((_i64(builder, c0), _i64(builder, n), builder.gep(x_data, [o64]),
                                 builder.gep(w_data, [o64]), s))
            a, b = _emit_searches(builder, vt, searches, avx512)
            return builder.or_(a, builder.shl(b, ir.Constant(_I64, 32)))

        return sig, codegen

    return _search, _search2


def _i64(builder, v):
    return v if v.type.width == 64 else builder.sext(v, _I64)


_search_avx512, _search2_avx512 = _search_intrinsic(True)
_search_portable, _search2_portable = _search_intrinsic(False)
_search, _search2 = (_search_avx512, _search2_avx512) if HAS_AVX512F else (_search_portable, _search2_portable)


@register_jitable(inline="always")
def best_position(vterms, chunk0, count, x, w, o, scale):
    """Position in its list of the neighbour closest to x[o:o+8] (weights w[o:o+8]) at `scale`;
    chunk0 / count: the list's first chunk and length. numba only."""
    return _search(vterms, chunk0, (count + CHUNK - 1) // CHUNK, x, w, o, scale)


@register_jitable(inline="always")
def best_positions2(vterms, x, w, c0a, count_a, oa, sa, c0b, count_b, ob, sb):
    """`best_position` of two searches in one pass: (position a, position b). numba only."""
    r = _search2(vterms, x, w, c0a, (count_a + CHUNK - 1) // CHUNK, oa, sa, c0b, (count_b + CHUNK - 1) // CHUNK, ob, sb)
    return r & 0xFFFFFFFF, r >> 32


@nb.njit(cache=True)
def positions_vector(vterms, chunk0, count, x, w, o, scale, out, portable):
    """out[j] = best_position for the j-th search of the arrays (test entry point); searches go in
    pairs (`best_positions2`) except odd ones out (every third, and a last odd one)."""
    j = 0
    n = out.shape[0]
    while j < n:
        if j % 3 == 2 or j + 1 == n:
            c = (count[j] + CHUNK - 1) // CHUNK
            if portable:
                out[j] = _search_portable(vterms, chunk0[j], c, x, w, o[j], scale[j])
            else:
                out[j] = _search(vterms, chunk0[j], c, x, w, o[j], scale[j])
            j += 1
        else:
            ca = (count[j] + CHUNK - 1) // CHUNK
            cb = (count[j + 1] + CHUNK - 1) // CHUNK
            if portable:
                r = _search2_portable(vterms, x, w, chunk0[j], ca, o[j], scale[j], chunk0[j + 1], cb, o[j + 1], scale[j + 1])
            else:
                r = _search2(vterms, x, w, chunk0[j], ca, o[j], scale[j], chunk0[j + 1], cb, o[j + 1], scale[j + 1])
            out[j] = r & 0xFFFFFFFF
            out[j + 1] = r >> 32
            j += 2


@nb.njit(cache=True, error_model="numpy")
def positions_scalar(nb_start, count, nb_terms, x, w, o, scale, out):
    """The scalar scan (ggml's order, first minimum wins) for the same searches."""
    T = np.zeros(24, dtype=np.float32)
    for j in range(out.shape[0]):
        for i in range(8):
            xi = x[o[j] + i]
            wi = w[o[j] + i]
            for lv in range(3):
                diff = scale[j] * np.float32(2 * lv + 1) - xi
                T[3 * i + lv] = wi * diff * diff
        best = np.float32(FLT_MAX)
        best_c = 0
        for c in range(count[j]):
            e = 8 * (nb_start[j] + c)
            acc = np.float32(0.0)
            for i in range(8):
                acc += T[nb_terms[e + i]]
            if acc < best:
                best = acc
                best_c = c
        out[j] = best_c
