"""The DS4 main-model tensor inventory for a given Config (model-spec §2.4, tooling-spec §1.3).

One function, `tensor_layout`, lists every tensor a DS4 GGUF holds for a config: its name, its
shape in GGUF `ne` order (fastest dimension first) and the family of types it may have. The
reader validates files against it, the converter plans its output from it, and the synthetic
checkpoint writer derives its HF shapes from it, so the three can never disagree.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ds4.engine.config import Config
from ds4.gguf_tools.constants import (
    OUTPUT, OUTPUT_HC_BASE, OUTPUT_HC_FN, OUTPUT_HC_SCALE, OUTPUT_NORM, TOKEN_EMBD, LayerTensor as T, QuantType, blk,
)


class Kind(enum.Enum):
    """What a tensor is, which decides the types it may be stored as."""

    VECTOR = "vector"  # norms, HC base/scale, sinks, router bias: F32
    MATRIX = "matrix"  # any 2-D weight: F32/F16/BF16 or a quant type whose block divides ne0
    EXPERTS = "experts"  # 3-D routed experts: a routed type
    INDEX = "index"  # tid2eid: I32


FLOAT_TYPES = (QuantType.F32, QuantType.F16, QuantType.BF16)
QUANT_TYPES = (QuantType.Q8_0, QuantType.Q2_K, QuantType.Q4_K, QuantType.IQ2_XXS)
ALLOWED_TYPES = {
    Kind.VECTOR: (QuantType.F32,),
    Kind.MATRIX: FLOAT_TYPES + QUANT_TYPES,
    Kind.EXPERTS: FLOAT_TYPES + QUANT_TYPES,
    Kind.INDEX: (QuantType.I32,),
}


@dataclass(frozen=True)
class TensorSlot:
    name: str
    ne: tuple[int, ...]  # GGUF order: ne[0] is the contiguous (input) dimension
    kind: Kind
    layer: int | None = None  # None for global tensors
    optional: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy / PyTorch shape: reversed ne, e.g. (out, in) or (E, out, in)."""
        return tuple(reversed(self.ne))


def tensor_layout(cfg: Config) -> list[TensorSlot]:
    """Every main-model tensor for `cfg`, in file order (globals first, then layer by layer)."""
    D, V, hc = cfg.n_embd, cfg.vocab_size, cfg.n_hc
    out: list[TensorSlot] = [
        TensorSlot(TOKEN_EMBD, (D, V), Kind.MATRIX),
        TensorSlot(OUTPUT_NORM, (D,), Kind.VECTOR),
        TensorSlot(OUTPUT, (D, V), Kind.MATRIX),
        TensorSlot(OUTPUT_HC_BASE, (hc,), Kind.VECTOR),
        TensorSlot(OUTPUT_HC_FN, (hc * D, hc), Kind.MATRIX),
        TensorSlot(OUTPUT_HC_SCALE, (1,), Kind.VECTOR),
    ]
    for i in range(cfg.n_layer):
        out.extend(layer_layout(cfg, i))
    return out


def layer_layout(cfg: Config, i: int) -> list[TensorSlot]:
    D, hd, H = cfg.n_embd, cfg.head_dim, cfg.n_head
    Rq, E, F = cfg.q_lora_rank, cfg.n_expert, cfg.expert_ffn
    hcd, mix = cfg.hc_dim, cfg.hc_mix
    M, Vec, X = Kind.MATRIX, Kind.VECTOR, Kind.EXPERTS

    def s(suffix: T, ne: tuple[int, ...], kind: Kind, optional: bool = False) -> TensorSlot:
        return TensorSlot(blk(i, suffix), ne, kind, i, optional)

    slots = [
        s(T.HC_ATTN_FN, (hcd, mix), M),
        s(T.HC_ATTN_SCALE, (3,), Vec),
        s(T.HC_ATTN_BASE, (mix,), Vec),
        s(T.ATTN_NORM, (D,), Vec),
        s(T.ATTN_Q_A, (D, Rq), M),
        s(T.ATTN_Q_A_NORM, (Rq,), Vec),
        s(T.ATTN_Q_B, (Rq, H * hd), M),
        s(T.ATTN_KV, (D, hd), M),
        s(T.ATTN_KV_A_NORM, (hd,), Vec),
        s(T.ATTN_SINKS, (H,), Vec),
        s(T.ATTN_OUTPUT_A, (cfg.group_width, cfg.o_groups * cfg.o_lora_rank), M),
        s(T.ATTN_OUTPUT_B, (cfg.o_groups * cfg.o_lora_rank, D), M),
    ]
    ratio = cfg.ratio(i)
    if ratio:
        w = cfg.compressor_width(i)
        slots += [
            s(T.COMP_APE, (w, ratio), M),
            s(T.COMP_KV, (D, w), M),
            s(T.COMP_GATE, (D, w), M),
            s(T.COMP_NORM, (hd,), Vec),
        ]
    if ratio == 4:
        iw = 2 * cfg.indexer_dim  # overlapping halves, like the main ratio-4 compressor
        slots += [
            s(T.IDX_Q_B, (Rq, cfg.indexer_heads * cfg.indexer_dim), M),
            s(T.IDX_PROJ, (D, cfg.indexer_heads), M),
            s(T.IDX_COMP_APE, (iw, ratio), M),
            s(T.IDX_COMP_KV, (D, iw), M),
            s(T.IDX_COMP_GATE, (D, iw), M),
            s(T.IDX_COMP_NORM, (cfg.indexer_dim,), Vec),
        ]
    slots += [
        s(T.HC_FFN_FN, (hcd, mix), M),
        s(T.HC_FFN_SCALE, (3,), Vec),
        s(T.HC_FFN_BASE, (mix,), Vec),
        s(T.FFN_NORM, (D,), Vec),
        s(T.FFN_GATE_INP, (D, E), M),
    ]
    if cfg.is_hash_layer(i):
        slots.append(s(T.FFN_GATE_TID2EID, (cfg.n_expert_used, cfg.vocab_size), Kind.INDEX))
    else:
        slots.append(s(T.EXP_PROBS_B, (E,), Vec, optional=True))
    slots += [
        s(T.FFN_GATE_SHEXP, (D, F), M),
        s(T.FFN_UP_SHEXP, (D, F), M),
        s(T.FFN_DOWN_SHEXP, (F, D), M),
        s(T.FFN_GATE_EXPS, (D, F, E), X),
        s(T.FFN_UP_EXPS, (D, F, E), X),
        s(T.FFN_DOWN_EXPS, (F, D, E), X),
    ]
    return slots


def layout_by_name(cfg: Config) -> dict[str, TensorSlot]:
    return {slot.name: slot for slot in tensor_layout(cfg)}
