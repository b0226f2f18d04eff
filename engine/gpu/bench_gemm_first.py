"""The host cost of a torch GEMM's first call at a row count the process has not run (NOTES.md v37 item 1).

For the prefill's dense product shapes, times one synchronized call of torch.mm (float32 output), addmm into a float32
output and _scaled_mm (e4m3) at a sequence of row counts, repeats included, and prints ms per shape. Run it with
CUDA_MODULE_LOADING=EAGER too: it is the per-M cost that stays, not the module loading.

    python -m ds4.engine.gpu.bench_gemm_first [--blas cublas|cublaslt]
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(4096, 1024), (4096, 512), (1024, 32768), (8192, 4096), (4096, 2048), (2048, 4096)]  # (K, N)
ROWS = (2048, 300, 2048, 6144, 6144, 6000, 6143, 8192, 8192, 12288)


def one_call(kind: str, x: torch.Tensor, w: torch.Tensor) -> None:
    if kind == "mm":
        torch.mm(x, w.T, out_dtype=torch.float32)
    elif kind == "addmm":
        y = torch.zeros(x.shape[0], w.shape[0], device=x.device)
        torch.addmm(y, x, w.T, out_dtype=torch.float32, out=y)
    else:
        one = torch.ones((), device=x.device)
        torch._scaled_mm(x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn).T, scale_a=one, scale_b=one,
                         out_dtype=torch.float32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default",
                    help="torch.backends.cuda.preferred_blas_library for mm / addmm (_scaled_mm is cuBLASLt always)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm_first: no CUDA device")
        return 1
    dev = torch.device("cuda")
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    print(f"blas library: {torch.backends.cuda.preferred_blas_library()}")
    weights = [torch.randn(n, k, device=dev, dtype=torch.float16) for k, n in SHAPES]
    print("shapes (K, N): " + " ".join(f"{k}x{n}" for k, n in SHAPES))
    for kind in ("mm", "addmm", "fp8"):
        for m in ROWS:
            ms = []
            for (k, _), w in zip(SHAPES, weights):
                x = torch.randn(m, k, device=dev, dtype=torch.float16)
                torch.cuda.synchronize()
                t = time.perf_counter()
                one_call(kind, x, w)
                torch.cuda.synchronize()
                ms.append((time.perf_counter() - t) * 1e3)
            print(f"{kind:6s} M={m:6d} " + " ".join(f"{v:7.2f}" for v in ms) + f"  sum {sum(ms):7.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
