"""Kernel benchmark of ds4.engine.gpu at DeepSeek V4 Flash shapes (issue 6; run on an H200).

For each kernel: time per call, bytes of weights read (GGUF bytes), achieved GB/s and the ratio to a
device-to-device copy measured in the same run (copy GB/s counts bytes read + written). Each timed
call goes through a CUDA graph that cycles over enough copies of the weights to keep them out of
the 60 MB L2. A "layer" row runs every matvec of one Flash q2 layer in sequence in one graph and
compares it with its bandwidth floor (bytes / copy bandwidth).

Each row also prints its launch ceiling: the most of copy bandwidth one launch of that size could reach if it
streamed at copy speed from its first instant, given the cost of an empty kernel launched from a CUDA graph
(measured in the same run): ceiling = t_copy / (t_launch + t_copy). Rows whose ceiling is under the issue's 0.80
cannot reach it as a launch of their own, however fast the kernel.

    python -m ds4.speed_bench.gpu_kernels [--batch 1 8] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import numpy as np

from ds4.engine import gpu
from ds4.gguf_tools.constants import BLOCK, QuantType as Q, row_bytes

L2_BYTES = 60 << 20
ROTATE_BYTES = 512 << 20  # weights cycled per graph: ~8x L2


def random_raw(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF blocks with finite f16 scales (bandwidth does not depend on the values)."""
    rb = row_bytes(qtype, cols)
    raw = np.frombuffer(rng.bytes(rows * rb), dtype=np.uint8).copy()
    if qtype == Q.F16:
        v = raw.view(np.uint16)
        v &= 0x3BFF  # |x| < 1, finite
        return raw.reshape(rows, rb)
    info = BLOCK[qtype]
    blocks = raw.reshape(-1, info.nbytes)
    scale_offsets = {Q.Q8_0: (0,), Q.Q2_K: (80, 82), Q.Q4_K: (0, 2), Q.IQ2_XXS: (0,)}[qtype]
    for off in scale_offsets:
        blocks[:, off:off + 2] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    return raw.reshape(rows, rb)


class Weights:
    """`copies` device copies of one random tensor (same bytes, distinct buffers)."""

    def __init__(self, name: str, qtype: Q, ne: tuple[int, ...], rng: np.random.Generator, copies: int | None = None):
        rows = int(np.prod(ne[1:]))
        raw = random_raw(qtype, rows, ne[0], rng)
        if copies is None:
            copies = max(1, min(64, -(-ROTATE_BYTES // raw.nbytes)))
        self.name, self.qtype, self.ne = name, qtype, ne
        self.tensors = [gpu.upload(f"{name}#{i}", qtype, ne, raw) for i in range(copies)]
        self.nbytes = raw.nbytes


def launch_ceiling(nbytes: int, copy_gbps: float, launch_us: float) -> float:
    """The fraction of copy bandwidth a launch reading nbytes can reach at best: its bytes at copy speed after the
    fixed cost of a graph-launched kernel."""
    if nbytes <= 0 or copy_gbps <= 0 or launch_us < 0:
        raise ValueError("launch_ceiling: nbytes and copy_gbps must be positive, launch_us not negative")
    t_copy_us = nbytes / (copy_gbps * 1e9) * 1e6
    return t_copy_us / (launch_us + t_copy_us)


def time_graph(record, n_calls: int, iters: int) -> float:
    """ms per call of `record(i)` captured n_calls times in one graph."""
    ext = gpu.load()
    record(0)  # size scratch outside capture
    ext.synchronize()
    ext.capture_begin()
    try:
        for i in range(n_calls):
            record(i)
    finally:
        graph = ext.capture_end()
    return graph.time_ms(iters=iters, warmup=2) / n_calls


def bench_matvec(w: Weights, batch: int, groups: int = 1, iters: int = 10) -> float:
    ext = gpu.load()
    rng = np.random.default_rng(0)
    ncols, nrows = w.ne[0], int(np.prod(w.ne[1:]))
    x = ext.Array.from_numpy(rng.standard_normal((batch, groups * ncols)).astype(np.float32))
    y = ext.Array.empty([batch, nrows])
    n_calls = max(len(w.tensors), 8)
    return time_graph(lambda i: ext.matvec(w.tensors[i % len(w.tensors)], x, y, groups), n_calls, iters)


def bench_sliced(w: Weights, slices: int, iters: int = 10) -> float:
    """ms per batch-1 Q8_0 matvec in column slices (ext.matvec_sliced: the parts, not yet summed)."""
    ext = gpu.load()
    rng = np.random.default_rng(0)
    x = ext.Array.from_numpy(rng.standard_normal((1, w.ne[0])).astype(np.float32))
    parts = ext.Array.empty([slices, int(np.prod(w.ne[1:]))])
    n_calls = max(len(w.tensors), 8)

    def record(i: int) -> None:
        if not ext.matvec_sliced(w.tensors[i % len(w.tensors)], x.ptr, parts.ptr, slices):
            raise RuntimeError(f"matvec_sliced declined {w.name} in {slices} slices")

    return time_graph(record, n_calls, iters)


class Experts:
    def __init__(self, mix: str, rng: np.random.Generator, n_expert: int = 256, n_embd: int = 4096, n_ff: int = 2048):
        qg, qd = (Q.IQ2_XXS, Q.Q2_K) if mix == "q2" else (Q.Q4_K, Q.Q4_K)
        self.mix, self.n_expert, self.n_embd = mix, n_expert, n_embd
        self.gate = Weights(f"{mix}.gate_exps", qg, (n_embd, n_ff, n_expert), rng, copies=1)
        self.up = Weights(f"{mix}.up_exps", qg, (n_embd, n_ff, n_expert), rng, copies=1)
        self.down = Weights(f"{mix}.down_exps", qd, (n_ff, n_embd, n_expert), rng, copies=1)
        self.per_expert = (self.gate.nbytes + self.up.nbytes + self.down.nbytes) // n_expert


def bench_moe(ex: Experts, tokens: int, k: int = 6, iters: int = 10) -> tuple[float, int]:
    """ms per MoE call with fresh experts each call; returns (ms, distinct expert bytes per call)."""
    ext = gpu.load()
    rng = np.random.default_rng(1)
    n_calls = 32
    perm = [rng.permutation(ex.n_expert) for _ in range(n_calls)]
    ids = [ext.Array.from_numpy(p[: tokens * k].reshape(tokens, k).astype(np.int32).copy()) for p in perm]
    wts = ext.Array.from_numpy(np.full((tokens, k), 0.25, np.float32))
    x = ext.Array.from_numpy(rng.standard_normal((tokens, ex.n_embd)).astype(np.float32))
    y = ext.Array.empty([tokens, ex.n_embd])
    g, u, d = ex.gate.tensors[0], ex.up.tensors[0], ex.down.tensors[0]
    ms = time_graph(lambda i: ext.moe(g, u, d, x, ids[i % n_calls], wts, y, 10.0), n_calls, iters)
    return ms, tokens * k * ex.per_expert


def bench_moe_shexp(ex: Experts, rng: np.random.Generator, k: int = 6, iters: int = 10) -> tuple[float, int]:
    """ms per decode MoE call with the shared expert (Q8_0, Flash's shape) in the same two launches
    (DS4_GPU_MOE_SHEXP, ext.moe_shexp); returns (ms, distinct routed + shared expert bytes per call)."""
    ext = gpu.load()
    n_ff = ex.gate.ne[1]
    shexp = [Weights(f"{ex.mix}.{n}_shexp", Q.Q8_0, ne, rng)
             for n, ne in (("gate", (ex.n_embd, n_ff)), ("up", (ex.n_embd, n_ff)), ("down", (n_ff, ex.n_embd)))]
    n_calls = 32
    perm = [rng.permutation(ex.n_expert) for _ in range(n_calls)]
    ids = [ext.Array.from_numpy(p[:k].reshape(1, k).astype(np.int32).copy()) for p in perm]
    wts = ext.Array.from_numpy(np.full((1, k), 0.25, np.float32))
    x = ext.Array.from_numpy(rng.standard_normal((1, ex.n_embd)).astype(np.float32))
    y, ys = ext.Array.empty([1, ex.n_embd]), ext.Array.empty([1, ex.n_embd])
    g, u, d = ex.gate.tensors[0], ex.up.tensors[0], ex.down.tensors[0]

    def record(i):
        sg, su, sd = (w.tensors[i % len(w.tensors)] for w in shexp)
        ext.moe_shexp(g, u, d, sg, su, sd, x, ids[i % n_calls], wts, y, ys, 10.0)
    ms = time_graph(record, n_calls, iters)
    return ms, k * ex.per_expert + sum(w.nbytes for w in shexp)


GATEUP_FORMS = ("rows", "unrolled", "mma")


def bench_gateup(ex: Experts, tokens: int, form: str, k: int = 6, iters: int = 10) -> tuple[float, int]:
    """ms per MoE gate/up call (x quantization, gate/up, SwiGLU; no down) through the rows kernel (rolled loop), its
    unrolled form on 4096 columns (`unrolled`) or the int8 mma kernel (IQ2_XXS only; engine/gpu/moe_mma.cu);
    returns (ms, distinct gate+up bytes per call)."""
    ext = gpu.load()
    rng = np.random.default_rng(1)
    n_calls = 32
    perm = [rng.permutation(ex.n_expert) for _ in range(n_calls)]
    ids = [ext.Array.from_numpy(p[: tokens * k].reshape(tokens, k).astype(np.int32).copy()) for p in perm]
    wts = ext.Array.from_numpy(np.full((tokens, k), 0.25, np.float32))
    x = ext.Array.from_numpy(rng.standard_normal((tokens, ex.n_embd)).astype(np.float32))
    h = ext.Array.empty([tokens * k, ex.gate.ne[1]])
    g, u = ex.gate.tensors[0], ex.up.tensors[0]
    ext.set_gateup_mma(form == "mma")  # the kernel is chosen when the graph is captured
    ext.set_gu_unroll(int(form == "unrolled"))
    try:
        ms = time_graph(lambda i: ext.moe_gateup(g, u, x, ids[i % n_calls], wts, h, 10.0), n_calls, iters)
    finally:
        ext.set_gateup_mma(None)
        ext.set_gu_unroll(-1)
    return ms, tokens * k * (ex.gate.nbytes + ex.up.nbytes) // ex.n_expert


# One Flash layer's matvecs (model-spec §2.4, §8.2): name, type, ne, groups.
FLASH_MATVECS = [
    ("attn_q_a", Q.Q8_0, (4096, 1024), 1),
    ("attn_q_b", Q.Q8_0, (1024, 32768), 1),
    ("attn_kv", Q.Q8_0, (4096, 512), 1),
    ("attn_output_a", Q.Q8_0, (4096, 8192), 8),
    ("attn_output_b", Q.Q8_0, (8192, 4096), 1),
    ("ffn_gate_shexp", Q.Q8_0, (4096, 2048), 1),
    ("ffn_up_shexp", Q.Q8_0, (4096, 2048), 1),
    ("ffn_down_shexp", Q.Q8_0, (2048, 4096), 1),
    ("attn_compressor_kv", Q.F16, (4096, 1024), 1),
    ("attn_compressor_gate", Q.F16, (4096, 1024), 1),
    ("indexer.attn_q_b", Q.F16, (1024, 8192), 1),
    ("indexer.proj", Q.F16, (4096, 64), 1),
    ("ffn_gate_inp", Q.F16, (4096, 256), 1),
]
# Stand-alone rows for each expert type at the size of 6 experts (a plain matvec over stacked rows).
EXPERT_MATVECS = [
    ("6x gate/up IQ2_XXS", Q.IQ2_XXS, (4096, 6 * 2048), 1),
    ("6x down Q2_K", Q.Q2_K, (2048, 6 * 4096), 1),
    ("6x gate/up Q4_K", Q.Q4_K, (4096, 6 * 2048), 1),
    ("6x down Q4_K", Q.Q4_K, (2048, 6 * 4096), 1),
]
HEAD = ("output (head)", Q.Q8_0, (4096, 129280), 1)


def bench_layer(rng: np.random.Generator, experts: Experts, copies: int, iters: int) -> tuple[float, int]:
    """All matvecs of one Flash q2 layer (ratio-4 layer: compressor + indexer) in one graph."""
    ext = gpu.load()
    layers = [{name: gpu.upload(f"L{c}.{name}", q, ne, random_raw(q, int(np.prod(ne[1:])), ne[0], rng))
               for name, q, ne, _ in FLASH_MATVECS} for c in range(copies)]
    bufs = {}
    for name, q, ne, groups in FLASH_MATVECS:
        bufs[name] = (ext.Array.from_numpy(rng.standard_normal((1, groups * ne[0])).astype(np.float32)),
                      ext.Array.empty([1, ne[1]]), groups)
    k = 6
    ids = [ext.Array.from_numpy(rng.permutation(experts.n_expert)[:k].reshape(1, k).astype(np.int32).copy())
           for _ in range(copies)]
    wts = ext.Array.from_numpy(np.full((1, k), 0.25, np.float32))
    xm = ext.Array.from_numpy(rng.standard_normal((1, experts.n_embd)).astype(np.float32))
    ym = ext.Array.empty([1, experts.n_embd])
    g, u, d = experts.gate.tensors[0], experts.up.tensors[0], experts.down.tensors[0]

    def record(i: int) -> None:
        layer = layers[i % copies]
        for name, _, _, groups in FLASH_MATVECS:
            x, y, _ = bufs[name]
            ext.matvec(layer[name], x, y, groups)
        ext.moe(g, u, d, xm, ids[i % copies], wts, ym, 10.0)

    ms = time_graph(record, copies, iters)
    nbytes = sum(t.gguf_nbytes for t in layers[0].values()) + k * experts.per_expert
    return ms, nbytes


# Dependent pairs the decode step chains (weights.py mv_pair, the shared expert): A's names, groups, B, SwiGLU.
CHAINS = [("o_a -> o_b", ("attn_output_a",), 8, "attn_output_b", False),
          ("shexp gate+up -> down", ("ffn_gate_shexp", "ffn_up_shexp"), 1, "ffn_down_shexp", True)]


def bench_chain(rng: np.random.Generator, a_names, groups: int, b_name: str, swiglu: bool, form: int,
                iters: int) -> tuple[float, int]:
    """ms per (A, then B on A's output): form 0 two launches, 1 / 2 one chained launch (register / bulk-copy form)."""
    ext = gpu.load()
    shapes = {name: (q, ne) for name, q, ne, _ in FLASH_MATVECS}
    pair_bytes = sum(row_bytes(shapes[n][0], shapes[n][1][0]) * shapes[n][1][1] for n in (*a_names, b_name))
    copies = max(1, min(16, -(-ROTATE_BYTES // pair_bytes)))
    mats = [{n: gpu.upload(f"chain{c}.{n}", shapes[n][0], shapes[n][1],
                           random_raw(shapes[n][0], shapes[n][1][1], shapes[n][1][0], rng)) for n in (*a_names, b_name)}
            for c in range(copies)]
    k_a, n_a = shapes[a_names[0]][1]
    x = ext.Array.from_numpy(rng.standard_normal((1, groups * k_a)).astype(np.float32))
    mid = ext.Array.empty([1, n_a * len(a_names)])
    y = ext.Array.empty([1, shapes[b_name][1][1]])
    ya = [mid.ptr + 4 * n_a * i for i in range(len(a_names))]

    def record(i: int) -> None:
        m = mats[i % copies]
        wa = [m[n] for n in a_names]
        if form == 0:
            if groups > 1:
                ext.matvec(wa[0], x, ext.Array.view(ya[0], [1, n_a]), groups)
            else:
                ext.matvec_multi(wa, x.ptr, ya)
            ext.matvec_multi([m[b_name]], mid.ptr, [y.ptr], swiglu, 10.0)
        elif not ext.matvec_chain(wa, x.ptr, ya, groups, m[b_name], y.ptr, swiglu, 10.0):
            raise RuntimeError(f"matvec_chain (form {form}) declined {a_names} -> {b_name}")

    ext.set_mv_chain_form(max(form, 1))
    try:
        return time_graph(record, copies, iters), pair_bytes
    finally:
        ext.set_mv_chain_form(-1)


# Decode's one-launch sets (ext.matvec_multi) of an indexed layer, against a launch per matrix: (label, [(type, ne)],
# whether x is RMS-normalized by the launch). q_b beside the indexer's q_b is the Q8_0 + F16 pair kernel.
MULTIS = [
    ("q_b + indexer q_b", [(Q.Q8_0, (1024, 32768)), (Q.F16, (1024, 8192))], True),
    ("compressors + indexer proj", [(Q.F16, (4096, 1024))] * 2 + [(Q.F16, (4096, 256))] * 2 + [(Q.F16, (4096, 64))],
     False),
]


def bench_multi(rng: np.random.Generator, mats, norm: bool, one: bool, iters: int) -> tuple[float, int]:
    """ms per set of matvecs on one x: one matvec_multi launch, or one launch per matrix."""
    ext = gpu.load()
    nbytes = sum(row_bytes(q, ne[0]) * ne[1] for q, ne in mats)
    copies = max(1, min(16, -(-ROTATE_BYTES // nbytes)))
    ws = [[gpu.upload(f"multi{c}.{i}", q, ne, random_raw(q, ne[1], ne[0], rng)) for i, (q, ne) in enumerate(mats)]
          for c in range(copies)]
    K = mats[0][1][0]
    x = ext.Array.from_numpy(rng.standard_normal((1, K)).astype(np.float32))
    nw = ext.Array.from_numpy((1.0 + 0.1 * rng.standard_normal(K)).astype(np.float32))
    ys = [ext.Array.empty([1, ne[1]]) for _, ne in mats]
    nptr = nw.ptr if norm else 0

    def record(i: int) -> None:
        w = ws[i % copies]
        if not one:
            for wi, y in zip(w, ys):
                ext.matvec(wi, x, y, 1, nptr, 1e-6)
        elif not ext.matvec_multi(w, x.ptr, [y.ptr for y in ys], False, 0.0, nptr, 1e-6):
            raise RuntimeError(f"matvec_multi declined {[q.name for q, _ in mats]}")

    return time_graph(record, copies, iters), nbytes


def k_sweep(rng: np.random.Generator, copy_gbps: float, iters: int) -> list[dict]:
    """Batch-1 Q8_0 matvecs of the same bytes as q_b (35.65 MB) at row lengths K = 512 .. 16384, on the streaming and
    the bulk-copy kernel: what a row's length (x staged per CTA, a warp's serial steps) costs at constant bytes."""
    ext = gpu.load()
    out = []
    for k in (512, 1024, 2048, 4096, 8192, 16384):
        rows = int(35.65e6 / row_bytes(Q.Q8_0, k)) // 64 * 64
        w = Weights(f"ksweep.{k}", Q.Q8_0, (k, rows), rng)
        for mode, kernel in ((0, "streaming"), (1, "bulk-copy")):
            ext.set_mv_tma(mode)
            try:
                ms = bench_matvec(w, 1, 1, iters)
            finally:
                ext.set_mv_tma(-1)
            ratio = w.nbytes / (ms * 1e-3) / 1e9 / copy_gbps
            out.append(dict(k=k, rows=rows, kernel=kernel, us=ms * 1e3, ratio=ratio))
            print(f"K={k:5d} x {rows:5d} rows  {kernel:9s} {ms * 1e3:6.1f} us  {ratio:.2f} of copy", flush=True)
        del w
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="GPU kernel bandwidth at Flash shapes (needs a CUDA device)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch widths to time (1..8)")
    ap.add_argument("--json", help="write all rows to this JSON file")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--only", metavar="REGEX",
                    help="time only the rows whose name matches (Python regex, e.g. 'attn_output|o_a'); the layer row "
                         "runs only if it matches 'layer'")
    ap.add_argument("--k-sweep", action="store_true",
                    help="also time Q8_0 matvecs of q_b's 35.65 MB at row lengths 512..16384 on both batch-1 kernels")
    args = ap.parse_args(argv)
    if any(b < 1 or b > 8 for b in args.batch):
        print("gpu_kernels: --batch values must be 1..8", file=sys.stderr)
        return 2
    try:
        only = re.compile(args.only) if args.only else None
    except re.error as e:
        print(f"gpu_kernels: --only is not a valid regex: {e}", file=sys.stderr)
        return 2
    if not gpu.available():
        print(f"gpu_kernels: {gpu.unavailable_reason()}", file=sys.stderr)
        return 2

    def wanted(name: str) -> bool:
        return only is None or only.search(name) is not None
    ext = gpu.load()
    iters = 5 if args.quick else 20
    info = ext.device_info()
    copy = ext.copy_bandwidth(1 << 31, 20)
    copy_gbps = copy["gbps"]
    read = ext.read_bandwidth(1 << 31, 20)  # a pure read stream: what a matvec, which only reads, could reach
    # batch-1 Q8_0 kernel chosen by $DS4_GPU_MV (engine/gpu/matvec.cu): the A/B is two runs of this bench
    mv = os.environ.get("DS4_GPU_MV") or "4"  # matvec.cu mv_variant(): 4 when unset
    print(f"device: {info['name']} ({info['sms']} SMs, L2 {info['l2_bytes'] >> 20} MiB); "
          f"D2D copy {copy_gbps:.0f} GB/s (read+write); read-only stream {read['gbps']:.0f} GB/s "
          f"({read['gbps'] / copy_gbps:.2f} of copy); mv={mv}", flush=True)
    launch_us = time_graph(lambda i: ext.launch_empty(1), 256, iters) * 1e3
    print(f"one empty kernel launched from a CUDA graph: {launch_us:.2f} us (the launch ceiling's fixed cost)", flush=True)
    rng = np.random.default_rng(0)
    rows = []

    def add(kernel: str, qtype: str, batch: int, ms: float, nbytes: int) -> None:
        gbps = nbytes / (ms * 1e-3) / 1e9
        row = dict(kernel=kernel, type=qtype, batch=batch, us=ms * 1e3, mbytes=nbytes / 1e6, gbps=gbps,
                   ratio=gbps / copy_gbps, ceiling=launch_ceiling(nbytes, copy_gbps, launch_us))
        rows.append(row)
        print(f"{kernel:26s} {qtype:8s} B={batch}  {row['us']:9.1f} us  {row['mbytes']:8.2f} MB  "
              f"{gbps:7.0f} GB/s  {row['ratio']:5.2f}  ceiling {row['ceiling']:.2f}", flush=True)

    t0 = time.time()
    for name, q, ne, groups in FLASH_MATVECS + EXPERT_MATVECS + [HEAD]:
        if not wanted(name):
            continue
        w = Weights(name, q, ne, rng)
        for b in args.batch:
            add(name, q.name, b, bench_matvec(w, b, groups, iters), w.nbytes)
        if name == "attn_output_b" and 1 in args.batch:  # o_b in two column slices (DS4_GPU_OB_SLICES=2)
            add("attn_output_b (2 slices)", q.name, 1, bench_sliced(w, 2, iters), w.nbytes)
        del w
    moe_rows = wanted("routed MoE") or wanted("IQ2_XXS gate/up")
    experts = {mix: Experts(mix, rng) for mix in ("q2", "q4")} if moe_rows or wanted("layer") else {}
    for mix, ex in experts.items() if moe_rows else []:
        for b in args.batch:
            ms, nbytes = bench_moe(ex, b, iters=iters)
            add(f"routed MoE k=6 ({mix})", "IQ2+Q2K" if mix == "q2" else "Q4_K", b, ms, nbytes)
        if 1 in args.batch:
            ms, nbytes = bench_moe_shexp(ex, rng, iters=iters)
            add(f"routed MoE k=6 + shexp ({mix})", ("IQ2+Q2K" if mix == "q2" else "Q4_K") + "+Q8", 1, ms, nbytes)
    for b in args.batch if moe_rows else []:  # IQ2_XXS gate/up alone in each form, then the MoE with the mma one
        for form in GATEUP_FORMS:
            ms, nbytes = bench_gateup(experts["q2"], b, form, iters=iters)
            add(f"IQ2_XXS gate/up k=6 ({form})", "IQ2_XXS", b, ms, nbytes)
        ext.set_gateup_mma(True)
        try:
            ms, nbytes = bench_moe(experts["q2"], b, iters=iters)
        finally:
            ext.set_gateup_mma(None)
        add("routed MoE k=6 (q2, mma)", "IQ2+Q2K", b, ms, nbytes)
    for label, a_names, groups, b_name, swiglu in CHAINS:
        if not wanted(label):
            continue
        for form, how in ((0, "2 launches"), (1, "chain regs"), (2, "chain bulk")):
            ms, nbytes = bench_chain(rng, a_names, groups, b_name, swiglu, form, iters)
            add(f"{label} ({how})", "Q8_0", 1, ms, nbytes)
    for label, mats, norm in MULTIS:
        if not wanted(label):
            continue
        types = "+".join(dict.fromkeys(q.name for q, _ in mats))
        for one, how in ((False, "a launch each"), (True, "one launch")):
            ms, nbytes = bench_multi(rng, mats, norm, one, iters)
            add(f"{label} ({how})", types, 1, ms, nbytes)
    sweep = k_sweep(rng, copy_gbps, iters) if args.k_sweep else []
    ms = floor_ms = None
    if wanted("layer"):
        ms, nbytes = bench_layer(rng, experts["q2"], copies=4, iters=iters)
        floor_ms = nbytes / (copy_gbps * 1e9) * 1e3
        add("Flash q2 layer (graph)", "mixed", 1, ms, nbytes)
        print(f"layer: {ms * 1e3:.1f} us vs floor {floor_ms * 1e3:.1f} us at copy bandwidth -> {ms / floor_ms:.2f}x floor")
    capped = sorted({r["kernel"] for r in rows if r["batch"] == 1 and r["ceiling"] < 0.80})
    if capped:
        print(f"launch ceiling under 0.80 of copy at batch 1 (cannot reach it as one launch): {', '.join(capped)}")
    print(f"total bench time {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(dict(device=info, copy=copy, read=read, mv=mv, launch_us=launch_us, rows=rows, k_sweep=sweep, layer_floor_ms=floor_ms, layer_ms=ms), f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
