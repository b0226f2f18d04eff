"""Helpers for the quality / vectors / bench tests: the tiny model, and GGUF copies with one
tensor edited or every matrix re-encoded (written with our GGUF reader and writer)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from ds4.gguf_tools.constants import QuantType
from ds4.gguf_tools.layout import Kind, tensor_layout
from ds4.gguf_tools.reader import open_gguf
from ds4.gguf_tools.writer import TensorPlan, Typed, encode, write_gguf


def tiny_model_path(request, tmp_path_factory) -> Path:
    """The suite's `tiny_gguf` fixture when it exists, else a random tiny GGUF of our own."""
    try:
        return Path(request.getfixturevalue("tiny_gguf"))
    except pytest.FixtureLookupError:
        from imatrix_steering_util import write_random_tiny
        return write_random_tiny(tmp_path_factory.mktemp("tiny") / "ds4-tiny.gguf")


def _metadata(f) -> dict:
    return {k: Typed(v, *f.metadata_types[k]) for k, v in f.metadata.items()}


def rewrite_gguf(src: Path, dst: Path, choose: Callable[[str, object], tuple[QuantType, np.ndarray] | None]) -> Path:
    """Copy `src` to `dst`; `choose(name, info)` returns (type, float values) to re-encode a tensor,
    or None to copy its bytes unchanged."""
    f = open_gguf(src)
    plans, edits = [], {}
    for name, t in f.tensors.items():
        ch = choose(name, t)
        if ch is None:
            plans.append(TensorPlan(name, QuantType(t.qtype), t.ne))
        else:
            qtype, values = ch
            edits[name] = (qtype, values)
            plans.append(TensorPlan(name, QuantType(qtype), t.ne))

    def produce(p: TensorPlan):
        if p.name in edits:
            qtype, values = edits[p.name]
            return encode(qtype, values)
        return np.asarray(f.raw(p.name)).reshape(-1)

    return write_gguf(dst, _metadata(f), plans, produce)


def perturb_rows(src: Path, dst: Path, tensor: str, rows, scale: float) -> Path:
    """Copy with rows (numpy first axis) of one float tensor multiplied by `scale`."""
    def choose(name, t):
        if name != tensor:
            return None
        a = np.array(open_gguf(src).array(name), dtype=np.float32)
        a[list(rows)] *= scale
        return QuantType(t.qtype), a
    return rewrite_gguf(src, dst, choose)


def quantize_copy(src: Path, dst: Path, qtype: QuantType, fallback: QuantType | None = QuantType.Q8_0,
                  keep: tuple[str, ...] = ()) -> Path:
    """Every matrix / expert tensor whose rows fit `qtype`'s block becomes `qtype` (else `fallback`
    when its rows fit that, else unchanged): a crude stand-in for ds4-quantize on test models."""
    from ds4.gguf_tools.constants import BLOCK
    f = open_gguf(src)
    from ds4.engine.config import Config
    cfg = Config.from_metadata(f.metadata)
    kinds = {s.name: s.kind for s in tensor_layout(cfg)}

    def choose(name, t):
        if kinds.get(name) not in (Kind.MATRIX, Kind.EXPERTS) or name in keep:
            return None
        for q in (qtype, fallback):
            if q is not None and t.ne[0] % BLOCK[q].elements == 0:
                return q, np.array(f.array(name), dtype=np.float32)
        return None
    return rewrite_gguf(src, dst, choose)


def write_random_model(path: Path, cfg, seed: int = 0) -> Path:
    """A random model of any config, with the real tokenizer (like imatrix_steering_util's tiny)."""
    from ds4.engine.model import expected_shapes
    from ds4.engine.tokenizer import load_tokenizer_json
    from ds4.gguf_tools.constants import BOS_TEXT, EOS_TEXT, LayerTensor
    from ds4.gguf_tools.writer import ds4_metadata, write_tensors

    tokens, merges = load_tokenizer_json()
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith(LayerTensor.FFN_GATE_TID2EID.value):
            tensors[name] = (QuantType.I32, rng.integers(0, cfg.n_expert, size=shape).astype(np.int32))
        elif len(shape) == 1:
            tensors[name] = (QuantType.F32, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            w = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
            tensors[name] = (QuantType.F32 if len(shape) == 2 and shape[0] < 64 else QuantType.F16, w)
    meta = ds4_metadata(cfg, tokens, merges, bos_id=tokens.index(BOS_TEXT), eos_id=tokens.index(EOS_TEXT))
    write_tensors(path, meta, tensors)
    return path


def tiny_wide_ffn_config():
    """`tiny` with 256-wide expert FFNs: the expert down projections then take 256-value quant blocks
    (Q2_K, Q4_K, IQ2_XXS), like the routed experts of a real 2-bit mix, while the model stays tiny."""
    from ds4.engine.config import preset
    return dataclasses.replace(preset("tiny"), expert_ffn=256, name="ds4-tiny-wide-ffn")
