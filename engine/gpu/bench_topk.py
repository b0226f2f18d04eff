"""`python -m ds4.engine.gpu.bench_topk`: the decode indexer's top-k (topk.cu, one block per row) alone, in µs per call.

Decode at context C holds n = C / 4 compressed rows of float64 keys, of which (pos + 1) / 4 are visible, and keeps the
k = 512 largest (Flash). The v19 trace put ~12.6 µs between the index keys' end and the top-k's end at 2k context
(513-528 visible rows); this separates the kernel's own time from what the decode graph adds. Timed by CUDA events over
replays of a CUDA graph of 20 launches (v19's first form timed Python-issued launches: ~24 us per call at every n, the
host's pace, not the kernel's); the keys are index_keys-like (relu scores, -inf past the visible rows). Peer:
torch.topk on the same keys (ratio = its time / ours).
"""

from __future__ import annotations

import argparse
import sys


def time_topk(n: int, visible: int, k: int, reps: int) -> tuple[float, float]:
    """(µs per call of the extension's top-k, µs per call of torch.topk on the same keys: the peer)."""
    import numpy as np
    import torch

    from ds4.engine import gpu
    from ds4.engine.gpu.fused import Fused
    from ds4.engine.gpu.graph_timing import torch_graph_us

    K = Fused(gpu.load(), torch.device("cuda"))
    rng = np.random.default_rng(n + visible)
    keys_np = np.full(n, -np.inf)
    keys_np[:visible] = np.maximum(rng.standard_normal(visible), 0.0) - np.arange(visible) * 1e-300
    keys = torch.from_numpy(keys_np).cuda()
    pos = torch.tensor([4 * visible - 1], device="cuda")  # (pos + 1) / 4 = visible
    for _ in range(5):
        K.topk(keys, k, pos, 4)
    torch.cuda.synchronize()
    return (torch_graph_us(lambda: K.topk(keys, k, pos, 4), reps), torch_graph_us(lambda: torch.topk(keys, k), reps))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=512, help="rows kept (Flash: 512)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--cases", default="528:513,528:528,2064:2048,2064:2064,8208:8192",
                    help="n:visible pairs (n: the key buffer's rows, visible: rows with keys)")
    args = ap.parse_args(argv)
    from ds4.engine import gpu

    if not gpu.available():
        print(f"bench_topk: no GPU engine here ({gpu.unavailable_reason()})", file=sys.stderr)
        return 2
    try:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",")]
        if any(len(c) != 2 or not args.k < c[1] <= c[0] for c in cases):
            raise ValueError
    except ValueError:
        print(f"bench_topk: --cases wants n:visible pairs with k < visible <= n, got {args.cases!r}", file=sys.stderr)
        return 2
    print(f"{'n':>6} {'visible':>8} {'k':>5} {'topk.cu us':>11} {'torch.topk us':>14} {'ratio':>6}")
    for n, visible in cases:
        ours, peer = time_topk(n, visible, args.k, args.reps)
        print(f"{n:>6} {visible:>8} {args.k:>5} {ours:>11.2f} {peer:>14.2f} {peer / ours:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
