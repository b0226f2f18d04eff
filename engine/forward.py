"""The DeepSeek V4 forward pass (model-spec §3-4), written section by section in numpy.

One entry point, `forward_chunk`, runs T consecutive tokens through the model layer-major and
updates the KV state in place; a decode step is a chunk of one token and a prefill is a chunk of
many, so both take the same code and the same per-token math:

    X = embed(token) on all n_hc streams
    for each layer:  u = HCpre_attn(X);  X = HCpost_attn(X, Attn(RMSNorm(u)))
                     v = HCpre_ffn(X);   X = HCpost_ffn(X, MoE(RMSNorm(v)))
    logits = output · RMSNorm(HChead(X))

Per query position p the attention sees raw rows p−W+1..p (W = sliding window) plus the compressed
rows i < floor((p+1)/r) of its layer; on ratio-4 layers the Lightning indexer narrows those to its
top-k once there are more than top-k of them. Compressed rows are pooled by a streaming compressor
whose frontier lives in the state, so any chunking gives the same rows.

The hot loops (weight products, compressor scan, indexer scores, attention with sink) have numba
versions in `ds4.engine.kernels`, held to the `*_ref` functions here by tests; `impl="ref"` runs
this file only. The numba path is batch-invariant: a token's logits are the same bits whether it
was decoded alone or prefilled in any chunking (see kernels.dense_matmul).

Numerics follow the official reference (model-spec §7): FP8 e4m3 rounding of the non-RoPE KV dims
(raw and compressed rows) and Hadamard + FP4 rounding of indexer q/keys, both on by default and
switched by `Config.fp8_kv` / `Config.indexer_qat` (off to compare with transformers, which lacks
them). Choices that differ from ds4 at the last-bit level only: raw rows are kept in f32 (ds4
rounds them to f16, the official code stores bf16); activations are not quantized before
Q8_0/K-quant products; softmaxes and norms accumulate in f32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ds4.engine.config import Config
from ds4.engine.hooks import Hooks
from ds4.engine.numerics import fp8_kv_round, indexer_qat, rms_norm, sigmoid, silu, softplus
from ds4.engine.rope import apply_tail, cos_sin, inv_freq
from ds4.gguf_tools import constants as C

F32 = np.float32
L = C.LayerTensor
_blk = lru_cache(maxsize=None)(C.blk)  # layer tensor names, built once (decode asks ~180 per token)
ROUTE_DENOM_MIN = 6.1035e-5  # ds4 clamps the routing-weight denominator here


# ---- state ---------------------------------------------------------------------------------------
@dataclass
class LayerState:
    """One layer's KV state (model-spec §4.1). Frontiers are kept canonical: rows not holding a
    live token are 0 (kv) / −inf (score), so a snapshot never depends on how tokens were chunked."""

    ratio: int
    raw: np.ndarray  # [raw_cap, d] ring; position p lives in row p % raw_cap
    comp: np.ndarray | None = None  # [comp_cap, d] compressed attention rows, append-only
    n_comp: int = 0
    comp_kv: np.ndarray | None = None  # frontier [coff·r, coff·d]
    comp_score: np.ndarray | None = None
    idx: np.ndarray | None = None  # [comp_cap, indexer_dim] indexer rows (ratio 4)
    n_idx: int = 0
    idx_kv: np.ndarray | None = None  # indexer frontier [8, 2·indexer_dim]
    idx_score: np.ndarray | None = None


def frontier_shape(ratio: int, width: int) -> tuple[int, int]:
    """(rows, cols) of a compressor frontier: 2r rows for the overlapping ratio 4, r rows otherwise."""
    return (2 * ratio, width) if ratio == 4 else (ratio, width)


def empty_frontier(ratio: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    shape = frontier_shape(ratio, width)
    return np.zeros(shape, F32), np.full(shape, -np.inf, F32)


@dataclass
class KVState:
    """The whole timeline's state for one model at a given context size."""

    cfg: Config
    ctx: int
    n_tokens: int = 0
    layers: list[LayerState] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.layers:
            self.reset()

    @property
    def raw_window(self) -> int:
        return min(self.cfg.sliding_window, self.ctx)

    @property
    def raw_cap(self) -> int:
        return self.raw_window

    @property
    def comp_cap(self) -> int:
        return self.ctx // 4 + 2

    def comp_rows(self, ratio: int) -> int:
        return self.ctx // ratio + 2

    def reset(self) -> None:
        cfg = self.cfg
        self.n_tokens = 0
        self.layers = []
        for i in range(cfg.n_layer):
            r = cfg.ratio(i)
            st = LayerState(ratio=r, raw=np.zeros((self.raw_cap, cfg.head_dim), F32))
            if r:
                st.comp = np.zeros((self.comp_rows(r), cfg.head_dim), F32)
                st.comp_kv, st.comp_score = empty_frontier(r, cfg.compressor_width(i))
            if r == 4:
                st.idx = np.zeros((self.comp_rows(4), cfg.indexer_dim), F32)
                st.idx_kv, st.idx_score = empty_frontier(4, 2 * cfg.indexer_dim)
            self.layers.append(st)

    def nbytes(self) -> int:
        total = 0
        for st in self.layers:
            for a in (st.raw, st.comp, st.comp_kv, st.comp_score, st.idx, st.idx_kv, st.idx_score):
                if a is not None:
                    total += a.nbytes
        return total


# ---- reference kernels (numba twins in kernels.py) -----------------------------------------------
def compressor_scan_ref(kv: np.ndarray, score: np.ndarray, pos0: int, ratio: int,
                        state_kv: np.ndarray, state_score: np.ndarray, out: np.ndarray) -> int:
    """Stream T tokens (kv, gate+ape; [T, width]) into a compressor frontier (model-spec §3.5).

    Every token whose window closes ((p+1) % ratio == 0) emits one pooled row (before norm/RoPE)
    into out[n]; returns the number n of rows emitted. Ratio 4 pools 8 candidates per channel: the
    A half [0, d) of the previous window (frontier rows 0..3) and the B half [d, 2d) of the current
    one (rows 4..7); ratio r > 4 pools its r rows. The softmax runs over candidates per channel.
    """
    width = kv.shape[1]
    d = width // 2 if ratio == 4 else width
    n = 0
    for t in range(kv.shape[0]):
        p = pos0 + t
        row = ratio + p % ratio if ratio == 4 else p % ratio
        state_kv[row] = kv[t]
        state_score[row] = score[t]
        if (p + 1) % ratio:
            continue
        if ratio == 4:
            cand_kv = np.concatenate([state_kv[:4, :d], state_kv[4:, d:]])
            cand_s = np.concatenate([state_score[:4, :d], state_score[4:, d:]])
        else:
            cand_kv, cand_s = state_kv, state_score
        e = np.exp(cand_s - cand_s.max(axis=0, keepdims=True))
        out[n] = np.sum(cand_kv * (e / e.sum(axis=0, keepdims=True)), axis=0)
        n += 1
        if ratio == 4:  # the finished window becomes the next row's A-half source
            state_kv[:4] = state_kv[4:]
            state_score[:4] = state_score[4:]
            state_kv[4:] = 0.0
            state_score[4:] = -np.inf
        else:
            state_kv[:] = 0.0
            state_score[:] = -np.inf
    return n


def indexer_scores_ref(q: np.ndarray, w: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """score[t, c] = Σ_h w[t, h] · ReLU(q[t, h] · keys[c])  (q [T, Hi, di], w [T, Hi], keys [N, di])."""
    dots = np.einsum("thd,cd->thc", q, keys)
    return np.einsum("th,thc->tc", w, np.maximum(dots, F32(0.0))).astype(F32)


def attend_ref(q: np.ndarray, keys: np.ndarray, mask: np.ndarray, sinks: np.ndarray, scale: float) -> np.ndarray:
    """Attention with a per-head sink in the denominator (model-spec §3.4 step 5), K = V.

    q [T, H, d], keys [N, d], mask [T, N] (True = visible), sinks [H] → o [T, H, d].
    """
    s = np.einsum("thd,nd->thn", q, keys) * F32(scale)
    s = np.where(mask[:, None, :], s, F32(-np.inf))
    m = np.maximum(s.max(axis=-1), sinks[None, :])
    e = np.exp(s - m[..., None])
    denom = e.sum(axis=-1) + np.exp(sinks[None, :] - m)
    return (np.einsum("thn,nd->thd", e / denom[..., None], keys)).astype(F32)


def topk_rows(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries per row; ties go to the lowest index (ds4's rule)."""
    return np.argsort(-scores, axis=-1, kind="stable")[..., :k]


class _RefKernels:
    """Plain numpy: the readable definition (BLAS matmuls are not batch-invariant; see kernels.dense_matmul)."""

    compressor_scan = staticmethod(compressor_scan_ref)
    indexer_scores = staticmethod(indexer_scores_ref)
    attend = staticmethod(attend_ref)
    rms_norm = staticmethod(rms_norm)
    fp8_kv_round = staticmethod(fp8_kv_round)
    apply_tail = staticmethod(apply_tail)
    indexer_qat = staticmethod(indexer_qat)

    @staticmethod
    def matmul(model, name, x):
        return (x @ model.w(name).T).astype(F32)

    @staticmethod
    def expert_matmul(model, name, e, x):
        return (x @ model.w(name)[e].T).astype(F32)

    @staticmethod
    def group_matmul(model, name, groups, x):
        w = model.w(name)
        return np.einsum("tgi,goi->tgo", x, w.reshape(groups, w.shape[0] // groups, w.shape[1])).astype(F32)

    @staticmethod
    def hc_block(model, X, fn_name, scale_name, base_name, norm_name):
        return hc_block_ref(model, _RefKernels, X, fn_name, scale_name, base_name, norm_name)

    hc_post = staticmethod(lambda X, y, post, comb: hc_post(X, y, post, comb))

    @staticmethod
    def moe(model, li, b, ids, w, limit, want_mid):
        return None  # the per-expert loop in numpy

    @staticmethod
    def swiglu(g, u, limit, scale_rows=None):
        h = _swiglu(g, u, limit)
        return h if scale_rows is None else h * scale_rows[:, None]


class _ReportingKernels:
    """Kernels that pass each 2-D layer projection's input to `hooks.linear_input` first. Only
    used when the hooks ask for it, so the plain path has no per-product check."""

    def __init__(self, kernels, hooks: Hooks):
        self._k = kernels
        self._hooks = hooks
        self.compressor_scan = kernels.compressor_scan
        self.indexer_scores = kernels.indexer_scores
        self.attend = kernels.attend
        self.expert_matmul = kernels.expert_matmul
        self.hc_post = kernels.hc_post
        self.swiglu = kernels.swiglu
        self.rms_norm = kernels.rms_norm
        self.fp8_kv_round = kernels.fp8_kv_round
        self.apply_tail = kernels.apply_tail
        self.indexer_qat = kernels.indexer_qat

    def _report(self, name: str, x: np.ndarray) -> None:
        if name.startswith("blk."):
            self._hooks.linear_input(int(name.split(".", 2)[1]), name, x)

    def matmul(self, model, name, x):
        self._report(name, x)
        return self._k.matmul(model, name, x)

    def group_matmul(self, model, name, groups, x):
        self._report(name, x.reshape(-1, x.shape[-1]))
        return self._k.group_matmul(model, name, groups, x)

    def hc_block(self, model, X, fn_name, scale_name, base_name, norm_name):
        if hasattr(self._k, "unit_rms"):
            self._report(fn_name, self._k.unit_rms(X.reshape(X.shape[0], -1), model.config.rms_eps))
            return self._k.hc_block(model, X, fn_name, scale_name, base_name, norm_name)
        return hc_block_ref(model, self, X, fn_name, scale_name, base_name, norm_name)

    def moe(self, model, li, b, ids, w, limit, want_mid):
        return None  # the per-expert loop, so the shared expert's projections are reported


def _kernels(impl: str):
    if impl == "ref":
        return _RefKernels
    from ds4.engine import kernels

    return kernels


# ---- sublayers -----------------------------------------------------------------------------------
def hc_pre(X: np.ndarray, mix: np.ndarray, scale: np.ndarray, base: np.ndarray, cfg: Config):
    """mHC pre (model-spec §3.3) from mix = fn · UnitRMS(flatten X) [T, (2+n)·n]: returns the
    sublayer input u [T, D], post [T, n] and the Sinkhorn-projected comb [T, n, n]."""
    n = X.shape[1]
    T = X.shape[0]
    pre = sigmoid(mix[:, :n] * scale[0] + base[:n]) + F32(cfg.hc_eps)
    post = F32(2.0) * sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = mix[:, 2 * n:].reshape(T, n, n) * scale[2] + base[2 * n:].reshape(n, n)
    comb = np.exp(comb - comb.max(axis=-1, keepdims=True))
    comb = comb / comb.sum(axis=-1, keepdims=True) + F32(cfg.hc_eps)
    comb = comb / (comb.sum(axis=1, keepdims=True) + F32(cfg.hc_eps))
    for _ in range(cfg.sinkhorn_iters - 1):
        comb = comb / (comb.sum(axis=2, keepdims=True) + F32(cfg.hc_eps))
        comb = comb / (comb.sum(axis=1, keepdims=True) + F32(cfg.hc_eps))
    return stream_sum(pre, X), post.astype(F32), comb.astype(F32)


def stream_sum(wts: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Σ_i wts[:, i] · X[:, i] (elementwise, so every token's result is independent of the batch)."""
    u = wts[:, 0, None] * X[:, 0]
    for i in range(1, X.shape[1]):
        u = u + wts[:, i, None] * X[:, i]
    return u.astype(F32)


def hc_post(X: np.ndarray, y: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """X'[b] = post_b · y + Σ_a comb[a, b] · X[a]."""
    out = np.empty_like(X)
    for b in range(X.shape[1]):
        out[:, b] = post[:, b, None] * y + stream_sum(comb[:, :, b], X)
    return out


def _hc_mix(model, K, X: np.ndarray, fn_name: str) -> np.ndarray:
    T, n, D = X.shape
    return K.matmul(model, fn_name, rms_norm(X.reshape(T, n * D), None, model.config.rms_eps))


def hc_block_ref(model, K, X: np.ndarray, fn_name: str, scale_name: str, base_name: str, norm_name: str):
    """mHC pre and the sublayer's RMSNorm: (a = RMSNorm(u; norm) [T, D], post, comb)."""
    cfg = model.config
    u, post, comb = hc_pre(X, _hc_mix(model, K, X, fn_name), model.w(scale_name), model.w(base_name), cfg)
    return rms_norm(u, model.w(norm_name), cfg.rms_eps), post, comb


def _finish_rows(pooled: np.ndarray, norm: np.ndarray, first_row: int, ratio: int, cfg: Config, indexer: bool,
                 K=None) -> np.ndarray:
    """Norm, RoPE at position i·r (compressed-layer RoPE) and the official rounding of new rows."""
    K = K or _RefKernels
    rows = K.rms_norm(pooled, norm, cfg.rms_eps)
    cos, sin = cos_sin(inv_freq(cfg, True), (first_row + np.arange(len(rows))) * ratio)
    rows = K.apply_tail(rows, cos, sin, cfg.rope_dim)
    if indexer:
        return K.indexer_qat(rows) if cfg.indexer_qat else rows
    return K.fp8_kv_round(rows, cfg.n_nope) if cfg.fp8_kv else rows


def _freq(model, compressed: bool) -> np.ndarray:
    """rope.inv_freq for the model's config, kept in model.plans (hashing the config per call costs
    more than the lookup saves)."""
    key = ("inv_freq", compressed)
    freq = model.plans.get(key)
    if freq is None:
        freq = model.plans[key] = inv_freq(model.config, compressed)
    return freq


def _compress(model, li: int, a: np.ndarray, pos0: int, K, names, state_kv, state_score,
              rows: np.ndarray, n_rows: int, indexer: bool) -> int:
    """Run one compressor over the chunk; append finished rows; return the new row count."""
    cfg = model.config
    ratio = cfg.ratio(li)
    kv_name, gate_name, ape_name, norm_name = names
    kv = K.matmul(model, _blk(li, kv_name), a)
    positions = pos0 + np.arange(a.shape[0])
    score = K.matmul(model, _blk(li, gate_name), a) + model.rows(_blk(li, ape_name), positions % ratio)
    pooled = np.empty((a.shape[0] // ratio + 1, kv.shape[1] // 2 if ratio == 4 else kv.shape[1]), F32)
    n = K.compressor_scan(np.ascontiguousarray(kv), np.ascontiguousarray(score, dtype=F32), pos0, ratio,
                          state_kv, state_score, pooled)
    if n:
        if n_rows + n > rows.shape[0]:
            raise ValueError("compressed rows exceed the context the state was built for")
        rows[n_rows:n_rows + n] = _finish_rows(pooled[:n], model.w(_blk(li, norm_name)), n_rows, ratio, cfg, indexer, K)
    return n_rows + n


def _indexer_mask(model, li: int, c: np.ndarray, a: np.ndarray, pos: np.ndarray, st: LayerState,
                  n_vis: np.ndarray, K) -> np.ndarray:
    """[T, n_idx] visibility of compressed rows after the Lightning indexer's top-k (model-spec §3.6)."""
    cfg = model.config
    T, n = len(pos), st.n_idx
    visible = np.arange(n)[None, :] < n_vis[:, None]
    sel = n_vis > cfg.indexer_top_k
    if not sel.any():
        return visible
    Hi, di = cfg.indexer_heads, cfg.indexer_dim
    rows = np.nonzero(sel)[0]
    q = K.matmul(model, _blk(li, L.IDX_Q_B), c[rows]).reshape(len(rows), Hi, di)
    cos, sin = cos_sin(_freq(model, True), pos[rows])
    q = K.apply_tail(q, cos, sin, cfg.rope_dim)
    if cfg.indexer_qat:
        q = K.indexer_qat(q)
    w = K.matmul(model, _blk(li, L.IDX_PROJ), a[rows]) * F32(1.0 / math.sqrt(di * Hi))
    scores = K.indexer_scores(np.ascontiguousarray(q), np.ascontiguousarray(w, dtype=F32), st.idx[:n])
    scores = np.where(visible[rows], scores, -np.inf)
    chosen = topk_rows(scores, cfg.indexer_top_k)
    narrowed = np.zeros((len(rows), n), bool)
    np.put_along_axis(narrowed, chosen, True, axis=1)
    visible[rows] = narrowed
    return visible


def attention(model, li: int, a: np.ndarray, pos0: int, st: LayerState, state: KVState, K) -> np.ndarray:
    """The attention sublayer (model-spec §3.4) for a chunk; a = RMSNorm(u; attn_norm) [T, D]."""
    cfg = model.config
    T, H, d = a.shape[0], cfg.n_head, cfg.head_dim
    ratio = cfg.ratio(li)
    pos = pos0 + np.arange(T)
    cos, sin = cos_sin(_freq(model, ratio != 0), pos)

    c = K.rms_norm(K.matmul(model, _blk(li, L.ATTN_Q_A), a), model.w(_blk(li, L.ATTN_Q_A_NORM)), cfg.rms_eps)
    q = K.rms_norm(K.matmul(model, _blk(li, L.ATTN_Q_B), c).reshape(T, H, d), None, cfg.rms_eps)
    q = K.apply_tail(q, cos, sin, cfg.rope_dim)
    kv = K.rms_norm(K.matmul(model, _blk(li, L.ATTN_KV), a), model.w(_blk(li, L.ATTN_KV_A_NORM)), cfg.rms_eps)
    kv = K.apply_tail(kv, cos, sin, cfg.rope_dim)
    if cfg.fp8_kv:
        kv = K.fp8_kv_round(kv, cfg.n_nope)

    # Raw window: earlier positions come from the ring, the chunk's own rows from kv. A decoded
    # token (fast kernels) attends over the ring in place once its own row is written.
    W, cap = state.raw_window, state.raw_cap
    decode = T == 1 and hasattr(K, "attend_decode")
    if decode:
        st.raw[pos0 % cap] = kv[0]
    else:
        old = np.arange(max(0, pos0 - W + 1), pos0)
        keys = np.concatenate([st.raw[old % cap], kv])
        key_pos = np.concatenate([old, pos])
        keep = pos[-min(T, cap):]
        st.raw[keep % cap] = kv[T - len(keep):]
        mask = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - W)

    comp_mask = None
    if ratio:
        st.n_comp = _compress(model, li, a, pos0, K, (L.COMP_KV, L.COMP_GATE, L.COMP_APE, L.COMP_NORM),
                              st.comp_kv, st.comp_score, st.comp, st.n_comp, indexer=False)
        if ratio == 4:
            st.n_idx = _compress(model, li, a, pos0, K, (L.IDX_COMP_KV, L.IDX_COMP_GATE, L.IDX_COMP_APE,
                                 L.IDX_COMP_NORM), st.idx_kv, st.idx_score, st.idx, st.n_idx, indexer=True)
        n_vis = (pos + 1) // ratio
        if ratio == 4:
            comp_mask = _indexer_mask(model, li, c, a, pos, st, n_vis, K)
        else:
            comp_mask = np.arange(st.n_comp)[None, :] < n_vis[:, None]
        if not decode:
            keys = np.concatenate([keys, st.comp[:st.n_comp]])
            mask = np.concatenate([mask, comp_mask], axis=1)

    sinks, scale = model.w(_blk(li, L.ATTN_SINKS)), 1.0 / math.sqrt(d)
    if decode:
        comp_rows = st.comp[:st.n_comp] if comp_mask is not None else st.raw[:0]
        comp_mask = comp_mask[0] if comp_mask is not None else np.zeros(0, bool)
        o = K.attend_decode(q, st.raw, pos0, W, comp_rows, comp_mask, sinks, scale)
    else:
        o = K.attend(np.ascontiguousarray(q), np.ascontiguousarray(keys), np.ascontiguousarray(mask),
                     sinks, scale)
    o = K.apply_tail(o, cos, sin, cfg.rope_dim, inverse=True)

    G = cfg.o_groups
    low = K.group_matmul(model, _blk(li, L.ATTN_OUTPUT_A), G, o.reshape(T, G, H * d // G)).reshape(T, -1)
    return K.matmul(model, _blk(li, L.ATTN_OUTPUT_B), low)


def route(model, K, li: int, b: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Expert ids [T, k] and routing weights [T, k] (model-spec §3.7 steps 1-3)."""
    cfg = model.config
    s = np.sqrt(softplus(K.matmul(model, _blk(li, L.FFN_GATE_INP), b)))
    hashed = cfg.is_hash_layer(li)
    ids = model.id_rows(_blk(li, L.FFN_GATE_TID2EID), tokens) if hashed else None
    bias_name = _blk(li, L.EXP_PROBS_B)
    bias = model.w(bias_name) if not hashed and model.has(bias_name) else None
    fast = getattr(K, "route_select", None)
    if fast is not None:  # the same float32 operations in one kernel (None: take the numpy path)
        done = fast(s, bias, ids, cfg.n_expert_used, ROUTE_DENOM_MIN, cfg.routed_scale)
        if done is not None:
            return done
    if not hashed:
        ids = topk_rows(s + bias if bias is not None else s, cfg.n_expert_used)
    w = np.take_along_axis(s, ids, axis=1)
    w = w / np.maximum(w.sum(axis=1, keepdims=True), F32(ROUTE_DENOM_MIN)) * F32(cfg.routed_scale)
    return ids, w.astype(F32)


def _swiglu(g: np.ndarray, u: np.ndarray, limit: float) -> np.ndarray:
    return silu(np.minimum(g, F32(limit))) * np.clip(u, -limit, limit)


def moe(model, K, li: int, b: np.ndarray, tokens: np.ndarray, hooks: Hooks | None) -> np.ndarray:
    """Routed experts plus the shared expert (model-spec §3.7); b = RMSNorm(v; ffn_norm) [T, D].

    Routed results are summed per token in ascending expert order, then the shared expert is added
    (the numba kernel `kernels.moe` does the same in one call for float weights)."""
    cfg = model.config
    T, k = b.shape[0], cfg.n_expert_used
    limit = cfg.swiglu_clamp[li]
    ids, w = route(model, K, li, b, tokens)
    want_mid = hooks is not None and hooks.wants_routed_inputs()
    fused = K.moe(model, li, b, ids, w, limit, want_mid)
    if fused is not None:
        out, mid = fused
    else:
        mid = np.zeros((T, k, cfg.expert_ffn), F32) if want_mid else None
        out = np.zeros((T, cfg.n_embd), F32)
        W1, W3, W2 = (_blk(li, n) for n in (L.FFN_GATE_EXPS, L.FFN_UP_EXPS, L.FFN_DOWN_EXPS))
        for e in np.unique(ids):
            tt, slot = np.nonzero(ids == e)
            x = b[tt]
            h = K.swiglu(K.expert_matmul(model, W1, e, x), K.expert_matmul(model, W3, e, x), limit, w[tt, slot])
            if mid is not None:
                mid[tt, slot] = h
            np.add.at(out, tt, K.expert_matmul(model, W2, e, h))
        sh = K.swiglu(K.matmul(model, _blk(li, L.FFN_GATE_SHEXP), b), K.matmul(model, _blk(li, L.FFN_UP_SHEXP), b),
                      limit)
        out = (out + K.matmul(model, _blk(li, L.FFN_DOWN_SHEXP), sh)).astype(F32)
    if want_mid:
        hooks.routed_inputs(li, b, ids, w, mid)
    return out


def head(model, K, X: np.ndarray) -> np.ndarray:
    """Output HC collapse, final norm and LM head (model-spec §3.8): X [T, n, D] → logits [T, V]."""
    cfg = model.config
    mix = _hc_mix(model, K, X, C.OUTPUT_HC_FN)
    wts = sigmoid(mix * model.w(C.OUTPUT_HC_SCALE)[0] + model.w(C.OUTPUT_HC_BASE)) + F32(cfg.hc_eps)
    h = stream_sum(wts, X)
    return K.matmul(model, C.OUTPUT, K.rms_norm(h, model.w(C.OUTPUT_NORM), cfg.rms_eps))


# ---- the model -----------------------------------------------------------------------------------
def _edit(hooks: Hooks | None, li: int, kind: str, y: np.ndarray) -> np.ndarray:
    if hooks is None:
        return y
    edited = hooks.sublayer_output(li, kind, y)
    return y if edited is None else np.asarray(edited, dtype=F32)


def forward_chunk(model, state: KVState, tokens, hooks: Hooks | None = None, *, all_logits: bool = False,
                  impl: str = "fast") -> np.ndarray:
    """Run `tokens` at positions state.n_tokens.. through every layer, updating `state` in place.

    Returns the logits of the last position [V], or of every position [T, V] with all_logits.
    """
    cfg = model.config
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    T = len(tokens)
    if T == 0:
        raise ValueError("forward_chunk needs at least one token")
    if state.n_tokens + T > state.ctx:
        raise ValueError(f"{state.n_tokens + T} tokens exceed the context of {state.ctx}")
    if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
        raise ValueError(f"token id out of range 0..{cfg.vocab_size - 1}")
    K = _kernels(impl)
    if hooks is not None and hooks.wants_linear_inputs():
        K = _ReportingKernels(K, hooks)
    pos0 = state.n_tokens
    if hooks is not None:
        hooks.begin(pos0, tokens)
    e = model.rows(C.TOKEN_EMBD, tokens)
    X = np.repeat(e[:, None, :], cfg.n_hc, axis=1).astype(F32)
    for li in range(cfg.n_layer):
        st = state.layers[li]
        a, post, comb = K.hc_block(model, X, _blk(li, L.HC_ATTN_FN), _blk(li, L.HC_ATTN_SCALE),
                                   _blk(li, L.HC_ATTN_BASE), _blk(li, L.ATTN_NORM))
        y = _edit(hooks, li, "attn", attention(model, li, a, pos0, st, state, K))
        X = K.hc_post(X, y, post, comb)

        b, post, comb = K.hc_block(model, X, _blk(li, L.HC_FFN_FN), _blk(li, L.HC_FFN_SCALE),
                                   _blk(li, L.HC_FFN_BASE), _blk(li, L.FFN_NORM))
        y = _edit(hooks, li, "ffn", moe(model, K, li, b, tokens, hooks))
        X = K.hc_post(X, y, post, comb)
        if hooks is not None:
            hooks.residual(li, X)
    state.n_tokens += T
    if all_logits:
        return head(model, K, X)
    return head(model, K, X[-1:])[0]


def warm_weights(model) -> None:
    """Make every weight view the fast path multiplies by (no conversion: F16 stays in the mmap)."""
    cfg = model.config
    names = [C.OUTPUT, C.OUTPUT_HC_FN, C.TOKEN_EMBD]
    for li in range(cfg.n_layer):
        for t in (L.HC_ATTN_FN, L.HC_FFN_FN, L.ATTN_Q_A, L.ATTN_Q_B, L.ATTN_KV, L.ATTN_OUTPUT_A, L.ATTN_OUTPUT_B,
                  L.FFN_GATE_INP, L.FFN_GATE_SHEXP, L.FFN_UP_SHEXP, L.FFN_DOWN_SHEXP, L.FFN_GATE_EXPS,
                  L.FFN_UP_EXPS, L.FFN_DOWN_EXPS, L.COMP_KV, L.COMP_GATE, L.IDX_COMP_KV, L.IDX_COMP_GATE,
                  L.IDX_Q_B, L.IDX_PROJ):
            if model.has(_blk(li, t)):
                names.append(_blk(li, t))
    for name in names:
        if model.quantized(name) is None:
            model.dense(name)
