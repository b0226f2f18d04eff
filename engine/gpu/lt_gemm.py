"""The dense prefill GEMMs through cuBLASLt with one algorithm per problem class (lt_gemm.cpp; NOTES.md v39).

torch's mm / addmm / _scaled_mm ask cuBLASLt's heuristic at every call, and its cache is keyed by the exact shape: a row
count the process has not run costs ~3-4.5 ms of host time per product shape while the device waits (v37 item 1). Here
the heuristic runs once per class (shape without the row count, from 1024 rows) and its algorithm serves every row
count. DS4_GPU_LT_GEMM=1 turns it on (v39: prepared, off until measured on the H200); 0 keeps torch's calls. Each function returns None where it does not take the operands (no
cuBLASLt, another layout or dtype); the caller then runs torch's call.

Layouts (row-major torch views; batched forms add a leading batch dimension with any batch stride):
    x [M, K] with unit column stride, w [K, N] as w_rows.T (unit row stride) or row-major, y [M, N] float32 rows.
"""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("DS4_GPU_LT_GEMM", "0") == "1"
# heuristic candidates timed on each class's first call (lt_gemm.cpp lt_fastest); 1 takes the heuristic's first pick
TUNE = int(os.environ.get("DS4_GPU_LT_TUNE", "4") or 4)
_STATE: dict = {}  # "ext": the loaded module with cuBLASLt, or None once found unavailable


def _ext():
    if "ext" not in _STATE:
        _STATE["ext"] = None
        from ds4.engine import gpu

        if ENABLED and gpu.available():
            ext = gpu.load()
            if getattr(ext, "lt_compiled", lambda: False)() and ext.lt_init(_library_path()):
                ext.lt_set_tune(TUNE)
                _STATE["ext"] = ext
    return _STATE["ext"]


def _library_path() -> str:
    """A cuBLASLt to load where the process holds none of the header's major version: the pip package torch uses."""
    try:
        import nvidia.cublas as nc  # torch's CUDA wheels depend on it

        for root in getattr(nc, "__path__", []):
            for name in sorted(os.listdir(os.path.join(root, "lib"))):
                if name.startswith("libcublasLt.so"):
                    return os.path.join(root, "lib", name)
    except (ImportError, OSError):
        pass
    return ""


def available() -> bool:
    return _ext() is not None


def stats() -> dict:
    ext = _ext()
    return dict(ext.lt_stats()) if ext is not None else {}


def _w_layout(w: torch.Tensor):
    """(w_trans, ldw) of a [.., K, N] view: w_rows.T (unit stride along K) or row-major; None otherwise."""
    K, N = w.shape[-2], w.shape[-1]
    if w.stride(-2) == 1 and (N == 1 or w.stride(-1) >= K):
        return 1, w.stride(-1)
    if w.stride(-1) == 1 and (K == 1 or w.stride(-2) >= N):
        return 0, w.stride(-2)
    return None


def _run(ab_type: int, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, beta1: bool, scales=(None, None),
         fast: bool = False) -> torch.Tensor | None:
    ext = _ext()
    if ext is None or not x.is_cuda or x.dim() != w.dim() or x.dim() != y.dim() or x.dim() not in (2, 3):
        return None
    if y.dtype != torch.float32 or x.stride(-1) != 1 or y.stride(-1) != 1:
        return None
    lw = _w_layout(w)
    if lw is None:
        return None
    M, K = x.shape[-2], x.shape[-1]
    N = w.shape[-1]
    if w.shape[-2] != K or tuple(y.shape[-2:]) != (M, N) or min(M, N, K) < 1:
        return None
    batch = x.shape[0] if x.dim() == 3 else 1
    if x.dim() == 3 and (w.shape[0] != batch or y.shape[0] != batch):
        return None
    sb = [t.stride(0) if t.dim() == 3 else 0 for t in (w, x, y)]
    ext.set_stream(torch.cuda.current_stream(x.device).cuda_stream)
    sw, sx = (0 if s is None else s.data_ptr() for s in scales)
    try:
        ext.lt_matmul(ab_type, w.data_ptr(), lw[0], x.data_ptr(), y.data_ptr(), M, N, K, lw[1], x.stride(-2),
                      y.stride(-2), batch, sb[0], sb[1], sb[2], beta1, sw, sx, fast)
    except RuntimeError as e:  # no algorithm for these operands (raised before any launch): torch's call runs
        _STATE.setdefault("refused", []).append(str(e).splitlines()[0][:200])
        return None
    return y


def mm_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x @ w for float16 operands (2-D or batched 3-D), float32 accumulation and result; None: not taken."""
    if x.dtype != torch.float16 or w.dtype != torch.float16 or not available():
        return None
    y = torch.empty((*x.shape[:-1], w.shape[-1]), dtype=torch.float32, device=x.device)
    return _run(0, x, w, y, beta1=False)


def acc_mm(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """y += x @ w in the GEMM's epilogue (float16 operands, float32 y); False: not taken."""
    if x.dtype != torch.float16 or w.dtype != torch.float16 or not available():
        return False
    return _run(0, x, w, y, beta1=True) is not None


def scaled_mm(a8: torch.Tensor, w8: torch.Tensor, scale_a: torch.Tensor, scale_w: torch.Tensor,
              out: torch.Tensor | None = None, fast: bool = True) -> torch.Tensor | None:
    """scale_a scale_w (a8 @ w8) in float32 for e4m3 operands: a8 [M, K] rows, w8 [K, N] as rows.T (cuBLASLt's float8
    form on Hopper), scales float32 scalars on the device; None: not taken."""
    e4m3 = getattr(torch, "float8_e4m3fn", None)
    if e4m3 is None or a8.dtype != e4m3 or w8.dtype != e4m3 or a8.dim() != 2 or w8.stride(-2) != 1 \
            or not available():
        return None
    y = out if out is not None else torch.empty((a8.shape[0], w8.shape[1]), dtype=torch.float32, device=a8.device)
    return _run(1, a8, w8, y, beta1=False, scales=(scale_w, scale_a), fast=fast)
