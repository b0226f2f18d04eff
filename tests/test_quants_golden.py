"""Quant kernels vs ggml: byte-identical blocks (tooling-spec §2).

The golden fixture (tests/fixtures/quants/golden.npz) holds input rows and the bytes ggml's
`ggml_quantize_chunk` produced for them, per type, with and without importance weights (IQ2_XXS
"without" = ds4's synthetic column-energy importance). Regenerate it with
`python tests/test_quants_golden.py` when llama-cpp-python is installed; the oracle tests below
also recompute ggml's bytes live whenever it is importable.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ds4.gguf_tools.constants import QuantType
from ds4.gguf_tools.quants import QUANTIZED, ggml_oracle, quantize
from ds4.gguf_tools.quants.iq2_xxs import synthetic_importance

GOLDEN = Path(__file__).parent / "fixtures" / "quants" / "golden.npz"
COLS = 512

needs_ggml = pytest.mark.skipif(not ggml_oracle.available(), reason="llama-cpp-python (ggml) not installed")


def _fp4_like(rng: np.random.Generator, n: int) -> np.ndarray:
    """Values on the e2m1 grid times power-of-two block scales, like dequantized DeepSeek experts."""
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)
    v = grid[rng.integers(0, 8, n)] * np.where(rng.random(n) < 0.5, -1, 1)
    scales = np.float32(2.0) ** rng.integers(-9, -4, n // 32).repeat(32)
    return (v * scales).astype(np.float32)


def golden_inputs(seed: int = 2024, cols: int = COLS) -> tuple[np.ndarray, np.ndarray]:
    """Rows chosen to hit every branch of the searches: scales, ties, zero groups, constant and
    one-signed rows, sparse rows, values below GROUP_MAX_EPS, FP4-grid values."""
    rng = np.random.default_rng(seed)
    n = cols
    rows = [
        rng.standard_normal(n),
        rng.standard_normal(n) * 0.01,
        rng.standard_normal(n) * 100,
        rng.standard_normal(n) * 1e-3 + 2e-3,
        np.clip(rng.standard_t(2, n), -50, 50),
        np.concatenate([np.zeros(256), rng.standard_normal(n - 256)]),
        np.full(n, 0.5),
        np.full(n, -0.25),
        rng.integers(-8, 9, n).astype(np.float64),
        rng.random(n),
        rng.standard_normal(n) * (rng.random(n) < 0.1),
        np.concatenate([rng.standard_normal(256) * 1e-18, rng.standard_normal(n - 256) * 1e-6]),
        (rng.integers(-6, 7, n) + 0.5) * 0.125,
        _fp4_like(rng, n),
        _fp4_like(rng, n),
        _fp4_like(rng, n) * (rng.random(n) < 0.7),
    ]
    x = np.stack(rows).astype(np.float32)
    imp = (rng.random(n) ** 3).astype(np.float32)
    imp[rng.random(n) < 0.05] = 0
    return x, imp


def _importance_for(qtype: QuantType, x: np.ndarray, imp: np.ndarray, weighted: bool) -> np.ndarray | None:
    if weighted:
        return imp
    return synthetic_importance(x) if qtype == QuantType.IQ2_XXS else None


def _key(qtype: QuantType, weighted: bool) -> str:
    return f"{qtype.name}_{'imp' if weighted else 'noimp'}"


def build_golden() -> dict[str, np.ndarray]:
    x, imp = golden_inputs()
    keys, requests = [], []
    for qtype in QUANTIZED:
        for weighted in (False, True):
            keys.append(_key(qtype, weighted))
            requests.append((qtype, x, _importance_for(qtype, x, imp, weighted)))
    return {"x": x, "importance": imp, **dict(zip(keys, ggml_oracle.quantize_many(requests)))}


CASES = [(q, w) for q in QUANTIZED for w in (False, True)]
IDS = [_key(q, w) for q, w in CASES]


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(GOLDEN))


@pytest.mark.parametrize("qtype,weighted", CASES, ids=IDS)
def test_matches_committed_ggml_bytes(golden, qtype, weighted):
    x, imp = golden["x"], golden["importance"]
    # ours is given None for IQ2_XXS "noimp": it must build the synthetic importance itself
    ours = quantize(qtype, x, imp if weighted else None)
    want = golden[_key(qtype, weighted)]
    assert ours.shape == want.shape
    bad = np.argwhere(ours != want)
    assert len(bad) == 0, f"{len(bad)} bytes differ, first at (row, byte) {bad[0].tolist()}"


@needs_ggml
def test_committed_fixture_is_what_ggml_produces(golden):
    fresh = build_golden()
    for key, value in fresh.items():
        np.testing.assert_array_equal(value, golden[key], err_msg=key)


def _random_case(seed: int, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * rng.gamma(1.0, 1.0, (rows, 1))).astype(np.float32)
    x[0, : cols // 2] = _fp4_like(rng, cols // 2)
    imp = rng.gamma(0.5, 1.0, cols).astype(np.float32)
    return x, imp


RANDOM_SHAPES = [(1, 5, 768), (2, 3, 2048), (3, 9, 256), (4, 2, 4096)]


@needs_ggml
def test_random_tensors_match_live_ggml():
    """Fresh random tensors of several shapes, every type, with and without importance."""
    cases, requests = [], []
    for seed, rows, cols in RANDOM_SHAPES:
        x, imp = _random_case(seed, rows, cols)
        for qtype, weighted in CASES:
            cases.append((qtype, weighted, x, imp, (seed, rows, cols)))
            requests.append((qtype, x, _importance_for(qtype, x, imp, weighted)))
    for (qtype, weighted, x, imp, shape), want in zip(cases, ggml_oracle.quantize_many(requests)):
        ours = quantize(qtype, x, imp if weighted else None)
        np.testing.assert_array_equal(ours, want, err_msg=f"{_key(qtype, weighted)} seed/rows/cols {shape}")


@needs_ggml
def test_oracle_aborts_on_iq2_xxs_without_importance():
    x = np.ones((1, 256), dtype=np.float32)
    with pytest.raises(ggml_oracle.OracleError):
        ggml_oracle.quantize(QuantType.IQ2_XXS, x, None)


@needs_ggml
@pytest.mark.parametrize("qtype", [QuantType.Q2_K, QuantType.IQ2_XXS], ids=lambda q: q.name)
def test_batched_searches_match_live_ggml_on_many_blocks(qtype):
    """Q2_K and IQ2_XXS batch their trial steps (make_qkx/make_qp trials, the 13 IQ2 scales):
    many blocks of varied data (Gaussian at several scales, heavy tails, FP4 grid values, sparse,
    one-signed), with and without importance, must still give ggml's bytes."""
    rng = np.random.default_rng(int(qtype) + 77)
    rows, cols = 48, 1024
    x = (rng.standard_normal((rows, cols)) * rng.gamma(1.0, 0.05, (rows, 1))).astype(np.float32)
    x[0:8] = np.clip(rng.standard_t(3, (8, cols)), -30, 30)
    x[8:16] = _fp4_like(rng, 8 * cols).reshape(8, cols)
    x[16:24] *= rng.random((8, cols)) < 0.2
    x[24:28] = np.abs(x[24:28])
    x[28:32] = -np.abs(x[28:32]) * 1e-4
    imp = (rng.gamma(0.5, 1.0, cols) * (rng.random(cols) < 0.95)).astype(np.float32)
    requests = [(qtype, x, _importance_for(qtype, x, imp, weighted)) for weighted in (False, True)]
    for weighted, want in zip((False, True), ggml_oracle.quantize_many(requests)):
        ours = quantize(qtype, x, imp if weighted else None)
        np.testing.assert_array_equal(ours, want, err_msg=_key(qtype, weighted))


if __name__ == "__main__":
    if not ggml_oracle.available():
        sys.exit("llama-cpp-python is not installed: cannot regenerate the golden fixture")
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    data = build_golden()
    np.savez_compressed(GOLDEN, **data)
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes, {len(data)} arrays)")
