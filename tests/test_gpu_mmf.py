"""The routed experts' prefill products on the float16 tensor cores with the codes as exact float16 integers (mmf.cu,
DS4_GPU_MOE_GEMM=mmf; its warpgroup-MMA form mmw for IQ2_XXS, DS4_GPU_MOE_GEMM=mmw) against a float64 reference (the
dequantized experts times the activations as split to float16 hi + lo), and in the session on `small` against the CPU
engine. Skipped without a built extension and a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

from test_gpu_kernels import dequant, random_blocks, rel_err
from test_gpu_mmq import _Counting, small_reference  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]


def _split(x):
    from ds4.engine.gpu import weights

    return weights.to_half(x, True)


def run_mmf(w, x: np.ndarray, counts: list[int]) -> np.ndarray:
    import torch

    from ds4.engine.gpu import moe_gemm

    ext = gpu.load()
    tiles = torch.tensor(moe_gemm.expert_tiles(counts, ext.mmf_tile_rows()), dtype=torch.int32, device="cuda")
    xa = moe_gemm.mmf_activations(_split, torch.from_numpy(x).cuda(), w.qtype)
    y = ext.Array.empty([x.shape[0], w.nrows // len(counts)])
    y.fill(float("nan"))
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    torch.cuda.synchronize()
    assert ext.mmf_experts(w, ptr(xa.hi), ptr(xa.lo), ptr(xa.sum_hi), ptr(xa.sum_lo), ptr(xa.s), tiles.data_ptr(),
                           tiles.shape[0], y)
    return y.numpy()


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.Q2_K, Q.Q4_K])
@pytest.mark.parametrize("n_embd", [256, 1024])
def test_mmf_experts_match_the_reference(qtype, n_embd):
    """Tiles of at most mmf_tile_rows() rows: an unused expert, experts of one row, partial and several tiles; 200
    rows per expert (a partial tile of weight rows); one super-block (its two stages) and four."""
    ext = gpu.load()
    rng = np.random.default_rng(11)
    n_ff, counts = 200, [3, 0, 150, 1, 128, 129, 1, 20, 300, 64]
    n_expert = len(counts)
    raw = random_blocks(qtype, n_ff * n_expert, n_embd, rng)
    w = gpu.upload(f"blk.0.ffn_gate_exps.mmf{qtype.name}{n_embd}", qtype, (n_embd, n_ff, n_expert), raw)
    assert ext.mmf_takes(w, n_expert)
    x = rng.standard_normal((sum(counts), n_embd)).astype(np.float32)
    x[5] *= 1e-3  # rows of very different sizes: each keeps its own scale
    got = run_mmf(w, x, counts)
    wd = dequant(qtype, raw, n_embd).reshape(n_expert, n_ff, n_embd)
    expert = np.repeat(np.arange(n_expert), counts)
    want = np.einsum("rc,roc->ro", x.astype(np.float64), wd[expert])
    err = rel_err(got, want)
    assert err <= 1e-5, f"rel err {err:.2e}"
    row_err = np.abs(got[5] - want[5]).max() / np.abs(want[5]).max()
    assert row_err <= 1e-5, f"small row: rel err {row_err:.2e}"


def test_mmf_declines_other_experts_and_checks_arguments():
    ext = gpu.load()
    rng = np.random.default_rng(12)
    q8 = gpu.upload("blk.0.ffn_gate_exps.mmfq8", Q.Q8_0, (256, 64, 2), random_blocks(Q.Q8_0, 128, 256, rng))
    y = ext.Array.empty([4, 64])
    assert not ext.mmf_takes(q8, 2)
    assert not ext.mmf_experts(q8, 1, 1, 1, 1, 1, 1, 1, y)
    q2 = gpu.upload("blk.0.ffn_gate_exps.mmfq2", Q.Q2_K, (256, 64, 2), random_blocks(Q.Q2_K, 128, 256, rng))
    with pytest.raises(ValueError, match="y must be"):
        ext.mmf_experts(q2, 1, 1, 1, 1, 1, 1, 1, ext.Array.empty([4, 65]))
    with pytest.raises(ValueError, match="K-quants need the group sums"):
        ext.mmf_experts(q2, 1, 1, 0, 0, 1, 1, 1, y)


def test_mmf_prefill_in_the_session(monkeypatch, small_reference):  # noqa: F811
    """small, 600 tokens in chunks of 256: the prefill with the routed experts on mmf against the CPU engine; the
    activations keep the hi/lo GEMMs' ~22 bits, so float32 level is expected, not only the engine's 1e-3."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    from ds4.engine.gpu import moe_gemm
    from ds4.engine.gpu.session import Session as GpuSession

    m, toks, want = small_reference
    calls = []
    monkeypatch.setattr(moe_gemm, "MOE_GEMM", "mmf")
    g = GpuSession(m, ctx=1024, prefill_chunk=256)
    g.W.ext = _Counting(g.W.ext, calls)
    got = g.sync(toks)
    assert calls and all(calls), "the routed experts did not go through mmf"
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    print(f"\nmmf prefill against the CPU engine: rel {err:.2e} ({len(calls)} mmf calls)")
    assert err <= 1e-4


def run_mmw(w, x: np.ndarray, counts: list[int]) -> np.ndarray:
    import torch

    from ds4.engine.gpu import moe_gemm

    ext = gpu.load()
    tiles = torch.tensor(moe_gemm.expert_tiles(counts, ext.mmw_tile_rows()), dtype=torch.int32, device="cuda")
    xa = moe_gemm.mmf_activations(_split, torch.from_numpy(x).cuda(), w.qtype)
    y = ext.Array.empty([x.shape[0], w.nrows // len(counts)])
    y.fill(float("nan"))
    torch.cuda.synchronize()
    assert ext.mmw_experts(w, xa.hi.data_ptr(), xa.lo.data_ptr(), xa.s.data_ptr(), tiles.data_ptr(), tiles.shape[0],
                           y)
    return y.numpy()


@pytest.mark.parametrize("n_embd", [256, 1024, 4096])
def test_mmw_experts_match_the_reference_and_mmf(n_embd):
    """The warpgroup-MMA form on IQ2_XXS experts: tiles of at most mmw_tile_rows() rows (an unused expert, experts of
    one row, partial and several tiles), 200 rows per expert (a partial 128-row weight tile), one super-block (four
    stages) and sixteen; against the float64 reference and against mmf (the same arithmetic, other sum order)."""
    ext = gpu.load()
    rng = np.random.default_rng(14)
    n_ff, counts = 200, [3, 0, 150, 1, 128, 129, 1, 20, 300, 64]
    n_expert = len(counts)
    raw = random_blocks(Q.IQ2_XXS, n_ff * n_expert, n_embd, rng)
    w = gpu.upload(f"blk.0.ffn_gate_exps.mmw{n_embd}", Q.IQ2_XXS, (n_embd, n_ff, n_expert), raw)
    assert ext.mmw_takes(w, n_expert)
    x = rng.standard_normal((sum(counts), n_embd)).astype(np.float32)
    x[5] *= 1e-3  # rows of very different sizes: each keeps its own scale
    got = run_mmw(w, x, counts)
    assert np.isfinite(got).all()
    wd = dequant(Q.IQ2_XXS, raw, n_embd).reshape(n_expert, n_ff, n_embd)
    expert = np.repeat(np.arange(n_expert), counts)
    want = np.einsum("rc,roc->ro", x.astype(np.float64), wd[expert])
    err = rel_err(got, want)
    assert err <= 1e-5, f"rel err {err:.2e}"
    row_err = np.abs(got[5] - want[5]).max() / np.abs(want[5]).max()
    assert row_err <= 1e-5, f"small row: rel err {row_err:.2e}"
    assert rel_err(got, run_mmf(w, x, counts)) <= 1e-6


def test_mmw_declines_other_experts_and_checks_arguments():
    ext = gpu.load()
    rng = np.random.default_rng(15)
    q2 = gpu.upload("blk.0.ffn_gate_exps.mmwq2", Q.Q2_K, (256, 64, 2), random_blocks(Q.Q2_K, 128, 256, rng))
    y = ext.Array.empty([4, 64])
    assert not ext.mmw_takes(q2, 2)
    assert not ext.mmw_experts(q2, 1, 1, 1, 1, 1, y)
    iq = gpu.upload("blk.0.ffn_gate_exps.mmwiq", Q.IQ2_XXS, (256, 64, 2), random_blocks(Q.IQ2_XXS, 128, 256, rng))
    with pytest.raises(ValueError, match="y must be"):
        ext.mmw_experts(iq, 1, 1, 1, 1, 1, ext.Array.empty([4, 65]))
    with pytest.raises(ValueError, match="missing activation planes"):
        ext.mmw_experts(iq, 0, 1, 1, 1, 1, y)


class _CountingMmw:
    """The extension module with its mmw_experts calls counted (everything else passes through)."""

    def __init__(self, ext, calls):
        self._ext, self._calls = ext, calls

    def mmw_experts(self, *a, **kw):
        took = self._ext.mmw_experts(*a, **kw)
        self._calls.append(took)
        return took

    def __getattr__(self, name):
        return getattr(self._ext, name)


def test_mmw_prefill_in_the_session(monkeypatch, small_reference):  # noqa: F811
    """small, 600 tokens in chunks of 256: gate and up on the warpgroup MMA (down on mmq) against the CPU engine."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    from ds4.engine.gpu import moe_gemm
    from ds4.engine.gpu.session import Session as GpuSession

    m, toks, want = small_reference
    calls = []
    monkeypatch.setattr(moe_gemm, "MOE_GEMM", "mmw")
    g = GpuSession(m, ctx=1024, prefill_chunk=256)
    g.W.ext = _CountingMmw(g.W.ext, calls)
    got = g.sync(toks)
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    print(f"\nmmw prefill against the CPU engine: rel {err:.2e} ({len(calls)} mmw calls)")
    assert calls and all(calls), "the routed experts did not go through mmw"
    assert err <= 1e-4
