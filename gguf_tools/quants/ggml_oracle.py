"""ggml's own quantizer as an oracle: `ggml_quantize_chunk` from the libggml-base that the optional
`llama-cpp-python` package bundles, called through ctypes.

Used by the byte-identity tests (to regenerate the committed fixtures) and by the benchmark. Not a
dependency of ds4: everything here reports "unavailable" when the library is not installed.

ggml aborts the whole process on some inputs (IQ2_XXS without importance), so `quantize` runs the
call in a child process; `quantize_in_process` is for callers that know their inputs are valid
(the benchmark, which must time ggml in its own process).

Child protocol: `python -m ds4.gguf_tools.quants.ggml_oracle IN.npz OUT.npz`; IN holds `n` and per
request i `x{i}`, `qtype{i}`, optionally `importance{i}`; OUT holds `out{i}`.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from ..constants import QuantType, row_bytes


class OracleError(RuntimeError):
    """ggml refused the input (its process aborted) or is not installed."""


def library_path() -> Path | None:
    """libggml-base.so inside the installed llama_cpp package, or None."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        for name in ("libggml-base.so", "libggml-base.dylib"):
            p = Path(root) / "lib" / name
            if p.exists():
                return p
    return None


def available() -> bool:
    return library_path() is not None


_lib = None


def _load():
    global _lib
    if _lib is None:
        path = library_path()
        if path is None:
            raise OracleError("llama-cpp-python (libggml-base) is not installed")
        lib = ctypes.CDLL(str(path))
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ]
        lib.ggml_quantize_init.restype = None
        lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        _lib = lib
    return _lib


def quantize_in_process(qtype: QuantType, x: np.ndarray, importance: np.ndarray | None = None,
                        threads: int = 1) -> np.ndarray:
    """ggml_quantize_chunk in this process, optionally split by rows over `threads` threads
    (ctypes releases the GIL, so the threads run in parallel like ggml's own quantize tool)."""
    lib = _load()
    qtype = QuantType(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = x.shape
    rb = row_bytes(qtype, cols)
    out = np.zeros((rows, rb), dtype=np.uint8)
    imp = None if importance is None else np.ascontiguousarray(importance, dtype=np.float32)
    lib.ggml_quantize_init(int(qtype))  # IQ2 tables, built once, outside the timed threads

    def work(r0: int, r1: int) -> None:
        if r1 > r0:
            lib.ggml_quantize_chunk(
                int(qtype), x.ctypes.data, out.ctypes.data, r0 * cols, r1 - r0, cols,
                None if imp is None else imp.ctypes.data,
            )

    threads = max(1, min(threads, rows))
    if threads == 1:
        work(0, rows)
    else:
        bounds = np.linspace(0, rows, threads + 1).astype(int)
        ts = [threading.Thread(target=work, args=(int(a), int(b))) for a, b in zip(bounds[:-1], bounds[1:])]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return out


def quantize(qtype: QuantType, x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """ggml's bytes for `x`, computed in a child process. Raises OracleError if ggml aborts."""
    return quantize_many([(qtype, x, importance)])[0]


def quantize_many(requests: list[tuple[QuantType, np.ndarray, np.ndarray | None]]) -> list[np.ndarray]:
    """Several (qtype, x, importance) requests in one child process (one interpreter start)."""
    if not available():
        raise OracleError("llama-cpp-python (libggml-base) is not installed")
    with tempfile.TemporaryDirectory(prefix="ds4-ggml-") as tmp:
        src, dst = Path(tmp) / "in.npz", Path(tmp) / "out.npz"
        arrays = {"n": np.int32(len(requests))}
        for i, (qtype, x, importance) in enumerate(requests):
            arrays[f"x{i}"] = np.asarray(x, dtype=np.float32)
            arrays[f"qtype{i}"] = np.int32(int(qtype))
            if importance is not None:
                arrays[f"importance{i}"] = np.asarray(importance, dtype=np.float32)
        np.savez(src, **arrays)
        env = dict(os.environ, OMP_NUM_THREADS="1", GGML_NO_BACKTRACE="1")
        proc = subprocess.run([sys.executable, "-m", __name__, str(src), str(dst)],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not dst.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            names = ", ".join(QuantType(int(q)).name for q, _, _ in requests)
            raise OracleError(f"ggml quantize of {names} failed (exit {proc.returncode}): {tail[0]}")
        with np.load(dst) as out:
            return [out[f"out{i}"] for i in range(len(requests))]


def _child(src: str, dst: str) -> None:
    data = np.load(src)
    results = {}
    for i in range(int(data["n"])):
        imp = data[f"importance{i}"] if f"importance{i}" in data.files else None
        results[f"out{i}"] = quantize_in_process(QuantType(int(data[f"qtype{i}"])), data[f"x{i}"], imp)
    np.savez(dst, **results)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
