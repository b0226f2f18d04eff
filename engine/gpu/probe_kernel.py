"""`python -m ds4.engine.gpu.probe_kernel OP`: one decode kernel at a Flash shape, launched eagerly a few times, for
Nsight Compute (`ncu --kernel-name regex:... --launch-skip 2 --launch-count 1 python -m ...probe_kernel o_b`).

OP: a streaming matvec of one Flash layer (q_a, q_b, kv, o_a, o_b, shexp_down, idx_q_b, router) or the routed
experts' gate/up (`gateup`, 6 IQ2_XXS experts) or their whole MoE (`moe`). Weights are random GGUF blocks
(speed_bench.gpu_kernels.random_raw); several copies rotate so that no launch finds its weights in L2.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ds4.gguf_tools.constants import QuantType as Q

# name: (type, ne, groups)
MATVECS = {
    "q_a": (Q.Q8_0, (4096, 1024), 1),
    "q_b": (Q.Q8_0, (1024, 32768), 1),
    "kv": (Q.Q8_0, (4096, 512), 1),
    "o_a": (Q.Q8_0, (4096, 8192), 8),
    "o_b": (Q.Q8_0, (8192, 4096), 1),
    "shexp_down": (Q.Q8_0, (2048, 4096), 1),
    "idx_q_b": (Q.F16, (1024, 8192), 1),
    "router": (Q.F16, (4096, 256), 1),
}
OPS = [*MATVECS, "gateup", "moe"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="launch one decode kernel at a Flash shape (for ncu)")
    ap.add_argument("op", choices=OPS)
    ap.add_argument("--calls", type=int, default=6, help="launches (default 6)")
    ap.add_argument("--copies", type=int, default=4, help="weight copies rotated over the launches (default 4)")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.copies < 1:
        print("probe_kernel: --calls and --copies must be at least 1", file=sys.stderr)
        return 2
    from ds4.engine import gpu
    from ds4.speed_bench.gpu_kernels import Experts, Weights

    ext = gpu.load()
    rng = np.random.default_rng(0)
    if args.op in MATVECS:
        qt, ne, groups = MATVECS[args.op]
        w = Weights(args.op, qt, ne, rng, copies=args.copies)
        x = ext.Array.from_numpy(rng.standard_normal((1, groups * ne[0])).astype(np.float32))
        y = ext.Array.empty([1, ne[1]])
        for i in range(args.calls):
            ext.matvec(w.tensors[i % len(w.tensors)], x, y, groups)
    else:
        ex = Experts("q2", rng)
        k = 6
        x = ext.Array.from_numpy(rng.standard_normal((1, ex.n_embd)).astype(np.float32))
        wts = ext.Array.from_numpy(np.full((1, k), 0.25, np.float32))
        h = ext.Array.empty([k, ex.gate.ne[1]])
        y = ext.Array.empty([1, ex.n_embd])
        g, u, d = ex.gate.tensors[0], ex.up.tensors[0], ex.down.tensors[0]
        for i in range(args.calls):
            ids = ext.Array.from_numpy(rng.permutation(ex.n_expert)[:k].reshape(1, k).astype(np.int32).copy())
            if args.op == "gateup":
                ext.moe_gateup(g, u, x, ids, wts, h, 10.0)
            else:
                ext.moe(g, u, d, x, ids, wts, y, 10.0)
    ext.synchronize()
    print(f"probe_kernel: {args.op} x {args.calls} done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
