"""Fused quantized matmuls (gguf_tools/quants/fused.py) and quantized GGUFs in the engine.

Kernels: decoder == dequantize bit for bit; fused product == its numpy lane-order reference bit
for bit and == a float64 dequantize-then-matmul within rounding; a token's row is the same bits
alone, in any batch and on the threaded path. Engine: a reduced config (hidden 256, expert ffn 256,
so the K-quant mixes apply) synthesized and converted with the real CLI to f16, q8_0, q4 and q2;
the quantized models run fused by default, decode == prefill bit for bit, the fused path matches
the same model multiplied by its dequantized weights, and the logit error grows q8_0 < q4 < q2.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine.model import Model
from ds4.engine.session import Session
from ds4.gguf_tools.constants import QuantType
from ds4.gguf_tools.quants import QUANTIZED, dequantize, fused, matmul, quantize
from ds4.gguf_tools.synth import synth_checkpoint

from conftest import quantize_cli
from ds4_tool_util import reduced_config


def _blocks(qtype: QuantType, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.gamma(1.0, 1.0, (rows, 1))).astype(np.float32)
    imp = rng.random(cols).astype(np.float32) if seed % 2 else None
    return quantize(qtype, w, imp)


SHAPES = [(QuantType.Q8_0, 40, 96), (QuantType.Q8_0, 300, 512), (QuantType.Q4_K, 72, 512),
          (QuantType.Q2_K, 64, 768), (QuantType.IQ2_XXS, 48, 512), (QuantType.IQ2_XXS, 530, 256)]


@pytest.mark.parametrize("qtype,rows,cols", SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_decoder_equals_dequantize(qtype, rows, cols):
    raw = _blocks(qtype, rows, cols, seed=rows)
    np.testing.assert_array_equal(fused.decode(qtype, raw, cols).view(np.uint32),
                                  dequantize(qtype, raw, cols).view(np.uint32))


@pytest.mark.parametrize("qtype,rows,cols", SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_fused_matmul_vs_reference_and_dequantize_then_matmul(qtype, rows, cols):
    raw = _blocks(qtype, rows, cols, seed=rows + 1)
    rng = np.random.default_rng(cols)
    w = dequantize(qtype, raw, cols).astype(np.float64)
    for n in (1, 2, 3, 5, 8, 33):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        got = matmul(qtype, raw, x)
        assert got.dtype == np.float32 and got.shape == (n, rows)
        np.testing.assert_array_equal(got.view(np.uint32), fused.matmul_reference(qtype, raw, x).view(np.uint32))
        want = x.astype(np.float64) @ w.T
        bound = 2e-6 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
        assert np.all(np.abs(got - want) <= bound)


def test_fused_rows_are_batch_and_thread_invariant():
    for qtype in QUANTIZED:
        raw = _blocks(qtype, 1024, 512, seed=int(qtype))  # big enough for the threaded path at n=40
        x = np.random.default_rng(3).standard_normal((40, 512)).astype(np.float32)
        assert raw.shape[0] * 512 * 44 >= fused.PARALLEL_MIN_WORK
        batch = fused.matmul(qtype, raw, x)
        for t in (0, 17, 39):
            one = fused.matmul(qtype, raw, x[t:t + 1])  # serial path
            np.testing.assert_array_equal(one[0].view(np.uint32), batch[t].view(np.uint32))
        np.testing.assert_array_equal(fused.matmul(qtype, raw, x[5:13]), batch[5:13])


def test_fused_rejects_wrong_shapes():
    raw = _blocks(QuantType.Q4_K, 4, 512, seed=0)
    with pytest.raises(ValueError):
        fused.matmul(QuantType.Q4_K, raw, np.zeros((1, 256), np.float32))
    with pytest.raises(ValueError):
        fused.matmul(QuantType.F16, raw, np.zeros((1, 512), np.float32))


# ---------------------------------------------------------------- quantized models in the engine

@pytest.fixture(scope="module")
def quantized_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused_models")
    hf = synth_checkpoint(reduced_config(), root / "hf", seed=3)
    out = {}
    for label, flags in [("f16", ["--type", "f16"]), ("q8_0", ["--type", "q8_0"]),
                         ("q4", ["--type", "q8_0", "--mix", "q4"]), ("q2", ["--type", "q8_0", "--mix", "q2"])]:
        out[label] = root / f"{label}.gguf"
        quantize_cli("convert", str(hf), str(out[label]), *flags, "--quiet")
    return out


TOKENS = [int(t) for t in np.random.default_rng(11).integers(1000, 100000, 72)]


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kl_and_top1(base: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """Mean KL(base || other) over positions and the share of positions with the same argmax."""
    lp, lq = _log_softmax(base), _log_softmax(other)
    kl = float((np.exp(lp) * (lp - lq)).sum(axis=-1).mean())
    return kl, float((base.argmax(-1) == other.argmax(-1)).mean())


def test_quantized_models_run_fused_and_error_grows_with_fewer_bits(quantized_models):
    base = Session(Model.load(quantized_models["f16"]), ctx=128).prefill(TOKENS, all_logits=True)
    kls = {}
    for label in ("q8_0", "q4", "q2"):
        model = Model.load(quantized_models[label])
        qtypes = {model.quantized(n) for n in model.file.tensors}
        want = {"q8_0": {QuantType.Q8_0}, "q4": {QuantType.Q8_0, QuantType.Q4_K},
                "q2": {QuantType.Q8_0, QuantType.IQ2_XXS, QuantType.Q2_K}}[label]
        assert qtypes - {None} == want  # every quantized tensor is multiplied fused, by default
        logits = Session(model, ctx=128).prefill(TOKENS, all_logits=True)
        assert np.isfinite(logits).all()
        kls[label], top1 = kl_and_top1(base, logits)
    assert 0 < kls["q8_0"] < kls["q4"] < kls["q2"]


def test_fused_decode_equals_prefill_and_dequantized_model(quantized_models):
    model = Model.load(quantized_models["q2"], fp8_kv=False, indexer_qat=False)
    prefill = Session(model, ctx=128, prefill_chunk=24).prefill(TOKENS[:40], all_logits=True)
    s = Session(model, ctx=128)
    decoded = np.stack([s.decode(t).copy() for t in TOKENS[:40]])
    np.testing.assert_array_equal(decoded, prefill)
    plain = Model.load(quantized_models["q2"], fp8_kv=False, indexer_qat=False, fused_quant=False)
    assert plain.quantized("blk.0.ffn_gate_exps.weight") is None
    ref = Session(plain, ctx=128).prefill(TOKENS[:40], all_logits=True)
    rel = np.abs(prefill - ref).max(axis=1) / np.abs(ref).max(axis=1)
    assert rel.max() <= 1e-5


@pytest.mark.slow
def test_small_quantized_models_kl_and_top1_order(tmp_path_factory, data_dir):
    """`small` (real vocabulary, hidden 512) converted q8_0 / q4 / q2, 256 tokens of real text."""
    from ds4.engine.config import preset

    root = tmp_path_factory.mktemp("small_quant")
    hf = synth_checkpoint(preset("small"), root / "hf", seed=0)
    paths = {}
    for label, flags in [("f16", ["--type", "f16"]), ("q8_0", ["--type", "q8_0"]),
                         ("q4", ["--type", "q8_0", "--mix", "q4"]), ("q2", ["--type", "q8_0", "--mix", "q2"])]:
        paths[label] = root / f"{label}.gguf"
        quantize_cli("convert", str(hf), str(paths[label]), *flags, "--quiet")
    base_model = Model.load(paths["f16"])
    text = (data_dir / "speed-bench" / "promessi_sposi.txt").read_text(encoding="utf-8")[:8000]
    tokens = base_model.tokenizer.encode(text)[:256]
    base = Session(base_model, ctx=256).prefill(tokens, all_logits=True)
    stats = {label: kl_and_top1(base, Session(Model.load(paths[label]), ctx=256).prefill(tokens, all_logits=True))
             for label in ("q8_0", "q4", "q2")}
    assert 0 < stats["q8_0"][0] < stats["q4"][0] < stats["q2"][0]
    assert stats["q8_0"][1] >= stats["q4"][1] >= stats["q2"][1]
