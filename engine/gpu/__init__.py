"""ds4.engine.gpu: CUDA kernels for DeepSeek V4 decode (resident quantized weights, fused matvec, MoE).

The compiled extension (`_ext`, built by `make cuda`) is imported lazily, so importing this package
never fails: `available()` says whether it can run, `unavailable_reason()` says why not, and any
use of a kernel raises `GpuUnavailable` with that reason.

    from ds4.engine import gpu
    w = gpu.upload("blk.0.attn_q_a.weight", QuantType.Q8_0, (4096, 1024), raw_bytes)
    y = gpu.matvec_host(w, x)                 # x float32 [B, 4096], B <= 8 -> y [B, 1024]

Device API (for graphs): gpu.Array.from_numpy / .numpy(), gpu.matvec(w, x, y, groups), gpu.moe(...),
gpu.capture_begin() / gpu.capture_end() -> Graph with .launch(n) and .time_ms(iters).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GpuUnavailable", "available", "unavailable_reason", "load", "upload", "ResidentModel",
           "matvec_host", "moe_host"]


class GpuUnavailable(RuntimeError):
    """The CUDA extension is not built, or no CUDA device can be used."""


_loaded: Any = None  # not `_ext`: importing the submodule sets the package attribute of that name
_reason: str | None = None
_checked = False


def _probe() -> None:
    global _loaded, _reason, _checked
    if _checked:
        return
    _checked = True
    try:
        mod = importlib.import_module(f"{__name__}._ext")
    except ImportError as e:
        _reason = f"the CUDA extension is not built (run `make cuda`): {e}"
        return
    try:
        n = mod.device_count()
    except RuntimeError as e:
        _reason = str(e)
        return
    if n < 1:
        _reason = "no CUDA device"
        return
    _loaded = mod


def available() -> bool:
    _probe()
    return _loaded is not None


def unavailable_reason() -> str | None:
    _probe()
    return _reason


def load() -> Any:
    """The extension module; raises GpuUnavailable with the reason when it cannot run."""
    _probe()
    if _loaded is None:
        raise GpuUnavailable(_reason or "CUDA unavailable")
    return _loaded


def __getattr__(name: str) -> Any:  # gpu.matvec, gpu.Array, ... forward to the extension
    if name.startswith("__"):
        raise AttributeError(name)
    if (Path(__file__).parent / f"{name}.py").is_file():  # `from ds4.engine.gpu import ops`: no extension needed
        return importlib.import_module(f"{__name__}.{name}")
    return getattr(load(), name)


def upload(name: str, qtype: int, ne: tuple[int, ...], raw: np.ndarray) -> Any:
    """Upload one tensor's GGUF bytes (ne in GGUF order); the result stays resident until dropped."""
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    return load().upload(name, int(qtype), [int(n) for n in ne], raw)


class ResidentModel:
    """Every tensor of an open GGUF file (ds4.gguf_tools.reader) on the device, uploaded once.

    Quantized and F16 matrices become gpu.Tensor; F32 and I32 tensors become gpu.Array. Failures
    (out of memory, unsupported shape) name the tensor.
    """

    MATRIX_TYPES = {1, 8, 10, 12, 16}  # F16, Q8_0, Q2_K, Q4_K, IQ2_XXS

    def __init__(self, gguf_file: Any, names: list[str] | None = None, progress: bool = False):
        ext = load()
        self.tensors: dict[str, Any] = {}
        names = list(gguf_file.tensors) if names is None else names
        it = names
        if progress:
            from tqdm import tqdm

            it = tqdm(names, desc="upload", unit="tensor")
        for name in it:
            info = gguf_file.info(name)
            qt = int(info.qtype)
            try:
                if qt in self.MATRIX_TYPES and info.ne[0] % (8 if qt == 1 else 32) == 0:
                    self.tensors[name] = ext.upload(name, qt, list(info.ne), gguf_file.raw(name).reshape(-1))
                elif qt in (0, 26):  # F32, I32
                    arr = gguf_file.array(name)
                    arr = arr.astype(np.int32 if qt == 26 else np.float32, copy=False)
                    self.tensors[name] = ext.Array.from_numpy(np.ascontiguousarray(arr))
                else:
                    raise ValueError(f"type {info.type_name} with ne={info.ne} has no GPU form")
            except MemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised with the tensor's name
                raise type(e)(f"tensor '{name}': {e}") from e

    def __getitem__(self, name: str) -> Any:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def nbytes(self) -> int:
        ext = load()
        return sum(t.nbytes if isinstance(t, ext.Tensor) else 4 * int(np.prod(t.shape)) for t in self.tensors.values())


def matvec_host(w: Any, x: np.ndarray, groups: int = 1) -> np.ndarray:
    """y = W x for host arrays: x float32 [B, groups * ncols] (or [ncols]) -> y [B, nrows]."""
    ext = load()
    x = np.ascontiguousarray(x, dtype=np.float32)
    squeeze = x.ndim == 1
    x2 = x.reshape(1 if squeeze else x.shape[0], -1)
    y = ext.Array.empty([x2.shape[0], w.nrows])
    ext.matvec(w, ext.Array.from_numpy(x2), y, groups)
    out = y.numpy()
    return out[0] if squeeze else out


def moe_host(gate: Any, up: Any, down: Any, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
             clamp: float = 10.0) -> np.ndarray:
    """Routed experts for host arrays: x [T, n_embd], ids/weights [T, k] -> y [T, n_embd]."""
    ext = load()
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = ext.Array.empty(list(x.shape))
    ext.moe(gate, up, down, ext.Array.from_numpy(x), ext.Array.from_numpy(np.ascontiguousarray(ids, dtype=np.int32)),
            ext.Array.from_numpy(np.ascontiguousarray(weights, dtype=np.float32)), y, float(clamp))
    return y.numpy()
