"""`python -m ds4.engine.gpu.bench_hc`: decode's mHC kernel (hc_post_pre: the previous sublayer's post, the mix, Sinkhorn
and the next sublayer's input in one launch) alone, in µs per call, by its Sinkhorn iterations.

Why: a decode token runs this kernel 87 times (~10 µs each in the v21 trace, 13% of the step). Its last CTA finishes the
mix: seven warps form the sublayer's input while one thread runs Sinkhorn (20 iterations for Flash) for comb, which only
the next mHC reads. The kernel ends when that thread does, so if Sinkhorn is the tail, the chain waits for it. The peer
is the same launch with 0 iterations (the softmax rows only): the difference is what Sinkhorn adds to the chain.
Timed by CUDA events over replays of a CUDA graph of 20 launches at Flash's shape (n = 4 streams of D = 4096).
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, nargs="+", default=[20, 10, 1],
                    help="Sinkhorn iterations to time (Flash and Pro: 20); the peer (0) is always timed")
    ap.add_argument("--reps", type=int, default=2000, help="calls timed per setting")
    args = ap.parse_args(argv)
    if any(i < 0 or i > 1000 for i in args.iters) or args.reps < 1:
        print("bench_hc: --iters must be in 0..1000 and --reps positive", file=sys.stderr)
        return 2
    from ds4.engine import gpu

    if not gpu.available():
        print(f"bench_hc: no CUDA extension: {gpu.unavailable_reason()}", file=sys.stderr)
        return 2
    peer = time_hc(0, args.reps)
    print(f"{'iters':>6}  {'us':>7}  {'/ peer (0 iters)':>16}")
    print(f"{0:>6}  {peer:7.2f}  {1.0:16.2f}")
    for it in args.iters:
        us = time_hc(it, args.reps)
        print(f"{it:>6}  {us:7.2f}  {us / peer:16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
