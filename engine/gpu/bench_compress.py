"""`python -m ds4.engine.gpu.bench_compress`: the decode compressor step (fused.cu compress_step) alone, in µs per call.

A ratio-4 layer runs both compressors in one launch (the attention's: 1024 columns, FP8 rows; the indexer's: 256 columns,
FP4 QAT rows); on one step in four they pool a window, normalize, rotate and round the finished row and shift the
frontier. The v24 trace put that pooling launch ~12 µs after its predecessor's end, against ~1.6 µs on the other steps,
so this separates the kernel's own time from what the decode graph adds. Each form runs at a pooling position and at a
storing one (the peer: the same launch with nothing to pool; ratio = pooling / storing). Timed by CUDA events over
replays of a CUDA graph of launches (graph_timing.torch_graph_us).
"""

from __future__ import annotations

import argparse
import sys


def compress_us(ratio: int, pooling: bool, prewait: int, regs: int, reps: int, wide: int = 0) -> float:
    """µs per launch of one decode compressor step at Flash's shapes (ratio 4: both compressors in one launch)."""
    import torch

    from ds4.engine import gpu
    from ds4.engine.gpu.fused import Fused
    from ds4.engine.gpu.graph_timing import torch_graph_us

    dev = torch.device("cuda")
    K = Fused(gpu.load(), dev)
    g = torch.Generator().manual_seed(ratio)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).float().to(dev)

    rd = 64
    freq = (1.0 / 160000.0 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)).float().to(dev)
    shapes = ((1024, 448, False), (256, 0, True)) if ratio == 4 else ((512, 448, False),)
    jobs = []
    for width, fp8, qat in shapes:
        d = width // 2 if ratio == 4 else width
        frontier = 8 if ratio == 4 else ratio
        jobs.append(dict(kv=rnd(1, width, scale=2.0), sc=rnd(1, width, scale=3.0), ape=rnd(ratio, width, scale=0.3),
                         s_kv=rnd(frontier, width), s_sc=rnd(frontier, width), rows=torch.zeros(64, d, device=dev),
                         r=ratio, norm_w=rnd(d), eps=1e-6, freq=freq, rope_dim=rd, fp8_nope=fp8, qat=qat))
    p = 4 * 16 + 3 if ratio == 4 else ratio * 2 + ratio - 1
    pos = torch.tensor([p if pooling else p + 1], device=dev)
    K.ext.set_prewait(prewait)
    K.ext.set_compress_regs(regs)
    K.ext.set_compress_wide(wide)
    try:
        if len(jobs) == 2:
            def run():
                K.compress_step(pos=pos, **jobs[0], also={k: v for k, v in jobs[1].items()})
        else:
            def run():
                K.compress_step(pos=pos, **jobs[0])
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        return torch_graph_us(run, reps)
    finally:
        K.ext.set_prewait(-1)
        K.ext.set_compress_regs(-1)
        K.ext.set_compress_wide(-1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200, help="launches per timed graph")
    args = ap.parse_args(argv)
    from ds4.engine import gpu

    if args.reps < 1:
        print("bench_compress: --reps must be at least 1", file=sys.stderr)
        return 2
    if not gpu.available():
        print(f"bench_compress: no GPU engine here ({gpu.unavailable_reason()})", file=sys.stderr)
        return 2
    # (ratio, DS4_GPU_PREWAIT, DS4_GPU_COMPRESS_REGS, DS4_GPU_COMPRESS_WIDE, name); v24: ratio 4 10.60 -> 6.33 us pooling (1.42 storing),
    # ratio 128 117.5 us pooling (v23's regs 2: 135.8, removed)
    forms = [(4, 0, 1, 0, "ratio 4, v23"), (4, 1, 1, 0, "ratio 4, prewait (one round trip)"),
             (128, 1, 1, 0, "ratio 128 (the v15 loops)"), (128, 1, 1, 1, "ratio 128, COMPRESS_WIDE (v25 default)")]
    print(f"{'form':<36} {'pooling us':>11} {'storing us':>11} {'ratio':>6}")
    for ratio, prewait, regs, wide, name in forms:
        pool = compress_us(ratio, True, prewait, regs, args.reps, wide)
        store = compress_us(ratio, False, prewait, regs, args.reps, wide)
        print(f"{name:<36} {pool:>11.2f} {store:>11.2f} {pool / store:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
