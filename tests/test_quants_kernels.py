"""Quant kernels: decoding vs the gguf package, fast paths vs numpy references, fused matmul vs
dequantize-then-matmul, and the float32/f16 building blocks (tooling-spec §2.1-§2.2)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from ds4.gguf_tools.constants import QuantType, row_bytes
from ds4.gguf_tools.quants import QUANTIZED, dequantize, matmul, matvec, module_for, quantize
from ds4.gguf_tools.quants import _numeric, iq2_xxs, q8_0
from numba import njit

RNG = np.random.default_rng(7)


def _tensor(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, cols)) * rng.gamma(1.0, 1.0, (rows, 1))).astype(np.float32)


@pytest.fixture(scope="module", params=QUANTIZED, ids=lambda q: q.name)
def quantized(request):
    qtype = request.param
    x = _tensor(6, 512, seed=int(qtype))
    imp = np.random.default_rng(1).random(512).astype(np.float32)
    return qtype, x, quantize(qtype, x, imp)


def test_dequantize_is_bit_identical_to_gguf(quantized):
    qtype, x, raw = quantized
    ours = dequantize(qtype, raw, x.shape[1])
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype)))
    assert ours.dtype == np.float32 and ours.shape == x.shape
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_numpy_reference_decoder_matches_fast_path(quantized):
    qtype, x, raw = quantized
    ref = module_for(qtype).dequantize_reference(raw)
    np.testing.assert_array_equal(ref.view(np.uint32), dequantize(qtype, raw, x.shape[1]).view(np.uint32))


def test_dequantize_keeps_leading_dims(quantized):
    qtype, x, raw = quantized
    stacked = np.stack([raw, raw[::-1]])  # [2, rows, row_bytes], like a 3-D expert tensor
    out = dequantize(qtype, stacked, x.shape[1])
    assert out.shape == (2, *x.shape)
    np.testing.assert_array_equal(out[1], dequantize(qtype, raw[::-1], x.shape[1]))


def test_quantization_error_is_small(quantized):
    qtype, x, raw = quantized
    err = dequantize(qtype, raw, x.shape[1]) - x
    rel = np.sqrt((err**2).mean() / (x**2).mean())
    bound = {QuantType.Q8_0: 0.01, QuantType.Q4_K: 0.12, QuantType.Q2_K: 0.45, QuantType.IQ2_XXS: 0.5}[qtype]
    assert rel < bound


@pytest.mark.parametrize("n", [1, 3, 8])
def test_fused_matmul_equals_dequantize_then_matmul(quantized, n):
    qtype, x, raw = quantized
    X = RNG.standard_normal((n, x.shape[1])).astype(np.float32)
    w = dequantize(qtype, raw, x.shape[1]).astype(np.float64)
    want = X.astype(np.float64) @ w.T
    got = matmul(qtype, raw, X)
    assert got.shape == (n, x.shape[0]) and got.dtype == np.float32
    scale = np.abs(X).astype(np.float64) @ np.abs(w).T
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30)
    np.testing.assert_allclose(matvec(qtype, raw, X[0]), got[0], rtol=0, atol=0)


def test_q8_0_matches_gguf_quantize_and_numpy_reference():
    x = _tensor(9, 320, seed=3)
    x[0, :32] = 0
    x[1, :32] = (np.arange(32) - 15.5) * (1 / 127)  # exact halves after scaling: roundf ties
    ours = quantize(QuantType.Q8_0, x)
    np.testing.assert_array_equal(ours, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0))
    np.testing.assert_array_equal(ours, q8_0.quantize_reference(x))


def test_iq2_xxs_without_importance_uses_synthetic_column_energy():
    x = _tensor(4, 512, seed=5)
    imp = iq2_xxs.synthetic_importance(x)
    manual = np.zeros(512, dtype=np.float32)
    for r in range(4):
        manual = (manual + x[r] * x[r]).astype(np.float32)
    np.testing.assert_array_equal(imp, manual)
    np.testing.assert_array_equal(quantize(QuantType.IQ2_XXS, x), quantize(QuantType.IQ2_XXS, x, imp))


def test_iq2_tables_agree_with_gguf_grid():
    from gguf.quants import IQ2_XXS as G

    G.init_grid()
    decoded = np.asarray(G.grid, dtype=np.float32).reshape(256, 8)
    np.testing.assert_array_equal(iq2_xxs.GRID_DECODE.astype(np.float32), decoded)
    assert (iq2_xxs.GRID_MAP >= 0).sum() == 256
    # every code a search can produce (levels 0..2) is on the grid or has a neighbour list
    levels = (np.arange(iq2_xxs.MAP_SIZE)[:, None] >> (2 * np.arange(8))) & 3
    reachable = (levels <= 2).all(axis=1)
    assert np.all((iq2_xxs.GRID_MAP >= 0) | (iq2_xxs.NB_COUNT > 0) | ~reachable)
    # neighbour lists are ordered by distance then index, and hold exactly two distance shells
    for u in np.flatnonzero(iq2_xxs.NB_COUNT)[::97]:
        s, n = iq2_xxs.NB_START[u], iq2_xxs.NB_COUNT[u]
        idx = iq2_xxs.NB_INDEX[s : s + n]
        pos = 2 * levels[u] + 1
        d2 = ((iq2_xxs.GRID_Q[idx] - pos) ** 2).sum(axis=1)
        assert list(zip(d2, idx)) == sorted(zip(d2, idx))
        all_d2 = np.unique(((iq2_xxs.GRID_Q.astype(int) - pos) ** 2).sum(axis=1))
        assert set(d2) == set(all_d2[:2])
        terms = iq2_xxs.NB_TERMS[8 * s : 8 * (s + n)].reshape(n, 8)
        np.testing.assert_array_equal(terms, 3 * np.arange(8) + (iq2_xxs.GRID_Q[idx] - 1) // 2)


@njit
def _f16_bits_many(x):
    out = np.empty(x.shape[0], dtype=np.uint16)
    for i in range(x.shape[0]):
        out[i] = _numeric.fp32_to_fp16_bits(x[i])
    return out


@njit
def _f16_back_many(h):
    out = np.empty(h.shape[0], dtype=np.float32)
    for i in range(h.shape[0]):
        out[i] = _numeric.fp16_bits_to_fp32(h[i])
    return out


@njit
def _nearest_many(x):
    out = np.empty(x.shape[0], dtype=np.int32)
    for i in range(x.shape[0]):
        out[i] = _numeric.nearest_int(x[i])
    return out


@njit
def _roundf_many(x):
    out = np.empty(x.shape[0], dtype=np.float32)
    for i in range(x.shape[0]):
        out[i] = _numeric.roundf(x[i])
    return out


def test_f16_conversion_rounds_to_nearest_even():
    bits = RNG.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = np.concatenate([x, np.float32([65504, 65519.99, 65520, 1e-8, 2.9802322e-08, 5.9604645e-08, -0.0, 0.0])])
    finite = np.isfinite(x)
    ours = _f16_bits_many(x)
    with np.errstate(over="ignore"):
        want = x[finite].astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(ours[finite], want)
    nan = np.isnan(x)
    np.testing.assert_array_equal(ours[nan] & 0x7FFF, np.full(nan.sum(), 0x7E00, dtype=np.uint16))
    np.testing.assert_array_equal(ours[nan] >> 15, (x[nan].view(np.uint32) >> 31).astype(np.uint16))
    all_h = np.arange(65536, dtype=np.uint16)
    back = _f16_back_many(all_h)
    want = all_h.view(np.float16).astype(np.float32)
    same = (back.view(np.uint32) == want.view(np.uint32)) | (np.isnan(back) & np.isnan(want))
    assert same.all()


def test_nearest_int_is_round_half_even_and_roundf_is_half_away():
    x = np.concatenate([RNG.uniform(-4e6, 4e6, 100_000), np.arange(-20, 20) + 0.5]).astype(np.float32)
    np.testing.assert_array_equal(_nearest_many(x), np.rint(x).astype(np.int32))
    halves = (np.arange(-20, 20) + 0.5).astype(np.float32)
    np.testing.assert_array_equal(_roundf_many(halves), np.where(halves > 0, np.floor(halves) + 1, np.ceil(halves) - 1))
    y = RNG.uniform(-300, 300, 10_000).astype(np.float32)
    np.testing.assert_array_equal(_roundf_many(y), q8_0._roundf_np(y))


@pytest.mark.parametrize("qtype", [QuantType.F32, QuantType.F16, QuantType.BF16])
def test_float_types_round_trip(qtype):
    x = _tensor(3, 64, seed=9)
    raw = quantize(qtype, x)
    assert raw.dtype == np.uint8 and raw.shape == (3, row_bytes(qtype, 64))
    back = dequantize(qtype, raw, 64)
    if qtype == QuantType.F32:
        np.testing.assert_array_equal(back, x)
    elif qtype == QuantType.F16:
        np.testing.assert_array_equal(back, x.astype(np.float16).astype(np.float32))
    else:
        import ml_dtypes

        np.testing.assert_array_equal(back, x.astype(ml_dtypes.bfloat16).astype(np.float32))
    X = RNG.standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_allclose(matmul(qtype, raw, X), X @ back.T, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError):
        quantize(QuantType.Q4_K, np.zeros((2, 100), np.float32))
    with pytest.raises(ValueError):
        quantize(QuantType.Q8_0, np.zeros(64, np.float32))
    with pytest.raises(ValueError):
        quantize(QuantType.Q2_K, np.zeros((2, 256), np.float32), np.ones(128, np.float32))
    raw = quantize(QuantType.Q8_0, np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError):
        dequantize(QuantType.Q8_0, raw, 96)
    with pytest.raises(ValueError):
        matvec(QuantType.Q8_0, raw, np.zeros(32, np.float32))
