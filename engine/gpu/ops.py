"""Torch twins of the forward's numeric primitives (model-spec §3.1), for the CUDA engine.

Each function mirrors the numpy one in ds4.engine.numerics / ds4.engine.rope operation for
operation (frexp-based power-of-two scales, round-half-even minifloat rounding), so the GPU
session and the CPU engine round KV and indexer values the same way. They run on any torch
device; the tests hold them to the numpy versions on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

F32 = torch.float32


@dataclass(frozen=True)
class Unscaled:
    """A product whose per-row rescale is still to be applied: its value is z [T, n] * r [T, 1]. The hi/lo GEMMs
    (weights.mm_unscaled) hand o_b's and the shared expert's outputs on in this form, so the mHC post rescales them
    as it reads them (hc_post's r1, r2: the bits of multiplying first) instead of a pass over [T, n] each. Not a
    tuple: the session tells an attention output's summands by their tuple."""

    z: torch.Tensor
    r: torch.Tensor

    def value(self) -> torch.Tensor:
        return self.z * self.r


def scaled(y):
    """y itself, or an Unscaled product's value (y = z * r)."""
    return y.value() if isinstance(y, Unscaled) else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)
    return y * weight if weight is not None else y


def _pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    m, e = torch.frexp(v)
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(v), e)


def _round_minifloat(x: torch.Tensor, mant_bits: int, min_exp: int) -> torch.Tensor:
    ax = x.abs()
    _, e = torch.frexp(torch.where(ax > 0, ax, torch.ones_like(ax)))
    e = torch.clamp(e - 1, min=min_exp)
    step = torch.ldexp(torch.ones_like(ax), e - mant_bits)
    return torch.round(x / step) * step


def fp8_kv_round(x: torch.Tensor, n_nope: int) -> torch.Tensor:
    lead = x.shape[:-1]
    blocks = x[..., :n_nope].reshape(*lead, n_nope // 64, 64)
    amax = torch.clamp(blocks.abs().amax(dim=-1, keepdim=True), min=1e-4)
    scale = _pow2_ceil(amax / 448.0)
    q = torch.clamp(blocks / scale, -448.0, 448.0)
    head = (_round_minifloat(q, 3, -6) * scale).reshape(*lead, n_nope)
    return torch.cat([head, x[..., n_nope:]], dim=-1)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < n:
        y = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(*lead, n)
        h *= 2
    return x * (1.0 / n ** 0.5)


def fp4_round(x: torch.Tensor) -> torch.Tensor:
    lead, n = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(*lead, n // 32, 32)
    amax = torch.clamp(blocks.abs().amax(dim=-1, keepdim=True), min=6.0 * 2.0 ** -126)
    scale = _pow2_ceil(amax / 6.0)
    q = torch.clamp(blocks / scale, -6.0, 6.0)
    return (_round_minifloat(q, 1, 0) * scale).reshape(*lead, n)


def indexer_qat(x: torch.Tensor) -> torch.Tensor:
    return fp4_round(hadamard(x))


def cos_sin(freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ang = positions.to(F32)[:, None] * freq[None, :]
    return torch.cos(ang), torch.sin(ang)


def apply_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
               inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs of the last rope_dim dims; x [T, ..., hd], cos/sin [T, rope_dim/2]."""
    extra = (1,) * (x.dim() - 2)
    c = cos.reshape(cos.shape[0], *extra, cos.shape[1])
    s = sin.reshape(sin.shape[0], *extra, sin.shape[1])
    if inverse:
        s = -s
    n_nope = x.shape[-1] - rope_dim
    tail = x[..., n_nope:]
    x0, x1 = tail[..., 0::2], tail[..., 1::2]
    rot = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).reshape(*tail.shape)
    return torch.cat([x[..., :n_nope], rot], dim=-1)


def hc_weights(mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int, eps: float):
    """mHC pre/post/comb from mix [T, (2+n)·n] (model-spec §3.3 steps 3-6)."""
    T = mix.shape[0]
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2.0 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = mix[:, 2 * n:].reshape(T, n, n) * scale[2] + base[2 * n:].reshape(n, n)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=1, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=2, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=1, keepdim=True) + eps)
    return pre, post, comb


def stream_sum(wts: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """Σ_i wts[:, i] · X[:, i] for X [T, n, D]."""
    return torch.einsum("tn,tnd->td", wts, X)


def hc_post(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'[b] = post_b · y + Σ_a comb[a, b] · X[a]."""
    return post[:, :, None] * y[:, None, :] + torch.einsum("tab,tad->tbd", comb, X)


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    g = torch.clamp(g, max=limit)
    return g * torch.sigmoid(g) * torch.clamp(u, -limit, limit)


def quantize_hilo(x: torch.Tensor, group: int = 32, hi_only: bool = False) -> torch.Tensor:
    """The activation the extension's quantized kernels see (repack.cu quantize_x_kernel), in float32.

    Per 32 columns (group; 256: mmq's S256 form; the row length: mmq's XROW form): s = amax / 127, hi = rint(x / s),
    lo = clamp(rint((x / s - hi) · 254), ±127), x' = s / 254 · (254 · hi + lo). Used to emulate the kernels'
    arithmetic on the CPU. hi_only: lo = 0, the routed experts' 8-bit activations (DS4_GPU_MOE_X8).
    """
    lead, n = x.shape[:-1], x.shape[-1]
    b = x.reshape(*lead, n // group, group)
    s = b.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(s > 0, s, torch.ones_like(s))
    t = b / safe
    hi = torch.round(t)
    lo = torch.clamp(torch.round((t - hi) * 254.0), -127.0, 127.0)
    if hi_only:
        lo = torch.zeros_like(lo)
    out = (safe / 254.0) * (254.0 * hi + lo)
    return torch.where(s > 0, out, torch.zeros_like(out)).reshape(*lead, n)
