"""The hi/lo split product with its correction terms on float8 (engine/gpu/fp8_split.py, DS4_GPU_PREFILL_GEMM=fp8).

On the CPU the float8 rounding is emulated (float32 products of the e4m3 values): the product must stay within
2^-16 of sum |w x| of the float64 reference, far closer than the single float16 pass, and the packing must never
overflow e4m3 whatever the weights' range. On a CUDA device (compute capability 8.9 or newer) cuBLASLt's float8 GEMM
must give the emulation's numbers, and the session's dense GEMMs under the mode must meet the exact mode's 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4.engine.gpu import fp8_split  # noqa: E402
from ds4.engine.gpu import weights as W  # noqa: E402


def _q8_case(T: int, K: int, N: int, seed: int, device: str = "cpu"):
    """Q8_0-valued weights [N, K], activations with large channels, their float16 splits and float64 references."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (N, K // 32, 32), generator=gen).float()
    d = (torch.rand(N, K // 32, 1, generator=gen) * 1e-3 + 1e-3).half().float()
    w = (codes * d).reshape(N, K)
    x = torch.randn(T, K, generator=gen)
    x[:, ::512] *= 40.0
    wh = (w * W.W_SCALE).half()
    wl = (w * W.W_SCALE - wh.float()).half()
    xh, xl, s = W.to_half(x, True)
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    on = lambda t: t.to(device)  # noqa: E731
    return on(xh), on(xl), on(s), on(wh), on(wl), ref, mag


def _err(y: torch.Tensor, s: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor) -> float:
    got = y.cpu().double() * (s.cpu().double() / W.W_SCALE)
    return float(((got - ref).abs() / mag).max())


def test_emulated_product_is_close_to_the_three_pass_form() -> None:
    xh, xl, s, wh, wl, ref, mag = _q8_case(48, 2048, 256, seed=3)
    fp8 = _err(fp8_split.product(xh, xl, wh.T, wl.T, W.acc_mm), s, ref, mag)
    three = _err(W.split_product(xh, xl, wh.T, wl.T), s, ref, mag)
    one = _err(W.split_product(xh, None, wh.T, None), s, ref, mag)
    assert fp8 <= 2.0 ** -16, f"fp8 correction: {fp8:.2e} of sum |w x|"
    assert fp8 * 8 <= one, f"fp8 {fp8:.2e} against the single f16 pass {one:.2e}"
    assert three <= fp8, (three, fp8)


def test_batched_product_equals_each_group_alone() -> None:
    G, T, K, N = 3, 20, 512, 128
    xh, xl, _, wh, wl, _, _ = _q8_case(G * T, K, G * N, seed=5)
    xg = lambda t: t.view(G, T, K)  # noqa: E731
    wg = lambda t: t.view(G, N, K).transpose(1, 2)  # noqa: E731
    y = fp8_split.product(xg(xh), xg(xl), wg(wh), wg(wl), W.acc_mm)
    assert y.shape == (G, T, N)
    sigma_all = fp8_split.weight_scale(wg(wh))
    for g in range(G):
        a8 = fp8_split.pack_x(xg(xh)[g], xg(xl)[g])
        b8 = fp8_split.pack_w(wg(wh)[g].T, wg(wl)[g].T, sigma_all)
        alone = fp8_split.correction(a8, b8, sigma_all) + W.mm_f32(xg(xh)[g].float(), wg(wh)[g].float())
        torch.testing.assert_close(y[g], alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("top", [1e-6, 1.0, 3e3])
def test_packing_stays_finite_and_in_range(top: float) -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(64, 256, generator=gen) * top
    w[0, :] = 0.0  # an all-zero row beside large ones
    wh = w.half()
    wl = (w - wh.float()).half()
    sigma = fp8_split.weight_scale(wh.T)
    b8 = fp8_split.pack_w(wh, wl, sigma).float()
    assert torch.isfinite(b8).all() and b8.abs().max() <= 2.0 ** fp8_split.W_TOP
    assert b8.abs().max() >= 2.0 ** (fp8_split.W_TOP - 1)  # the largest weight lands in the top binade
    x = torch.randn(16, 256, generator=gen) * top
    xh, xl, _ = W.to_half(x, True)
    a8 = fp8_split.pack_x(xh, xl).float()
    assert torch.isfinite(a8).all() and a8.abs().max() <= 448.0


def test_all_zero_weight_gives_zero() -> None:
    xh, xl, _, wh, wl, _, _ = _q8_case(8, 256, 32, seed=9)
    y = fp8_split.product(xh, xl, torch.zeros_like(wh).T, torch.zeros_like(wl).T, W.acc_mm)
    assert torch.equal(y, torch.zeros_like(y))


def _cuda_fp8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fp8(), reason="needs a CUDA device of compute capability 8.9 or newer")
def test_cublas_float8_gemm_gives_the_emulated_numbers() -> None:
    """cuBLASLt's float8 GEMM (fast accumulation: the tensor cores keep ~14 bits of the running sum) against the
    emulation's float32 sums of the same e4m3 operands: within 2^-8 of the correction's own scale sum |a8| |b8|,
    i.e. ~2^-19 of the product; and the product within the emulated bar of the float64 reference."""
    xh, xl, s, wh, wl, ref, mag = _q8_case(200, 4096, 1024, seed=11, device="cuda")
    sigma = fp8_split.weight_scale(wh.T)
    a8, b8 = fp8_split.pack_x(xh, xl), fp8_split.pack_w(wh, wl, sigma)
    got = fp8_split.correction(a8, b8, sigma).cpu().double()
    want = fp8_split.correction(a8.cpu(), b8.cpu(), sigma.cpu()).double()
    scale = (a8.cpu().float().abs() @ b8.cpu().float().abs().T).double() * 2.0 ** -19 / float(sigma)
    worst = float(((got - want).abs() / scale).max())
    assert worst <= 2.0 ** -8, f"float8 GEMM vs emulation: {worst:.2e} of sum |a8 b8|"
    err = _err(fp8_split.product(xh, xl, wh.T, wl.T, W.acc_mm), s, ref, mag)
    assert err <= 2.0 ** -16, f"product: {err:.2e} of sum |w x|"


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fp8(), reason="needs a CUDA device of compute capability 8.9 or newer")
@pytest.mark.parametrize("groups", [1, 8])
def test_session_gemm_in_fp8_mode_meets_the_exact_bar(monkeypatch, groups: int) -> None:
    from ds4.engine import gpu
    from ds4.gguf_tools.constants import QuantType as Q
    from test_gpu_kernels import dequant, random_blocks, rel_err

    if not gpu.available():
        pytest.skip(str(gpu.unavailable_reason()))
    monkeypatch.setattr(W, "FP8_GEMM", True)
    monkeypatch.setattr(W, "FP8_MIN", 0)
    rows, cols, T = 512, 1024, 40
    rng = np.random.default_rng(90 + groups)
    raw = random_blocks(Q.Q8_0, rows, cols, rng)
    w = gpu.upload(f"fp8.q8.{groups}", Q.Q8_0, (cols, rows), raw)
    x = rng.standard_normal((T, groups * cols)).astype(np.float32)
    x[:, :64] *= 300.0
    wd = dequant(Q.Q8_0, raw, cols)
    per = rows // groups
    ref = np.concatenate([x[:, g * cols:(g + 1) * cols].astype(np.float64) @ wd[g * per:(g + 1) * per].T
                          for g in range(groups)], axis=1)
    weights = W.Weights(None, torch.device("cuda"))
    got = weights._gemm(w, torch.from_numpy(x).cuda(), groups).cpu().numpy()
    gpu.load().reset_stream()
    assert fp8_split._SCALED_MM[0], "torch._scaled_mm refused the float8 operands"
    assert weights._fp8_scales, "the product did not take the float8 path"
    assert rel_err(got.astype(np.float64), ref) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fp8(), reason="needs a CUDA device of compute capability 8.9 or newer")
@pytest.mark.parametrize("qtype_name,groups", [("Q8_0", 1), ("Q8_0", 8), ("Q2_K", 1)])
def test_dequant_writes_the_weights_float8_operand(monkeypatch, qtype_name: str, groups: int) -> None:
    """DS4_GPU_DEQUANT_FP8: the dequant's float8 operand is pack_w of its own hi and lo planes byte for byte, its hi
    plane is half()'s, and the session's product with it (the weight's scale kept from a first product) has the bits
    of the product that packs the weight separately."""
    from ds4.engine import gpu
    from ds4.gguf_tools.constants import QuantType as Q
    from test_gpu_kernels import random_blocks

    if not gpu.available():
        pytest.skip(str(gpu.unavailable_reason()))
    qtype = Q[qtype_name]
    monkeypatch.setattr(W, "FP8_GEMM", True)
    monkeypatch.setattr(W, "FP8_MIN", 0)
    rows, cols, T = 512, 1024, 40
    rng = np.random.default_rng(27 + groups)
    w = gpu.upload(f"fp8.dq.{qtype_name}.{groups}", qtype, (cols, rows), random_blocks(qtype, rows, cols, rng))
    x = torch.from_numpy(rng.standard_normal((T, groups * cols)).astype(np.float32)).cuda()
    weights = W.Weights(None, torch.device("cuda"))
    want = weights._gemm(w, x, groups)  # packs the weight with pack_fp8 and keeps its scale
    assert weights._fp8_scales, "the product did not take the float8 path"
    monkeypatch.setattr(W, "DEQUANT_FP8", True)
    hi, lo, scale, b8 = weights._operands(w, groups)
    assert lo is None and b8 is not None
    hi0, lo0, scale0 = weights.half(w, True)
    sigma = weights._fp8_scales[id(w)]
    assert scale == scale0 and torch.equal(hi, hi0)
    packed = fp8_split.pack_w(hi0, lo0, sigma).reshape(b8.shape)
    assert torch.equal(b8.view(torch.uint8), packed.view(torch.uint8))
    got = weights._gemm(w, x, groups)
    gpu.load().reset_stream()
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fp8(), reason="needs a CUDA device of compute capability 8.9 or newer")
def test_extension_packing_equals_torch_casts() -> None:
    """pack_fp8 (dequant.cu) against torch's casts, bit for bit: plain rows, the grouped activations' strided view
    and the grouped weights' batches, with a device-side scale."""
    from ds4.engine import gpu

    if not gpu.available():
        pytest.skip(str(gpu.unavailable_reason()))
    gen = torch.Generator().manual_seed(13)
    xh, xl, _ = W.to_half(torch.randn(24, 4 * 256, generator=gen) * 3.0, True)
    xh, xl = xh.cuda(), xl.cuda()
    xg = lambda t: t.view(24, 4, 256).transpose(0, 1)  # noqa: E731  [groups, T, K], strided
    sigma = torch.tensor(2.0 ** -5, device="cuda")  # 2048 * 2^-5 * |xh| <= 64: inside e4m3's range
    cases = [(xh, xl, fp8_split.X_HI_SCALE, fp8_split.X_LO_SCALE, None),
             (xg(xh), xg(xl), fp8_split.X_HI_SCALE, fp8_split.X_LO_SCALE, None),
             (xh.view(4, 24, 256), xl.view(4, 24, 256), 2048.0, 1.0, sigma)]
    for a, b, sa, sb, k in cases:
        got = fp8_split._pack(a, b, sa, sb, k)
        ka, kb = (sa, sb) if k is None else (sa * k, sb * k)
        want = torch.cat(((a.float() * ka).to(fp8_split.E4M3), (b.float() * kb).to(fp8_split.E4M3)), dim=-1)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (a.shape, a.stride())


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fp8(), reason="needs a CUDA device of compute capability 8.9 or newer")
def test_small_session_with_every_dense_product_on_float8(monkeypatch, tmp_path):
    """`small` (q2 layout, simulations off) with DS4_GPU_FP8_MIN=0, so every dense product of 16+ rows takes the
    float8 corrections and the attention hands o_a its float8 operand: within test_gpu_session_cuda's bar (1e-3)
    of the CPU engine."""
    from conftest import quantize_cli

    from ds4.engine import gpu
    from ds4.engine.gpu.session import Session as GpuSession
    from ds4.engine.model import Model
    from ds4.engine.session import Session as CpuSession

    if not gpu.available():
        pytest.skip(str(gpu.unavailable_reason()))
    monkeypatch.setattr(W, "FP8_GEMM", True)
    monkeypatch.setattr(W, "FP8_MIN", 0)
    quantize_cli("synth", "--preset", "small", "--gguf", str(tmp_path / "small.gguf"), "--mix", "q2", "--quiet")
    m = Model.load(tmp_path / "small.gguf").with_numerics(fp8_kv=False, indexer_qat=False)
    toks = np.random.default_rng(5).integers(2, m.config.vocab_size, 600).tolist()
    g = GpuSession(m, ctx=1024, prefill_chunk=256)
    got = g.sync(toks)
    want = CpuSession(m, ctx=1024, prefill_chunk=256).sync(toks)
    err = float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))
    print(f"\nsmall, every dense product on float8: prefill rel {err:.2e}")
    assert g.W._fp8_scales, "no product took the float8 path"
    assert g.W.takes_fp8("blk.0.attn_output_a.weight", 256, m.config.o_groups)
    assert err <= 1e-3


def test_unpack_lo_returns_the_packed_lo_part() -> None:
    """unpack_lo (the refusal fallback) gives back lo to e4m3's precision: within 2^-4 of |lo| plus the subnormal step."""
    gen = torch.Generator().manual_seed(17)
    xh, xl, _ = W.to_half(torch.randn(12, 256, generator=gen), True)
    got = fp8_split.unpack_lo(fp8_split.pack_x(xh, xl), xh)
    assert got.shape == xl.shape and got.dtype == torch.float16
    assert ((got.float() - xl.float()).abs() <= xl.float().abs() * 2.0 ** -4 + 2.0 ** -28).all()
