"""Decode's compressor products deferred to the last token of their window ($DS4_GPU_COMP_DEFER, default 2; 0 off).

Why: a compressor's kv and score products (F16: with the indexer's, ~21 MB per ratio-4 layer of Flash, ~8 MB per
ratio-128 layer) only fill the frontier on all but the last step of a window; nothing reads those slots before that
step pools them. Computed one token at a time they stream the same weights r times per window, and in a ratio-4 layer
the attention's chain waits for them (q_b -> compressor products -> compress step -> index keys -> top-k). Here a
decode step only copies its normalized input `a` into a ring of r rows per compressed layer. On the step that ends a
window one product over the ring's rows (each weight read once) fills the window's frontier slots, and the usual
compress step pools. Nothing else reads the frontier during decode, so each step computes what it did before; on CUDA
the window's products come from the streaming kernel with a group per ring row (ext.matvec_rows), whose row sums are
the every-step launch's, so the logits are the same bits (tests/test_gpu_comp_defer.py). Measured (NOTES v49, H100):
decode neutral, i.e. the ratio-4 chain was not waiting on these products; kept for the ~5% fewer DRAM bytes per token.

What decides the work is whether the step's position ends a window of ratio r, which the host knows, so the decode
graph is captured once per step kind (`step_kind`: the ratios that pool at that position).

The frontier stays the session's state for everything outside decode (prefill chunks, snapshots): `flush` writes
the ring's pending rows into it first, and `synced` marks a frontier complete again (after a prefill chunk or a
restore). `start` holds the first position whose input lives in the rings (the positions before it came from a
prefill chunk or a restore, and their products are already in the frontiers): one device scalar for every layer, so
no step has to reset it.
"""

from __future__ import annotations

import math
import os

import torch

# 0: products every step; 1: deferred, the window's slots written by torch ops before the compress step; 2 (default):
# deferred, and in ratio-4 layers the compress step kernel reads the window's products itself (one launch, no fill)
MODE = os.environ.get("DS4_GPU_COMP_DEFER", "2").strip() or "2"
if MODE not in ("0", "1", "2"):
    raise ValueError(f"DS4_GPU_COMP_DEFER must be 0, 1 or 2, got {MODE!r}")
DEFER = MODE != "0"
KERNEL_FILL = MODE == "2"
# 1: the decode mHC pre kernel (hc_cluster_kernel) writes the step's input into the ring as it writes it, instead of
# two torch launches per compressed layer (remainder, index_copy_) at the head of the compressor branch; the same rows
HC_STORE = os.environ.get("DS4_GPU_RING_HC", "0").strip() == "1"
F16 = 1  # the extension's qtype of float16 matrices


def ratios(cfg) -> tuple[int, ...]:
    return tuple(sorted({cfg.ratio(li) for li in range(cfg.n_layer)} - {0}))


def step_kind(cfg, pos: int) -> tuple[int, ...]:
    """The compressor ratios whose windows end at position pos: their compressors pool at that decode step."""
    return tuple(r for r in ratios(cfg) if (pos + 1) % r == 0)


def slot0(r: int) -> int:
    """The frontier slot of a window's phase 0 (ratio 4 keeps the previous window in slots 0-3)."""
    return 4 if r == 4 else 0


class CompRing:
    """The normalized inputs of the current window's decode steps, per compressed layer, and the kind of the step
    being built (`kind`, set by the session around each decode step)."""

    def __init__(self, cfg, device: torch.device):
        self.cfg = cfg
        self.kind: tuple[int, ...] = ()
        self.rows = {li: torch.zeros((cfg.ratio(li), cfg.n_embd), dtype=torch.float32, device=device)
                     for li in range(cfg.n_layer) if cfg.ratio(li)}
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        self.phase = {r: torch.arange(r, device=device) for r in ratios(cfg)}
        self.dirty = False  # decode steps since the frontiers were last whole (host side: graph replays run no Python)
        self.by_pre: set[int] = set()  # the layers whose row this step's mHC pre has written (hc_target)
        self.kernel_rows = 0  # rows the mHC kernel itself wrote, over the session (the tests' witness)

    def begin_step(self, pools: tuple[int, ...]) -> None:
        """A decode step is being built: the ratios that pool at it."""
        self.kind = pools
        self.by_pre.clear()

    def pools(self, li: int) -> bool:
        return self.cfg.ratio(li) in self.kind

    def hc_target(self, li: int, pos: torch.Tensor) -> tuple | None:
        """(this ring, li, pos) for the mHC pre that makes layer li's input to write it into the ring too
        ($DS4_GPU_RING_HC), or None."""
        return (self, li, pos) if HC_STORE and li in self.rows else None

    def stored_by_pre(self, li: int, a: torch.Tensor, pos: torch.Tensor, written: bool) -> None:
        """The mHC pre made layer li's input a: its kernel wrote the ring row (written), or it is copied here; either
        way the compressor steps skip their store."""
        if written:
            self.kernel_rows += 1
        else:
            self.store(li, a, pos)
        self.by_pre.add(li)

    def store(self, li: int, a: torch.Tensor, pos: torch.Tensor) -> None:
        """This step's input a [1, n_embd] into its phase's row (pos [1]: the step's position on the device)."""
        self.rows[li].index_copy_(0, torch.remainder(pos, self.cfg.ratio(li)), a)

    def fill(self, r: int, kv: torch.Tensor, sc: torch.Tensor, s_kv: torch.Tensor, s_sc: torch.Tensor,
             first, upto: int) -> None:
        """Frontier slots of the window's phases [0, upto) whose positions (first + phase; first: the window's first
        position, a device tensor [1] or an int) are at or after `start` <- kv, sc [r, width] (the products of the
        ring's r rows; sc with its APE row added), one compressor's; the other slots keep their values."""
        keep = (self.phase[r] + first < self.start) | (self.phase[r] >= upto)
        lo = slot0(r)
        for dst, src in ((s_kv, kv), (s_sc, sc)):
            part = dst[lo:lo + r]
            part.copy_(torch.where(keep[:, None], part, src))

    def synced(self, pos: int) -> None:
        """The frontiers hold every token before pos (a prefill chunk, a restore, a flush): the rings start at pos."""
        self.start.fill_(pos)
        self.dirty = False

    def flush(self, sess, pos: int) -> None:
        """Write the pending rows (the positions from `start` to pos - 1 of the window holding pos) into the frontiers,
        so the frontier is the session's whole state again, then `synced(pos)`."""
        for li in self.rows if self.dirty else ():
            r = self.cfg.ratio(li)
            if pos % r:
                for job in comp_products(sess, li, self.rows[li]):
                    self.fill(*job, first=pos - pos % r, upto=pos % r)
        self.synced(pos)


def _names(li: int, indexer: bool) -> tuple:
    from ds4.gguf_tools import constants as C

    L = C.LayerTensor
    names = (L.IDX_COMP_KV, L.IDX_COMP_GATE, L.IDX_COMP_APE) if indexer else (L.COMP_KV, L.COMP_GATE, L.COMP_APE)
    return tuple(C.blk(li, n) for n in names)


def takes(sess) -> bool:
    """Whether the session's compressor matrices (and indexer heads) allow deferred products: torch tensors, or float16
    matrices, whose batched matvec needs no scratch of the extension (a decode graph must not point into the prefill
    scratch, which a longer chunk reallocates)."""
    from ds4.gguf_tools import constants as C

    cfg, W = sess.cfg, sess.W
    for li in range(cfg.n_layer):
        r = cfg.ratio(li)
        names = [n for ix in ((False, True) if r == 4 else (False,)) for n in _names(li, ix)[:2]]
        names += [C.blk(li, C.LayerTensor.IDX_PROJ)] if r == 4 else []
        if r and not all(isinstance(w, torch.Tensor) or w.qtype == F16 for w in map(W.mat, names)):
            return False
    return True


def products(W, names: list[str], x: torch.Tensor) -> list[torch.Tensor]:
    """[W_n x] for the rows of x (a ring). On CUDA, matrices of one width: one launch of the batch-1 streaming kernel
    with a group per row (ext.matvec_rows: each row's sums are the every-step launch's bits, each weight tile read by
    the rows at once), else float16 ones in batched matvec launches of up to 8 rows; neither takes extension scratch.
    Elsewhere W.mm."""
    ws = [W.mat(n) for n in names]
    if W.ext is None or any(isinstance(w, torch.Tensor) for w in ws) or len({w.ncols for w in ws}) != 1:
        return [W.mm(n, x) for n in names]
    x = x.contiguous()
    ys = [torch.empty((x.shape[0], w.nrows), dtype=torch.float32, device=x.device) for w in ws]
    W._sync_stream()
    if not W.ext.matvec_rows(ws, x.data_ptr(), x.shape[0], [y.data_ptr() for y in ys]):
        for i in range(0, x.shape[0], 8):
            W.ext.matvec_shared(ws, W._arr(x[i:i + 8]), [W._arr(y[i:i + 8]) for y in ys])
    return ys


def comp_products(sess, li: int, x: torch.Tensor) -> list[tuple]:
    """Layer li's compressor products of the rows x [r, n_embd] (phase i in row i): (r, kv, score + APE, frontier kv,
    frontier score) per compressor, the indexer's second in a ratio-4 layer."""
    W, st, r = sess.W, sess.layers[li], sess.cfg.ratio(li)
    out = []
    for indexer in ((False, True) if r == 4 else (False,)):
        kv_n, gate_n, ape_n = _names(li, indexer)
        kv, sc = products(W, [kv_n, gate_n], x)
        sc = sc + W.vec(ape_n)[:x.shape[0]]
        s_kv, s_sc = (st["idx_kv"], st["idx_score"]) if indexer else (st["comp_kv"], st["comp_score"])
        out.append((4 if indexer else r, kv, sc, s_kv, s_sc))
    return out


def steps_to_every_kind(cfg, pos: int) -> int:
    """Decode steps from position pos until every step kind has run once (each kind's decode graph captured): the
    bench's warm-up, so no capture lands in a timed row."""
    period = max(ratios(cfg), default=1)  # every ratio divides the largest (4 and 128)
    every = {step_kind(cfg, p) for p in range(period)}
    seen, n = set(), 0
    while seen != every:
        seen.add(step_kind(cfg, pos + n))
        n += 1
    return n


def torch_compress_steps(sess, li: int, a: torch.Tensor, pos: torch.Tensor) -> None:
    """The torch form of decode's compressor steps in layer li (fused.compress_steps is the kernels'): each
    compressor's store (and pooling), or with the session's ring the input into it and, on a window's last step,
    the products of all its rows before the pooling."""
    jobs, ring = (False, True) if sess.cfg.ratio(li) == 4 else (False,), sess.comp_ring
    if ring is None:
        for indexer in jobs:
            torch_compress_step(sess, li, a, pos, indexer)
        return
    ring.store(li, a, pos)
    if not ring.pools(li):
        return
    for indexer, (r, kv, sc, s_kv, s_sc) in zip(jobs, comp_products(sess, li, ring.rows[li])):
        ring.fill(r, kv, sc, s_kv, s_sc, first=pos - (r - 1), upto=r - 1)
        torch_compress_step(sess, li, a, pos, indexer, inputs=(kv[-1:], sc[-1:]))


def torch_compress_step(sess, li: int, a: torch.Tensor, pos: torch.Tensor, indexer: bool, inputs=None) -> None:
    """inputs: this token's (kv, score with its APE row) when already computed."""
    st, r = sess.layers[li], sess.cfg.ratio(li)
    if indexer:
        r = 4
    kv, sc = sess._comp_inputs(li, a, pos, indexer) if inputs is None else inputs
    s_kv, s_sc, rows = (st["idx_kv"], st["idx_score"], st["idx"]) if indexer else \
        (st["comp_kv"], st["comp_score"], st["comp"])
    width = kv.shape[1]
    d = width // 2 if r == 4 else width
    slot = (r + pos % r) if r == 4 else pos % r
    s_kv.index_copy_(0, slot, kv)
    s_sc.index_copy_(0, slot, sc)
    emit = (pos + 1) % r == 0  # [1]
    if r == 4:
        cand_kv = torch.cat([s_kv[:4, :d], s_kv[4:, d:]])
        cand_sc = torch.cat([s_sc[:4, :d], s_sc[4:, d:]])
    else:
        cand_kv, cand_sc = s_kv, s_sc
    pooled = (cand_kv * torch.softmax(cand_sc, dim=0)).sum(dim=0, keepdim=True)
    i = (pos + 1) // r - 1
    row = sess._finish_rows(li, torch.nan_to_num(pooled), torch.clamp(i, min=0) * r, indexer)
    dummy = rows.shape[0] - 1
    rows.index_copy_(0, torch.where(emit, i, torch.full_like(i, dummy)), torch.where(emit[:, None], row, 0.0))
    if r == 4:
        new_kv = torch.cat([s_kv[4:], torch.zeros_like(s_kv[4:])])
        new_sc = torch.cat([s_sc[4:], torch.full_like(s_sc[4:], -math.inf)])
    else:
        new_kv, new_sc = torch.zeros_like(s_kv), torch.full_like(s_sc, -math.inf)
    s_kv.copy_(torch.where(emit, new_kv, s_kv))
    s_sc.copy_(torch.where(emit, new_sc, s_sc))
