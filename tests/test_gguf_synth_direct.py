"""`ds4-quantize synth --gguf`: random valid blocks written straight into a DS4 GGUF."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine.config import preset
from ds4.gguf_tools.constants import QuantType
from ds4.gguf_tools.layout import layout_by_name
from ds4.gguf_tools.plan import published_type
from ds4.gguf_tools.reader import open_model
from ds4.gguf_tools.synth_gguf import random_blocks

from conftest import quantize_cli


@pytest.fixture(scope="module")
def small_q2(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "small-q2.gguf"
    res = quantize_cli("synth", "--preset", "small", "--gguf", str(out), "--mix", "q2", "--quiet")
    assert "random GGUF" in res.stderr
    return out


def test_types_and_metadata_are_the_published_layout(small_q2):
    cfg = preset("small")
    f = open_model(small_q2)  # validates metadata, shapes and block sizes
    layout = layout_by_name(cfg)
    assert f.config.n_layer == cfg.n_layer and len(f.tokens) == cfg.vocab_size
    for name, info in f.tensors.items():
        assert int(info.qtype) == int(published_type(layout[name], "q2")), name


@pytest.mark.parametrize("qtype", [QuantType.Q8_0, QuantType.Q2_K, QuantType.Q4_K, QuantType.IQ2_XXS])
def test_random_blocks_decode_to_zero_mean_weights_of_the_asked_spread(qtype):
    from ds4.gguf_tools.quants import dequantize

    blocks = random_blocks(qtype, 2048, 0.02, np.random.default_rng(1))
    from ds4.gguf_tools.constants import BLOCK

    w = dequantize(qtype, blocks, BLOCK[qtype].elements).astype(np.float64)
    assert np.isfinite(w).all()
    assert abs(w.mean()) < 0.1 * w.std()
    assert 0.5 < w.std() / 0.02 < 2.0


def test_cpu_engine_runs_the_file_without_nan(small_q2):
    from ds4.engine.model import Model
    from ds4.engine.session import Session

    s = Session(Model.load(small_q2), ctx=256)
    logits = s.sync(list(range(3, 3 + 140)))  # past the raw window and one ratio-128 row
    assert np.isfinite(logits).all() and 0.3 < logits.std() < 30


def test_tiny_cannot_hold_iq2_xxs_rows(tmp_path):
    res = quantize_cli("synth", "--preset", "tiny", "--gguf", str(tmp_path / "t.gguf"), "--mix", "q2", check=False)
    assert res.returncode == 2 and "multiple of 256" in res.stderr
    assert not (tmp_path / "t.gguf").exists()


def test_layers_writes_the_presets_first_layers_and_refuses_more(tmp_path):
    """--layers N: the preset's first N layers (ratios, clamps, hash routing as the full shape has them), a GGUF the
    engine loads and runs; more layers than the shape has is a usage error, not a file."""
    from ds4.engine.model import Model
    from ds4.engine.session import Session

    full = preset("small")
    out = tmp_path / "small-5.gguf"
    quantize_cli("synth", "--preset", "small", "--layers", "5", "--gguf", str(out), "--mix", "q2", "--quiet")
    f = open_model(out)
    assert f.config.n_layer == 5
    assert tuple(f.config.compress_ratios) == tuple(full.compress_ratios[:5])
    assert f.config.n_hash_layers == full.n_hash_layers and f.config.n_embd == full.n_embd
    assert not any(name.startswith("blk.5.") for name in f.tensors)
    assert any(name.startswith("blk.4.") for name in f.tensors)
    logits = Session(Model.load(out), ctx=256).sync([0, 100, 200, 300])
    assert np.isfinite(logits).all()
    bad = tmp_path / "small-99.gguf"
    res = quantize_cli("synth", "--preset", "small", "--layers", "99", "--gguf", str(bad), "--quiet", check=False)
    assert res.returncode == 2 and "--layers" in res.stderr and "1..8" in res.stderr
    assert not bad.exists()
