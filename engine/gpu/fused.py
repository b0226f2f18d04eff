"""Fused CUDA kernels for the layer chains of the CUDA engine session (ds4.engine.gpu.session).

Each method runs one kernel of fused.cu or hc.cu on torch tensors (raw device pointers, torch's current
stream) and means exactly what the torch ops it replaces mean (ops.rms_norm + hc_weights +
stream_sum, ops.hc_post, rms_norm + apply_tail + fp8_kv_round / indexer_qat, the router's
softplus/top-k/normalization, the compressor step, decode attention with sinks, the indexer
scores). tests/test_gpu_fused.py holds every kernel to those torch ops on fresh random input.
`attn_step` is the whole decode attention sublayer built from them (static shapes: capturable).

DS4_GPU_FUSED=0 turns them off (the session then runs the torch ops).
"""

from __future__ import annotations

import math
import os
from functools import partial

import torch

from . import comp_defer, ops, weights

F32 = torch.float32
# hc_pre: tokens from which the mix is one float32 GEMM (TF32 stays off, torch's default)
HC_GEMM_MIN = int(os.environ.get("DS4_GPU_HC_GEMM_MIN", "64"))
# DS4_GPU_HC_MIX (v27; default 1 since v28): prefill's mHC mix by hc_mix_rows (X read once) instead of torch's
# float32 GEMM; 0 the GEMM
HC_MIX = os.environ.get("DS4_GPU_HC_MIX", "1") == "1"
# DS4_GPU_HC_POST_MIX (v31, default 1): prefill's mHC post and the next mix in one pass (hc_post_mix: X read once,
# X' written, its mix made from the stage in shared memory) instead of hc_post4 then hc_mix_rows; 0: the two launches
HC_POST_MIX = os.environ.get("DS4_GPU_HC_POST_MIX", "1") == "1"
TOPK_KERNEL_MAX_ROWS = 65536  # attn_step's indexer top-k: our kernel up to here, torch.topk above
# decode: the F16 router matvec and the routing in one launch (router.cu; Fused.router_one), read once. Default 1
# since v23 (the cluster kernel, DS4_GPU_ROUTER_CLUSTER: 6.12 -> 6.02 ms at 2k); 0: the router matvec, then the routing
ROUTER_ONE = os.environ.get("DS4_GPU_ROUTER_ONE", "1") == "1"
# decode: 1 launches the indexer's head-weight matvec (w = proj a) with the compressor steps, on their side branch,
# instead of after the indexer's query. v16: 225 us per token slower (its streaming grid takes SMs from q_a/kv and
# q_b on the main branch), so off by default; DS4_GPU_IDX_MERGE=comp puts it into the compressors' own launch instead
EARLY_IDX_PROJ = os.environ.get("DS4_GPU_EARLY_IDX_PROJ", "0") == "1"
# decode with the `ffn` branch: the routed experts' x quantized on the side stream beside the router (v16), so the
# router -> gate/up chain has one launch less; 0: quantized by the MoE launch itself
EARLY_XQ = os.environ.get("DS4_GPU_EARLY_XQ", "1") != "0"
# decode, one token: 1 runs the routed experts and the shared expert in one gate/up launch and one down launch
# (moe.cu moe_gateup_shexp_kernel; Weights.moe_shexp) instead of the shared expert's matvecs on the `ffn` branch. v36;
# default 0 until measured. The routed experts' bits are the same; the shared expert's sums run in another order.
MOE_SHEXP = os.environ.get("DS4_GPU_MOE_SHEXP", "0") == "1"
# decode indexer keys: 2 the v16 kernel (lanes over the dims, the query's RoPE/QAT folded into its staging; other
# summation order, the same top-k on the tests' inputs). v16: 125 us per token slower (every CTA repeats the 64 query
# rows' Hadamard/FP4 and RoPE where norm_rope spread them over 64 CTAs); 1, the v15 kernel and a norm_rope launch;
# 3 (default since v17) the v16 kernel after the norm_rope launch: v17 trace, 2k, 80-90 us per token faster than 1
# $DS4_GPU_ATTN_FORM, the prefill attention's form (attn_prefill.cu reads the same variable): 3 (default since v25:
# every product on the bfloat16 tensor cores, keys packed with their RoPE tail split; 8192-token Flash prefill
# 3847 -> 4029 t/s) where the FP8 KV simulation leaves the keys exact, else the TF32 form 2; 2; 1
ATTN_FORM = os.environ.get("DS4_GPU_ATTN_FORM", "3").strip()
INDEX_KEYS_MODE = os.environ.get("DS4_GPU_INDEX_KEYS", "3")
INDEX_KEYS_V2 = INDEX_KEYS_MODE in ("2", "3")
INDEX_KEYS_FOLD = INDEX_KEYS_MODE == "2"
# decode, indexed ratio-4 layers: the indexer's small launches inside other launches. `qb`: its q_b (F16) in q_b's
# launch (Q8_0, x = the normalized q_a; matvec_pair_kernel) and its query's RoPE/QAT in the query's norm_rope launch (a
# third job); `comp`: its proj (x = a) as a fifth segment of the compressors' F16 launch (on the `comp` side branch).
# Names joined by ","; "0" or empty: neither (the v19 chain: its own matvecs and norm_rope after the query's). v20 (H200,
# 2k / 8k): qb,comp 7.03 / 7.10 ms, qb 7.09 / 7.17 (call 5); qb 7.26 / 7.33, none 7.34 / 7.39 (call 2). The proj in
# q_a/kv's launch instead lost (7.45 / 7.52: q_a/kv leave the bulk-copy kernel, 9.5 -> 16.2 us) and is gone.
IDX_MERGE = frozenset(t.strip() for t in os.environ.get("DS4_GPU_IDX_MERGE", "qb,comp").replace("+", ",").split(",")
                      if t.strip() in ("qb", "comp"))
# decode: the indexer only at steps where a ratio-4 layer's visible compressed rows outnumber top-k (model-spec §3;
# below that every row is attended), decided on the host per step, so each step kind has a decode graph with the
# indexer and one without (Session._step_key). v50: the same bits, +8.1% decode at 1k in a 32k session (H100); 0:
# wherever the session's capacity allows more rows than top-k
SHORT_INDEX = os.environ.get("DS4_GPU_SHORT_INDEX", "1") != "0"
# decode, ratio-4 layers: 1 (default) both compressors' steps in one launch of two blocks (on pooling steps they pool
# side by side: v20 trace, 18.5 + 11.9 us one after the other); 0: a launch each
COMPRESS_ONE = os.environ.get("DS4_GPU_COMPRESS_ONE", "1") != "0"
# greedy decode: argmax_kernel of topk.cu (v16; torch.argmax's answer in one block); 0: torch.argmax
ARGMAX = os.environ.get("DS4_GPU_ARGMAX", "1") != "0"


def _p(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _unscaled(y, T: int) -> tuple:
    """(z, r) of an ops.Unscaled product for the kernels that rescale as they read (hc_post, swiglu; r: T float32 row
    scales), (y, None) for a tensor."""
    if not isinstance(y, ops.Unscaled):
        return y, None
    r = y.r.reshape(-1)
    if r.dtype != F32 or r.numel() != T or y.z.shape[0] != T:
        raise ValueError(f"an unscaled product needs {T} float32 row scales, got {tuple(y.r.shape)} "
                         f"{y.r.dtype} for rows {tuple(y.z.shape)}")
    return y.z, r.contiguous()


class Fused:
    def __init__(self, ext, device: torch.device):
        self.ext, self.device = ext, device

    def _stream(self) -> None:
        self.ext.set_stream(torch.cuda.current_stream(self.device).cuda_stream)

    def argmax_into(self, x: torch.Tensor, out: torch.Tensor, pos: torch.Tensor | None = None,
                    hist: torch.Tensor | None = None, banned: torch.Tensor | None = None) -> None:
        """out[0] = torch.argmax(x) (int64; NaN counts as the largest value, ties go to the first index). With pos
        (one int64), also pos[0] += 1 and then hist[p] = out[0] at p = pos[0] clamped to hist's indices: greedy
        decode's next step fed on the device (its token in out, its position in pos, the output list in hist).
        banned (one int64, read when the kernel runs, so a graph follows it): x[banned[0]] counts as -inf where it is
        an index of x (ds4-bench's EOS, so a speed probe never stops early; -1: none)."""
        if not (ARGMAX and x.dtype == F32 and out.dtype == torch.long and x.numel() > 0):
            if banned is not None:
                x = torch.where(torch.arange(x.numel(), device=x.device) == banned, -math.inf, x)
            out.copy_(torch.argmax(x).view(1))
            if pos is not None:
                pos += 1
                if hist is not None:  # index_copy_ with a device index stays on the device (graph capture)
                    hist.index_copy_(0, pos.clamp(0, hist.numel() - 1), out)
            return
        x = x.contiguous()
        self._stream()
        self.ext.argmax(_p(x), x.numel(), _p(out), _p(pos), _p(hist), 0 if hist is None else hist.numel(),
                        _p(banned))

    def embed(self, emb: torch.Tensor, tok: torch.Tensor, n_hc: int) -> torch.Tensor:
        """X [T, n_hc, D]: every residual stream of token t starts as float32(emb[tok[t]]) (torch's emb[tok].to(float32)
        expanded, the same bits); a token id out of range gives a row of NaN. emb: [vocab, D] float16 or float32."""
        if emb.dtype not in (torch.float16, F32) or emb.dim() != 2 or tok.dtype != torch.long:
            raise ValueError(f"embed takes a float16/float32 [vocab, D] table and int64 ids, got {emb.dtype} "
                             f"{tuple(emb.shape)} and {tok.dtype}")
        emb, tok = emb.contiguous(), tok.reshape(-1).contiguous()
        X = torch.empty((tok.numel(), n_hc, emb.shape[1]), dtype=F32, device=self.device)
        self._stream()
        self.ext.embed(_p(emb), emb.dtype == torch.float16, emb.shape[0], emb.shape[1], _p(tok), tok.numel(), n_hc,
                       _p(X))
        return X

    # ---- row-wise ops ------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        self._stream()
        n = x.shape[-1]
        self.ext.rms_norm(_p(x), _p(w), _p(y), x.numel() // n, n, float(eps))
        return y

    def hc_pre(self, X: torch.Tensor, Wf: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
               norm_w: torch.Tensor | None, iters: int, eps_rms: float, eps_hc: float, head: bool = False,
               mix: torch.Tensor | None = None):
        """X [T, n, D], Wf [M, n·D] float32 (the mHC fn) → (rms_norm(Σ pre_i X_i) * norm_w, post, comb),
        mix = Wf · rms_norm(flatten(X)) computed in the kernels (mix: flatten(X) · Wf^T [T, M] already made by
        hc_post_mix)."""
        T, n, D = X.shape
        M = n if head else (2 + n) * n
        if Wf.dtype != F32 or tuple(Wf.shape) != (M, n * D):
            raise ValueError(f"hc_pre: fn must be float32 [{M}, {n * D}], got {Wf.dtype} {tuple(Wf.shape)}")
        X, Wf = X.contiguous(), Wf.contiguous()
        out = torch.empty((T, D), dtype=F32, device=self.device)
        post = torch.empty((T, n), dtype=F32, device=self.device)
        comb = torch.empty((T, n, n), dtype=F32, device=self.device)
        parts = 0
        if mix is not None:  # hc_post_mix's: hc_pre_rows takes it (post_mix_takes checked that)
            part, parts = mix, -1
        elif T >= HC_GEMM_MIN and self.ext.hc_pre_rows_takes(n, D, head):
            # prefill: the mix as one float32 GEMM; the kernel sums flatten(X)'s squares from the rows it holds
            part = self.hc_mix(X.reshape(T, n * D), Wf)
            parts = -1
        elif T >= HC_GEMM_MIN:  # the mix as one float32 GEMM, not T decode-shaped reductions; the norm by torch
            flat = X.reshape(T, n * D)
            part = torch.empty((T, 1, M + 1), dtype=F32, device=self.device)
            torch.mm(flat, Wf.T, out=part[:, 0, :M])
            torch.linalg.vector_norm(flat, dim=1, out=part[:, 0, M]).square_()
            parts = 1
        else:
            part = torch.empty((T, self.ext.hc_parts(n, D), M + 1), dtype=F32, device=self.device)
        self._stream()
        self.ext.hc_pre(_p(X), _p(Wf), _p(part), _p(scale), _p(base), _p(norm_w), T, n, D, int(iters),
                        float(eps_rms), float(eps_hc), bool(head), _p(out), _p(post), _p(comb), parts)
        return out, post, comb

    def hc_mix(self, flat: torch.Tensor, Wf: torch.Tensor) -> torch.Tensor:
        """flat [T, K] . Wf [M, K]^T as float32 [T, M]: hc_mix_rows under DS4_GPU_HC_MIX=1 where it takes the shapes,
        else torch's GEMM."""
        T, K = flat.shape
        M = Wf.shape[0]
        if not (HC_MIX and self.ext.hc_mix_rows_takes(K, M) and flat.is_contiguous() and Wf.is_contiguous()
                and flat.data_ptr() % 16 == 0 and Wf.data_ptr() % 16 == 0):
            return torch.mm(flat, Wf.T)
        out = torch.empty((T, M), dtype=F32, device=self.device)
        S = self.ext.hc_mix_rows_splits(T, K)
        scratch = torch.empty((S, T, M), dtype=F32, device=self.device) if S > 1 else None
        self._stream()
        self.ext.hc_mix_rows(_p(flat), _p(Wf), T, K, M, _p(out), _p(scratch))
        return out

    def hc_post_pre(self, X: torch.Tensor, y1: torch.Tensor, y2: torch.Tensor | None, post_in: torch.Tensor,
                    comb_in: torch.Tensor, Wf: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                    norm_w: torch.Tensor | None, iters: int, eps_rms: float, eps_hc: float, head: bool = False,
                    logits: torch.Tensor | None = None, ring: tuple | None = None):
        """X' = hc_post(X, y1, y2, post_in, comb_in), then hc_pre of X': (X', out, post, comb). One launch for
        decode shapes (the mix blocks apply the post to their columns); hc_post + hc_pre otherwise.
        logits ([T, 16] float32, one launch only): comb's logits are written there and comb is left for sinkhorn()
        (the session's deferred Sinkhorn, DS4_GPU_HC_DEFER). ring (CompRing.hc_target's (ring, layer, pos)): out
        into the layer's ring row too, by the kernel where it can (comp_defer.HC_STORE)."""
        Xn, out, post, comb, written = self._hc_post_pre(X, y1, y2, post_in, comb_in, Wf, scale, base, norm_w, iters,
                                                         eps_rms, eps_hc, head, logits, ring)
        if ring is not None:
            ring[0].stored_by_pre(ring[1], out, ring[2], written)
        return Xn, out, post, comb

    def _hc_post_pre(self, X, y1, y2, post_in, comb_in, Wf, scale, base, norm_w, iters, eps_rms, eps_hc, head, logits,
                     ring):
        """hc_post_pre's work: (X', out, post, comb, whether the kernel wrote the ring row)."""
        T, n, D = X.shape
        M = n if head else (2 + n) * n
        if self.ext.hc_one_launch_takes(T, n, D, bool(head)):  # the one launch takes tensors: rescale them first
            y1, y2 = ops.scaled(y1), ops.scaled(y2)
        aligned = all(t is None or isinstance(t, ops.Unscaled) or t.data_ptr() % 16 == 0 for t in (X, y1, y2))
        if not (aligned and self.ext.hc_one_launch_takes(T, n, D, bool(head))) or Wf.dtype != F32 \
                or tuple(Wf.shape) != (M, n * D):
            if logits is not None:
                raise ValueError("hc_post_pre: deferred comb logits need the one-launch kernel's shapes")
            if self.post_mix_takes(X, Wf, head):
                Xn, mix = self.hc_post_mix(X, y1, y2, post_in, comb_in, Wf)
                return (Xn, *self.hc_pre(Xn, Wf, scale, base, norm_w, iters, eps_rms, eps_hc, head, mix=mix), False)
            Xn = self.hc_post(X, y1, y2, post_in, comb_in)
            return (Xn, *self.hc_pre(Xn, Wf, scale, base, norm_w, iters, eps_rms, eps_hc, head), False)
        X, y1, Wf = X.contiguous(), y1.contiguous(), Wf.contiguous()
        y2 = None if y2 is None else y2.contiguous()
        post_in, comb_in = post_in.contiguous(), comb_in.contiguous()
        Xn = torch.empty_like(X)
        out = torch.empty((T, D), dtype=F32, device=self.device)
        post = torch.empty((T, n), dtype=F32, device=self.device)
        comb = torch.empty((T, n, n), dtype=F32, device=self.device)
        part = torch.empty((T, self.ext.hc_parts(n, D), M + 1), dtype=F32, device=self.device)
        self._stream()
        rows, pos, r = (None, None, 0) if ring is None else (ring[0].rows[ring[1]], ring[2], ring[0].cfg.ratio(ring[1]))
        written = self.ext.hc_post_pre(_p(X), _p(y1), _p(y2), _p(post_in), _p(comb_in), _p(Xn), _p(Wf), _p(part),
                                       _p(scale), _p(base), _p(norm_w), T, n, D, int(iters), float(eps_rms),
                                       float(eps_hc), bool(head), _p(out), _p(post), _p(comb),
                                       0 if logits is None else _p(logits), _p(rows), _p(pos), int(r))
        return Xn, out, post, comb, written

    def sinkhorn(self, logits: torch.Tensor, iters: int, eps: float, comb: torch.Tensor) -> None:
        """comb [T, 4, 4] = Sinkhorn of the logits [T, 16] hc_post_pre(..., logits=) wrote: its one-launch arithmetic."""
        T = logits.shape[0]
        if logits.dtype != F32 or tuple(logits.shape) != (T, 16) or comb.dtype != F32 or tuple(comb.shape) != (T, 4, 4):
            raise ValueError("sinkhorn: logits must be float32 [T, 16] and comb float32 [T, 4, 4]")
        self._stream()
        self.ext.sinkhorn4(_p(logits), T, int(iters), float(eps), _p(comb))

    def post_mix_takes(self, X: torch.Tensor, Wf: torch.Tensor, head: bool) -> bool:
        """Whether hc_post_pre's prefill rows take hc_post_mix (DS4_GPU_HC_POST_MIX) and hc_pre_rows its mix."""
        T, n, D = X.shape
        return HC_POST_MIX and T >= HC_GEMM_MIN and Wf.dtype == F32 and Wf.dim() == 2 and Wf.shape[1] == n * D \
            and Wf.is_contiguous() \
            and Wf.data_ptr() % 16 == 0 and self.ext.hc_post_mix_takes(n, D, Wf.shape[0]) \
            and self.ext.hc_pre_rows_takes(n, D, head)

    def hc_post_mix(self, X: torch.Tensor, y1, y2, post: torch.Tensor, comb: torch.Tensor, Wf: torch.Tensor):
        """(X', mix): X' = hc_post(X, y1, y2, post, comb) with its bits and mix = flatten(X') · Wf^T [T, M] float32,
        in one pass (hc_mix.cu; 4 streams; the mix to float rounding of hc_mix's)."""
        T, n, D = X.shape
        (y1, r1), (y2, r2) = _unscaled(y1, T), _unscaled(y2, T)
        X, y1, post, comb = X.contiguous(), y1.contiguous(), post.contiguous(), comb.contiguous()
        y2 = None if y2 is None else y2.contiguous()
        if any(t is not None and t.data_ptr() % 16 for t in (X, y1, y2)):  # views of odd offsets: copies align them
            X, y1 = X.clone(), y1.clone()
            y2 = None if y2 is None else y2.clone()
        Xn = torch.empty_like(X)
        M = Wf.shape[0]
        out = torch.empty((T, M), dtype=F32, device=self.device)
        S = self.ext.hc_mix_rows_splits(T, n * D)
        scratch = torch.empty((S, T, M), dtype=F32, device=self.device) if S > 1 else None
        self._stream()
        self.ext.hc_post_mix(_p(X), _p(y1), _p(y2), _p(post), _p(comb), _p(r1), _p(r2), _p(Wf), T, D, M, _p(Xn),
                             _p(out), _p(scratch))
        return Xn, out

    def hc_post(self, X: torch.Tensor, y1, y2, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """X' = post (y1 + y2) + comb^T X per token; y1, y2 tensors [T, D] or ops.Unscaled products, whose per-row
        rescale the kernel applies as it reads them (the bits of rescaling first)."""
        T, n, D = X.shape
        (y1, r1), (y2, r2) = _unscaled(y1, T), _unscaled(y2, T)
        X, y1 = X.contiguous(), y1.contiguous()
        y2 = None if y2 is None else y2.contiguous()
        out = torch.empty_like(X)
        self._stream()
        self.ext.hc_post(_p(X), _p(y1), _p(y2), _p(post), _p(comb), T, n, D, _p(out), _p(r1), _p(r2))
        return out

    def norm_rope(self, x: torch.Tensor, d: int, rows_per_token: int, pos: torch.Tensor | None, *,
                  norm: bool = False, w: torch.Tensor | None = None, eps: float = 1e-6,
                  freq: torch.Tensor | None = None, rope_dim: int = 0, inverse: bool = False, fp8_nope: int = 0,
                  qat: bool = False, out: torch.Tensor | None = None, ring_cap: int = 0,
                  also: dict | list[dict] | None = None, in_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of length d: [rms_norm (* w)] → [RoPE tail at pos[row // rows_per_token]] → [FP8 | FP4 sim].
        ring_cap > 0 (one row): written to out[pos % ring_cap] instead of a new tensor. also: the arguments
        (x, d, rows_per_token and the keywords) of a second norm_rope with the same pos, or a list of up to two
        such, run in the same launch (each output is written to its `out`, which it must give). in_scale [tokens]
        float32: the rows are x * in_scale[row // rows_per_token] (the bits of that multiply done first)."""
        first = self._norm_rope_job(x, d, rows_per_token, norm=norm, w=w, eps=eps, freq=freq, rope_dim=rope_dim,
                                    inverse=inverse, fp8_nope=fp8_nope, qat=qat, out=out, ring_cap=ring_cap,
                                    in_scale=in_scale)
        jobs = [first]
        extra = [] if also is None else ([also] if isinstance(also, dict) else list(also))
        if len(extra) > 2:
            raise ValueError("norm_rope: at most two jobs besides the first")
        for job in extra:
            if job.get("out") is None:
                raise ValueError("norm_rope: the jobs after the first need their out tensors")
            jobs.append(self._norm_rope_job(**job))
        self._stream()
        self.ext.norm_rope(_p(pos), [job for job, _, _ in jobs])  # jobs hold the inputs alive until launched
        return first[1]

    def _norm_rope_job(self, x, d, rows_per_token, *, norm=False, w=None, eps=1e-6, freq=None, rope_dim=0,
                       inverse=False, fp8_nope=0, qat=False, out=None, ring_cap=0, in_scale=None):
        x = x.contiguous()
        rows = x.numel() // d
        if out is None:
            out = torch.empty((rows, d), dtype=F32, device=self.device)
        if in_scale is not None:
            in_scale = in_scale.to(F32).contiguous()
            if in_scale.numel() * rows_per_token != rows:
                raise ValueError(f"norm_rope: in_scale has {in_scale.numel()} values for {rows} rows of "
                                 f"{rows_per_token} per token")
        job = (_p(x), rows, d, rows_per_token, bool(norm), _p(w), float(eps), _p(freq), int(rope_dim), bool(inverse),
               int(fp8_nope), bool(qat), float(1.0 / math.sqrt(d)), int(ring_cap), _p(out), _p(in_scale))
        return job, out, (x, in_scale)

    # ---- MoE -----------------------------------------------------------------------------------
    def router(self, logits: torch.Tensor, bias: torch.Tensor | None, table: torch.Tensor | None,
               tok: torch.Tensor, k: int, scale: float):
        logits = logits.contiguous()
        T, E = logits.shape
        ids = torch.empty((T, k), dtype=torch.int32, device=self.device)
        wts = torch.empty((T, k), dtype=F32, device=self.device)
        tok = tok.to(torch.int64).contiguous()
        self._stream()
        self.ext.router(_p(logits), _p(bias), _p(table), _p(tok), T, E, int(k), float(scale), _p(ids), _p(wts))
        return ids, wts

    def router_one(self, w, x: torch.Tensor, bias: torch.Tensor | None, table: torch.Tensor | None,
                   tok: torch.Tensor, k: int, scale: float):
        """Decode (x [1, n_embd]): (logits = w · x, ids, wts) as W.mm then `router`, with the same bits, in one
        launch (router.cu). None, with nothing launched, where that kernel does not take w (a torch matrix, not
        F16, shapes the streaming matvec declines): the caller then runs the two launches."""
        if isinstance(w, torch.Tensor) or x.shape[0] != 1:
            return None
        x = x.contiguous()
        logits = torch.empty((1, w.nrows), dtype=F32, device=self.device)
        ids = torch.empty((1, k), dtype=torch.int32, device=self.device)
        wts = torch.empty((1, k), dtype=F32, device=self.device)
        tok = tok.to(torch.int64).contiguous()
        self._stream()
        if not self.ext.router_one(w, _p(x), _p(logits), _p(bias), _p(table), _p(tok), int(k), float(scale), _p(ids),
                                   _p(wts)):
            return None
        return logits, ids, wts

    def swiglu(self, g, u, limit: float) -> torch.Tensor:
        """silu(min(g, limit)) * clamp(u, +-limit); g, u tensors [T, F] or ops.Unscaled products, whose per-row
        rescales the kernel applies as it reads them (the bits of rescaling first)."""
        T = (g.z if isinstance(g, ops.Unscaled) else g).shape[0]
        (g, rg), (u, ru) = _unscaled(g, T), _unscaled(u, T)
        g, u = g.contiguous(), u.contiguous()
        out = torch.empty_like(g)
        self._stream()
        self.ext.swiglu(_p(g), _p(u), g.numel(), float(limit), _p(out), 0, g.shape[-1] if g.dim() else 1, 0, _p(rg),
                        _p(ru))
        return out

    # ---- decode attention pieces -----------------------------------------------------------------
    def compress_step(self, kv, sc, ape, s_kv, s_sc, rows, pos, r: int, norm_w, eps: float, freq, rope_dim: int,
                      fp8_nope: int, qat: bool, also: dict | None = None, ring: tuple | None = None) -> None:
        """One compressor's decode step; also: a second compressor's arguments (these names, pos shared), run beside
        it in the same launch. ring: (kv [4, width], sc [4, width], start [1]) the window's deferred products, read
        for the positions from start (comp_defer; ratio 4, where ext.compress_ring_takes)."""
        jobs, keep = [], []
        for job in ({"kv": kv, "sc": sc, "ape": ape, "s_kv": s_kv, "s_sc": s_sc, "rows": rows, "r": r, "norm_w": norm_w,
                     "eps": eps, "freq": freq, "rope_dim": rope_dim, "fp8_nope": fp8_nope, "qat": qat, "ring": ring},
                    *([also] if also else [])):
            width = job["kv"].shape[-1]
            d = width // 2 if job["r"] == 4 else width
            kv_c, sc_c = job["kv"].contiguous(), job["sc"].contiguous()
            keep += [kv_c, sc_c]
            jobs.append((_p(kv_c), _p(sc_c), _p(job["ape"]), _p(job["s_kv"]), _p(job["s_sc"]), _p(job["rows"]),
                         int(job["r"]), int(width), _p(job["norm_w"]), float(job["eps"]), _p(job["freq"]),
                         int(job["rope_dim"]), int(job["fp8_nope"]), bool(job["qat"]), float(1.0 / math.sqrt(d)),
                         *(() if job.get("ring") is None else (_p(job["ring"][0]), _p(job["ring"][1]),
                                                                _p(job["ring"][2])))))
        self._stream()
        self.ext.compress_step(_p(pos), jobs)

    def attention(self, q: torch.Tensor, raw: torch.Tensor, comp: torch.Tensor | None, sel: torch.Tensor | None,
                  ratio: int, pos: torch.Tensor, sinks: torch.Tensor, freq: torch.Tensor, rope_dim: int) -> torch.Tensor:
        """Decode attention of q [H, d] over the raw ring and the visible compressed rows, with sinks;
        inverse RoPE on the output tail. Returns [H, d]."""
        H, d = q.shape
        cap = raw.shape[0]
        n_comp = 0 if comp is None else (sel.numel() if sel is not None else comp.shape[0])
        nc = self.ext.attn_chunks(cap + n_comp)
        part_o = torch.empty((nc, H, d), dtype=F32, device=self.device)
        part_ml = torch.empty((nc, H, 2), dtype=F32, device=self.device)
        out = torch.empty((H, d), dtype=F32, device=self.device)
        q = q.contiguous()
        self._stream()
        self.ext.attention(_p(q), H, d, _p(raw), cap, _p(comp), _p(sel), n_comp, int(ratio), _p(pos),
                           float(1.0 / math.sqrt(d)), _p(sinks), _p(freq), int(rope_dim), _p(part_o), _p(part_ml),
                           _p(out))
        return out

    def prefill_attn(self, q: torch.Tensor, win: torch.Tensor, comp: torch.Tensor | None, sel: torch.Tensor | None,
                     sinks: torch.Tensor, pos0: int, ratio: int, exact_dims: int = 0,
                     inverse_rope: tuple[torch.Tensor, int] | None = None, prefetch: int = -1,
                     packed: bool = False, form: int = -1, q_post: dict | None = None,
                     split_heads: int = 0, split_fp8: bool = False):
        """Prefill attention of T queries in one launch (attn_prefill.cu): q [T, H, d], win [T + Wn - 1, d] (query
        t's window is rows t .. t + Wn - 1), comp [n, d] rows visible below (pos + 1) / ratio, sel [T, k] int64 rows
        of comp per query (None: all of them). exact_dims: the keys' columns [0, exact_dims) are exact in TF32 (the
        FP8 KV simulation's values), so their products skip the keys' zero lo part (the same bits, fewer products).
        inverse_rope = (freq, rope_dim): the output's RoPE tail undone at each query's position (the bits of
        norm_rope(..., inverse=True) on the output). prefetch: 0, 1 (the selected rows staged once per query), 2 (also
        the next key tile into L2), -1 ($DS4_GPU_ATTN_PREFETCH): the same bits. packed (with exact_dims > 0): the keys
        read from packed copies (their exact_dims columns as bfloat16, the rest float32: half the bytes, two key
        buffers per CTA); the same bits where those columns are exact in bfloat16 (the FP8 KV simulation's values).
        form: 2 (the inner loops without per-step branches), 1 (the v13 loops; the same bits), 3 (the bfloat16
        products, attn_prefill_bf16.cu: with exact_dims = 448 of d = 512 the keys are packed, their RoPE tail as
        bfloat16 hi + lo; within float32 rounding of form 2, not its bits; form 2 where it does not take the shapes),
        -1 ($DS4_GPU_ATTN_FORM).
        q_post (norm, eps, freq, rope_dim, in_scale; as norm_rope's keywords): q holds raw rows, staged as
        norm_rope(q, d, H, positions, **q_post) would write them (the same bits, one pass over q less). split_heads
        > 0: the output as (hi, lo, s), weights.to_half's float16 split with one scale per query and group of
        split_heads heads (hi, lo [T, H d], s [T, H / split_heads]), for the grouped o_a GEMM; with split_fp8
        (hi, None, s, a8) instead, a8 [H / split_heads, T, 2 split_heads d] float8 e4m3 = fp8_split.pack_x of each
        group's hi and lo (the float8 GEMM's operand, written by the kernel in place of lo). None where the kernel
        does not take the shapes."""
        T, H, d = q.shape
        if not self.ext.prefill_attn_takes(H, d):
            return None
        q, win = q.contiguous(), win.contiguous()
        comp = None if comp is None else comp.contiguous()
        sel = None if sel is None else sel.to(torch.int64).contiguous()
        freq = None if inverse_rope is None else inverse_rope[0].contiguous()  # held until the launch
        hi = lo = s_out = a8 = None
        if split_heads > 0:
            out = None
            hi = torch.empty((T, H * d), dtype=torch.float16, device=self.device)
            if split_fp8:
                a8 = torch.empty((H // split_heads, T, 2 * split_heads * d), dtype=torch.float8_e4m3fn,
                                 device=self.device)
            else:
                lo = torch.empty_like(hi)
            s_out = torch.empty((T, H // split_heads), dtype=F32, device=self.device)
        else:
            out = torch.empty_like(q)
        self._stream()
        win_pk = comp_pk = None
        if form == -1 and ATTN_FORM in ("1", "2", "3"):
            form = int(ATTN_FORM)
        # form 3 reads keys packed with their RoPE tail split as bfloat16 hi + lo; where it does not take the
        # shapes, the TF32 form 2
        split = form == 3 and exact_dims > 0 and self.ext.prefill_attn_bf16_takes(d, int(exact_dims), split_heads)
        if form == 3 and not split:
            form = 2
        if (packed or split) and exact_dims > 0:
            win_pk, comp_pk = self.pack_keys(win, int(exact_dims), split), None if comp is None else self.pack_keys(
                comp, int(exact_dims), split)
        qp = dict(q_post or {})
        q_freq, q_scale = qp.get("freq"), qp.get("in_scale")
        q_freq = None if q_freq is None else q_freq.contiguous()
        q_scale = None if q_scale is None else q_scale.to(F32).contiguous()
        self.ext.prefill_attn(_p(q), _p(win), _p(comp), _p(sel), _p(sinks.contiguous()), _p(out), T, H, d,
                              win.shape[0] - T + 1, 0 if comp is None else comp.shape[0],
                              0 if sel is None else sel.shape[1], int(ratio), int(pos0), 1.0 / math.sqrt(d),
                              int(exact_dims), _p(freq), 0 if inverse_rope is None else int(inverse_rope[1]),
                              int(prefetch), _p(win_pk), _p(comp_pk), int(exact_dims) if win_pk is not None else 0,
                              int(form), bool(qp.get("norm", False)), float(qp.get("eps", 1e-6)), _p(q_freq),
                              int(qp.get("rope_dim", 0)), _p(q_scale), _p(hi), _p(lo), _p(s_out), int(split_heads),
                              bool(split), _p(a8))
        if split_heads > 0:
            return (hi, None, s_out, a8) if split_fp8 else (hi, lo, s_out)
        return out

    def pack_keys(self, x: torch.Tensor, pk_dims: int, split_tail: bool = False) -> torch.Tensor:
        """Key rows x [n, d] float32 as packed rows (int16 [n, pk_dims + 2 (d - pk_dims)]: pk_dims bfloat16 values by
        truncation, then the float32 bits of the rest), the form prefill_attn(packed=True) reads; split_tail: the rest
        as bfloat16 hi (rounded), then bfloat16 lo = rest - hi (rounded), the form 3 rows."""
        n, d = x.shape
        out = torch.empty((n, pk_dims + 2 * (d - pk_dims)), dtype=torch.int16, device=x.device)
        self._stream()
        self.ext.pack_keys(_p(x.contiguous()), n, d, int(pk_dims), _p(out), bool(split_tail))
        return out

    def index_keys(self, q: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor, ratio: int,
                   scale: float, post: dict | None = None) -> torch.Tensor:
        """Per compressed row: Σ_h scale w_h relu(q_h . row) as float64 minus row·1e-300, -inf if not visible.
        post (freq, rope_dim, qat; only where index_keys_v2_takes): q is the raw query, and the kernel applies
        norm_rope's RoPE and QAT rows to it while staging it (the bits of norm_rope(q, di, Hi, pos, **post))."""
        Hi, di = q.shape
        keys = torch.empty(idx.shape[0], dtype=torch.float64, device=self.device)
        q, w = q.contiguous(), w.contiguous()
        self._stream()
        if post is not None or (INDEX_KEYS_V2 and self.ext.index_keys_v2_takes(Hi, di)):
            post = post or {}
            self.ext.index_keys_v2(_p(q), _p(w), _p(idx), idx.shape[0], Hi, di, _p(pos), int(ratio), float(scale),
                                   _p(post.get("freq")), int(post.get("rope_dim", 0)), bool(post.get("qat", False)),
                                   float(1.0 / math.sqrt(di)), _p(keys))
            return keys
        self.ext.index_keys(_p(q), _p(w), _p(idx), idx.shape[0], Hi, di, _p(pos), int(ratio), float(scale), _p(keys))
        return keys

    def index_keys_takes_post(self, Hi: int, di: int) -> bool:
        """Whether index_keys(..., post=) folds the query's norm_rope in (the v16 kernel, DS4_GPU_INDEX_KEYS=2)."""
        return INDEX_KEYS_FOLD and self.ext.index_keys_v2_takes(Hi, di)

    def index_scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_vis: torch.Tensor) -> torch.Tensor | None:
        """Prefill indexer scores (indexer.cu): [T, n] float32, Σ_h w[t, h] relu(q[t, h] . keys[c]) for c < n_vis[t],
        -inf beyond; q [T, Hi, di], w [T, Hi], keys [n, di] float32, all exact in bfloat16 (the indexer QAT's values).
        None where the kernel does not take the shapes."""
        T, Hi, di = q.shape
        if not self.ext.index_scores_takes(Hi, di):
            return None
        n = keys.shape[0]
        q, w = q.contiguous(), w.contiguous()
        kb = keys.to(torch.bfloat16).contiguous()
        vis = n_vis.to(torch.int64).contiguous()
        scores = torch.empty((T, n), dtype=torch.float32, device=self.device)
        self._stream()
        self.ext.index_scores(_p(q), _p(w), _p(kb), n, T, Hi, di, _p(vis), _p(scores))
        return scores

    def topk_rows(self, scores: torch.Tensor, k: int, pos: torch.Tensor | None = None, ratio: int = 1) -> torch.Tensor:
        """int64 [R, k]: per row of float32 scores [R, n], the rows of its k largest in ascending row order (ties to
        the lowest rows, NaN smallest); with pos [R], rows whose (pos + 1) // ratio <= k get 0..k-1."""
        if scores.dtype != torch.float32 or scores.dim() != 2 or scores.stride(1) != 1:
            raise ValueError(f"topk_rows: scores must be [R, n] float32 with unit column stride, got {scores.dtype} "
                             f"{tuple(scores.shape)}")
        R, n = scores.shape
        sel = torch.empty((R, k), dtype=torch.int64, device=self.device)
        if R == 0:
            return sel
        pos = None if pos is None else pos.to(torch.int64).contiguous()
        self._stream()
        self.ext.topk_rows_f32(_p(scores), n, scores.stride(0), R, int(k), _p(pos), int(ratio), _p(sel))
        return sel

    def comp_pool_chunk(self, kv, kv_r, sc, sc_r, ape, s_kv, s_sc, r: int, off: int, live0: int,
                        n_full: int) -> torch.Tensor | None:
        """The pooled rows [n_full, d] of a prefill chunk's finished compressor windows (compress_prefill.cu): the
        sequence is the frontier's rows live0 .. live0 + off - 1, then the chunk's rows kv * kv_r and sc * sc_r +
        ape[k % r] (kv, sc [T, width] float32; kv_r, sc_r [T] or [T, 1], or None for 1). None where the kernel does not
        take the ratio and width."""
        T, width = kv.shape
        if not self.ext.comp_pool_takes(int(r), int(width)):
            return None
        ts = [t.contiguous() if t is not None else None for t in (kv, kv_r, sc, sc_r, ape, s_kv, s_sc)]
        if any(t is not None and t.dtype != F32 for t in ts) or sc.shape != kv.shape or ape.shape != (r, width) \
                or s_kv.shape[1] != width or s_kv.shape != s_sc.shape:
            raise ValueError(f"comp_pool_chunk: float32 kv, sc [T, {width}], ape [{r}, {width}] and the frontier "
                             f"[rows, {width}]")
        if (kv_r is not None and kv_r.numel() != T) or (sc_r is not None and sc_r.numel() != T):
            raise ValueError(f"comp_pool_chunk: one rescale per row ({T})")
        d = width // 2 if r == 4 else width
        out = torch.empty((n_full, d), dtype=F32, device=self.device)
        self._stream()
        self.ext.comp_pool_chunk(*(_p(t) for t in ts), int(width), int(r), int(off), int(live0), int(n_full), _p(out))
        return out

    def topk(self, keys: torch.Tensor, k: int, pos: torch.Tensor | None = None, ratio: int = 1) -> torch.Tensor:
        """int64 [k]: the rows of the k largest float64 keys in ascending row order (the same set as
        torch.topk; ties go to the lowest rows, NaN counts as smallest). With pos, when (pos + 1) // ratio <= k
        rows are visible: 0..k-1 (the attention masks the rows not yet visible); else the top-k of the visible rows
        only (index_keys writes -inf past them; the keys there are not read)."""
        if keys.dtype != torch.float64 or keys.dim() != 1:
            raise ValueError(f"topk: keys must be 1-D float64, got {keys.dtype} {tuple(keys.shape)}")
        keys = keys.contiguous()
        sel = torch.empty(k, dtype=torch.int64, device=self.device)
        self._stream()
        self.ext.topk_rows(_p(keys), keys.numel(), int(k), _p(pos), int(ratio), _p(sel))
        return sel


def compress_steps(sess, li: int, a: torch.Tensor, pos: torch.Tensor) -> None:
    """The decode compressor steps of layer li (and its indexer's on ratio-4 layers): they read only the
    normalized input a and the layer's compressor state, so they may run on a side branch. With sess.comp_ring
    (comp_defer): a into the ring, and the products only on a window's last step, of all its rows."""
    from ds4.gguf_tools import constants as C

    L = C.LayerTensor
    cfg, W, K, st = sess.cfg, sess.W, sess.K, sess.layers[li]
    r = cfg.ratio(li)
    fp8 = cfg.n_nope if cfg.fp8_kv else 0
    jobs = (False, True) if r == 4 else (False,)
    names_of = {True: (L.IDX_COMP_KV, L.IDX_COMP_GATE, L.IDX_COMP_APE, L.IDX_COMP_NORM),
                False: (L.COMP_KV, L.COMP_GATE, L.COMP_APE, L.COMP_NORM)}
    mats = [C.blk(li, names_of[ix][j]) for ix in jobs for j in (0, 1)]
    # both compressors' kv and score products in one launch where the four matrices share type and width (and the
    # indexer's proj, which reads a too, as a fifth: DS4_GPU_IDX_MERGE=comp)
    ws = [W.mat(n) for n in mats]
    one = all(not isinstance(w, torch.Tensor) for w in ws) and len({(w.qtype, w.ncols) for w in ws}) == 1
    proj = C.blk(li, L.IDX_PROJ)
    with_proj = one and r == 4 and idx_merged(sess, li, "comp") and not isinstance(W.mat(proj), torch.Tensor) and \
        (W.mat(proj).qtype, W.mat(proj).ncols) == (ws[0].qtype, ws[0].ncols)
    early_proj = EARLY_IDX_PROJ and indexer_runs(sess, li)
    ring, x = sess.comp_ring, a
    if ring is not None:
        if li not in ring.by_pre:  # else the mHC pre wrote a there (DS4_GPU_RING_HC)
            ring.store(li, a, pos)
        if not ring.pools(li):  # nothing but the indexer's head weights, which this step's index keys read
            if with_proj or early_proj:
                sess._idx_proj[li] = W.mm(proj, a)
            return
        x = ring.rows[li]  # [r, n_embd]: this step's a is the last row
    many = W.mm_many if ring is None else partial(comp_defer.products, W)  # a ring's rows: batched, no scratch
    outs = many(mats + [proj] * with_proj, x) if one else \
        [y for i in range(0, len(mats), 2) for y in many(mats[i:i + 2], x)]
    if with_proj:
        sess._idx_proj[li] = outs[-1][-1:]  # taken by index_select after the side branch joins
    if early_proj:
        # the indexer's head weights need only a: on this (side) branch they leave the indexer's chain
        sess._idx_proj[li] = W.mm(proj, a)
    in_kernel = ring is not None and comp_defer.KERNEL_FILL and r == 4 and sess.W.ext.compress_ring_takes(4)
    rings = [None] * len(jobs)
    if in_kernel:  # the compress step reads the window's products (the earlier phases) itself
        rings = [(outs[2 * j], outs[2 * j + 1], ring.start) for j in range(len(jobs))]
        outs = [y[-1:] for y in outs]
    elif ring is not None:  # the window's earlier steps into the frontier, then this step's rows as before
        for j, indexer in enumerate(jobs):
            s_kv, s_sc = (st["idx_kv"], st["idx_score"]) if indexer else (st["comp_kv"], st["comp_score"])
            sc = outs[2 * j + 1] + W.vec(C.blk(li, names_of[indexer][2]))
            ring.fill(4 if indexer else r, outs[2 * j], sc, s_kv, s_sc, first=pos - (x.shape[0] - 1),
                      upto=x.shape[0] - 1)
        outs = [y[-1:] for y in outs]
    steps = []
    for j, indexer in enumerate(jobs):
        names = names_of[indexer]
        s_kv, s_sc, rows = (st["idx_kv"], st["idx_score"], st["idx"]) if indexer else \
            (st["comp_kv"], st["comp_score"], st["comp"])
        steps.append(dict(kv=outs[2 * j], sc=outs[2 * j + 1], ape=W.vec(C.blk(li, names[2])), s_kv=s_kv, s_sc=s_sc,
                          rows=rows, pos=pos, r=4 if indexer else r, norm_w=W.vec(C.blk(li, names[3])),
                          eps=cfg.rms_eps, freq=sess._freq[True], rope_dim=cfg.rope_dim,
                          fp8_nope=0 if indexer else fp8, qat=bool(indexer and cfg.indexer_qat), ring=rings[j]))
    if COMPRESS_ONE and len(steps) == 2:  # both compressors of a ratio-4 layer in one launch, side by side
        K.compress_step(**steps[0], also={k: v for k, v in steps[1].items() if k != "pos"})
    else:
        for step in steps:
            K.compress_step(**step)


def indexer_sized(sess, li: int) -> bool:
    """Whether layer li's compressed rows can outnumber the indexer's top-k in this session (ratio 4, its capacity)."""
    cfg = sess.cfg
    return cfg.ratio(li) == 4 and sess.layers[li]["comp"].shape[0] > cfg.indexer_top_k


def index_on_at(sess, pos: int) -> bool:
    """Whether the decode step at host position pos runs the indexer of the layers that have one (SHORT_INDEX: only
    where (pos + 1) / 4 rows are visible past top-k; always while sess._index_forced, the warm-up's graphs)."""
    return not SHORT_INDEX or sess._index_forced or (pos + 1) // 4 > sess.cfg.indexer_top_k


def indexer_runs(sess, li: int) -> bool:
    """Whether this decode step runs layer li's indexer (sess._index_on: index_on_at of the step's position)."""
    return indexer_sized(sess, li) and sess._index_on


def idx_merged(sess, li: int, part: str) -> bool:
    """Whether decode layer li runs the indexer's `part` (qb: q_b and the query's post; comp: proj) inside other
    launches (DS4_GPU_IDX_MERGE): an indexed ratio-4 layer whose indexer is not on a side branch."""
    return part in IDX_MERGE and sess._in_step and sess.K is not None and indexer_runs(sess, li) and \
        "idx" not in sess._branches


def visible_comp(sess, li: int) -> torch.Tensor:
    """Layer li's compressed rows a decode step without its indexer attends: where the indexer is sized but off this
    step, the first top-k rows, which hold every visible one (the attention's grid stays the selected rows')."""
    comp = sess.layers[li]["comp"]
    return comp[:sess.cfg.indexer_top_k] if indexer_sized(sess, li) and not sess._index_on else comp


def index_select(sess, li: int, a: torch.Tensor, c: torch.Tensor, q_norm, pos: torch.Tensor,
                 qi: torch.Tensor | None = None) -> torch.Tensor:
    """The indexer's top-k compressed rows for the decode token of ratio-4 layer li (its compressor step done).
    qi: the indexer's query rows already through their RoPE/QAT (idx_merged); None: computed here."""
    from ds4.gguf_tools import constants as C

    L = C.LayerTensor
    cfg, W, K, st = sess.cfg, sess.W, sess.K, sess.layers[li]
    Hi, di = cfg.indexer_heads, cfg.indexer_dim
    q_post = dict(freq=sess._freq[True], rope_dim=cfg.rope_dim, qat=cfg.indexer_qat)
    folded = False
    if qi is None:
        qi = W.mm(C.blk(li, L.IDX_Q_B), c, norm=q_norm)
        folded = K.index_keys_takes_post(Hi, di)  # the query's RoPE/QAT inside index_keys: one launch less
        if not folded:
            qi = K.norm_rope(qi, di, Hi, pos, **q_post)
    wi = sess._idx_proj.pop(li, None)  # launched with the compressor steps (EARLY_IDX_PROJ)
    if wi is None:
        wi = W.mm(C.blk(li, L.IDX_PROJ), a)
    keys = K.index_keys(qi.reshape(Hi, di), wi.reshape(-1), st["idx"], pos, 4, 1.0 / math.sqrt(di * Hi),
                        post=q_post if folded else None)
    # one block: faster than torch.topk up to some 50k rows (H200), slower at 262144
    return K.topk(keys, cfg.indexer_top_k, pos, 4) if keys.numel() <= TOPK_KERNEL_MAX_ROWS else \
        torch.topk(keys, cfg.indexer_top_k).indices


def attn_step(sess, li: int, a: torch.Tensor, c: torch.Tensor, kv_lin: torch.Tensor, pos: torch.Tensor):
    """The decode attention sublayer of layer li with the fused kernels (session._attn_step's meaning). c: the
    normalized q_a, or (q_a, (norm weight, eps)) for q_b's matvecs to normalize (DS4_GPU_NORM_FOLD)."""
    from ds4.gguf_tools import constants as C

    L = C.LayerTensor
    cfg, W, K, st = sess.cfg, sess.W, sess.K, sess.layers[li]
    r = cfg.ratio(li)
    H, d, rd = cfg.n_head, cfg.head_dim, cfg.rope_dim
    freq = sess._freq[r != 0]
    fp8 = cfg.n_nope if cfg.fp8_kv else 0
    kv_job = dict(x=kv_lin, d=d, rows_per_token=1, norm=True, w=W.vec(C.blk(li, L.ATTN_KV_A_NORM)), eps=cfg.rms_eps,
                  freq=freq, rope_dim=rd, fp8_nope=fp8, out=st["raw"], ring_cap=sess.raw_cap)
    c, q_norm = c if isinstance(c, tuple) else (c, None)
    indexed = indexer_runs(sess, li)
    side_index = indexed and sess._in_step and "idx" in sess._branches
    sel = None
    if side_index:  # the indexer's chain beside q_b and its RoPE (DS4_GPU_BRANCH=idx)
        with sess.side.fork():  # after this layer's compressor steps when those are on the side already
            if not sess._comp_forked:
                compress_steps(sess, li, a, pos)
            sel = index_select(sess, li, a, c, q_norm, pos)
    merged = indexed and not side_index and idx_merged(sess, li, "qb")
    also, qi = [kv_job], None
    if merged:  # the indexer's q_b in q_b's launch, its query's RoPE/QAT in the query's norm_rope launch
        q_lin, qi_lin = W.mm_many([C.blk(li, L.ATTN_Q_B), C.blk(li, L.IDX_Q_B)], c, norm=q_norm)
        Hi, di = cfg.indexer_heads, cfg.indexer_dim
        qi = torch.empty((Hi, di), dtype=torch.float32, device=sess.device)
        also.append(dict(x=qi_lin, d=di, rows_per_token=Hi, freq=sess._freq[True], rope_dim=rd,
                         qat=cfg.indexer_qat, out=qi))
    else:
        q_lin = W.mm(C.blk(li, L.ATTN_Q_B), c, norm=q_norm)
    sess.prefetch("oa", [C.blk(li, L.ATTN_OUTPUT_A)], cfg.o_groups)  # o_a and o_b stream after the attention
    sess.prefetch("ob", [C.blk(li, L.ATTN_OUTPUT_B)])
    q = K.norm_rope(q_lin, d, H, pos, norm=True, eps=cfg.rms_eps, freq=freq, rope_dim=rd,
                    also=also)  # the KV row into the ring in the same launch
    comp = None
    if r:
        if sess._comp_forked or side_index:  # launched on the side branch (DS4_GPU_BRANCH=comp / idx)
            sess.side.join()
        else:
            compress_steps(sess, li, a, pos)
        comp = visible_comp(sess, li)
        if indexed and not side_index:
            sel = index_select(sess, li, a, c, q_norm, pos, qi=qi)
    o = K.attention(q, st["raw"], comp, sel, r, pos, W.vec(C.blk(li, L.ATTN_SINKS)), freq, rd)
    if weights.OB_SLICES:  # o_b's two column-slice parts (DS4_GPU_OB_SLICES=2), which the next mHC post adds
        return W.mm_then_parts(C.blk(li, L.ATTN_OUTPUT_A), o.reshape(1, H * d), cfg.o_groups, C.blk(li, L.ATTN_OUTPUT_B))
    return W.mm_then(C.blk(li, L.ATTN_OUTPUT_A), o.reshape(1, H * d), cfg.o_groups, C.blk(li, L.ATTN_OUTPUT_B))
