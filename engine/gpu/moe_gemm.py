"""Prefill's routed experts as grouped GEMMs with little padding (Weights.moe for many tokens on CUDA).

A chunk of T tokens makes T·k (token, expert) assignments. Sorted by expert, every expert's rows would be one
GEMM on that expert's weights: 256 small GEMMs per matrix. The v5 path (`padded`) put every expert into one
batched GEMM padded to a common cap (twice the mean load) and sent the rest of busy experts to plain GEMMs; with
the synthetic router's spread about half of that batch was zero rows, and filling and scattering into it cost
as much again (v9 trace: 1.93 s of an 8192-token prefill's 3.88 s of kernels were the routed experts).

`buckets` (default): the experts a chunk uses are ordered busiest first, and consecutive ones whose counts are
within `DS4_GPU_MOE_SPREAD` (1.25) of the group's busiest form a bucket with cap = that busiest count; experts
with few rows (<= SMALL_ROWS) share one bucket. Each bucket is one batched GEMM (one plain GEMM for a bucket of
one expert). The dequant kernel writes the used experts' weights in that order (its block map), so a bucket's
weights are one strided view; one gather builds every padded activation row (a zero row where there is no
assignment), and one gather takes the results back in assignment order. Padding is then at most the spread
(~10% in practice) and there is one host sync per layer (the counts), as before.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ds4.gguf_tools.constants import QuantType as Q

F32, F16 = torch.float32, torch.float16
# mmq (default since v11: int8 tensor cores on the codes, mmq.cu; no dequant pass, no padding, no new GEMM shapes per
# prompt: first 2048-token prefill of a process 2396 against 1172 t/s, 8192 tokens 2655 / 2673 against 2600 / 2636)
# | mmf (v11, written without a device: float16 tensor cores, the codes as exact float16 integers, mmf.cu)
# | mmw (v14: gate and up as mmf computes them on the warpgroup MMA, down on mmq; IQ2_XXS only; 1.2x slower than mmq)
# | buckets (v9: dequant to float16 hi/lo, three GEMMs per bucket) | padded (the v5..v8 path)
MOE_GEMM = os.environ.get("DS4_GPU_MOE_GEMM", "mmq")
# mmq: gate and up from one quantization of the token rows read in expert order (no gathered copy of x), and the k
# expert rows of a token summed straight from the expert order (moe_combine; no scatter back); 0: the v11 form
MOE_FUSE = os.environ.get("DS4_GPU_MOE_FUSE", "1") != "0"
# mmq: single Q2_K expert products (the q2 mix's down projection) on activations quantized per 256 columns, the
# super-block sums in the mma's int32 registers (mmq.cu S256; prepared in v13, off until measured): prefill then
# rounds that input per 256 columns, not decode's 32
MMQ_S256 = os.environ.get("DS4_GPU_MMQ_S256", "0") == "1"
# mmq experts (fused, with a per-32 down input): the down product quantizes swiglu(g, u) times the routing weights
# straight from g and u (quantize_x's SwiGLU source), so h is never written as floats (v15; 0: the v14 SwiGLU launch)
MMQ_SWIGLU_Q = os.environ.get("DS4_GPU_MMQ_SWIGLU_Q", "1") != "0"
# mmq experts: the tile table built on the device from the expert counts (ext.expert_tiles; v15), so the layer
# has no host sync (v14: ~45 ms of an 8192-token prefill idle while Python built the table); 0: built on the host
DEVICE_TILES = os.environ.get("DS4_GPU_DEVICE_TILES", "1") != "0"
SPREAD = float(os.environ.get("DS4_GPU_MOE_SPREAD", "1.25"))  # a bucket's cap over its members' counts, at most
SMALL_ROWS = 64  # experts with at most this many rows share one bucket (their padding is a few rows each)
# caps rounded up to a multiple of this: fewer distinct GEMM shapes across prompts (cuBLAS picks a kernel per new
# shape), for a little more padding; 1 = exact caps. v10 (8192 tokens, 3 runs): 16 gave 2383 / 2683 / 2696 t/s
# against 2130 / 2645 / 2671 for 1 (the first run pays every new shape)
ROUND = int(os.environ.get("DS4_GPU_MOE_ROUND", "16"))


class Bucket(NamedTuple):
    slot0: int  # first expert slot (position in the busiest-first order)
    slots: int  # experts in the bucket
    cap: int  # rows per expert (its busiest member's count)
    row0: int  # first padded row: the bucket holds rows row0 .. row0 + slots * cap - 1


def plan_buckets(counts: list[int], spread: float = SPREAD, small: int = SMALL_ROWS, round_to: int = 1) \
        -> tuple[list[int], list[Bucket], int]:
    """(experts with rows in slot order: busiest first, ties to the lower id; their buckets; padded rows).
    round_to: each cap rounded up to a multiple of it."""
    if spread < 1.0:
        raise ValueError(f"DS4_GPU_MOE_SPREAD must be >= 1, got {spread}")
    if round_to < 1:
        raise ValueError(f"DS4_GPU_MOE_ROUND must be >= 1, got {round_to}")
    used = sorted((e for e, c in enumerate(counts) if c > 0), key=lambda e: (-counts[e], e))
    buckets: list[Bucket] = []
    row = i = 0
    while i < len(used):
        cap = counts[used[i]]
        j = i + 1
        while j < len(used) and (cap <= small or counts[used[j]] * spread >= cap):
            j += 1
        cap = -(-cap // round_to) * round_to
        buckets.append(Bucket(i, j - i, cap, row))
        row += (j - i) * cap
        i = j
    return used, buckets, row


def _mm_into(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """y = a @ b (float16 operands, float32 y written in place)."""
    from .weights import mm_f32

    fn = torch.mm if a.dim() == 2 else torch.bmm
    try:
        fn(a, b, out_dtype=F32, out=y)
    except (TypeError, RuntimeError, NotImplementedError):
        y.copy_(mm_f32(a, b))


def routed_experts(W, gate, up, down, b: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, limit: float):
    """sum_k w_k · down_e(swiglu(gate_e b, up_e b)) for every token, e = ids[t, k]: [T, n_embd] float32."""
    from .weights import EXACT_GEMM, W_SCALE, acc_mm

    dev = b.device
    T, k = ids.shape
    n_expert, n_ff, n_embd = int(gate.ne[2]), int(gate.ne[1]), int(gate.ne[0])
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_expert)
    used, buckets, P = plan_buckets(counts.cpu().tolist(), SPREAD, SMALL_ROWS, ROUND)  # the layer's one host sync
    base = [0] * n_expert  # padded row of each expert's first assignment
    for bk in buckets:
        for s in range(bk.slots):
            base[used[bk.slot0 + s]] = bk.row0 + s * bk.cap
    n_asg = T * k
    e_sorted = flat[order]
    rank = torch.arange(n_asg, device=dev) - (torch.cumsum(counts, 0) - counts)[e_sorted]
    dst = torch.tensor(base, device=dev)[e_sorted] + rank  # padded row of each assignment (expert order)
    asg_of_row = torch.full((P,), n_asg, dtype=torch.long, device=dev)  # n_asg: no assignment (a zero row)
    asg_of_row[dst] = torch.arange(n_asg, device=dev)
    tok_sorted = order // k
    tok_of_row = torch.cat([tok_sorted, torch.full((1,), T, dtype=torch.long, device=dev)])[asg_of_row]
    block_map = torch.tensor(used, dtype=torch.int32, device=dev)

    def padded(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
        return None if t is None else torch.cat([t, t.new_zeros((1, t.shape[1]))])[rows]

    def experts(w, xh, xl, n_out: int, n_in: int, row_scale: torch.Tensor) -> torch.Tensor:
        """Padded f16 activations [P, n_in] times the used experts' weights → [T·k, n_out] in expert order, times
        row_scale [T·k, 1] (the activations' split scale) over the weights' power-of-two scale: one pass."""
        split = EXACT_GEMM
        scale = W_SCALE if split else 1.0
        hi = torch.empty((len(used) * n_out, n_in), dtype=F16, device=dev)
        lo = torch.empty_like(hi) if split else None
        W._sync_stream()
        W.ext.dequant(w, hi.data_ptr(), 0 if lo is None else lo.data_ptr(), scale, 0, len(used) * n_out, -1,
                      block_map.data_ptr(), n_out)
        y = torch.empty((P, n_out), dtype=F32, device=dev)
        for bk in buckets:
            r = slice(bk.row0, bk.row0 + bk.slots * bk.cap)
            wr = slice(bk.slot0 * n_out, (bk.slot0 + bk.slots) * n_out)
            if bk.slots == 1:  # one expert: a plain GEMM
                a_h, a_l, yv = xh[r], None if xl is None else xl[r], y[r]
                w_h, w_l = hi[wr].T, None if lo is None else lo[wr].T
            else:
                a_h = xh[r].view(bk.slots, bk.cap, n_in)
                a_l = None if xl is None else xl[r].view(bk.slots, bk.cap, n_in)
                yv = y[r].view(bk.slots, bk.cap, n_out)
                w_h = hi[wr].view(bk.slots, n_out, n_in).transpose(1, 2)
                w_l = None if lo is None else lo[wr].view(bk.slots, n_out, n_in).transpose(1, 2)
            _mm_into(yv, a_h, w_h)
            if a_l is not None:
                acc_mm(yv, a_l, w_h)
            if w_l is not None:
                acc_mm(yv, a_h, w_l)
        return y[dst] * (row_scale * (1.0 / scale))  # exact: scale is a power of two

    xh, xl, s = W.to_half(b)
    g_rows_h, g_rows_l = padded(xh, tok_of_row), padded(xl, tok_of_row)
    sa = s[tok_sorted]
    g = experts(gate, g_rows_h, g_rows_l, n_ff, n_embd, sa)
    u = experts(up, g_rows_h, g_rows_l, n_ff, n_embd, sa)
    del g_rows_h, g_rows_l
    h = torch.empty_like(g)
    W.ext.swiglu(g.data_ptr(), u.data_ptr(), g.numel(), float(limit), h.data_ptr())
    h *= wts.reshape(-1)[order, None]
    hh, hl, hs = W.to_half(h)
    y_sorted = experts(down, padded(hh, asg_of_row), padded(hl, asg_of_row), n_embd, n_ff, hs)
    y = torch.empty((n_asg, n_embd), dtype=F32, device=dev)
    y[order] = y_sorted  # back to (token, expert) order: the k-sum below is deterministic
    return y.view(T, k, n_embd).sum(dim=1)


# Activation rows and tile slots (tiles x tile rows) of every expert_tiles call in this process: how much of the
# routed experts' tiles is padding (an expert's last tile is partial). bench_session prints it.
TILE_FILL = {"rows": 0, "slots": 0}


def expert_counts(flat: torch.Tensor, n_expert: int) -> torch.Tensor:
    """Assignments per expert (int64 [n_expert]) with no host sync. torch.bincount on CUDA reads the ids' maximum
    back to size its output: one sync per layer, and the device then idles while the host catches up (v30's trace of
    an 8192-token prefill: 49 ms of the routed experts' 72 ms of device idle). Integer atomics: the same counts in any
    order."""
    idx = flat.reshape(-1).long()
    return torch.zeros(n_expert, dtype=torch.int64, device=flat.device).scatter_add_(0, idx, torch.ones_like(idx))


def expert_tiles(counts: list[int], tile: int) -> list[tuple[int, int, int, int]]:
    """(first row, rows, expert, 0) per tile of at most `tile` activation rows, for rows sorted by expert."""
    tiles, off = [], 0
    for e, n in enumerate(counts):
        tiles += [(off + j, min(tile, n - j), e, 0) for j in range(0, n, tile)]
        off += n
    TILE_FILL["rows"] += off
    TILE_FILL["slots"] += len(tiles) * tile
    return tiles


def routed_experts_codes(W, gate, up, down, b: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, limit: float,
                         kernel: str):
    """routed_experts straight from the experts' codes, the assignments sorted by expert: no padding, no weight
    copies. kernel `mmq` (mmq.cu: int8 tensor cores on 16-bit activations, one scale per row where
    $DS4_GPU_MMQ_XROW takes them, else per 32 columns as decode rounds them), `mmf` (mmf.cu:
    float16 tensor cores, the codes as exact float16 integers, the activations split to ~22 bits as the hi/lo GEMMs
    split them) or `mmw` (gate and up of IQ2_XXS experts as mmf computes them, on the warpgroup MMA; down on mmq).
    None where the kernel does not take the expert tensors (the caller falls back)."""
    dev, ext = b.device, W.ext
    T, k = ids.shape
    n_expert, n_ff, n_embd = int(gate.ne[2]), int(gate.ne[1]), int(gate.ne[0])
    if kernel == "mmw":  # gate and up (IQ2_XXS) on the warpgroup MMA, down (Q2_K) on mmq
        takes_all = ext.mmw_takes(gate, n_expert) and ext.mmw_takes(up, n_expert) and ext.mmq_takes(down, n_expert)
        gu_rows, down_rows = ext.mmw_tile_rows(), ext.mmq_tile_rows()
    else:
        takes, tile_rows = (ext.mmq_takes, ext.mmq_tile_rows) if kernel == "mmq" else (ext.mmf_takes, ext.mmf_tile_rows)
        takes_all = all(takes(w, n_expert) for w in (gate, up, down))
        gu_rows = down_rows = tile_rows()
    if not takes_all:
        return None
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    n_asg = T * k
    if DEVICE_TILES and kernel == "mmq":  # the tile table built on the device: no host sync in the layer
        counts_d = expert_counts(flat, n_expert)
        max_tiles = -(-n_asg // gu_rows) + n_expert
        tiles = torch.empty((max_tiles, 4), dtype=torch.int32, device=dev)
        W._sync_stream()
        ext.expert_tiles(counts_d.data_ptr(), n_expert, gu_rows, tiles.data_ptr(), max_tiles)
        down_tiles = tiles
    else:
        counts = torch.bincount(flat, minlength=n_expert).cpu().tolist()  # the layer's one host sync
        tiles = torch.tensor(expert_tiles(counts, gu_rows), dtype=torch.int32, device=dev)
        down_tiles = tiles if down_rows == gu_rows else torch.tensor(expert_tiles(counts, down_rows),
                                                                     dtype=torch.int32, device=dev)
    g = torch.empty((n_asg, n_ff), dtype=F32, device=dev)
    u = torch.empty_like(g)
    W._sync_stream()
    fused = kernel in ("mmq", "mmw") and MOE_FUSE  # the SwiGLU with the routing weights, the combine in slot order
    if fused and kernel == "mmq":  # gate and up from one quantization of b's rows, read in expert order: no copy
        if not ext.mmq_experts(gate, W._arr(b.contiguous()), tiles.data_ptr(), tiles.shape[0], W._arr(g),
                               (order // k).data_ptr(), up, W._arr(u)):
            return None
    else:
        product = {"mmq": _mmq_product, "mmf": _mmf_product, "mmw": _mmw_product}[kernel]
        xa = _activations(W, b[order // k].contiguous(), gate.qtype, kernel)  # activation rows in expert order
        if not (product(W, gate, xa, tiles, g) and product(W, up, xa, tiles, u)):
            return None
    y_sorted = torch.empty((n_asg, n_embd), dtype=F32, device=dev)
    down_kernel = "mmq" if kernel == "mmw" else kernel
    if fused and down_kernel == "mmq" and MMQ_SWIGLU_Q and not MMQ_S256:  # h quantized from g and u, never stored
        flat_w = wts.reshape(-1).contiguous()
        if not ext.mmq_experts(down, W._arr(g), down_tiles.data_ptr(), down_tiles.shape[0], W._arr(y_sorted),
                               up=W._arr(u), limit=float(limit), row_w=flat_w.data_ptr(), row_of=order.data_ptr()):
            return None
    else:
        h = torch.empty_like(g)
        if fused:  # the routing weight of each row read through the expert order inside the SwiGLU launch
            flat_w = wts.reshape(-1).contiguous()
            ext.swiglu(g.data_ptr(), u.data_ptr(), g.numel(), float(limit), h.data_ptr(), flat_w.data_ptr(), n_ff,
                       order.data_ptr())
        else:
            ext.swiglu(g.data_ptr(), u.data_ptr(), g.numel(), float(limit), h.data_ptr())
            h *= wts.reshape(-1)[order, None]
        product = _mmq_product if down_kernel == "mmq" else _mmf_product
        if not product(W, down, _activations(W, h, down.qtype, down_kernel), down_tiles, y_sorted):
            return None
    if fused:  # each token's k rows summed in slot order, straight from the expert order
        slot_row = torch.empty_like(order)
        slot_row[order] = torch.arange(n_asg, device=dev)
        out = torch.empty((T, n_embd), dtype=F32, device=dev)
        ext.moe_combine(y_sorted.data_ptr(), slot_row.data_ptr(), T, k, n_embd, out.data_ptr())
        return out
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted  # back to (token, expert) order: the k-sum below is deterministic
    return y.view(T, k, n_embd).sum(dim=1)


class MmfActivations(NamedTuple):
    """Activation rows as mmf.cu takes them: x / s = hi + lo (float16), s [R, 1]; the K-quants' group sums of x / s
    split alike ([R, cols / 256, 16]), None for IQ2_XXS."""

    hi: torch.Tensor
    lo: torch.Tensor
    s: torch.Tensor
    sum_hi: torch.Tensor | None
    sum_lo: torch.Tensor | None


# columns per min group of the K-quants (Q2_K: 16, Q4_K: 32); mmf.cu takes 16 sums per 256 columns
MIN_GROUP = {int(Q.Q2_K): 16, int(Q.Q4_K): 32}


def mmf_activations(to_half, x: torch.Tensor, qtype: int) -> MmfActivations:
    """x [R, cols] float32 as mmf.cu takes it for experts of qtype; to_half(x) -> (hi, lo or None, s) is the split
    (Weights.to_half: the split_half kernel)."""
    hi, lo, s = to_half(x)
    if lo is None:  # DS4_GPU_PREFILL_GEMM=f16: one float16 pass
        lo = torch.zeros_like(hi)
    group = MIN_GROUP.get(int(qtype))
    if group is None:
        return MmfActivations(hi, lo, s, None, None)
    R, K = x.shape
    # sums of x itself, then / s: no [R, K] temporary (the split's hi + lo is x / s to ~22 bits; the sums need no more)
    sums = x.view(R, K // 256, 256 // group, group).sum(dim=-1) / s.view(R, 1, 1)
    if sums.shape[-1] < 16:
        sums = torch.nn.functional.pad(sums, (0, 16 - sums.shape[-1]))
    sum_hi = sums.to(F16)
    return MmfActivations(hi, lo, s, sum_hi.contiguous(), (sums - sum_hi.float()).to(F16).contiguous())


def _activations(W, x: torch.Tensor, qtype: int, kernel: str):
    return x if kernel == "mmq" else mmf_activations(W.to_half, x, qtype)


def _mmq_product(W, w, x: torch.Tensor, tiles: torch.Tensor, y: torch.Tensor) -> bool:
    return W.ext.mmq_experts(w, W._arr(x), tiles.data_ptr(), tiles.shape[0], W._arr(y), s256=int(MMQ_S256))


def _mmw_product(W, w, xa: MmfActivations, tiles: torch.Tensor, y: torch.Tensor) -> bool:
    return W.ext.mmw_experts(w, xa.hi.data_ptr(), xa.lo.data_ptr(), xa.s.data_ptr(), tiles.data_ptr(), tiles.shape[0],
                             W._arr(y))


def _mmf_product(W, w, xa: MmfActivations, tiles: torch.Tensor, y: torch.Tensor) -> bool:
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    return W.ext.mmf_experts(w, ptr(xa.hi), ptr(xa.lo), ptr(xa.sum_hi), ptr(xa.sum_lo), ptr(xa.s), tiles.data_ptr(),
                             tiles.shape[0], W._arr(y))
