"""Prefill of the CUDA engine's Session (dynamic shapes, any chunk length T): attention over each query's
own keys, the compressors' frontiers, the indexer's top-k per query. Split from session.py, whose methods
these functions use (`ses` is the Session); the decode step (static shapes, graph-captured) stays there.

Queries run in blocks: the gathered top-k keys ([t, k, d] float32) and the score tensors grow with the
block, while every block costs a fixed ~20 torch launches of host time. A block is as many queries as fit
a byte budget (DS4_GPU_ATTN_MIB, default 2048 MiB for the largest per-block tensors), or exactly
DS4_GPU_ATTN_BLOCK queries where that is set (an A/B switch; 512 was the fixed size before).
`section` names the phases for the profiler (bench_session --gaps), at ~1 us of host time each.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from ds4.engine.session import SessionError
from ds4.gguf_tools import constants as C

from . import tc

L = C.LayerTensor
F32 = torch.float32
ATTN_BLOCK = int(os.environ.get("DS4_GPU_ATTN_BLOCK", "0"))  # queries per block; 0: from the byte budget
ATTN_BYTES = int(float(os.environ.get("DS4_GPU_ATTN_MIB", "2048")) * 2**20)
# DS4_GPU_PREFILL_ATTN (tc.py): f32 (default) / tf32 / tc torch products per query block, or fused: the attention of
# a whole chunk in one kernel (attn_prefill.cu; three TF32 passes; v10: on par with f32, 2706 against 2727 t/s)
FUSED_ATTN = tc.ATTN_MODE == "fused"
# DS4_GPU_INDEX_PREFILL: `fused` (default where the indexer QAT is on): the indexer's scores of a chunk in one kernel on
# the bfloat16 tensor cores (indexer.cu; exact: the QAT'd values fit bfloat16) and its top-k per query in one launch
# (topk.cu); `torch`: float32 dots [t, heads, n] per query block, then a stable sort.
# DS4_GPU_ATTN_EXACT_KEYS (default 1 since v13: 3194 -> 3243 t/s at 8192 tokens): with the FP8 KV simulation on, the
# fused attention skips the keys' TF32 lo part on their FP8-rounded columns (zero there: the same bits, fewer products)
ATTN_EXACT_KEYS = os.environ.get("DS4_GPU_ATTN_EXACT_KEYS", "1") != "0"
# DS4_GPU_ATTN_OUT_ROPE (default 1 since v13): the fused attention undoes the output's RoPE tail in its epilogue (the
# bits of norm_rope's inverse pass, which is then skipped: one pass over [T, H, d] less)
ATTN_OUT_ROPE = os.environ.get("DS4_GPU_ATTN_OUT_ROPE", "1") != "0"
# DS4_GPU_ATTN_PACKED=1 (prepared in v13, off until measured): with exact keys, the fused attention reads packed key
# rows (the FP8-simulated columns as bfloat16, exact; the rest float32: 1152 instead of 2048 bytes per Flash row), so
# the 32-head form gets two key buffers at two CTAs per SM; the same bits.
ATTN_PACKED = os.environ.get("DS4_GPU_ATTN_PACKED", "0") == "1"
# fused prefill attention: the queries' RMS norm, RoPE and q_b rescale applied as the kernel stages them (v15: the same
# bits as norm_rope's pass over [T, H, d], which it replaces); 0: the v14 norm_rope pass
ATTN_Q_POST = os.environ.get("DS4_GPU_ATTN_Q_POST", "1") != "0"
# fused prefill attention (with the output's inverse RoPE in its epilogue): the output written as the o_a GEMM's
# float16 split, one scale per query and output group (v15), so no split pass over [T, H, d]; 0: float32 output
ATTN_OUT_SPLIT = os.environ.get("DS4_GPU_ATTN_OUT_SPLIT", "1") != "0"
# v26: where o_a's product runs the float8 corrections, the attention writes their float8 operand in place of the
# split's lo part (one pack pass over [T, H d] less per layer); 0: lo, packed by the product (A/B)
ATTN_OUT_FP8 = os.environ.get("DS4_GPU_ATTN_OUT_FP8", "1") != "0"
# DS4_GPU_COMP_POOL (v31, default 1): the compressors' pooling of a chunk's finished windows in one kernel
# (compress_prefill.cu) from the GEMMs' unscaled products and the frontier; 0: the torch form (rescale, APE add, the
# candidates' concatenations, softmax, multiply, sum). Not the torch softmax's bits (the decode step's expressions)
COMP_POOL = os.environ.get("DS4_GPU_COMP_POOL", "1") != "0"
INDEX_MODES = ("fused", "torch")
INDEX_MODE = os.environ.get("DS4_GPU_INDEX_PREFILL", "fused").strip().lower() or "fused"
if INDEX_MODE not in INDEX_MODES:
    raise ValueError(f"DS4_GPU_INDEX_PREFILL={INDEX_MODE!r}: unknown mode (known: {', '.join(INDEX_MODES)})")


def section(name: str, on: bool = True):
    """A profiler label for a prefill phase (nothing where on is False: the decode step)."""
    return torch.profiler.record_function(name) if on else contextlib.nullcontext()


def block_rows(per_query_bytes: int) -> int:
    """Queries per block: ATTN_BLOCK where set, else what fits ATTN_BYTES (a multiple of 64, at least 64)."""
    if ATTN_BLOCK > 0:
        return ATTN_BLOCK
    return max(64, ATTN_BYTES // max(1, per_query_bytes) // 64 * 64)


def attn_chunk(ses, li, a, c, pos0, kv_lin):
    """Each query reads only its own keys: the raw window (a sliding view of ring + chunk) and the
    compressed rows it may see (all of them, or the indexer's top-k gathered per query)."""
    cfg, st = ses.cfg, ses.layers[li]
    T = a.shape[0]
    r = cfg.ratio(li)
    pos = torch.arange(pos0, pos0 + T, device=ses.device)
    fused_attn = FUSED_ATTN and ses.K is not None and not ses.tc_attn
    defer_q = fused_attn and ATTN_Q_POST and ses.K.ext.prefill_attn_takes(ses.cfg.n_head, ses.cfg.head_dim)
    with section("qkv"):
        q, kv, cos, sin, q_post = ses._qkv(li, a, c, pos, kv_lin, defer_q=defer_q)
    Wn, cap = ses.raw_window, ses.raw_cap
    old = torch.arange(max(0, pos0 - Wn + 1), pos0, device=ses.device)
    pad = torch.zeros((Wn - 1 - len(old), kv.shape[1]), dtype=F32, device=ses.device)
    win_keys = torch.cat([pad, st["raw"][old % cap], kv])  # row j is position pos0 - (Wn - 1) + j
    keep = pos[-min(T, cap):]
    st["raw"][keep % cap] = kv[T - len(keep):]
    on = ses.tc_attn
    win = tc.each(tc.maybe_split(win_keys, on), lambda v: v.unfold(0, Wn, 1))  # [T, d, Wn], oldest key first
    win_valid = (pos[:, None] - (Wn - 1) + torch.arange(Wn, device=ses.device)[None, :]) >= 0
    comp = sel = comp_valid = None
    n_comp = 0
    if r:
        with section("compress"):
            n_comp = compress_chunk(ses, li, a, pos0, indexer=False)
            if r == 4:
                compress_chunk(ses, li, a, pos0, indexer=True)
        n_vis = (pos + 1) // r
        comp = st["comp"][:n_comp]
        K = cfg.indexer_top_k
        if r == 4 and n_comp > K:  # per-query rows: the top-k where more than k are visible
            with section("indexer"):
                sel = indexer_select_chunk(ses, li, a, c, pos0, pos, n_comp, n_vis)
            comp_valid = sel < n_vis[:, None]
        else:
            comp_valid = torch.arange(n_comp, device=ses.device)[None, :] < n_vis[:, None]
    if fused_attn:
        with section("attend"):
            exact = cfg.n_nope if (ATTN_EXACT_KEYS and cfg.fp8_kv) else 0
            inv = (ses._freq[r != 0], cfg.rope_dim) if ATTN_OUT_ROPE else None
            hpg = cfg.n_head // cfg.o_groups
            split = hpg if (ATTN_OUT_SPLIT and inv is not None and 16 % hpg == 0
                            and ses.W.takes_split(C.blk(li, L.ATTN_OUTPUT_A), T)) else 0
            split_fp8 = split > 0 and ATTN_OUT_FP8 and ses.W.takes_fp8(C.blk(li, L.ATTN_OUTPUT_A), T, cfg.o_groups)
            o = ses.K.prefill_attn(q, win_keys, comp, sel, ses.W.vec(C.blk(li, L.ATTN_SINKS)), pos0, r, exact, inv,
                                   packed=ATTN_PACKED, q_post=q_post, split_heads=split, split_fp8=split_fp8)
        if o is not None:
            with section("attn_out"):
                return ses._attn_out(li, o, cos, sin, pos, rope_done=inv is not None)
    if q_post is not None:  # the fused kernel declined after all: finish the queries here
        q = ses.K.norm_rope(q.reshape(T, -1), q.shape[-1], q.shape[1], pos, **q_post).reshape(q.shape)
    comp = None if comp is None else tc.maybe_split(comp, on)
    o = torch.empty_like(q)
    H, d = q.shape[1], q.shape[2]
    n_keys = Wn + (sel.shape[1] if sel is not None else n_comp) + 1
    # per query: scores, their concatenation and softmax (float32), and the gathered top-k keys
    step = block_rows(H * n_keys * 4 * 3 + (sel.shape[1] * d * 4 * (2 if on else 1) if sel is not None else 0))
    with section("attend"), tc.tf32_products(ses.tf32_attn):
        for t0 in range(0, T, step):
            b = slice(t0, min(T, t0 + step))
            res = attend_rows(ses, li, q[b], tc.each(win, lambda v: v[b]), win_valid[b], comp,
                              None if sel is None else sel[b], None if comp is None else comp_valid[b],
                              out=None if on else o[b])
            if on:
                o[b] = res
    with section("attn_out"):
        return ses._attn_out(li, o, cos, sin, pos)


def attend_rows(ses, li, q, win, win_valid, comp, sel, comp_valid, out=None):
    """Softmax with sink over a query block's window keys [t, d, Wn] and compressed keys (all n rows
    of comp, or the rows sel [t, k] of it). The sink is one more score column, so the softmax is one
    fused torch op (the explicit max/exp/sum/divide chain was most of prefill's elementwise time).
    win and comp are float32, or tc.Splits for the products on tensor cores. out (float32 operands): the [t, H, d]
    result is written there, the compressed rows' product accumulated in its GEMM (no sum pass, no copy)."""
    t, H, d = q.shape
    on = isinstance(win, tc.Split)
    sinks = ses.W.vec(C.blk(li, L.ATTN_SINKS))
    qs = tc.maybe_split(q * (1.0 / math.sqrt(d)), on)
    s = tc.mm(qs, win).masked_fill_(~win_valid[:, None, :], -math.inf)
    parts, kc = [s], None
    if comp is not None:
        if sel is not None:
            kc = tc.each(comp, lambda v: v[sel])  # [t, k, d]
            sc = tc.mm(qs, tc.t(kc))
        else:
            sc = tc.mm(tc.each(qs, lambda v: v.reshape(t * H, d)), tc.t(comp)).reshape(t, H, -1)
        parts.append(sc.masked_fill_(~comp_valid[:, None, :], -math.inf))
    parts.append(sinks[None, :, None].expand(t, H, 1))
    p = tc.maybe_split(torch.softmax(torch.cat(parts, dim=-1), dim=-1), on)
    Wn = win_valid.shape[-1]
    if out is not None and not on:
        torch.matmul(p[..., :Wn], win.transpose(-1, -2), out=out)
        if comp is not None:
            pc = p[..., Wn:-1]
            if kc is not None:
                out.baddbmm_(pc, kc)
            else:
                out.view(t * H, d).addmm_(pc.reshape(t * H, -1), comp)
        return out
    o = tc.mm(tc.each(p, lambda v: v[..., :Wn]), tc.t(win))
    if comp is not None:
        pc = tc.each(p, lambda v: v[..., Wn:-1])
        if kc is not None:
            o += tc.mm(pc, kc)
        else:
            o += tc.mm(tc.each(pc, lambda v: v.reshape(t * H, -1)), comp).reshape(t, H, d)
    return o


def indexer_select_chunk(ses, li, a, c, pos0, pos, n, n_vis):
    """[T, k] compressed rows per query in ascending order (the order in which the CPU engine and decode attend
    them): the indexer's top-k (ties to the lower row) where more than k rows are visible, else rows 0..k-1 (the
    caller masks rows >= n_vis)."""
    cfg, st = ses.cfg, ses.layers[li]
    K = cfg.indexer_top_k
    T = len(pos)
    sel = torch.arange(K, device=ses.device).expand(T, K).clone()
    # n_vis = (pos + 1) // 4 grows with pos: the queries with more than k visible rows are a suffix,
    # found from the chunk's first position on the host (no device sync)
    first = min(T, max(0, 4 * (K + 1) - 1 - pos0))
    ids = torch.arange(n, device=ses.device)
    on = ses.tc_attn
    keys = tc.t(tc.maybe_split(st["idx"][:n], on))
    Hi = cfg.indexer_heads
    step = block_rows(Hi * n * 4 * 2 + n * 4 * 4)  # dots and their clamp; scores, sort values and indices
    if first < T:  # the indexer's queries of all those rows: two GEMMs (each dequantizes its weight once)
        q_all, w_all = ses._index_q(li, a[first:], c[first:], pos[first:])
        if INDEX_MODE == "fused" and ses.K is not None and cfg.indexer_qat:
            if select_fused(ses.K, q_all, w_all, st["idx"][:n], n_vis[first:], K, sel[first:]):
                return sel
    for i in range(first, T, step):
        rb = slice(i, min(T, i + step))
        q, w = q_all[i - first:rb.stop - first], w_all[i - first:rb.stop - first]
        t, Hi, di = q.shape
        with tc.tf32_products(ses.tf32_attn):
            dots = tc.mm(tc.maybe_split(q.reshape(t * Hi, di), on), keys).reshape(t, Hi, n)
        scores = torch.einsum("th,thc->tc", w, torch.clamp(dots, min=0.0))
        scores = torch.where(ids[None, :] < n_vis[rb, None], scores, -math.inf)
        top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :K]
        sel[rb] = torch.sort(top, dim=-1).values
    return sel


def select_fused(K, q, w, keys, n_vis, k: int, out) -> bool:
    """The indexer's top-k rows of each query into out [t, k] (ascending): indexer.cu's scores and one top-k launch per
    block of queries, a block's [t, n] float32 scores within the DS4_GPU_ATTN_MIB budget (long contexts: n grows with
    them). False, nothing written, where the kernel does not take the shapes."""
    step = block_rows(keys.shape[0] * 4)
    for i in range(0, q.shape[0], step):
        b = slice(i, i + step)
        scores = K.index_scores(q[b], w[b], keys, n_vis[b])
        if scores is None:
            return False
        out[b] = K.topk_rows(scores, k)
    return True


def compress_chunk(ses, li, a, pos0, indexer: bool) -> int:
    """Stream T tokens into a compressor frontier; append finished rows; return the row count."""
    st, r = ses.layers[li], ses.cfg.ratio(li)
    if indexer:
        r = 4
    width = st["idx_kv" if indexer else "comp_kv"].shape[1]
    if COMP_POOL and ses.K is not None and ses.K.ext.comp_pool_takes(r, width):
        return compress_chunk_pooled(ses, li, a, pos0, indexer, r)
    T = a.shape[0]
    pos = torch.arange(pos0, pos0 + T, device=ses.device)
    kv, sc = ses._comp_inputs(li, a, pos, indexer)
    s_kv, s_sc, rows = (st["idx_kv"], st["idx_score"], st["idx"]) if indexer else \
        (st["comp_kv"], st["comp_score"], st["comp"])
    width = kv.shape[1]
    d = width // 2 if r == 4 else width
    off = pos0 % r
    n_rows = pos0 // r
    live = slice(r, r + off) if r == 4 else slice(0, off)
    seq_kv, seq_sc = torch.cat([s_kv[live], kv]), torch.cat([s_sc[live], sc])
    n_full = (off + T) // r
    rem = off + T - n_full * r
    if n_full:
        win_kv = seq_kv[:n_full * r].reshape(n_full, r, width)
        win_sc = seq_sc[:n_full * r].reshape(n_full, r, width)
        if r == 4:
            prev_kv = torch.cat([s_kv[None, :4, :d], win_kv[:-1, :, :d]])
            prev_sc = torch.cat([s_sc[None, :4, :d], win_sc[:-1, :, :d]])
            cand_kv = torch.cat([prev_kv, win_kv[:, :, d:]], dim=1)
            cand_sc = torch.cat([prev_sc, win_sc[:, :, d:]], dim=1)
        else:
            cand_kv, cand_sc = win_kv, win_sc
        pooled = (cand_kv * torch.softmax(cand_sc, dim=1)).sum(dim=1)
        if n_rows + n_full > rows.shape[0] - 1:
            raise SessionError("compressed rows exceed the context the session was built for")
        row_pos = (n_rows + torch.arange(n_full, device=ses.device)) * r
        rows[n_rows:n_rows + n_full] = ses._finish_rows(li, pooled, row_pos, indexer)
    new_kv, new_sc = torch.zeros_like(s_kv), torch.full_like(s_sc, -math.inf)
    if r == 4:
        if n_full:
            new_kv[:4], new_sc[:4] = win_kv[-1], win_sc[-1]
        else:
            new_kv[:4], new_sc[:4] = s_kv[:4], s_sc[:4]
        new_kv[4:4 + rem], new_sc[4:4 + rem] = seq_kv[n_full * 4:], seq_sc[n_full * 4:]
    else:
        new_kv[:rem], new_sc[:rem] = seq_kv[n_full * r:], seq_sc[n_full * r:]
    s_kv.copy_(new_kv)
    s_sc.copy_(new_sc)
    return n_rows + n_full



def compress_chunk_pooled(ses, li, a, pos0, indexer: bool, r: int) -> int:
    """compress_chunk with the finished windows pooled by one kernel (Fused.comp_pool_chunk) from the products as the
    GEMMs leave them (unscaled where the hi/lo path leaves the rescale over) and the frontier: no [T, width] rescale,
    APE add or concatenation. The rows kept in the frontier get the torch form's values (the same elementwise ops on
    the few rows kept), so the frontier's bits are the same."""
    st, W = ses.layers[li], ses.W
    names = (L.IDX_COMP_KV, L.IDX_COMP_GATE, L.IDX_COMP_APE) if indexer else (L.COMP_KV, L.COMP_GATE, L.COMP_APE)
    kv, kv_r = W.mm_unscaled(C.blk(li, names[0]), a)
    sc, sc_r = W.mm_unscaled(C.blk(li, names[1]), a)
    ape = W.vec(C.blk(li, names[2]))
    s_kv, s_sc, rows = (st["idx_kv"], st["idx_score"], st["idx"]) if indexer else \
        (st["comp_kv"], st["comp_score"], st["comp"])
    T, width = kv.shape
    off, n_rows = pos0 % r, pos0 // r
    live0 = r if r == 4 else 0
    n_full = (off + T) // r

    def seq(k0: int, k1: int):
        """Sequence rows [k0, k1) (row k: position pos0 - off + k) as the torch form's seq_kv, seq_sc hold them."""
        if k1 <= k0:
            return s_kv[:0], s_sc[:0]
        parts_kv, parts_sc = [], []
        if k0 < off:
            parts_kv.append(s_kv[live0 + k0:live0 + min(k1, off)])
            parts_sc.append(s_sc[live0 + k0:live0 + min(k1, off)])
        if k1 > off:
            t0, t1 = max(k0, off) - off, k1 - off
            pk, ps = kv[t0:t1], sc[t0:t1]
            pk = pk if kv_r is None else pk * kv_r[t0:t1]
            ps = ps if sc_r is None else ps * sc_r[t0:t1]
            phase = torch.arange(pos0 - off + max(k0, off), pos0 - off + k1, device=ses.device) % r
            parts_kv.append(pk)
            parts_sc.append(ps + ape[phase])
        one = len(parts_kv) == 1
        return (parts_kv[0], parts_sc[0]) if one else (torch.cat(parts_kv), torch.cat(parts_sc))

    if n_full:
        if n_rows + n_full > rows.shape[0] - 1:
            raise SessionError("compressed rows exceed the context the session was built for")
        pooled = ses.K.comp_pool_chunk(kv, kv_r, sc, sc_r, ape, s_kv, s_sc, r, off, live0, n_full)
        row_pos = (n_rows + torch.arange(n_full, device=ses.device)) * r
        rows[n_rows:n_rows + n_full] = ses._finish_rows(li, pooled, row_pos, indexer)
    rem = off + T - n_full * r
    new_kv, new_sc = torch.zeros_like(s_kv), torch.full_like(s_sc, -math.inf)
    tail_kv, tail_sc = seq(n_full * r, off + T)
    if r == 4:
        if n_full:
            new_kv[:4], new_sc[:4] = seq(4 * (n_full - 1), 4 * n_full)
        else:
            new_kv[:4], new_sc[:4] = s_kv[:4], s_sc[:4]
        new_kv[4:4 + rem], new_sc[4:4 + rem] = tail_kv, tail_sc
    else:
        new_kv[:rem], new_sc[:rem] = tail_kv, tail_sc
    s_kv.copy_(new_kv)
    s_sc.copy_(new_sc)
    return n_rows + n_full
