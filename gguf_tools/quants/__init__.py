"""Quantization kernels for the four ggml block types ds4 uses (tooling-spec §2, model-spec §2.6).

One module per type (`q8_0`, `q4_k`, `q2_k`, `iq2_xxs`), each with its block layout as a numpy
structured dtype, `quantize(x, importance=None)`, `dequantize(raw)` and a numpy reference beside the
numba fast path. Output bytes are identical to ggml's `ggml_quantize_chunk`. `fused` multiplies
straight from the blocks of any of the four types (the engine's quantized matmul).

This module dispatches on `QuantType`:

    raw = quantize(QuantType.Q4_K, w)            # w: float32 [rows, cols] -> uint8 [rows, row_bytes]
    w2 = dequantize(QuantType.Q4_K, raw, cols)   # -> float32 [rows, cols]
    y = matvec(QuantType.Q4_K, raw, x)           # y[r] = w2[r] . x
    Y = matmul(QuantType.Q4_K, raw, X)           # Y[n, r] = w2[r] . X[n]
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np

from ..constants import BLOCK, QuantType, row_bytes

__all__ = ["QUANTIZED", "quantize", "dequantize", "matvec", "matmul", "module_for", "row_bytes"]

_MODULES = {
    QuantType.Q8_0: "q8_0",
    QuantType.Q4_K: "q4_k",
    QuantType.Q2_K: "q2_k",
    QuantType.IQ2_XXS: "iq2_xxs",
}
QUANTIZED = tuple(_MODULES)


def module_for(qtype: QuantType) -> ModuleType:
    """The kernel module of a block-quantized type."""
    qtype = QuantType(qtype)
    if qtype not in _MODULES:
        raise ValueError(f"{qtype.name} is not a block-quantized type")
    return importlib.import_module(f"{__name__}.{_MODULES[qtype]}")


def _check_importance(importance: np.ndarray | None, cols: int) -> np.ndarray | None:
    if importance is None:
        return None
    importance = np.ascontiguousarray(importance, dtype=np.float32).reshape(-1)
    if importance.shape[0] != cols:
        raise ValueError(f"importance has {importance.shape[0]} values, the rows have {cols}")
    return importance


def quantize(qtype: QuantType, x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """Quantize float32 rows [rows, cols] to raw blocks uint8 [rows, row_bytes(qtype, cols)].

    F32/F16/BF16 targets are plain conversions (F16 and BF16 round to nearest even).
    """
    qtype = QuantType(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize expects a 2-D [rows, cols] array, got shape {x.shape}")
    if qtype == QuantType.F32:
        return x.view(np.uint8).reshape(x.shape[0], -1)
    if qtype == QuantType.F16:
        return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], -1)
    if qtype == QuantType.BF16:
        return _f32_to_bf16(x).view(np.uint8).reshape(x.shape[0], -1)
    row_bytes(qtype, x.shape[1])  # validates the block multiple
    return module_for(qtype).quantize(x, _check_importance(importance, x.shape[1]))


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def _raw_rows(raw: np.ndarray, nbytes: int) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    if raw.shape[-1] != nbytes:
        raise ValueError(f"raw rows have {raw.shape[-1]} bytes, expected {nbytes}")
    return np.ascontiguousarray(raw)


def dequantize(qtype: QuantType, raw: np.ndarray, ncols: int) -> np.ndarray:
    """Raw rows uint8 [..., row_bytes] -> float32 [..., ncols]. Also F32, F16 and BF16."""
    qtype = QuantType(qtype)
    raw = _raw_rows(raw, row_bytes(qtype, ncols))
    if qtype == QuantType.F32:
        return raw.view(np.float32).copy()
    if qtype == QuantType.F16:
        return raw.view(np.float16).astype(np.float32)
    if qtype == QuantType.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return module_for(qtype).dequantize(raw)


def matmul(qtype: QuantType, raw: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Y[n, r] = dequant(raw)[r] . X[n] for a batch X [n, cols], without dequantizing the matrix.

    Quant types run `fused.matmul`: each output summed in one fixed order whatever n is."""
    qtype = QuantType(qtype)
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim != 2:
        raise ValueError(f"matmul expects X of shape [n, cols], got {X.shape}")
    ncols = X.shape[1]
    raw = _raw_rows(raw, row_bytes(qtype, ncols))
    if raw.ndim != 2:
        raise ValueError(f"matmul expects raw of shape [rows, row_bytes], got {raw.shape}")
    if qtype in (QuantType.F32, QuantType.F16, QuantType.BF16):
        return (X @ dequantize(qtype, raw, ncols).T).astype(np.float32)
    from .fused import matmul as fused_matmul  # one fixed summation order per output: batch-invariant

    return fused_matmul(qtype, raw, X)


def matvec(qtype: QuantType, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y[r] = dequant(raw)[r] . x for x [cols]."""
    x = np.asarray(x, dtype=np.float32)
    return matmul(qtype, raw, x.reshape(1, -1))[0]


def block_elements(qtype: QuantType) -> int:
    return BLOCK[QuantType(qtype)].elements
