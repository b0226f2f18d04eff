"""The hi/lo split product with its two correction terms in one FP8 GEMM (DS4_GPU_PREFILL_GEMM=fp8).

weights.split_product computes (xh + xl)(wh + wl) as three float16 GEMMs: xh·wh + xl·wh + xh·wl. The two
correction terms are ~2^-11 of the main one, so they need only a few significant bits of their own: rounded to
float8 e4m3 (3-bit mantissas, relative error <= 2^-4), each contributes an error of ~2^-15 of the product at worst
and ~2^-18 typically, below what the decode kernels' activation quantization gives. Both go into ONE e4m3 GEMM over
twice the depth, [xh | xl] @ [wl ; wh], which Hopper's tensor cores run at twice the float16 rate: the cost of the
product falls from three float16 passes to two.

Scaling (all powers of two, so exact, and kept on the device: no host sync, the calls can be graph-captured):
- x: to_half's rows are divided by their largest magnitude, so |xh| <= 1 and |xl| <= 2^-12: xh * 2^8 and
  xl * 2^19 both lie within e4m3's range (max 448) with their largest elements near 2^8.
- w: sigma = 2^(8 - ceil(log2 max|wh|)) puts wh * sigma and wl * 2^11 * sigma at or below 2^8 (|wl| <= 2^-11 |wh|:
  half a float16 ulp).
The GEMM's product is (xh·wl + xl·wh) * 2^19 * sigma, so its scales are 2^-19 and 1 / sigma. Elements far below
their row's largest fall into e4m3's subnormals; their absolute error stays below 2^-18 of that row's scale.

The float8 GEMM is torch._scaled_mm (cuBLASLt) with a float32 result; the main term then accumulates into it
inside a float16 GEMM's epilogue (weights.acc_mm). On the CPU (tests) the same rounding is emulated with float32
products of the float8 values.
"""

from __future__ import annotations

import torch

E4M3 = getattr(torch, "float8_e4m3fn", None)  # torch >= 2.1; available() says False without it
X_HI_SCALE = 2.0 ** 8
X_LO_SCALE = 2.0 ** 19  # 2^8 for the row scale, 2^11 for the lo part's size
W_TOP = 8  # log2 of the largest scaled weight
_SCALED_MM = [True]  # torch._scaled_mm takes these operands (cleared at the first refusal)


def available(device: torch.device) -> bool:
    """Whether the FP8 correction GEMM can run on this device (the CPU emulates it)."""
    if not (_SCALED_MM[0] and hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn")):
        return False
    return device.type == "cpu" or torch.cuda.get_device_capability(device) >= (8, 9)


def weight_scale(wh: torch.Tensor) -> torch.Tensor:
    """sigma = 2^(W_TOP - ceil(log2 max|wh|)) as a float32 scalar on wh's device (1 for an all-zero weight)."""
    m = wh.abs().amax().float().clamp_min(2.0 ** -100)
    return torch.exp2(W_TOP - torch.ceil(torch.log2(m)))


def pack_x(xh: torch.Tensor, xl: torch.Tensor) -> torch.Tensor:
    """[..., T, K] float16 parts -> [..., T, 2K] e4m3: [xh * 2^8 | xl * 2^19] (row-major, the GEMM's first operand)."""
    return _pack(xh, xl, X_HI_SCALE, X_LO_SCALE, None)


def pack_w(wh_rows: torch.Tensor, wl_rows: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """[..., N, K] float16 weight rows -> [..., N, 2K] e4m3: [wl * 2^11 * sigma | wh * sigma] (each row one output)."""
    return _pack(wl_rows, wh_rows, 2048.0, 1.0, sigma)


def _pack(a: torch.Tensor, b: torch.Tensor, sa: float, sb: float, k: torch.Tensor | None) -> torch.Tensor:
    """[..., R, n] float16 planes -> [..., R, 2n] e4m3 = [a * sa * k | b * sb * k] (k a float32 scalar tensor or 1):
    the extension's pack_fp8 in one pass on CUDA, torch's casts elsewhere (the same values; in float32, since
    sa * k may pass float16's range)."""
    ext = _ext() if a.is_cuda else None
    if ext is not None and a.stride() == b.stride() and a.stride(-1) == 1 and a.dim() in (2, 3):
        n, rows = a.shape[-1], a.shape[-2]
        batch, sbt = (a.shape[0], a.stride(0)) if a.dim() == 3 else (1, 0)
        out = torch.empty((*a.shape[:-1], 2 * n), dtype=E4M3, device=a.device)
        kp = 0 if k is None else k.float().contiguous().data_ptr()
        ext.set_stream(torch.cuda.current_stream(a.device).cuda_stream)
        ext.pack_fp8(a.data_ptr(), b.data_ptr(), batch, rows, n, a.stride(-2), sbt, sa, sb, kp, out.data_ptr())
        return out
    ka, kb = (sa, sb) if k is None else (sa * k, sb * k)
    return torch.cat(((a.float() * ka).to(E4M3), (b.float() * kb).to(E4M3)), dim=-1)


def _ext():
    from ds4.engine import gpu

    return gpu.load() if gpu.available() and hasattr(gpu.load(), "pack_fp8") else None


def unpack_lo(a8: torch.Tensor, xh: torch.Tensor) -> torch.Tensor:
    """The lo part as pack_x stored it (e4m3 of lo * 2^19: 4 significant bits), as float16 in xh's shape and layout
    (a fallback for a producer that wrote the float8 operand in place of lo)."""
    K = a8.shape[-1] // 2
    lo = (a8[..., K:].float() * (1.0 / X_LO_SCALE)).to(torch.float16)
    return lo if lo.shape == xh.shape else lo.reshape(xh.shape)


def correction(a8: torch.Tensor, b8_rows: torch.Tensor, sigma: torch.Tensor, out: torch.Tensor | None = None):
    """(xh·wl + xl·wh) as float32 [T, N] from pack_x's [T, 2K] and pack_w's [N, 2K] (2-D operands)."""
    inv = (1.0 / sigma).float().reshape(())
    if a8.device.type == "cpu":
        y = (a8.float() @ b8_rows.float().T) * (2.0 ** -19) * inv
        if out is None:
            return y
        out.copy_(y)
        return out
    sa = torch.full((), 2.0 ** -19, dtype=torch.float32, device=a8.device)
    kw = {} if out is None else {"out": out}
    # fast accumulation: the sum needs only ~2^-8 of its own size (it is ~2^-11 of the product)
    return torch._scaled_mm(a8, b8_rows.T, sa, inv, out_dtype=torch.float32, use_fast_accum=True, **kw)


def product(xh: torch.Tensor, xl: torch.Tensor | None, wh: torch.Tensor, wl: torch.Tensor | None, acc_mm,
            sigma: torch.Tensor | None = None, a8: torch.Tensor | None = None,
            b8: torch.Tensor | None = None) -> torch.Tensor:
    """(xh + xl) @ (wh + wl) as float32 (2-D [T, K] @ [K, N], or batched 3-D), the corrections on FP8.
    acc_mm(y, a, b): y += a @ b for float16 operands (weights.acc_mm); sigma: weight_scale(wh) if known; a8:
    pack_x(xh, xl) if the activations' producer wrote it (xl unused then); b8: pack_w(wh rows, wl rows, sigma) if the
    weight's dequant wrote it (wl unused then). Raises RuntimeError where _scaled_mm refuses the operands (the caller
    then takes the float16 path)."""
    batched = xh.dim() == 3
    if sigma is None:
        sigma = weight_scale(wh)
    if a8 is None:
        a8 = pack_x(xh, xl)
    if b8 is None:  # [.., N, K] views of the weights' rows
        b8 = pack_w(wh.transpose(-1, -2), wl.transpose(-1, -2), sigma)
    if not batched:
        y = correction(a8, b8, sigma)
    else:
        G, T, N = xh.shape[0], xh.shape[1], wh.shape[-1]
        y = torch.empty((G, T, N), dtype=torch.float32, device=xh.device)
        for g in range(G):
            correction(a8[g], b8[g], sigma, out=y[g])
    acc_mm(y, xh, wh)
    return y


def usable(xh: torch.Tensor, wh: torch.Tensor) -> bool:
    """Whether product() runs on cuBLASLt's float8 GEMM for these operands: on a CUDA device that has it (compute
    capability 8.9+, torch took the operands so far), depth and width multiples of 16."""
    return xh.is_cuda and available(xh.device) and xh.shape[-1] % 16 == 0 and wh.shape[-1] % 16 == 0


def refuse() -> None:
    _SCALED_MM[0] = False
