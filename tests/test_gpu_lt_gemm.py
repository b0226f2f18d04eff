"""lt_gemm (lt_gemm.cpp / lt_gemm.py): the dense prefill GEMMs through cuBLASLt with one algorithm per shape class.

Against float64 products of the same float16 / e4m3 operands, in every layout the prefill uses (w.T views, row-major
weights, the grouped o_a's strided batches, accumulation into y), and the point of it: a row count the process has
not run asks the heuristic nothing once its class has an algorithm. Skipped without a built extension with cuBLASLt
and a CUDA device."""

from __future__ import annotations

import pytest

from ds4.engine import gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def lt():
    """lt_gemm switched on for this module (the engine's default is DS4_GPU_LT_GEMM's), as it was afterwards."""
    from ds4.engine.gpu import lt_gemm

    saved = lt_gemm.ENABLED, dict(lt_gemm._STATE)
    lt_gemm.ENABLED = True
    lt_gemm._STATE.clear()
    try:
        if not lt_gemm.available():
            pytest.skip("the extension was built without cuBLASLt's header, or the library is missing")
        yield lt_gemm
    finally:
        lt_gemm.ENABLED = saved[0]
        lt_gemm._STATE.clear()
        lt_gemm._STATE.update(saved[1])


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 accumulation's error scale: 2^-20 of sum |x| |w| per output (float32 rounding over K terms, loosely)."""
    return torch.matmul(x.double().abs(), w.double().abs()) * 2.0 ** -20 + 1e-30


def f16(*shape, dev="cuda"):
    return torch.randn(*shape, device=dev).to(torch.float16)


@pytest.mark.parametrize("M,K,N", [(300, 4096, 1024), (2048, 1024, 2048), (1100, 512, 48)])
def test_mm_f32_against_float64(lt, M, K, N):
    x, w_rows = f16(M, K), f16(N, K)
    y = lt.mm_f32(x, w_rows.T)
    assert y is not None and y.dtype == torch.float32 and y.shape == (M, N)
    ref = x.double() @ w_rows.double().T
    assert ((y.double() - ref).abs() <= bound(x, w_rows.T)).all()
    w_kn = f16(K, N)  # a row-major [K, N] weight takes the other transpose
    y2 = lt.mm_f32(x, w_kn)
    assert ((y2.double() - x.double() @ w_kn.double()).abs() <= bound(x, w_kn)).all()


def test_grouped_strided_batches(lt):
    """The grouped o_a's views: x [T, G n_in] seen as [G, T, n_in] (batch stride n_in), w [G, n_in, n_out] as rows.T."""
    T, G, n_in, n_out = 1500, 4, 256, 128
    x = f16(T, G * n_in)
    w = f16(G * n_out, n_in)
    xg = x.view(T, G, n_in).transpose(0, 1)
    wg = w.view(G, n_out, n_in).transpose(1, 2)
    y = lt.mm_f32(xg, wg)
    assert y is not None and y.shape == (G, T, n_out)
    ref = torch.bmm(xg.double(), wg.double())
    assert ((y.double() - ref).abs() <= torch.bmm(xg.double().abs(), wg.double().abs()) * 2.0 ** -20 + 1e-30).all()


def test_acc_mm_adds_into_y(lt):
    M, K, N = 1200, 2048, 512
    x, w_rows = f16(M, K), f16(N, K)
    y0 = torch.randn(M, N, device="cuda")
    y = y0.clone()
    assert lt.acc_mm(y, x, w_rows.T)
    ref = y0.double() + x.double() @ w_rows.double().T
    assert ((y.double() - ref).abs() <= bound(x, w_rows.T) + y0.double().abs() * 2.0 ** -23).all()


def test_scaled_mm_against_float64(lt):
    e4m3 = torch.float8_e4m3fn
    M, K, N = 2048, 1024, 512
    a8 = (torch.randn(M, K, device="cuda") * 16).to(e4m3)
    w8 = (torch.randn(N, K, device="cuda") * 16).to(e4m3)
    sa = torch.full((), 2.0 ** -7, device="cuda")
    sw = torch.full((), 0.25, device="cuda")
    out = torch.full((M, N), float("nan"), device="cuda")
    y = lt.scaled_mm(a8, w8.T, sa, sw, out=out, fast=False)
    assert y is out
    ref = (a8.double() @ w8.double().T) * 2.0 ** -7 * 0.25
    mag = (a8.double().abs() @ w8.double().abs().T) * 2.0 ** -7 * 0.25
    # Hopper's float8 tensor cores keep ~14 bits of the running sum between cuBLAS's float32 promotions (as
    # test_gpu_fp8_split notes), so the bar is 2^-13 of sum |a| |w|, not float32's
    assert ((y.double() - ref).abs() <= mag * 2.0 ** -13 + 1e-30).all()
    torch_y = torch._scaled_mm(a8, w8.T, sa, sw, out_dtype=torch.float32)
    assert ((y.double() - torch_y.double()).abs() <= mag * 2.0 ** -12 + 1e-30).all()
    # and the errors are the tensor cores', not a lost term: the worst is far below one product's share
    worst = float(((y.double() - ref).abs() / mag).max())
    print(f"e4m3 worst error {worst:.2e} of sum |a||w|")


def test_new_row_counts_reuse_the_class_algorithm(lt):
    """After a class's first call (from 1024 rows) a new row count runs a check, never the heuristic."""
    K, N = 1536, 768  # a class no other test uses
    w_rows = f16(N, K)
    lt.mm_f32(f16(2048, K), w_rows.T)
    before = lt.stats()
    for M in (6144, 6000, 8192, 1024, 4097):
        x = f16(M, K)
        y = lt.mm_f32(x, w_rows.T)
        assert ((y.double() - x.double() @ w_rows.double().T).abs() <= bound(x, w_rows.T)).all()
    after = lt.stats()
    assert after["heuristics"] - before["heuristics"] == after["check_failures"] - before["check_failures"] == 0
    assert after["checks"] - before["checks"] == 5
    assert after["calls"] - before["calls"] == 5
    lt.mm_f32(f16(6144, K), w_rows.T)  # a row count seen before: neither
    again = lt.stats()
    assert again["checks"] == after["checks"] and again["heuristics"] == after["heuristics"]


def test_layouts_it_does_not_take(lt):
    x, w_rows = f16(64, 128), f16(32, 128)
    assert lt.mm_f32(x.T.contiguous().T[:, ::2], w_rows.T[::2]) is None  # a column stride of 2
    assert lt.mm_f32(x.float(), w_rows.T.float()) is None  # float32 operands: torch's call
    y = torch.zeros(64, 32, device="cuda", dtype=torch.float16)
    assert not lt.acc_mm(y, x, w_rows.T)  # a float16 y


def test_the_session_prefill_runs_on_it(lt, tmp_path):
    """A prefill on `small` q2 sends its dense products here (none refused), and matches the CPU engine as before."""
    import numpy as np
    from conftest import quantize_cli

    from ds4.engine.gpu import session as gpu_session
    from ds4.engine.model import Model
    from ds4.engine.session import Session as CpuSession

    quantize_cli("synth", "--preset", "small", "--gguf", str(tmp_path / "small.gguf"), "--mix", "q2", "--quiet")
    m = Model.load(tmp_path / "small.gguf").with_numerics(fp8_kv=False, indexer_qat=False)  # the 1e-3 case
    toks = np.random.default_rng(3).integers(2, m.config.vocab_size, 200).tolist()
    before = lt.stats()
    got = gpu_session.Session(m, ctx=512, prefill_chunk=128).prefill(toks)
    assert lt.stats()["calls"] > before["calls"]
    assert not lt._STATE.get("refused")
    want = CpuSession(m, ctx=512, prefill_chunk=128).prefill(toks)
    assert np.linalg.norm(np.asarray(got, np.float64) - want) <= 1e-3 * np.linalg.norm(want)


def test_timed_candidates_leave_y_to_the_one_real_product(lt):
    """A class's first call times several of the heuristic's algorithms into a scratch output: an accumulating call
    still adds x . w to y exactly once, and the timed pick serves later row counts."""
    ext = lt._ext()
    ext.lt_set_tune(6)
    try:
        K, N = 1280, 640  # a class no other test uses
        w_rows = f16(N, K)
        before = lt.stats()
        for M in (3000, 1024):
            x = f16(M, K)
            y0 = torch.randn(M, N, device="cuda")
            y = y0.clone()
            assert lt.acc_mm(y, x, w_rows.T)
            ref = y0.double() + x.double() @ w_rows.double().T
            assert ((y.double() - ref).abs() <= bound(x, w_rows.T) + y0.double().abs() * 2.0 ** -23).all()
        after = lt.stats()
        assert after["heuristics"] - before["heuristics"] == 1
        # cuBLASLt offers several algorithms for a float16 product of this size: more than one was timed
        assert after["timed"] - before["timed"] >= 2
    finally:
        ext.lt_set_tune(lt.TUNE)
    with pytest.raises(ValueError):
        ext.lt_set_tune(0)
