"""`python -m ds4.engine.gpu.bench_mmq`: the int8 tensor-core prefill products (mmq.cu) against their peer, the
default exact path of weights.py (dequant to float16 hi + lo, the activation split, three float16 GEMMs), on random
weights at Flash shapes for T activation rows. Prints milliseconds per product (the peer with and without its dequant
pass), the float32-equivalent TFLOP/s and the ratio; for the expert types also the float16 tensor-core kernel on the
codes as exact integers (mmf.cu, one expert of T rows, its activation split included). `--experts`: the routed
experts' launches as the session makes them, with DS4_GPU_MMQ_XPTR off and on, and DS4_GPU_MMQ_PAIRS on top. Needs a
CUDA device and the built extension."""

from __future__ import annotations

import sys

import numpy as np
import torch

from ds4.gguf_tools.constants import BLOCK, QuantType as Q, row_bytes

from .bench_attn import bench_args, time_ms

# (name, type, columns, rows): the Flash matrices each path serves; the expert ones as one expert's matrix
SHAPES = [("attn_q_b", Q.Q8_0, 1024, 32768), ("attn_output_b", Q.Q8_0, 8192, 4096), ("ffn_gate_shexp", Q.Q8_0, 4096, 2048),
          ("expert gate (IQ2_XXS)", Q.IQ2_XXS, 4096, 2048), ("expert down (Q2_K)", Q.Q2_K, 2048, 4096)]
# byte offset and range of each block's f16 scales, so the random blocks decode to finite, realistic weights
SCALES = {Q.Q8_0: [(0, 1e-3, 2e-3)], Q.IQ2_XXS: [(0, 1e-3, 4e-3)], Q.Q2_K: [(80, 2e-3, 8e-3), (82, 1e-3, 4e-3)]}


def random_weight(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    info = BLOCK[qtype]
    nblk = rows * cols // info.elements
    raw = rng.integers(0, 256, size=(nblk, info.nbytes), dtype=np.uint8)
    for off, lo, hi in SCALES[qtype]:
        raw[:, off:off + 2] = rng.uniform(lo, hi, nblk).astype(np.float16).view(np.uint8).reshape(nblk, 2)
    return raw.reshape(rows, row_bytes(qtype, cols))


def main(argv=None) -> int:
    def extra(ap):
        ap.add_argument("--experts", action="store_true",
                        help="instead: the routed experts as the session launches them (T tokens x 6 of 256 Flash "
                             "experts: the IQ2_XXS gate through the token-row table, the Q2_K down from the SwiGLU "
                             "source), each with mmq's rows found per stage and once per CTA (DS4_GPU_MMQ_XPTR 0 / "
                             "1), and with the fragments in pairs (DS4_GPU_MMQ_PAIRS=1)")

    args = bench_args(argv, __doc__, "bench_mmq", 8192, 5, "activation rows (--experts: tokens)", extra)
    if args is None:
        return 2
    from . import load, upload
    from .weights import W_SCALE, split_product

    ext = load()
    rng = np.random.default_rng(0)
    T = args.tokens
    if args.experts:
        return bench_experts(ext, upload, T, args.reps, rng)
    from .moe_gemm import expert_tiles, mmf_activations

    print(f"{'matrix':<24} {'mmq ms':>8} {'peer ms':>8} {'(GEMMs)':>8} {'mmq TF/s':>9} {'peer / mmq':>11} {'mmf ms':>7} "
          f"{'peer / mmf':>11}")
    for name, qtype, cols, rows in SHAPES:
        raw = random_weight(qtype, rows, cols, rng)
        w = upload(f"bench.{name}", int(qtype), (cols, rows), raw)
        x = torch.randn(T, cols, device="cuda")
        y = torch.empty(T, rows, device="cuda")
        arr = lambda t: ext.Array.view(t.data_ptr(), list(t.shape), False)  # noqa: E731
        hi = torch.empty(rows, cols, dtype=torch.float16, device="cuda")
        lo = torch.empty_like(hi)
        xh, xl = torch.empty(T, cols, dtype=torch.float16, device="cuda"), torch.empty(T, cols, dtype=torch.float16,
                                                                                       device="cuda")
        s = torch.empty(T, 1, device="cuda")

        def mmq():
            ext.mmq(w, arr(x), arr(y), 1)

        def dequant():
            ext.dequant(w, hi.data_ptr(), lo.data_ptr(), W_SCALE)

        def gemms():
            ext.split_half(x.data_ptr(), T, cols, xh.data_ptr(), xl.data_ptr(), s.data_ptr())
            return split_product(xh, xl, hi.T, lo.T) * (s / W_SCALE)

        ext.set_stream(torch.cuda.current_stream().cuda_stream)
        t_mmq = time_ms(mmq, args.reps)
        t_gemm = time_ms(gemms, args.reps)
        t_peer = t_gemm + time_ms(dequant, args.reps)
        dequant()
        err = float((y - gemms()).norm() / gemms().norm())
        tf = 2.0 * T * rows * cols / t_mmq / 1e9
        mmf = _mmf_column(ext, name, qtype, raw, rows, x, args.reps, t_peer, gemms(), expert_tiles, mmf_activations)
        print(f"{name:<24} {t_mmq:8.2f} {t_peer:8.2f} {t_gemm:8.2f} {tf:9.0f} {t_peer / t_mmq:11.2f} {mmf}  "
              f"(mmq rel to peer {err:.1e})")
    return 0


def bench_experts(ext, upload, T: int, reps: int, rng: np.random.Generator) -> int:
    """ms per routed-expert launch at Flash shapes, with DS4_GPU_MMQ_XPTR off and on, DS4_GPU_MMQ_PAIRS on top and then
    DS4_GPU_MMQ_XROW, in this process (and whether all but XROW give the same bits); the quantization of the launch's
    activations is included, as in the session."""
    from .moe_gemm import expert_tiles

    n_embd, n_ff, n_expert, k = 4096, 2048, 256, 6
    gate = upload("bench.ffn_gate_exps", int(Q.IQ2_XXS), (n_embd, n_ff, n_expert),
                  random_weight(Q.IQ2_XXS, n_ff * n_expert, n_embd, rng))
    down = upload("bench.ffn_down_exps", int(Q.Q2_K), (n_ff, n_embd, n_expert),
                  random_weight(Q.Q2_K, n_embd * n_expert, n_ff, rng))
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.rand(T, n_expert, device="cuda", generator=gen).argsort(dim=1)[:, :k]  # k distinct experts per token
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_expert).cpu().tolist()
    tiles = torch.tensor(expert_tiles(counts, ext.mmq_tile_rows()), dtype=torch.int32, device="cuda")
    rows = (order // k).contiguous()
    R = T * k
    x = torch.randn(T, n_embd, device="cuda", generator=gen)
    g, u = torch.empty(R, n_ff, device="cuda"), torch.empty(R, n_ff, device="cuda")
    y = torch.empty(R, n_embd, device="cuda")
    wts = torch.rand(R, device="cuda", generator=gen)
    arr = lambda t: ext.Array.view(t.data_ptr(), list(t.shape), False)  # noqa: E731
    ext.set_stream(torch.cuda.current_stream().cuda_stream)

    def gate_launch():
        assert ext.mmq_experts(gate, arr(x), tiles.data_ptr(), tiles.shape[0], arr(g), rows.data_ptr())

    def down_launch():  # the session's form: h = swiglu(g, u) times the routing weights, quantized from g and u
        assert ext.mmq_experts(down, arr(g), tiles.data_ptr(), tiles.shape[0], arr(y), up=arr(u), limit=10.0,
                               row_w=wts.data_ptr(), row_of=order.data_ptr())

    ext.mmq_experts(gate, arr(x), tiles.data_ptr(), tiles.shape[0], arr(u), rows.data_ptr())  # an up stand-in
    print(f"routed experts, {T} tokens x {k} of {n_expert} ({tiles.shape[0]} activation tiles of "
          f"{ext.mmq_tile_rows()} rows): ms per launch")
    settings = {"XPTR=0 PAIRS=0": (0, 0, 0), "XPTR=1 PAIRS=0": (1, 0, 0), "XPTR=1 PAIRS=1": (1, 1, 0),
                "XPTR=1 PAIRS=1 XROW=1": (1, 1, 1), "XPTR=1 PAIRS=1 XROW=3": (1, 1, 3)}
    times, outs = {}, {}
    try:
        for name, (xptr, pairs, xrow) in settings.items():
            ext.set_mmq_xptr(xptr)
            ext.set_mmq_pairs(pairs)
            ext.set_mmq_xrow(xrow)
            times[name] = (time_ms(gate_launch, reps), time_ms(down_launch, reps))
            torch.cuda.synchronize()
            outs[name] = (g.clone(), y.clone())
    finally:
        ext.set_mmq_xptr(-1)
        ext.set_mmq_pairs(-1)
        ext.set_mmq_xrow(-1)
    base = "XPTR=0 PAIRS=0"
    # XROW quantizes the gate's activations per row: other bits by design, so it is compared by its relative error
    same = all(torch.equal(a, b) for name in settings if "XROW" not in name for a, b in zip(outs[base], outs[name]))
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    xrow_err = (rel(outs["XPTR=1 PAIRS=1 XROW=1"][0], outs[base][0]), rel(outs["XPTR=1 PAIRS=1 XROW=3"][1], outs[base][1]))
    for name, (tg, td) in times.items():
        g0, d0 = times[base]
        print(f"  DS4_GPU_MMQ_{name:<15} gate (IQ2_XXS) {tg:6.2f}   down (Q2_K) {td:6.2f}   per 43-layer prefill "
              f"(gate, up, down) {43 * (2 * tg + td):7.1f} ms   against the first: gate {tg / g0:.3f}, down {td / d0:.3f}")
    print(f"  the same bits in every setting without XROW: {'yes' if same else 'NO'}; against the 32-column scales' "
          f"outputs: XROW=1 gate rel {xrow_err[0]:.2e}, XROW=3 down rel {xrow_err[1]:.2e}")
    return 0 if same else 1


def _mmf_column(ext, name, qtype, raw, rows, x, reps, t_peer, want, expert_tiles, mmf_activations) -> str:
    """'ms ratio (rel err)' of mmf.cu on this matrix as one expert of T rows, or dashes where it does not apply."""
    from . import upload

    T, cols = x.shape
    ew = upload(f"bench.{name}.exps", int(qtype), (cols, rows, 1), raw)
    if not ext.mmf_takes(ew, 1):
        return f"{'-':>7} {'-':>11}"
    tiles = torch.tensor(expert_tiles([T], ext.mmf_tile_rows()), dtype=torch.int32, device="cuda")
    y = torch.empty(T, rows, device="cuda")
    arr = ext.Array.view(y.data_ptr(), [T, rows], False)

    def split(t):
        hi, lo = torch.empty(t.shape, dtype=torch.float16, device="cuda"), torch.empty(t.shape, dtype=torch.float16,
                                                                                         device="cuda")
        s = torch.empty(t.shape[0], 1, device="cuda")
        ext.split_half(t.data_ptr(), t.shape[0], t.shape[1], hi.data_ptr(), lo.data_ptr(), s.data_ptr())
        return hi, lo, s

    def mmf():
        xa = mmf_activations(split, x, int(qtype))
        p = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        ext.mmf_experts(ew, p(xa.hi), p(xa.lo), p(xa.sum_hi), p(xa.sum_lo), p(xa.s), tiles.data_ptr(), tiles.shape[0],
                        arr)

    t = time_ms(mmf, reps)
    mmf()
    torch.cuda.synchronize()
    err = float((y - want).norm() / want.norm())
    out = f"{t:7.2f} {t_peer / t:11.2f}  (mmf rel to peer {err:.1e})"
    if ext.mmw_takes(ew, 1):  # the warpgroup-MMA form (IQ2_XXS): the same activations, its own tile table
        wt = torch.tensor(expert_tiles([T], ext.mmw_tile_rows()), dtype=torch.int32, device="cuda")

        for pipe in (0, 1):  # the lock-step form and the warp-specialized one
            def mmw():
                xa = mmf_activations(split, x, int(qtype))
                ext.mmw_experts(ew, xa.hi.data_ptr(), xa.lo.data_ptr(), xa.s.data_ptr(), wt.data_ptr(), wt.shape[0],
                                arr, pipe)

            y.fill_(float("nan"))
            tw = time_ms(mmw, reps)
            mmw()
            torch.cuda.synchronize()
            err = float((y - want).norm() / want.norm())
            out += f"  (mmw{' pipe' if pipe else ''} {tw:.2f} ms, peer / mmw {t_peer / tw:.2f}, rel to peer {err:.1e})"
    return out


if __name__ == "__main__":
    sys.exit(main())
