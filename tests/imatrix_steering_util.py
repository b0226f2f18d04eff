"""Helpers shared by the imatrix and steering tests: the `tiny` model (the `tiny_gguf` fixture when
the suite provides one, else a random tiny GGUF written here with our own writer) and token ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ds4.engine.config import preset
from ds4.engine.model import Model, expected_shapes
from ds4.gguf_tools.constants import BOS_TEXT, EOS_TEXT, LayerTensor, QuantType

SAMPLE_TEXT = ("The quick brown fox jumps over the lazy dog while the model routes every token to a few "
               "experts; importance is the mean square of what each expert sees. ") * 4


def write_random_tiny(path: Path, seed: int = 0) -> Path:
    from ds4.engine.tokenizer import load_tokenizer_json
    from ds4.gguf_tools.writer import ds4_metadata, write_tensors

    cfg = preset("tiny")
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


def tiny_gguf_path(request, tmp_path_factory) -> Path:
    try:
        return Path(request.getfixturevalue("tiny_gguf"))
    except pytest.FixtureLookupError:
        return write_random_tiny(tmp_path_factory.mktemp("tiny") / "ds4-tiny.gguf")


def load_tiny(path: Path) -> Model:
    return Model.load(path)
