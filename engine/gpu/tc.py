"""Products of float32 activations on tensor cores for prefill attention and the indexer.

Each operand x becomes a `Split`: float16 hi + lo of x / s with s its largest magnitude (so nothing
overflows float16), i.e. ~22 significant bits, and a product is hi·hi + hi·lo + lo·hi accumulated in
float32 inside the GEMMs (weights.split_product). That keeps float32-level agreement with the CPU engine
(the lo·lo term is below float32 rounding) at tensor-core speed: the float32 products these replace ran
on the SIMT cores (~0.6 s of an 8192-token prefill). DS4_GPU_PREFILL_GEMM=f16 drops the lo parts, as
for the weight GEMMs; DS4_GPU_PREFILL_ATTN=f32 keeps the float32 products.

Operands may be Splits or float32 tensors (the CPU path): `each` applies a view or gather to both parts,
`mm` multiplies either kind.
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple

import torch

from .weights import EXACT_GEMM, split_product

# Off by default: measured slower on the H200 (8192-token prefill 1612 t/s vs 1799 t/s with the float32
# products): the split's torch passes over q, p and the keys cost more than the tensor cores save.
TC_ATTN = os.environ.get("DS4_GPU_PREFILL_ATTN", "f32") == "tc"


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
