"""Importance vectors for the quantizer from an imatrix file (tooling-spec §1.6-1.7).

    imp = Importance.load("im.dat", strict=False)
    row = imp.for_tensor(slot, QuantType.IQ2_XXS, expert=7)   # float32 [ncols] or None

Both imatrix formats are read by `ds4.imatrix.format.load` (legacy `.dat`, values divided by ncall;
GGUF imatrix, sum2 / counts). Lookups follow ds4's quantizer: candidates [GGUF name, official
checkpoint name]; routed experts try `NAME.expert.E`, `NAME.expert_E`, then the bare name (shared
row, or one row per expert sliced out of an `n_expert × ncols` entry). As in later ds4 versions
lookups happen only for the types that use importance (Q2_K, Q4_K, IQ2_XXS), so `--imatrix-strict`
with a routed-only imatrix does not abort on the first attention tensor. A missing entry is None
(the caller then uses the unweighted K-quant algorithm, or for IQ2_XXS the synthetic column
energy), or an error under `strict`.

The metadata written with the GGUF: `quantize.imatrix.file` (the path as given),
`quantize.imatrix.entries_count` (u64), `quantize.imatrix.dataset` (string, when the file names
one) and `quantize.imatrix.chunks_count` (u64, when > 0), ds4's types for these keys.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGUFValueType

from ds4.gguf_tools.constants import QuantType
from ds4.gguf_tools.layout import Kind, TensorSlot
from ds4.imatrix import format as imformat

USES_IMPORTANCE = (QuantType.Q2_K, QuantType.Q4_K, QuantType.IQ2_XXS)

KEY_FILE = "quantize.imatrix.file"
KEY_ENTRIES = "quantize.imatrix.entries_count"
KEY_DATASET = "quantize.imatrix.dataset"
KEY_CHUNKS = "quantize.imatrix.chunks_count"


class ImportanceError(ValueError):
    """An imatrix that cannot be used for this conversion (one-line message)."""


@dataclass
class Importance:
    matrix: imformat.Imatrix
    path: str
    strict: bool = False

    @classmethod
    def load(cls, path: str | os.PathLike, strict: bool = False) -> "Importance":
        try:
            return cls(imformat.load(path), os.fspath(path), strict)
        except imformat.ImatrixError as e:
            raise ImportanceError(str(e)) from None
        except (OSError, ValueError) as e:  # a foreign or truncated file
            raise ImportanceError(f"{path}: not an imatrix file ({type(e).__name__}: {e})") from None

    def for_tensor(self, slot: TensorSlot, qtype: QuantType, expert: int | None = None) -> np.ndarray | None:
        """The importance row for one tensor (or one expert of a routed tensor), or None."""
        if QuantType(qtype) not in USES_IMPORTANCE:
            return None
        from ds4.gguf_tools.hf import official_name

        ncols = slot.ne[0]
        if slot.kind == Kind.EXPERTS:
            if expert is None:
                raise ValueError(f"{slot.name}: routed experts are looked up per expert")
            names = [slot.name, official_name(slot, expert)]
        else:
            names = [slot.name, official_name(slot)]
        try:
            row = self.matrix.lookup(names, ncols, expert if slot.kind == Kind.EXPERTS else None)
        except imformat.ImatrixError as e:
            raise ImportanceError(f"{self.path}: {e}") from None
        if row is None and self.strict:
            where = f" expert {expert}" if expert is not None else ""
            raise ImportanceError(f"{self.path}: no entry for '{slot.name}'{where} (--imatrix-strict)")
        if row is not None and not np.all(np.isfinite(row)):
            raise ImportanceError(f"{self.path}: entry for '{slot.name}' holds non-finite values")
        return None if row is None else np.ascontiguousarray(row, dtype=np.float32)

    def metadata(self) -> dict[str, Any]:
        from ds4.gguf_tools.writer import Typed

        meta: dict[str, Any] = {
            KEY_FILE: self.path,
            KEY_ENTRIES: Typed(len(self.matrix.entries), GGUFValueType.UINT64),
        }
        datasets = [d for d in self.matrix.datasets if d]
        if datasets:
            meta[KEY_DATASET] = ",".join(datasets)
        if self.matrix.chunks > 0:
            meta[KEY_CHUNKS] = Typed(int(self.matrix.chunks), GGUFValueType.UINT64)
        return meta
