"""The CUDA engine: DeepSeek V4 with the whole forward pass on the device, behind the Session API.

    from ds4.engine.gpu.session import Session
    s = Session(model, ctx=8192)          # uploads the quantized weights once (ds4.engine.gpu)
    logits = s.sync(prompt_ids)           # chunked prefill on the GPU
    logits = s.decode(tok)                # one CUDA-graph replay per token
    toks = s.greedy(64)                   # argmax on the device; only token ids cross to the host

Same API and state layout as ds4.engine.session.Session (runtime-spec §6.1): tokens, logits,
sync/prefill/decode, kv_bytes, snapshot/restore producing the same DSV4 payload (the state is
copied to the host in the CPU layout). Hooks (steering) are not supported here.

Design. The model math of model-spec §3-4 is written once in torch over device tensors
(ds4.engine.gpu.ops); weight products go through the resident-weight kernels of the extension
(fused dequant matvec for B ≤ 8, routed MoE) on CUDA, or through float32 matmuls on the CPU
(the same code then runs without a GPU, which is how its logic is tested against the numpy
engine). Two paths share the sublayers:
- `_chunk` (prefill, any T): dynamic shapes, the raw window from ring + chunk, compressors
  pooled window-by-window from the frontier, the indexer's top-k per query (stable, lowest index
  first), as ds4.engine.forward does; each query attends to its window (a sliding view) and its
  own compressed rows (gathered), in blocks of queries; weight products of 16+ rows are f16
  tensor-core GEMMs on weights dequantized per call, split hi/lo so they agree with float32
  (ds4.engine.gpu.weights), and chunks are long (8192 tokens) because every chunk dequantizes
  every weight once;
- `_step` (decode, T = 1): static shapes only (positions are a device tensor; ring rows, visible
  compressed rows and the emission of a compressed row are masks and `where`s), so the whole
  token is captured once in a CUDA graph and replayed.
"""

from __future__ import annotations

import contextlib
import math
import os

import numpy as np
import torch

from ds4.engine.rope import inv_freq
from ds4.engine.session import RESUME_PREFILL_MIN, SessionError, Timeline, kv_bytes_per_token
from ds4.engine.session import Session as CpuSession
from ds4.gguf_tools import constants as C

from . import branches, comp_defer, fused, ops, prefill, tc
from .weights import Weights, default_device

L = C.LayerTensor
F32 = torch.float32
ROUTE_DENOM_MIN = 6.1035e-5



PREFETCH_POINTS = ("oa", "ob", "sh", "qb")
PF_SIDE = os.environ.get("DS4_GPU_PF_SIDE", "1") != "0"
# decode with the fused kernels: q_a's RMS norm applied by q_b's (and the indexer's q_b) matvec while it stages x,
# not by its own launch (the same bits); read once, "0" turns it off. The default since v19: 7.27 / 7.35 against
# 7.31 / 7.39 ms at 2k / 8k (v18: 7.33 / 7.41 against 7.35 / 7.42)
NORM_FOLD = os.environ.get("DS4_GPU_NORM_FOLD", "1") == "1"
# prefill: the q_b GEMM's per-row rescale (weights.mm_unscaled) applied by norm_rope as it loads the rows instead of a
# separate pass over [T, 32768] (v12 profile: 34 ms per 8192-token prefill); the same bits. Default since v13. Since
# v31 the indexer's q_b too (its [T, 8192] multiply: 3.2 ms per 8192-token prefill in v30's profile).
FOLD_RESCALE = os.environ.get("DS4_GPU_FOLD_RESCALE", "1") == "1"
# prefill: o_b's and the shared expert's per-row rescales (weights.mm_unscaled) applied by the mHC post as it reads
# them (hc_post's r1, r2) instead of a torch multiply over [T, 4096] each (call 2's profile: 8.7 ms per 8192-token
# prefill); the same bits. v28; "0" turns it off.
FOLD_POST = os.environ.get("DS4_GPU_FOLD_POST", "1") == "1"
# Session._reserve_prefill: `auto` (default, v31), a size in MiB, or 0 (off)
PREFILL_RESERVE = os.environ.get("DS4_GPU_PREFILL_RESERVE", "auto").strip().lower() or "auto"


def parse_prefetch(spec: str) -> dict[str, float]:
    """DS4_GPU_PREFETCH: decode L2 prefetch points separated by "," or "+", each `name` or `name:fraction` (of the
    weights' bytes): oa / ob (o_a, o_b: asked for after q_b's launch), sh (shared expert: after o_b), qb (the
    next layer's q_a, kv and q_b: after the shared expert)."""
    out = {}
    for item in filter(None, (t.strip() for t in spec.replace("+", ",").split(","))):
        name, _, frac = item.partition(":")
        try:
            out[name] = float(frac) if frac else 1.0
        except ValueError:
            raise SessionError(f"DS4_GPU_PREFETCH: bad fraction in {item!r} (want name or name:0.5)") from None
        if name not in PREFETCH_POINTS or not 0.0 <= out[name] <= 1.0:
            raise SessionError(f"DS4_GPU_PREFETCH: {item!r} is not one of {', '.join(PREFETCH_POINTS)} with a "
                               "fraction in [0, 1]")
    return out

class Session(Timeline):
    greedy_on_device = True  # ds4-bench's sweep times greedy(n, banned=EOS): no logits cross to the host per token
    def __init__(self, model, ctx: int = 4096, prefill_chunk: int = 8192, hooks=None, impl: str | None = None,
                 progress=None, device: str | torch.device | None = None, graphs: bool | None = None,
                 weights: Weights | None = None):
        if hooks is not None:
            raise SessionError("the CUDA engine has no hooks; use the CPU backend for steering")
        if ctx < 2:
            raise SessionError(f"context must be at least 2 tokens, got {ctx}")
        self.model = model
        self.cfg = model.config
        self.ctx = int(ctx)
        self.prefill_chunk = int(min(prefill_chunk, ctx))
        self.hooks = None
        self.route_hook = None  # (layer, ids [T, k], biased scores [T, E]) -> ids; eager paths only
        self.progress = progress
        self.device = torch.device(device) if device is not None else default_device()
        self.graphs = (self.device.type == "cuda" and os.environ.get("DS4_GPU_GRAPHS", "1") != "0") \
            if graphs is None else graphs
        self.W = weights if weights is not None else Weights.shared(model, self.device)  # one upload per model
        cfg = self.cfg
        self._freq = {c: torch.from_numpy(inv_freq(cfg, c)).to(self.device) for c in (False, True)}
        self.raw_window = min(cfg.sliding_window, self.ctx)
        self.raw_cap = self.raw_window
        self._alloc_state()
        # decode's compressor products deferred to each window's last step (comp_defer); None: every step
        self.comp_ring = comp_defer.CompRing(cfg, self.device) if comp_defer.DEFER and comp_defer.takes(self) else None
        self._tokens: list[int] = []
        self._logits: torch.Tensor | None = None
        self._tok = torch.zeros(1, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(1, dtype=torch.long, device=self.device)
        # greedy's output list on the device: the argmax after the step at position p writes the token of p + 1 here
        self._hist = torch.zeros(self.ctx + 1, dtype=torch.long, device=self.device)
        self._banned = torch.full((1,), -1, dtype=torch.long, device=self.device)  # greedy(banned=): never chosen
        self._idx_proj: dict[int, torch.Tensor] = {}  # fused.compress_steps -> fused.index_select, per layer
        self._xq: torch.Tensor | None = None  # _xq_buf
        # decode graphs per step kind (comp_defer.step_kind): kind -> (graph, its logits, the extension's scratch
        # generation it was captured under)
        self._graphs: dict[tuple, tuple] = {}
        # torch.compile fuses the elementwise chains of the decode step (Sinkhorn, roundings, RoPE)
        # into a few kernels each; DS4_GPU_COMPILE=0 turns it off, and any compile error does too.
        self._compile = self.device.type == "cuda" and os.environ.get("DS4_GPU_COMPILE", "1") != "0"
        self._compiled: dict[str, object] = {}
        self._in_step = False
        self._index_on, self._index_forced = True, False  # this step runs the indexer (fused.index_on_at)
        self.K = None  # fused CUDA kernels (ds4.engine.gpu.fused); DS4_GPU_FUSED=0 keeps the torch ops
        if self.device.type == "cuda" and os.environ.get("DS4_GPU_FUSED", "1") != "0":
            self.K = fused.Fused(self.W.ext, self.device)
        self._pf = parse_prefetch(os.environ.get("DS4_GPU_PREFETCH", "")) if self.K is not None else {}
        self._pf_stream, self._pf_joins = None, False
        # decode graph branches (DS4_GPU_BRANCH): independent work on a side stream
        self._branches = branches.BRANCHES if self.K is not None else frozenset()
        self.side = branches.SideStream(self.W.ext, self.device) if self._branches else None
        self.hc_defer = branches.DeferredSinkhorn(self.K, self.device) if branches.HC_DEFER and self.K is not None \
            else None
        self._comp_forked = False
        self.tc_attn = tc.TC_ATTN and self.device.type == "cuda"  # prefill attention products on tensor cores
        self.tf32_attn = tc.TF32_ATTN and self.device.type == "cuda"  # ... as TF32 (a speed mode)
        self.load_weights()
        self._reserve_prefill()

    def _reserve_prefill(self) -> None:
        """Grow torch's cache once to a prefill chunk's working set (DS4_GPU_PREFILL_RESERVE: `auto`, MiB, or 0):
        the first long prompt otherwise pays the allocator's growth inside its layers (13 cudaMalloc calls in the
        first 8192-token prefill, later runs none; v31 call 2: that first prefill 4976 -> 5000 t/s, 2048 tokens 4126
        -> 4159). One allocation, freed at once: it stays cached (torch splits it for the chunk's tensors and returns
        it to the device on an out-of-memory retry)."""
        if self.device.type != "cuda" or PREFILL_RESERVE == "0":
            return
        if PREFILL_RESERVE == "auto":  # 11 residual streams' bytes per token: v30's torch peak 5.7 GiB at 8192, Flash
            want = 11 * self.cfg.n_hc * self.cfg.n_embd * 4 * self.prefill_chunk
        else:
            want = int(float(PREFILL_RESERVE) * 2**20)
        free, _ = torch.cuda.mem_get_info(self.device)
        want = min(want, free // 2)
        if want >= 64 * 2**20:
            block = torch.empty(want, dtype=torch.uint8, device=self.device)
            del block

    def _f(self, name: str):
        """ops.<name>, compiled when running the decode step on CUDA."""
        fn = getattr(ops, name)
        if not (self._compile and self._in_step):
            return fn
        c = self._compiled.get(name)
        if c is None:
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
            compiled = torch.compile(fn, dynamic=False)

            def c(*args, _compiled=compiled, _fn=fn, **kw):
                if not self._compile:
                    return _fn(*args, **kw)
                try:
                    return _compiled(*args, **kw)
                except Exception as e:  # noqa: BLE001 - fall back to eager ops for good
                    import warnings

                    warnings.warn(f"torch.compile failed ({type(e).__name__}: {e}); decode runs eager ops")
                    self._compile = False
                    return _fn(*args, **kw)
            self._compiled[name] = c
        return c

    # ---- setup -------------------------------------------------------------------------------
    def load_weights(self) -> None:
        """Upload every weight now (keeps uploads out of timings)."""
        cfg, W = self.cfg, self.W
        W.embedding()
        fused = self.K is not None  # the fused hc_pre reads the mHC fns as float32
        W.mat(C.OUTPUT)
        W.dense(C.OUTPUT_HC_FN) if fused else W.mat(C.OUTPUT_HC_FN)
        for name in (C.OUTPUT_NORM, C.OUTPUT_HC_SCALE, C.OUTPUT_HC_BASE):
            W.vec(name)
        for li in range(cfg.n_layer):
            for t in L:
                name = C.blk(li, t)
                if not self.model.has(name):
                    continue
                if t == L.FFN_GATE_TID2EID:
                    W.ids(name)
                elif fused and t in (L.HC_ATTN_FN, L.HC_FFN_FN):
                    W.dense(name)
                elif len(self.model.shape(name)) == 1 or t in (L.COMP_APE, L.IDX_COMP_APE):
                    W.vec(name)
                else:
                    W.mat(name)

    def _alloc_state(self) -> None:
        cfg, dev = self.cfg, self.device
        self.layers = []
        for i in range(cfg.n_layer):
            r = cfg.ratio(i)
            st = {"raw": torch.zeros((self.raw_cap, cfg.head_dim), dtype=F32, device=dev)}
            if r:
                rows, w = self.ctx // r + 2, cfg.compressor_width(i)
                fr = (2 * r if r == 4 else r, w)
                st["comp"] = torch.zeros((rows, cfg.head_dim), dtype=F32, device=dev)
                st["comp_kv"] = torch.zeros(fr, dtype=F32, device=dev)
                st["comp_score"] = torch.full(fr, -math.inf, dtype=F32, device=dev)
            if r == 4:
                rows = self.ctx // 4 + 2
                st["idx"] = torch.zeros((rows, cfg.indexer_dim), dtype=F32, device=dev)
                st["idx_kv"] = torch.zeros((8, 2 * cfg.indexer_dim), dtype=F32, device=dev)
                st["idx_score"] = torch.full((8, 2 * cfg.indexer_dim), -math.inf, dtype=F32, device=dev)
            self.layers.append(st)

    def _reset_state(self) -> None:
        for st in self.layers:
            for k, t in st.items():
                t.fill_(-math.inf if k.endswith("score") else 0.0)
        if getattr(self, "comp_ring", None) is not None:
            self.comp_ring.synced(0)

    # ---- timeline (Timeline: tokens, pos, common_prefix, sync) -----------------------------------
    @property
    def logits(self) -> np.ndarray | None:
        return None if self._logits is None else self._logits.float().cpu().numpy()

    @logits.setter
    def logits(self, value) -> None:
        self._logits = None if value is None else torch.as_tensor(np.asarray(value, np.float32)).to(self.device)

    def invalidate(self) -> None:
        self._reset_state()
        self._tokens = []
        self._logits = None

    def _has_logits(self) -> bool:
        return self._logits is not None  # without copying them to the host

    def decode(self, token: int) -> np.ndarray:
        self._decode_device(int(token))
        return self.logits

    def prefill(self, tokens, all_logits: bool = False) -> np.ndarray:
        tokens = [int(t) for t in tokens]
        if not tokens:
            return np.zeros((0, self.cfg.vocab_size), np.float32) if all_logits else self.logits
        if self.pos + len(tokens) > self.ctx:
            raise SessionError(f"prompt exceeds context ({self.pos + len(tokens)} tokens, ctx {self.ctx})")
        self._check_ids(tokens)
        outs = []
        if len(tokens) < RESUME_PREFILL_MIN and self.pos > 0:
            for t in tokens:
                self._decode_device(t)
                outs.append(self._logits[None])
        else:
            done, total = 0, len(tokens)
            while done < total:
                n = min(self.prefill_chunk - self.pos % self.prefill_chunk, total - done)
                outs.append(self._run_chunk(tokens[done:done + n], all_logits))
                done += n
                if self.progress is not None:
                    self.progress(done, total)
        if all_logits:
            return torch.cat(outs).float().cpu().numpy()
        return self.logits

    def _check_ids(self, tokens) -> None:
        if min(tokens) < 0 or max(tokens) >= self.cfg.vocab_size:
            raise SessionError(f"token id out of range 0..{self.cfg.vocab_size - 1}")

    def _run_chunk(self, tokens: list[int], all_logits: bool) -> torch.Tensor:
        try:
            with torch.no_grad():
                if self.comp_ring is not None:  # the chunk reads the frontiers: the decode steps' pending rows first
                    self.comp_ring.flush(self, self.pos)
                out = self._chunk(torch.tensor(tokens, dtype=torch.long, device=self.device), self.pos, all_logits)
        except BaseException:
            self.invalidate()
            raise
        finally:
            self.W.clear_splits()  # the chunk's activation splits: not held into decode
        self._tokens.extend(tokens)
        if self.comp_ring is not None:
            self.comp_ring.synced(self.pos)
        self._logits = out[-1].clone()
        return out

    def _decode_device(self, token: int) -> torch.Tensor:
        if self.pos + 1 > self.ctx:
            raise SessionError(f"context full ({self.ctx} tokens)")
        self._check_ids([token])
        self._tok.fill_(token)
        self._step_from_buffers()
        self._tokens.append(token)
        return self._logits

    def _step_from_buffers(self, fill_pos: bool = True) -> None:
        """One decode step reading the token from self._tok at position self.pos (device-only). Its argmax feeds the
        next step (self._argmax_feed); fill_pos=False: self._pos already holds self.pos (greedy: the feed put it)."""
        if fill_pos:
            self._pos.fill_(self.pos)
        kind = self._step_key(self.pos)
        try:
            with torch.no_grad():
                if not self.graphs:
                    self._logits = self._step(self._tok, self._pos, kind)
                    self._argmax_feed(self._logits)
                elif not self._graph_fresh(kind):
                    self._capture(kind)
                else:
                    graph, self._logits, _ = self._graphs[kind]
                    graph.replay()
            if self.comp_ring is not None:
                self.comp_ring.dirty = True  # rows may be pending in the ring (flush)
        except BaseException:
            self.invalidate()
            raise

    def _step_key(self, pos: int) -> tuple:
        """A decode step's kind (its graph's key): the compressor ratios that pool at pos (comp_defer.step_kind, with
        deferred products), then whether it runs the indexer (fused.index_on_at)."""
        sized = any(fused.indexer_sized(self, li) for li in range(self.cfg.n_layer))  # else one graph serves both
        return (comp_defer.step_kind(self.cfg, pos) if self.comp_ring is not None else (),
                not sized or fused.index_on_at(self, pos))

    @contextlib.contextmanager
    def indexer_forced(self):
        """Decode steps inside run the indexer at every position: a warm-up at a short context captures the graphs
        that longer ones replay (ds4-bench)."""
        self._index_forced = True
        try:
            yield
        finally:
            self._index_forced = False

    def _scratch_generation(self) -> int:
        return self.W.ext.scratch_generation() if self.W.ext is not None else 0

    def _graph_fresh(self, kind: tuple) -> bool:
        """Whether the decode graph of this step kind may be replayed: it exists, and the extension's shared scratch
        (which a longer prefill chunk or another session may have grown since, freeing the buffer the graph points
        into) is the one it was captured with. A stale graph is captured again, from the same buffers, by the next
        step of its kind."""
        return kind in self._graphs and self._graphs[kind][2] == self._scratch_generation()

    def _capture(self, kind: tuple) -> None:
        """Run the first decode of a kind eagerly (it is a real step), then capture the next one's graph."""
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            logits = self._step(self._tok, self._pos, kind)
            self._argmax_feed(logits)
        torch.cuda.current_stream(self.device).wait_stream(s)
        self._logits = logits.clone()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = self._step(self._tok, self._pos, kind)
            self._argmax_feed(out)
        self._graphs[kind] = (g, out, self._scratch_generation())

    def _xq_buf(self, n: int) -> torch.Tensor:
        """The routed experts' pre-quantized x (one token of n columns), allocated once per session."""
        if self._xq is None or self._xq.numel() < self.W.ext.xq_bytes(1, n):
            self._xq = torch.empty(self.W.ext.xq_bytes(1, n), dtype=torch.uint8, device=self.device)
        return self._xq

    def _argmax_feed(self, logits: torch.Tensor) -> None:
        """Greedy's next step, on the device: self._tok = the argmax of the logits, self._pos += 1, and the token
        recorded at self._hist[self._pos] (one launch of the fused kernel where there is one)."""
        if self.K is not None:
            self.K.argmax_into(logits.reshape(-1), self._tok, self._pos, self._hist, self._banned)
        else:
            x = logits.reshape(-1)
            self._tok.copy_(torch.argmax(torch.where(torch.arange(x.numel(), device=x.device) == self._banned,
                                                     -math.inf, x)).view(1))
            self._pos += 1
            self._hist.index_copy_(0, self._pos.clamp(0, self._hist.numel() - 1), self._tok)

    def warm_steps(self) -> int:
        """Decode steps from here that run every kind of compressor step, so every decode graph of the current indexer
        setting is captured (one per kind, with deferred compressor products; indexer_forced for the indexed ones)."""
        return comp_defer.steps_to_every_kind(self.cfg, self.pos)

    def greedy(self, n: int, banned: int | None = None) -> list[int]:
        """Decode n tokens greedily from the current logits; argmax stays on the device. banned: a token id never
        chosen (ds4-bench's EOS: the next best instead, as speed_bench.frontier.argmax_excluding)."""
        if self._logits is None:
            raise SessionError("greedy needs a prompt first")
        if self.pos + n > self.ctx:
            raise SessionError(f"context full ({self.ctx} tokens)")
        p0 = self.pos
        self._banned.fill_(-1 if banned is None else int(banned))
        self._pos.fill_(p0 - 1)
        self._argmax_feed(self._logits)  # the token of p0 into self._tok and self._hist[p0]; self._pos = p0
        for _ in range(n):  # each step's argmax feeds the next one: a graph replay per token and nothing else
            self._step_from_buffers(fill_pos=False)
            self._tokens.append(-1)  # filled below (host learns the ids once, at the end)
        ids = self._hist[p0:p0 + n].cpu().tolist()
        self._tokens[len(self._tokens) - n:] = ids
        return ids

    # ---- memory ------------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        return sum(t.numel() * 4 for st in self.layers for t in st.values())

    def kv_bytes_per_token(self) -> float:
        return kv_bytes_per_token(self.cfg)

    # ---- payload (the CPU engine's format, via a host copy of the state) -----------------------
    def _cpu_session(self) -> CpuSession:
        s = CpuSession(self.model, ctx=self.ctx, prefill_chunk=self.prefill_chunk)
        return s

    def snapshot(self) -> bytes:
        if self.comp_ring is not None:  # the payload holds whole frontiers
            with torch.no_grad():
                self.comp_ring.flush(self, self.pos)
        s = self._cpu_session()
        n = self.pos
        s.state.n_tokens = n
        for i, (ls, st) in enumerate(zip(s.state.layers, self.layers)):
            ls.raw[:] = st["raw"].cpu().numpy()
            if ls.ratio:
                ls.n_comp = n // ls.ratio
                ls.comp[:ls.n_comp] = st["comp"][:ls.n_comp].cpu().numpy()
                ls.comp_kv[:] = st["comp_kv"].cpu().numpy()
                ls.comp_score[:] = st["comp_score"].cpu().numpy()
            if ls.ratio == 4:
                ls.n_idx = n // 4
                ls.idx[:ls.n_idx] = st["idx"][:ls.n_idx].cpu().numpy()
                ls.idx_kv[:] = st["idx_kv"].cpu().numpy()
                ls.idx_score[:] = st["idx_score"].cpu().numpy()
        s._tokens = list(self._tokens)
        s.logits = self.logits
        return s.snapshot()

    def restore(self, payload: bytes) -> None:
        s = self._cpu_session()
        try:
            s.restore(payload)
        except SessionError:
            self.invalidate()
            raise
        for ls, st in zip(s.state.layers, self.layers):
            st["raw"].copy_(torch.from_numpy(ls.raw))
            if ls.ratio:
                st["comp"].zero_()
                st["comp"][:ls.n_comp].copy_(torch.from_numpy(ls.comp[:ls.n_comp]))
                st["comp_kv"].copy_(torch.from_numpy(ls.comp_kv))
                st["comp_score"].copy_(torch.from_numpy(ls.comp_score))
            if ls.ratio == 4:
                st["idx"].zero_()
                st["idx"][:ls.n_idx].copy_(torch.from_numpy(ls.idx[:ls.n_idx]))
                st["idx_kv"].copy_(torch.from_numpy(ls.idx_kv))
                st["idx_score"].copy_(torch.from_numpy(ls.idx_score))
        self._tokens = s.tokens
        if self.comp_ring is not None:
            self.comp_ring.synced(self.pos)
        self.logits = s.logits

    # ---- the forward pass ----------------------------------------------------------------------
    def _chunk(self, tok: torch.Tensor, pos0: int, all_logits: bool) -> torch.Tensor:
        T = tok.shape[0]
        pos = torch.arange(pos0, pos0 + T, device=self.device)
        X, pending = self._layers(tok, pos, lambda li, a, c, kv: prefill.attn_chunk(self, li, a, c, pos0, kv))
        X = self._hc_post(X, *pending)
        if not all_logits:
            X = X[-1:]
        return self._head(X)

    def _step(self, tok: torch.Tensor, pos: torch.Tensor, kind: tuple = ((), True)) -> torch.Tensor:
        """kind: _step_key's (the compressor ratios that pool at this step, whether it runs the indexer)."""
        self._in_step = True
        pools, self._index_on = kind
        if self.comp_ring is not None:
            self.comp_ring.begin_step(pools)
        try:
            X, pending = self._layers(tok, pos, lambda li, a, c, kv: self._attn_step(li, a, c, pos, kv))
            out = self._head(X, pending)[0]
            if self._pf_joins:  # the side stream of the L2 prefetches rejoins (graph capture needs it)
                torch.cuda.current_stream(self.device).wait_stream(self._pf_stream)
                self._pf_joins = False
            return out
        finally:
            self._in_step = False

    def _layers(self, tok, pos, attn):
        """The residual streams X before the last sublayer's mHC post, and that post's inputs (y1, y2, post,
        comb): each sublayer's post is applied by the next mHC pre, in the same launch where it can be."""
        cfg, W = self.cfg, self.W
        if self.K is not None and W.embedding().dtype in (torch.float16, F32):  # one launch (the step's first kernel)
            X = self.K.embed(W.embedding(), tok, cfg.n_hc)
        else:
            X = W.embedding()[tok].to(F32)[:, None, :].expand(-1, cfg.n_hc, -1).contiguous()
        pending = None
        on = not self._in_step  # profiler labels of the prefill phases (bench_session --gaps)
        for li in range(cfg.n_layer):
            ring = self.comp_ring.hc_target(li, pos) if self._in_step and self.comp_ring is not None else None
            with prefill.section("hc_pre", on):
                X, a, post, comb = self._hc_pre(li, X, L.HC_ATTN_FN, L.HC_ATTN_SCALE, L.HC_ATTN_BASE, L.ATTN_NORM,
                                                pending, ring)
            self._comp_forked = self._in_step and "comp" in self._branches and cfg.ratio(li) != 0
            if self._comp_forked:  # the compressors need only a: beside q_a/kv, q_b and the norms
                with self.side.fork():
                    fused.compress_steps(self, li, a, pos)
            with prefill.section("q_a_kv", on):
                qa, kv = W.mm_many([C.blk(li, L.ATTN_Q_A), C.blk(li, L.ATTN_KV)], a)  # one launch for both
                q_norm = W.vec(C.blk(li, L.ATTN_Q_A_NORM))
                # folded: attn_step gets (q_a, (norm weight, eps)) and its q_b matvecs normalize while staging
                c = (qa, (q_norm, cfg.rms_eps)) if NORM_FOLD and self._in_step and self.K is not None and \
                    qa.shape[0] == 1 else self._rms_norm(qa, q_norm)
            out = attn(li, a, c, kv)  # the attention sublayer's output: a tensor, or summands for the mHC post
            y1, y2 = (*out, None)[:2] if isinstance(out, tuple) else (out, None)
            pending = (y1, y2, post, comb)
            self.prefetch("sh", self._shexp(li))  # streamed after the mHC, the router and the routed experts
            with prefill.section("hc_pre", on):
                X, b, post, comb = self._hc_pre(li, X, L.HC_FFN_FN, L.HC_FFN_SCALE, L.HC_FFN_BASE, L.FFN_NORM,
                                                pending)
            with prefill.section("ffn", on):
                pending = (*self._moe(li, b, tok), post, comb)
            self.prefetch("qb", [C.blk(li + 1, t) for t in (L.ATTN_Q_A, L.ATTN_KV, L.ATTN_Q_B)]
                          if li + 1 < cfg.n_layer else [C.OUTPUT])
        return X, pending

    def prefetch(self, point: str, names: list[str], groups: int = 1) -> None:
        """Decode only: at `point` (DS4_GPU_PREFETCH), ask L2 for weights a later matvec of the step streams.
        The request kernel runs on a side stream (joined at the end of the step), so the layer's own chain
        never waits for it ($DS4_GPU_PF_SIDE=0: on the main stream)."""
        if not (self._in_step and point in self._pf):
            return
        if not PF_SIDE:
            self.W.prefetch(names, self._pf[point], groups)
            return
        main = torch.cuda.current_stream(self.device)
        if self._pf_stream is None:
            self._pf_stream = torch.cuda.Stream(self.device)
        self._pf_stream.wait_stream(main)
        with torch.cuda.stream(self._pf_stream):
            self.W.prefetch(names, self._pf[point], groups)
        self.W._sync_stream()  # the extension's launches go to the main stream again
        self._pf_joins = True

    def _rms_norm(self, x, w):
        if self.K is not None:
            return self.K.rms_norm(x, w, self.cfg.rms_eps)
        return ops.rms_norm(x, w, self.cfg.rms_eps)

    def _hc_post(self, X, y1, y2, post, comb):
        if self.K is not None:
            return self.K.hc_post(X, y1, y2, post, comb)
        y1, y2 = ops.scaled(y1), ops.scaled(y2)
        return ops.hc_post(X, y1 if y2 is None else y1 + y2, post, comb)

    def _hc_pre(self, li, X, fn, scale, base, norm, pending=None, ring=None):
        """The previous sublayer's mHC post (pending: y1, y2, post, comb), then the mHC pre of this one and its
        RMS norm: (X after the post, normalized input, post, comb). ring: K.hc_post_pre's (after a post only)."""
        cfg, W = self.cfg, self.W
        T, n, D = X.shape
        if self.K is not None:  # the mix and the RMS of flatten(X) are computed in the kernels
            args = (W.dense(C.blk(li, fn)), W.vec(C.blk(li, scale)), W.vec(C.blk(li, base)), W.vec(C.blk(li, norm)),
                    cfg.sinkhorn_iters, cfg.rms_eps, cfg.hc_eps)
            if pending is not None:
                if self.hc_defer is not None and self._in_step and T == 1 and n == 4:
                    return self.hc_defer.post_pre(X, pending, args, ring)
                return self.K.hc_post_pre(X, *pending, *args, ring=ring)
            return (X, *self.K.hc_pre(X, *args))
        if pending is not None:
            X = self._hc_post(X, *pending)
        mix = W.mm(C.blk(li, fn), ops.rms_norm(X.reshape(T, n * D), None, cfg.rms_eps))
        pre, post, comb = self._f("hc_weights")(mix, W.vec(C.blk(li, scale)), W.vec(C.blk(li, base)), n,
                                         cfg.sinkhorn_iters, cfg.hc_eps)
        return X, ops.rms_norm(ops.stream_sum(pre, X), W.vec(C.blk(li, norm)), cfg.rms_eps), post, comb

    def _head(self, X: torch.Tensor, pending=None) -> torch.Tensor:
        """Logits from the residual streams (pending: the last sublayer's mHC post, not yet applied)."""
        cfg, W = self.cfg, self.W
        T, n, D = X.shape
        if self.K is not None:
            args = (W.dense(C.OUTPUT_HC_FN), W.vec(C.OUTPUT_HC_SCALE), W.vec(C.OUTPUT_HC_BASE), W.vec(C.OUTPUT_NORM), 0,
                    cfg.rms_eps, cfg.hc_eps)
            if pending is not None:
                if self.hc_defer is not None:
                    self.hc_defer.join()  # the last sublayer's comb
                _, h, _, _ = self.K.hc_post_pre(X, *pending, *args, head=True)
            else:
                h, _, _ = self.K.hc_pre(X, *args, head=True)
            return W.mm(C.OUTPUT, h)
        if pending is not None:
            X = self._hc_post(X, *pending)
        mix = W.mm(C.OUTPUT_HC_FN, ops.rms_norm(X.reshape(T, n * D), None, cfg.rms_eps))
        wts = torch.sigmoid(mix * W.vec(C.OUTPUT_HC_SCALE)[0] + W.vec(C.OUTPUT_HC_BASE)) + cfg.hc_eps
        h = ops.stream_sum(wts, X)
        return W.mm(C.OUTPUT, ops.rms_norm(h, W.vec(C.OUTPUT_NORM), cfg.rms_eps))

    def _moe(self, li: int, b: torch.Tensor, tok: torch.Tensor):
        """(routed experts' output, shared expert's output)."""
        cfg, W = self.cfg, self.W
        limit = float(cfg.swiglu_clamp[li])
        gate_inp = C.blk(li, L.FFN_GATE_INP)
        # decode with DS4_GPU_ROUTER_ONE=1: the router matvec and the routing in one launch (router.cu), below
        one_launch = fused.ROUTER_ONE and self.K is not None and self.route_hook is None and b.shape[0] == 1
        logits = None if one_launch else W.mm(gate_inp, b)
        if self.K is not None and self.route_hook is None:
            forked = self._in_step and "ffn" in self._branches
            # DS4_GPU_MOE_SHEXP: the shared expert inside the routed experts' two launches (no matvecs beside them)
            with_shexp = fused.MOE_SHEXP and b.shape[0] == 1 and W.moe_shexp_takes(li, self._shexp(li))
            xq, xq_ready = 0, None
            if forked:  # the shared expert beside the router and the routed experts
                with self.side.fork():
                    if fused.EARLY_XQ and W.moe_takes_xq(li, b.shape[0]):  # the routed x's planes beside the router
                        xq, xq_ready = W.quantize_x_into(b, self._xq_buf(b.shape[1])), self.side.mark()
                    if not with_shexp:
                        sh = W.swiglu_ffn(self._shexp(li), b, limit, self.K.swiglu)
            bias = C.blk(li, L.EXP_PROBS_B)
            hashed = cfg.is_hash_layer(li)
            route = (W.vec(bias) if (not hashed and self.model.has(bias)) else None,
                     W.ids(C.blk(li, L.FFN_GATE_TID2EID)) if hashed else None, tok, cfg.n_expert_used, cfg.routed_scale)
            one = self.K.router_one(W.mat(gate_inp), b, *route) if one_launch else None
            if one is None:  # two launches: the matvec, then the router kernel on its logits
                one = (None, *self.K.router(W.mm(gate_inp, b) if logits is None else logits, *route))
            _, ids, w = one
            if xq_ready is not None:
                self.side.wait(xq_ready)
            if with_shexp:
                out, sh = W.moe_shexp(li, b, ids, w, limit, self._shexp(li), xq=xq)
                if forked:
                    self.side.join()  # the branch held x's planes only (or nothing): the fork must rejoin
                return out, sh
            out = W.moe(li, b, ids, w, limit, xq=xq)
            if forked:
                self.side.join()
                return out, sh
            return out, W.swiglu_ffn(self._shexp(li), b, limit, self.K.swiglu, unscaled=FOLD_POST)
        s = torch.sqrt(torch.nn.functional.softplus(logits))
        if cfg.is_hash_layer(li):
            ids = W.ids(C.blk(li, L.FFN_GATE_TID2EID))[tok]
        else:
            bias = C.blk(li, L.EXP_PROBS_B)
            biased = s + W.vec(bias) if self.model.has(bias) else s
            ids = torch.topk(biased, cfg.n_expert_used, dim=-1).indices
            if self.route_hook is not None:  # diagnostics (eager only): see or replace the routing
                ids = self.route_hook(li, ids, biased)
        w = torch.gather(s, 1, ids)
        w = w / torch.clamp(w.sum(dim=1, keepdim=True), min=ROUTE_DENOM_MIN) * cfg.routed_scale
        out = W.moe(li, b, ids, w, limit)
        return out, W.swiglu_ffn(self._shexp(li), b, limit, ops.swiglu, fuse=False)  # DS4_GPU_FUSED=0: torch ops

    @staticmethod
    def _shexp(li: int) -> list[str]:
        return [C.blk(li, t) for t in (L.FFN_GATE_SHEXP, L.FFN_UP_SHEXP, L.FFN_DOWN_SHEXP)]

    # -- attention pieces shared by both paths
    def _qkv(self, li, a, c, pos, kv_lin, defer_q: bool = False):
        """(q, kv, cos, sin, q_post). defer_q (fused kernels only): q is the q_b product's raw rows and q_post the
        norm_rope keywords that finish them (the fused prefill attention applies them as it stages q); else None."""
        cfg, W = self.cfg, self.W
        T, H, d = a.shape[0], cfg.n_head, cfg.head_dim
        freq = self._freq[cfg.ratio(li) != 0]
        cos, sin = ops.cos_sin(freq, pos)
        if self.K is not None:
            # DS4_GPU_FOLD_RESCALE=1: the q_b GEMM's per-row rescale applied by norm_rope as it loads the rows
            z, rs = W.mm_unscaled(C.blk(li, L.ATTN_Q_B), c) if FOLD_RESCALE else (W.mm(C.blk(li, L.ATTN_Q_B), c), None)
            q_post = dict(norm=True, eps=cfg.rms_eps, freq=freq, rope_dim=cfg.rope_dim, in_scale=rs)
            q = z.reshape(T, H, d) if defer_q else self.K.norm_rope(z, d, H, pos, **q_post).reshape(T, H, d)
            kv = self.K.norm_rope(kv_lin, d, 1, pos, norm=True, w=W.vec(C.blk(li, L.ATTN_KV_A_NORM)), eps=cfg.rms_eps,
                                  freq=freq, rope_dim=cfg.rope_dim, fp8_nope=cfg.n_nope if cfg.fp8_kv else 0)
            return q, kv, cos, sin, (q_post if defer_q else None)
        q = ops.rms_norm(W.mm(C.blk(li, L.ATTN_Q_B), c).reshape(T, H, d), None, cfg.rms_eps)
        q = self._f("apply_tail")(q, cos, sin, cfg.rope_dim)
        kv = ops.rms_norm(kv_lin, W.vec(C.blk(li, L.ATTN_KV_A_NORM)), cfg.rms_eps)
        kv = self._f("apply_tail")(kv, cos, sin, cfg.rope_dim)
        if cfg.fp8_kv:
            kv = self._f("fp8_kv_round")(kv, cfg.n_nope)
        return q, kv, cos, sin, None

    def _finish_rows(self, li, pooled, row_pos, indexer: bool):
        cfg = self.cfg
        norm = self.W.vec(C.blk(li, L.IDX_COMP_NORM if indexer else L.COMP_NORM))
        if self.K is not None:
            return self.K.norm_rope(pooled, pooled.shape[-1], 1, row_pos, norm=True, w=norm, eps=cfg.rms_eps,
                                    freq=self._freq[True], rope_dim=cfg.rope_dim,
                                    fp8_nope=cfg.n_nope if (cfg.fp8_kv and not indexer) else 0,
                                    qat=bool(indexer and cfg.indexer_qat))
        rows = ops.rms_norm(pooled, norm, cfg.rms_eps)
        cos, sin = ops.cos_sin(self._freq[True], row_pos)
        rows = self._f("apply_tail")(rows, cos, sin, cfg.rope_dim)
        if indexer:
            return self._f("indexer_qat")(rows) if cfg.indexer_qat else rows
        return self._f("fp8_kv_round")(rows, cfg.n_nope) if cfg.fp8_kv else rows

    def _comp_inputs(self, li, a, pos, indexer: bool):
        W, r = self.W, self.cfg.ratio(li)
        names = (L.IDX_COMP_KV, L.IDX_COMP_GATE, L.IDX_COMP_APE) if indexer else (L.COMP_KV, L.COMP_GATE, L.COMP_APE)
        kv = W.mm(C.blk(li, names[0]), a)
        score = W.mm(C.blk(li, names[1]), a) + W.vec(C.blk(li, names[2]))[pos % r]
        return kv, score

    def _attend(self, li, q, keys, mask, cos, sin):
        """q [T, H, d], keys [T or 1, N, d], mask [T, N] → grouped output projection [T, D]."""
        T, d = q.shape[0], q.shape[2]
        sinks = self.W.vec(C.blk(li, L.ATTN_SINKS))
        s = torch.einsum("thd,tnd->thn", q, keys.expand(T, -1, -1)) * (1.0 / math.sqrt(d))
        s = torch.where(mask[:, None, :], s, torch.full_like(s, -math.inf))
        m = torch.maximum(s.amax(dim=-1), sinks[None, :])
        e = torch.exp(s - m[..., None])
        denom = e.sum(dim=-1) + torch.exp(sinks[None, :] - m)
        o = torch.einsum("thn,tnd->thd", e / denom[..., None], keys.expand(T, -1, -1))
        return self._attn_out(li, o, cos, sin)

    def _attn_out(self, li, o, cos, sin, pos=None, rope_done: bool = False):
        """Attention output [T, H, d] (RoPE tail undone), or its split (hi, lo, s) per output group from the fused
        prefill attention, through the grouped output projection → [T, D].
        pos (prefill on CUDA): the inverse RoPE runs in the norm_rope kernel, as decode's does; rope_done: the
        attention kernel undid it already."""
        cfg, W = self.cfg, self.W
        if isinstance(o, tuple):  # the fused prefill attention's output, already split per head group (mm_split)
            return W.mm_split_then(C.blk(li, L.ATTN_OUTPUT_A), o, cfg.o_groups, C.blk(li, L.ATTN_OUTPUT_B),
                                   unscaled=FOLD_POST)
        T, H, d = o.shape
        if rope_done:
            pass
        elif self.K is not None and pos is not None:
            o = self.K.norm_rope(o, d, H, pos, freq=self._freq[cfg.ratio(li) != 0], rope_dim=cfg.rope_dim,
                                 inverse=True)
        else:
            o = self._f("apply_tail")(o, cos, sin, cfg.rope_dim, inverse=True)
        low = W.mm(C.blk(li, L.ATTN_OUTPUT_A), o.reshape(T, H * d), groups=cfg.o_groups)
        return W.mm(C.blk(li, L.ATTN_OUTPUT_B), low)

    def _index_q(self, li, a, c, pos):
        cfg, W = self.cfg, self.W
        T, Hi, di = a.shape[0], cfg.indexer_heads, cfg.indexer_dim
        if self.K is not None:
            # FOLD_RESCALE: the GEMM's per-row rescale applied by norm_rope as it loads the rows (v31, as for q_b)
            z, rs = W.mm_unscaled(C.blk(li, L.IDX_Q_B), c) if FOLD_RESCALE else (W.mm(C.blk(li, L.IDX_Q_B), c), None)
            q = self.K.norm_rope(z, di, Hi, pos, freq=self._freq[True], rope_dim=cfg.rope_dim, qat=cfg.indexer_qat,
                                 in_scale=rs).reshape(T, Hi, di)
            return q, W.mm(C.blk(li, L.IDX_PROJ), a) * (1.0 / math.sqrt(di * Hi))
        q = W.mm(C.blk(li, L.IDX_Q_B), c).reshape(T, Hi, di)
        cos, sin = ops.cos_sin(self._freq[True], pos)
        q = self._f("apply_tail")(q, cos, sin, cfg.rope_dim)
        if cfg.indexer_qat:
            q = self._f("indexer_qat")(q)
        w = W.mm(C.blk(li, L.IDX_PROJ), a) * (1.0 / math.sqrt(di * Hi))
        return q, w

    # -- decode (static shapes: capturable)
    def _attn_step(self, li, a, c, pos, kv_lin):
        if self.K is not None:
            return fused.attn_step(self, li, a, c, kv_lin, pos)
        cfg, st = self.cfg, self.layers[li]
        r = cfg.ratio(li)
        q, kv, cos, sin, _ = self._qkv(li, a, c, pos, kv_lin)
        cap = self.raw_cap
        st["raw"].index_copy_(0, pos % cap, kv)
        j = torch.arange(cap, device=self.device)
        key_pos = pos - torch.remainder(pos - j, cap)
        keys, mask = st["raw"], key_pos >= 0
        if r:
            comp_defer.torch_compress_steps(self, li, a, pos)
            n_vis = (pos + 1) // r
            comp = fused.visible_comp(self, li)
            ids = torch.arange(comp.shape[0], device=self.device)
            if fused.indexer_runs(self, li):
                q_i, w_i = self._index_q(li, a, c, pos)
                dots = torch.einsum("hd,cd->hc", q_i[0], st["idx"])
                scores = (w_i[0][:, None] * torch.clamp(dots, min=0.0)).sum(dim=0)
                key = torch.where(ids < n_vis, scores.double() - ids.double() * 1e-300,
                                  torch.full_like(scores, -math.inf, dtype=torch.float64))
                ids = torch.topk(key, cfg.indexer_top_k).indices
                comp = comp[ids]
            keys = torch.cat([keys, comp])
            mask = torch.cat([mask, ids < n_vis])
        return self._attend(li, q, keys[None], mask[None], cos, sin)
