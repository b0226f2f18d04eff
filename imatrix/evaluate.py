"""How much an imatrix helps quantization: activation-weighted error of routed experts, measured on
held-out activations captured through the engine hooks.

For expert e of a routed tensor W_e [out, in] and the held-out input rows X_e routed to e, the error of
a quantization Ŵ_e is the relative output error

    err = Σ_rows ‖(W_e − Ŵ_e) x‖² / Σ_rows ‖W_e x‖²

compared between importance = the collected imatrix row and ds4's stand-in without an imatrix
(column energy Σ_r W[r, c]², the default for IQ2_XXS).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4.engine.hooks import Hooks
from ds4.gguf_tools.constants import LayerTensor, QuantType, blk
from ds4.imatrix.format import Imatrix

KIND_SUFFIX = {"gate": LayerTensor.FFN_GATE_EXPS, "up": LayerTensor.FFN_UP_EXPS, "down": LayerTensor.FFN_DOWN_EXPS}


class LayerInputRecorder(Hooks):
    """Routed rows of one layer per expert: x for gate/up, the slot's down input for down."""

    def __init__(self, layer: int):
        self.layer = layer
        self.gate_up: dict[int, list[np.ndarray]] = {}
        self.down: dict[int, list[np.ndarray]] = {}

    def routed_inputs(self, layer, x, expert_ids, weights, down_inputs):
        if layer != self.layer:
            return
        for t in range(expert_ids.shape[0]):
            for s in range(expert_ids.shape[1]):
                e = int(expert_ids[t, s])
                self.gate_up.setdefault(e, []).append(x[t].copy())
                self.down.setdefault(e, []).append(down_inputs[t, s].copy())

    def rows(self, kind: str, expert: int) -> np.ndarray | None:
        src = self.down if kind == "down" else self.gate_up
        got = src.get(expert)
        return np.stack(got) if got else None


@dataclass
class ExpertError:
    expert: int
    rows: int
    err_default: float
    err_imatrix: float


def weighted_error(W: np.ndarray, What: np.ndarray, X: np.ndarray) -> float:
    W64, E64, X64 = W.astype(np.float64), (W - What).astype(np.float64), X.astype(np.float64)
    return float(np.sum((X64 @ E64.T) ** 2) / max(np.sum((X64 @ W64.T) ** 2), 1e-300))


def compare_quantization(model, im: Imatrix, recorder: LayerInputRecorder, kind: str = "gate",
                         qtype: QuantType = QuantType.IQ2_XXS, max_experts: int = 0,
                         min_rows: int = 4) -> list[ExpertError]:
    """Per expert of layer `recorder.layer`, error without and with the imatrix on held-out rows."""
    from ds4.gguf_tools import quants
    from ds4.gguf_tools.quants.iq2_xxs import synthetic_importance

    name = blk(recorder.layer, KIND_SUFFIX[kind])
    Wall = model.w(name)  # [E, out, in]
    ncols = Wall.shape[2]
    out = []
    for e in range(Wall.shape[0]):
        X = recorder.rows(kind, e)
        if X is None or X.shape[0] < min_rows:
            continue
        W = np.ascontiguousarray(Wall[e], np.float32)
        imp = im.vector_for(name, ncols, e)
        if imp is None:
            raise KeyError(f"imatrix has no entry '{name}'")
        errs = []
        for importance in (synthetic_importance(W), imp):
            raw = quants.quantize(qtype, W, importance)
            errs.append(weighted_error(W, quants.dequantize(qtype, raw, ncols), X))
        out.append(ExpertError(e, X.shape[0], errs[0], errs[1]))
        if max_experts and len(out) >= max_experts:
            break
    return out
