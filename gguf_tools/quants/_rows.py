"""The Python side of every block-quant module: argument checks, output buffers, and the
flatten/reshape around a numba row kernel. The kernels themselves stay in each type's module (their
block loops differ), so these helpers never touch a value, only shapes and dtypes.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def float_rows(x: np.ndarray, elements: int, type_name: str) -> np.ndarray:
    """x as contiguous float32 [rows, cols] with cols a whole number of `elements`-value blocks."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % elements:
        raise ValueError(f"{type_name} needs a [rows, cols] array with cols % {elements} == 0, got {x.shape}")
    return x


def empty_blocks(x: np.ndarray, elements: int, block_bytes: int) -> np.ndarray:
    """The uint8 [rows, row_bytes] output of quantizing float rows x."""
    return np.empty((x.shape[0], x.shape[1] // elements * block_bytes), dtype=np.uint8)


def importance_arg(importance: np.ndarray | None, cols: int) -> tuple[bool, np.ndarray]:
    """(weighted, qw) for a kernel that takes both: numba needs an array even when it is unused."""
    if importance is None:
        return False, np.zeros(cols, np.float32)
    return True, np.ascontiguousarray(importance, dtype=np.float32)


def dequantize_blocks(kernel: Callable, raw: np.ndarray, elements: int, block_bytes: int, *tables) -> np.ndarray:
    """raw [..., row_bytes] -> float32 [..., cols] through `kernel(raw2d, out2d, *tables)`."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    flat = raw.reshape(-1, raw.shape[-1])
    out = np.empty((flat.shape[0], flat.shape[1] // block_bytes * elements), dtype=np.float32)
    kernel(flat, out, *tables)
    return out.reshape(*raw.shape[:-1], out.shape[-1])
