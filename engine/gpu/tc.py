"""Products of float32 activations on tensor cores for prefill attention and the indexer.

Each operand x becomes a `Split`: float16 hi + lo of x / s with s its largest magnitude (so nothing
overflows float16), i.e. ~22 significant bits, and a product is hi·hi + hi·lo + lo·hi accumulated in
float32 inside the GEMMs (weights.split_product). That keeps float32-level agreement with the CPU engine
(the lo·lo term is below float32 rounding) at tensor-core speed: the float32 products these replace ran
on the SIMT cores (~0.6 s of an 8192-token prefill). DS4_GPU_PREFILL_GEMM=f16 drops the lo parts, as
for the weight GEMMs.

DS4_GPU_PREFILL_ATTN picks the form of the prefill attention and indexer products:
- `f32` (default): float32 products on the SIMT cores (~40 TFLOP/s: 0.44 s of an 8192-token prefill, v9).
- `tf32`: the float32 products on the tensor cores as TF32 (one pass: operands rounded to 10-bit mantissas,
  float32 sums; torch's fp32_precision switch, only inside those products). A speed mode, like
  DS4_GPU_PREFILL_GEMM=f16: 8192-token prefill 2903 against 2072 t/s (v10, first runs), but the logits move
  1e-4 (median over positions) from float32 products, and near-tied expert routing flips at a few positions
  (`small`, 600 tokens: 4.6e-3 over all positions, 8.6e-2 at the worst one); the snapshot payload of `tiny`
  then misses the CPU engine's by more than rtol 1e-3 / atol 1e-4.
- `tc`: the f16 hi/lo Splits below (v7: slower, the split passes cost more than they save).
- `fused`: one kernel per chunk, attn_prefill.cu (three TF32 passes, float32-level: the session tests pass with it
  as they do with f32; v10: on par with f32, 2706 against 2727 t/s for later 8192-token runs).

Operands may be Splits or float32 tensors (the CPU path): `each` applies a view or gather to both parts,
`mm` multiplies either kind.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, NamedTuple

import torch

from .weights import EXACT_GEMM, split_product

ATTN_MODES = ("f32", "tf32", "tc", "fused")


def parse_attn_mode(value: str) -> str:
    mode = value.strip().lower() or "fused"
    if mode not in ATTN_MODES:
        raise ValueError(f"DS4_GPU_PREFILL_ATTN={value!r}: unknown mode (known: {', '.join(ATTN_MODES)})")
    return mode


# default: the one-kernel form (attn_prefill.cu); v11, 8192 tokens: 2741 / 2802 t/s against 2600 / 2636 for f32 (two
# calls agree: v10's last 2742 / 2802 against 2622 / 2667), at float32 level in every session test
ATTN_MODE = parse_attn_mode(os.environ.get("DS4_GPU_PREFILL_ATTN", ""))
TC_ATTN = ATTN_MODE == "tc"  # v7: 1612 against 1799 t/s for f32 (8192 tokens)
TF32_ATTN = ATTN_MODE == "tf32"


@contextlib.contextmanager
def tf32_products(on: bool):
    """float32 matmuls inside the block run as TF32 on the tensor cores where on (CUDA only)."""
    if not on:
        yield
        return
    mm = torch.backends.cuda.matmul
    new_api = hasattr(mm, "fp32_precision")  # torch >= 2.9; allow_tf32 before
    old = mm.fp32_precision if new_api else mm.allow_tf32
    if new_api:
        mm.fp32_precision = "tf32"
    else:
        mm.allow_tf32 = True
    try:
        yield
    finally:
        if new_api:
            mm.fp32_precision = old
        else:
            mm.allow_tf32 = old


class Split(NamedTuple):
    hi: torch.Tensor
    lo: torch.Tensor | None
    s: torch.Tensor  # 0-dim: x ~= (hi + lo) * s


def split(x: torch.Tensor, exact: bool = EXACT_GEMM) -> Split:
    s = x.abs().amax().clamp_min(1e-30) if x.numel() else x.new_ones(())  # no compressed rows yet: empty
    xn = x / s
    hi = xn.to(torch.float16)
    return Split(hi, (xn - hi.float()).to(torch.float16) if exact else None, s)


def maybe_split(x: torch.Tensor, on: bool):
    """A Split of x where tensor-core products are on, else x itself."""
    return split(x) if on else x


def each(x, fn: Callable[[torch.Tensor], torch.Tensor]):
    """fn (a view, reshape or gather) applied to a tensor or to both parts of a Split."""
    if isinstance(x, Split):
        return Split(fn(x.hi), None if x.lo is None else fn(x.lo), x.s)
    return fn(x)


def mm(a, b) -> torch.Tensor:
    """a @ b (2-D, or batched 3-D) as float32: two Splits on tensor cores, or two float32 tensors."""
    if isinstance(a, Split):
        return split_product(a.hi, a.lo, b.hi, b.lo) * (a.s * b.s)
    return torch.matmul(a, b)


def t(x):
    """The last two dimensions swapped (a view)."""
    return each(x, lambda v: v.transpose(-1, -2))
