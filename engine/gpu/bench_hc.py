"""`python -m ds4.engine.gpu.bench_hc`: decode's mHC kernel (hc_post_pre: the previous sublayer's post, the mix, Sinkhorn
and the next sublayer's input in one launch) alone, in µs per call, by its Sinkhorn iterations.

Why: a decode token runs this kernel 87 times (~10 µs each in the v21 trace, 13% of the step). Its last CTA finishes the
mix: seven warps form the sublayer's input while one thread runs Sinkhorn (20 iterations for Flash) for comb, which only
the next mHC reads. The kernel ends when that thread does, so if Sinkhorn is the tail, the chain waits for it. The peer
is the same launch with 0 iterations (the softmax rows only): the difference is what Sinkhorn adds to the chain.
Timed by CUDA events over replays of a CUDA graph of 20 launches at Flash's shape (n = 4 streams of D = 4096).

`--prefill-mix T`: prefill's mHC mix instead (flatten(X) [T, 16384] . Wf [24, 16384]^T in float32, 86 calls per
prefill): hc_mix_rows (DS4_GPU_HC_MIX) against its peer, torch's float32 GEMM, in ms per call on fresh inputs, with the
achieved read rate of X and the largest difference between the two relative to sum |x w|.
"""

from __future__ import annotations

import argparse
import sys


def time_hc(iters: int, reps: int, D: int = 4096, n: int = 4) -> float:
    """µs per call of hc_post_pre at one token with `iters` Sinkhorn iterations."""
    import torch

    from ds4.engine import gpu
    from ds4.engine.gpu.fused import Fused
    from ds4.engine.gpu.graph_timing import torch_graph_us

    K = Fused(gpu.load(), torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)  # the same inputs at every iteration count
    M = (2 + n) * n

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g, device="cuda") * s

    X, y1 = rnd(1, n, D), rnd(1, D)
    post_in = torch.rand(1, n, generator=g, device="cuda") * 2.0
    comb_in = torch.softmax(rnd(1, n, n), dim=-1)
    Wf, scale, base, norm_w = rnd(M, n * D, s=0.01), rnd(3, s=0.1).abs(), rnd(M, s=0.1), rnd(D).abs()

    def call():
        K.hc_post_pre(X, y1, None, post_in, comb_in, Wf, scale, base, norm_w, iters, 1e-6, 1e-6)

    return torch_graph_us(call, reps)


def time_prefill_mix(T: int, reps: int = 50, n: int = 4, D: int = 4096, M: int = 24) -> dict:
    """ms per call of hc_mix_rows and of torch.mm on the same [T, n D] rows, the rate at which each reads X, and
    their largest difference relative to sum |x w| per output."""
    import torch

    from ds4.engine import gpu

    ext, dev = gpu.load(), torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(T)
    sets = [torch.randn(T, n * D, generator=g, device=dev) for _ in range(3)]  # rotated: X (0.5 GB at 8k) > L2
    Wf = torch.randn(M, n * D, generator=g, device=dev) * 0.01
    ext.set_stream(torch.cuda.current_stream(dev).cuda_stream)
    out = torch.empty((T, M), device=dev)
    scratch = torch.empty((ext.hc_mix_rows_splits(T, n * D), T, M), device=dev)

    def kernel(X):
        ext.hc_mix_rows(X.data_ptr(), Wf.data_ptr(), T, n * D, M, out.data_ptr(), scratch.data_ptr())

    def peer(X):
        torch.mm(X, Wf.T)

    def ms(fn) -> float:
        for X in sets:
            fn(X)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(reps):
            fn(sets[i % len(sets)])
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    k_ms, p_ms = ms(kernel), ms(peer)
    # v31: the previous sublayer's post and this mix in one pass (hc_post_mix) against hc_post4 then hc_mix_rows
    y, post = torch.randn(T, D, generator=g, device=dev), torch.rand(T, n, generator=g, device=dev)
    comb = torch.rand(T, n, n, generator=g, device=dev)
    Xn = torch.empty((T, n * D), device=dev)

    def post_mix(X):
        ext.hc_post_mix(X.data_ptr(), y.data_ptr(), 0, post.data_ptr(), comb.data_ptr(), 0, 0, Wf.data_ptr(), T, D, M,
                        Xn.data_ptr(), out.data_ptr(), scratch.data_ptr())

    def post_then_mix(X):
        ext.hc_post(X.data_ptr(), y.data_ptr(), 0, post.data_ptr(), comb.data_ptr(), T, n, D, Xn.data_ptr(), 0, 0)
        ext.hc_mix_rows(Xn.data_ptr(), Wf.data_ptr(), T, n * D, M, out.data_ptr(), scratch.data_ptr())

    pm_ms, two_ms = ms(post_mix), ms(post_then_mix)
    kernel(sets[0])
    ref = torch.mm(sets[0].double(), Wf.double().T)
    mag = torch.mm(sets[0].double().abs(), Wf.double().abs().T)
    rel = float(((out.double() - ref).abs() / mag).max())
    gbs = lambda t: T * n * D * 4 / (t * 1e-3) / 1e9  # noqa: E731
    return {"kernel_ms": k_ms, "peer_ms": p_ms, "kernel_gbs": gbs(k_ms), "peer_gbs": gbs(p_ms), "rel": rel,
            "post_mix_ms": pm_ms, "post_then_mix_ms": two_ms}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, nargs="+", default=[20, 10, 1],
                    help="Sinkhorn iterations to time (Flash and Pro: 20); the peer (0) is always timed")
    ap.add_argument("--reps", type=int, default=2000, help="calls timed per setting")
    ap.add_argument("--prefill-mix", type=int, default=0, metavar="T",
                    help="time prefill's mHC mix of T rows instead (hc_mix_rows against torch's float32 GEMM)")
    args = ap.parse_args(argv)
    if args.prefill_mix < 0 or args.prefill_mix > 65536:
        print("bench_hc: --prefill-mix must be in 0..65536 rows", file=sys.stderr)
        return 2
    if any(i < 0 or i > 1000 for i in args.iters) or args.reps < 1:
        print("bench_hc: --iters must be in 0..1000 and --reps positive", file=sys.stderr)
        return 2
    from ds4.engine import gpu

    if not gpu.available():
        print(f"bench_hc: no CUDA extension: {gpu.unavailable_reason()}", file=sys.stderr)
        return 2
    if args.prefill_mix:
        r = time_prefill_mix(args.prefill_mix)
        print(f"prefill mix of {args.prefill_mix} rows: hc_mix_rows {r['kernel_ms']:.3f} ms ({r['kernel_gbs']:.0f} GB/s"
              f" of X), torch float32 GEMM {r['peer_ms']:.3f} ms ({r['peer_gbs']:.0f} GB/s): "
              f"{r['peer_ms'] / r['kernel_ms']:.2f}x; max diff from float64 {r['rel']:.1e} of sum |x w|")
        print(f"prefill post + mix of {args.prefill_mix} rows: hc_post_mix {r['post_mix_ms']:.3f} ms, hc_post then "
              f"hc_mix_rows {r['post_then_mix_ms']:.3f} ms: {r['post_then_mix_ms'] / r['post_mix_ms']:.2f}x")
        return 0
    peer = time_hc(0, args.reps)
    print(f"{'iters':>6}  {'us':>7}  {'/ peer (0 iters)':>16}")
    print(f"{0:>6}  {peer:7.2f}  {1.0:16.2f}")
    for it in args.iters:
        us = time_hc(it, args.reps)
        print(f"{it:>6}  {us:7.2f}  {us / peer:16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
