"""A copy of a DS4 GGUF that llama.cpp's `deepseek4` loader accepts (benchmarks and the peer test only).

Tensor names, shapes and bytes are already llama.cpp's (ds4 and llama.cpp share the dialect), so
the tensor data is copied unchanged. Only the metadata needs three edits:

* 64-bit integer keys (ours write `context_length` / `original_context_length` as u64, which the
  spec allows) become 32-bit: llama.cpp's key reader checks the exact type;
* `deepseek4.expert_gating_func` = 4 (LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS), required;
* `deepseek4.rope.scaling.type` = "yarn": without it llama.cpp treats `rope.scaling.factor` as
  linear scaling on every layer, where DeepSeek V4 uses YaRN on compressed layers only.

With an F32 GGUF and an F32 KV cache (type_k = type_v = 0), llama.cpp's logits then equal ours with
the rounding simulations off to ~1e-6 (tests/test_engine_llamacpp.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGUFValueType as V

from ds4.gguf_tools.constants import QuantType
from ds4.gguf_tools.reader import open_gguf
from ds4.gguf_tools.writer import TensorPlan, Typed, write_gguf

ARCH = "deepseek4"
GATING_SQRT_SOFTPLUS = 4
NARROW = {V.UINT64: V.UINT32, V.INT64: V.INT32}


def llamacpp_metadata(metadata: dict, types: dict) -> dict:
    """Our metadata with the edits above (a new dict of `Typed` values)."""
    out = {}
    for key, value in metadata.items():
        vtype, sub = types[key]
        vtype, sub = NARROW.get(vtype, vtype), NARROW.get(sub, sub)
        if vtype in (V.UINT32, V.INT32) and not -(1 << 31) <= int(value) < (1 << 32):
            raise ValueError(f"{key} = {value} does not fit the 32-bit key llama.cpp reads")
        out[key] = Typed(value, vtype, sub)
    out[f"{ARCH}.expert_gating_func"] = Typed(GATING_SQRT_SOFTPLUS, V.UINT32)
    out[f"{ARCH}.rope.scaling.type"] = Typed("yarn", V.STRING)
    return out


def write_llamacpp_gguf(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy `src` (a DS4 GGUF) to `dst` with llama.cpp-compatible metadata; tensors byte-identical."""
    f = open_gguf(src)
    try:
        if f.metadata.get("general.architecture") != ARCH:
            raise ValueError(f"{src}: not a {ARCH} GGUF")
        md = llamacpp_metadata(f.metadata, f.metadata_types)
        plans = [TensorPlan(name, QuantType(t.qtype), t.ne) for name, t in f.tensors.items()]
        return write_gguf(dst, md, plans, lambda p: np.asarray(f.raw(p.name)).reshape(-1))
    finally:
        f.close()
