"""Byte comparison of one regenerated tensor against a reference GGUF (tooling-spec §1.6).

`ds4-quantize convert HF OUT --compare-tensor NAME [--compare-gguf FILE]` prints:

    tensor: NAME
    type: Q2_K
    generated_bytes: N
    reference_bytes: M
    generated_fnv1a64: 16 hex digits
    reference_fnv1a64: 16 hex digits
    byte_compare: OK                      (or: byte_compare: FAIL mismatches=M first=F)

FNV-1a 64 (offset basis 0xcbf29ce484222325, prime 0x100000001b3) over the tensor's bytes;
`mismatches` counts differing bytes over the common length plus the length difference, `first` is
the offset of the first difference.
"""

from __future__ import annotations

import numpy as np
from numba import njit

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3


@njit(cache=True)
def _fnv1a64(data, h):
    prime = np.uint64(FNV_PRIME)
    for b in data:
        h = (h ^ np.uint64(b)) * prime  # uint64 arithmetic wraps modulo 2^64
    return h


def fnv1a64(data: bytes | np.ndarray) -> int:
    arr = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else \
        np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    return int(_fnv1a64(arr, np.uint64(FNV_OFFSET)))


def fnv1a64_reference(data: bytes) -> int:
    """Pure-Python definition."""
    h = FNV_OFFSET
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def compare_bytes(generated: np.ndarray, reference: np.ndarray) -> tuple[int, int | None]:
    """(mismatches, first differing offset or None)."""
    g = np.ascontiguousarray(generated).view(np.uint8).reshape(-1)
    r = np.ascontiguousarray(reference).view(np.uint8).reshape(-1)
    n = min(g.size, r.size)
    diff = np.flatnonzero(g[:n] != r[:n])
    mismatches = int(diff.size) + abs(g.size - r.size)
    if diff.size:
        return mismatches, int(diff[0])
    return mismatches, (n if g.size != r.size else None)


def report(name: str, type_name: str, generated: np.ndarray, reference: np.ndarray) -> tuple[list[str], bool]:
    """The §1.6 lines and whether the bytes are identical."""
    g = np.ascontiguousarray(generated).view(np.uint8).reshape(-1)
    r = np.ascontiguousarray(reference).view(np.uint8).reshape(-1)
    mismatches, first = compare_bytes(g, r)
    lines = [f"tensor: {name}", f"type: {type_name}", f"generated_bytes: {g.size}", f"reference_bytes: {r.size}",
             f"generated_fnv1a64: {fnv1a64(g):016x}", f"reference_fnv1a64: {fnv1a64(r):016x}"]
    ok = mismatches == 0
    lines.append("byte_compare: OK" if ok else f"byte_compare: FAIL mismatches={mismatches} first={first}")
    return lines, ok
