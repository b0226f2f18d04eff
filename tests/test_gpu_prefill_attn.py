"""The forms of the prefill attention (DS4_GPU_PREFILL_ATTN). The one-kernel form (attn_prefill.cu, `fused`) against a
float64 reference of model-spec §3.5's attention with sinks (window keys valid from position 0, compressed rows
visible below (pos + 1) / ratio, per-query top-k rows or all rows), and in the session against the torch path; the
TF32 products (`tf32`, a speed mode) in the session against float32 ones. Skipped without a usable CUDA device."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from ds4.engine import gpu  # noqa: E402

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and gpu.available()),
                                reason="needs a CUDA device and the built extension")

DEV = "cuda"


def reference(q, win, comp, sel, sinks, pos0: int, ratio: int) -> torch.Tensor:
    T, H, d = q.shape
    Wn = win.shape[0] - T + 1
    pos = torch.arange(pos0, pos0 + T, device=q.device)
    keys = [win.double().unfold(0, Wn, 1).transpose(1, 2)]  # [T, Wn, d]
    valid = [(pos[:, None] - (Wn - 1) + torch.arange(Wn, device=q.device)[None]) >= 0]
    if comp is not None:
        n = comp.shape[0]
        rows = sel if sel is not None else torch.arange(n, device=q.device).expand(T, n)
        keys.append(comp.double()[rows.clamp(0, max(n - 1, 0))])
        valid.append((rows >= 0) & (rows < n) & (rows < ((pos + 1) // ratio)[:, None]))
    K, V = torch.cat(keys, 1), torch.cat(valid, 1)
    s = torch.einsum("thd,tnd->thn", q.double(), K) / math.sqrt(d)
    s = s.masked_fill(~V[:, None, :], -math.inf)
    s = torch.cat([s, sinks.double()[None, :, None].expand(T, H, 1)], -1)
    p = torch.softmax(s, -1)[..., :-1]
    return torch.einsum("thn,tnd->thd", p, K)


def _case(seed, T, H, d, Wn, n_comp, k_sel, pos0, ratio):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, d, generator=g) * 0.3).to(DEV)
    win = torch.randn(T + Wn - 1, d, generator=g).to(DEV)
    comp = None if n_comp is None else torch.randn(n_comp, d, generator=g).to(DEV)
    sel = None
    if k_sel:
        sel = torch.stack([torch.randperm(n_comp, generator=g)[:k_sel] for _ in range(T)]).to(DEV)
    sinks = torch.randn(H, generator=g).to(DEV)
    return q, win, comp, sel, sinks


@pytest.mark.parametrize("T,H,d,n_comp,k_sel,pos0,ratio", [
    (40, 64, 512, 900, 512, 3000, 4),     # Flash: top-k rows, some not visible yet
    (24, 8, 512, 20, 0, 2000, 128),       # small, ratio 128: all rows, the last ones not visible
    (50, 4, 128, None, 0, 0, 0),          # tiny, window only, from position 0 (early window keys masked)
    (9, 128, 512, 700, 512, 2600, 4),     # Pro: two groups of 64 heads
    (17, 20, 64, 40, 16, 100, 4),         # 32-head groups with 12 padding rows
])
def test_prefill_attention_kernel_matches_the_float64_reference(T, H, d, n_comp, k_sel, pos0, ratio):
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device(DEV))
    q, win, comp, sel, sinks = _case(T + H, T, H, d, 128, n_comp, k_sel, pos0, ratio)
    got = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio)
    ref = reference(q, win, comp, sel, sinks, pos0, ratio)
    err = float((got.double() - ref).norm() / ref.norm())
    assert err < 1e-5, f"rel err {err:.2e}"


@pytest.mark.parametrize("T,H,d,n_comp,k_sel,pos0,ratio", [
    (40, 64, 512, 900, 512, 3000, 4),     # Flash: top-k rows
    (24, 8, 512, 20, 0, 2000, 128),       # small, ratio 128
    (50, 4, 128, None, 0, 0, 0),          # tiny, window only
    (17, 20, 128, 40, 16, 100, 4),        # padded head groups
])
def test_exact_keys_give_the_same_bits(T, H, d, n_comp, k_sel, pos0, ratio):
    """Keys FP8-rounded on their first d - 64 columns (as the FP8 KV simulation leaves them): skipping the keys' TF32
    lo part there (zero) gives the bits of the full three-product form, and stays at the float64 reference."""
    from ds4.engine.gpu import ops
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device(DEV))
    q, win, comp, sel, sinks = _case(T + 2 * H, T, H, d, 128, n_comp, k_sel, pos0, ratio)
    n_nope = d - 64
    win = ops.fp8_kv_round(win, n_nope)
    comp = None if comp is None else ops.fp8_kv_round(comp, n_nope)
    full = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio)
    fast = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, exact_dims=n_nope, form=2)  # form 3: its own tests
    assert torch.equal(fast, full)
    ref = reference(q, win, comp, sel, sinks, pos0, ratio)
    assert float((fast.double() - ref).norm() / ref.norm()) < 1e-5
    with pytest.raises(ValueError, match="exact_dims"):
        K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, exact_dims=12)


@pytest.mark.parametrize("T,H,d,n_comp,k_sel,pos0,ratio", [
    (40, 64, 512, 900, 512, 3000, 4),     # Flash: top-k rows, some not visible yet (two CTAs of 32 heads, one buffer)
    (30, 16, 128, 300, 100, 900, 4),      # 16 heads: the double-buffered form
    (9, 128, 512, 700, 512, 2600, 4),     # Pro: two groups of 64 heads
    (24, 8, 512, 20, 0, 2000, 128),       # no selection: nothing to stage
])
def test_staged_rows_and_prefetch_give_the_same_bits(T, H, d, n_comp, k_sel, pos0, ratio):
    """The selected rows staged in shared memory once per query (prefetch 1) and the next key tile prefetched into L2
    (prefetch 2) change where the addresses come from, not the keys: every output bit equals the v12 form's (0)."""
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device(DEV))
    q, win, comp, sel, sinks = _case(T + 3 * H, T, H, d, 128, n_comp, k_sel, pos0, ratio)
    if sel is not None:  # invalid entries too: negative, past the rows, not yet visible
        sel[0, :3] = torch.tensor([-1, n_comp, n_comp - 1], device=DEV)
    base = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, prefetch=0)
    for mode in (1, 2):
        assert torch.equal(K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, prefetch=mode), base), mode
    ref = reference(q, win, comp, sel, sinks, pos0, ratio)
    assert float((base.double() - ref).norm() / ref.norm()) < 1e-5


def test_pack_keys_writes_bfloat16_then_float32_columns():
    """pack_keys: per row the first pk_dims values as bfloat16 (truncated: exact for FP8-simulated values), then the
    float32 bits of the rest; the argument checks."""
    from ds4.engine.gpu import ops
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device(DEV))
    d, pk = 512, 448
    x = ops.fp8_kv_round(torch.randn(37, d, generator=torch.Generator().manual_seed(5)).to(DEV), pk)
    got = K.pack_keys(x, pk).cpu()
    bits = x.cpu().view(torch.int32)
    want_bf16 = (bits[:, :pk] >> 16).to(torch.int16)  # the top 16 bits: the bfloat16 of an exact value
    assert torch.equal(got[:, :pk], want_bf16)
    assert torch.equal(got[:, pk:].contiguous().view(torch.int32), bits[:, pk:])
    back = (got[:, :pk].to(torch.int32) << 16).view(torch.float32)
    assert torch.equal(back, x.cpu()[:, :pk])  # the premise: FP8-simulated columns are exact in bfloat16
    out = torch.empty((37, pk + 2 * (d - pk)), dtype=torch.int16, device=DEV)
    with pytest.raises(ValueError, match="pk_dims"):
        K.ext.pack_keys(x.data_ptr(), 37, d, 12, out.data_ptr())


@pytest.mark.parametrize("T,H,d,n_comp,k_sel,pos0,ratio", [
    (40, 64, 512, 900, 512, 3000, 4),     # Flash: two CTAs of 32 heads, now with two key buffers
    (30, 16, 128, 300, 100, 900, 4),      # 16 heads
    (9, 128, 512, 700, 512, 2600, 4),     # Pro: two groups of 64 heads
    (24, 8, 512, 20, 0, 2000, 128),       # all rows, the last ones not visible
    (50, 4, 128, None, 0, 0, 0),          # window only
    (17, 20, 128, 40, 16, 100, 4),        # padded head groups
])
def test_packed_keys_give_the_same_bits(T, H, d, n_comp, k_sel, pos0, ratio):
    """Keys FP8-rounded on their first d - 64 columns: reading them from packed rows (bfloat16 there, float32 for the
    RoPE columns) gives every output bit of the float32 rows, at each heads-per-CTA form."""
    from ds4.engine.gpu import ops
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device(DEV))
    q, win, comp, sel, sinks = _case(T + 5 * H, T, H, d, 128, n_comp, k_sel, pos0, ratio)
    n_nope = d - 64
    win = ops.fp8_kv_round(win, n_nope)
    comp = None if comp is None else ops.fp8_kv_round(comp, n_nope)
    plain = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, exact_dims=n_nope, form=2)
    packed = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, exact_dims=n_nope, packed=True, form=2)
    assert torch.equal(packed, plain)
    for mode in (0, 2):  # the staged selection and the L2 prefetch forms read the packed rows alike
        assert torch.equal(K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, exact_dims=n_nope, packed=True,
                                          prefetch=mode, form=2), plain), mode


@pytest.mark.parametrize("T,H,d,n_comp,k_sel,pos0,ratio", [
    (40, 64, 512, 900, 512, 3000, 4),     # Flash: two CTAs of 32 heads
    (30, 16, 512, 300, 100, 900, 4),      # 16 heads per CTA
    (9, 128, 512, 700, 512, 2600, 4),     # Pro: two groups of 64 heads
    (24, 8, 512, 20, 0, 2000, 128),       # all rows, the last ones not visible
    (17, 20, 128, 40, 16, 100, 4),        # d = 128: form 2 falls back to form 1's loops
])
def test_straight_loops_give_the_same_bits(T, H, d, n_comp, k_sel, pos0, ratio):
    """Form 2 (v14: the inner loops split where the keys' TF32 split changes, no branch per step, each step's dependent
    products apart) against form 1 (v13's loops): every output bit, with float32 keys, FP8-rounded keys with
    exact_dims (448 of 512: the split changes inside a warp's columns) and packed keys."""
    from ds4.engine.gpu import ops
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device(DEV))
    q, win, comp, sel, sinks = _case(T + 7 * H, T, H, d, 128, n_comp, k_sel, pos0, ratio)
    for exact in (0, d - 64):
        if exact:
            win = ops.fp8_kv_round(win, exact)
            comp = None if comp is None else ops.fp8_kv_round(comp, exact)
        for packed in ((False, True) if exact else (False,)):
            old = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, exact_dims=exact, packed=packed, form=1)
            new = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, exact_dims=exact, packed=packed, form=2)
            assert torch.isfinite(new).all()
            assert torch.equal(new, old), (exact, packed)
    ref = reference(q, win, comp, sel, sinks, pos0, ratio)
    assert float((new.double() - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("T,H", [(40, 64), (3, 8)])  # norm_rope's warp kernel (2560 rows) and its block kernel (24)
def test_inverse_rope_in_the_epilogue_gives_the_same_bits(T, H):
    """The attention output's RoPE tail undone in the kernel's epilogue equals norm_rope's inverse pass on the output."""
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device(DEV))
    d, pos0, ratio = 512, 2000, 4
    q, win, comp, sel, sinks = _case(T * H, T, H, d, 128, 700, 64, pos0, ratio)
    freq = (10000.0 ** (-torch.arange(32, dtype=torch.float32) / 32)).to(DEV)
    pos = torch.arange(pos0, pos0 + T, device=DEV)
    plain = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio)
    want = K.norm_rope(plain, d, H, pos, freq=freq, rope_dim=64, inverse=True).view(T, H, d)
    got = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, inverse_rope=(freq, 64))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="out_rope_dim"):
        K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, inverse_rope=(freq, 12))


@pytest.mark.parametrize("T,H,d,scaled", [(40, 64, 512, True), (40, 64, 512, False), (70, 4, 128, True)])
def test_query_post_in_the_staging_gives_the_same_bits(T, H, d, scaled):
    """Raw q_b rows normed, rotated and rescaled as the kernel stages them (q_post) give the bits of norm_rope's
    warp kernel (256+ rows, as in prefill) followed by the attention of its output."""
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device(DEV))
    pos0, ratio = 2000, 4
    z, win, comp, sel, sinks = _case(T * H + d, T, H, d, 128, 700, 64, pos0, ratio)
    z = z * 7.0
    freq = (10000.0 ** (-torch.arange(32, dtype=torch.float32) / 32)).to(DEV)
    pos = torch.arange(pos0, pos0 + T, device=DEV)
    rs = (torch.rand(T, generator=torch.Generator().manual_seed(T)) + 0.5).to(DEV) if scaled else None
    post = dict(norm=True, eps=1e-6, freq=freq, rope_dim=64, in_scale=rs)
    q = K.norm_rope(z.reshape(T, H * d), d, H, pos, **post).view(T, H, d)
    want = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio)
    got = K.prefill_attn(z, win, comp, sel, sinks, pos0, ratio, q_post=post)
    assert torch.equal(got, want)
    assert not torch.equal(K.prefill_attn(z, win, comp, sel, sinks, pos0, ratio), want)  # it took effect


@pytest.mark.parametrize("T,H,hpg", [(40, 64, 8), (9, 20, 4), (12, 32, 16)])
def test_split_output_is_to_half_per_head_group(T, H, hpg):
    """The output written as the o_a GEMM's float16 split: per query and group of hpg heads, the bits of
    weights.to_half on that group's columns of the float32 output (the same kernel run, inverse RoPE included)."""
    from ds4.engine.gpu.fused import Fused
    from ds4.engine.gpu.weights import to_half

    K = Fused(gpu.load(), torch.device(DEV))
    d, pos0, ratio = 128, 500, 4
    q, win, comp, sel, sinks = _case(T + H + hpg, T, H, d, 128, 60, 16, pos0, ratio)
    freq = (10000.0 ** (-torch.arange(32, dtype=torch.float32) / 32)).to(DEV)
    inv = (freq, 64)
    y = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, inverse_rope=inv)
    hi, lo, s = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, inverse_rope=inv, split_heads=hpg)
    G = H // hpg
    want_hi, want_lo, want_s = to_half(y.reshape(T, G, hpg * d), True)
    assert torch.equal(s, want_s.reshape(T, G))
    assert torch.equal(hi, want_hi.reshape(T, H * d)) and torch.equal(lo, want_lo.reshape(T, H * d))
    with pytest.raises(ValueError, match="split output"):
        K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, inverse_rope=inv, split_heads=3)


def test_exact_keys_in_the_session(monkeypatch, tmp_path):
    """`small` with the rounding simulations on (FP8 KV): every position's logits with DS4_GPU_ATTN_EXACT_KEYS, then
    also DS4_GPU_ATTN_OUT_ROPE, then also DS4_GPU_ATTN_PACKED, are the bits of the full form."""
    from conftest import quantize_cli

    from ds4.engine.gpu import fused, prefill
    from ds4.engine.gpu.session import Session as GpuSession
    from ds4.engine.model import Model

    quantize_cli("synth", "--preset", "small", "--gguf", str(tmp_path / "small.gguf"), "--mix", "q2", "--quiet")
    m = Model.load(tmp_path / "small.gguf")
    assert m.config.fp8_kv
    toks = np.random.default_rng(13).integers(2, m.config.vocab_size, 600).tolist()
    monkeypatch.setattr(fused, "ATTN_FORM", "2")  # the TF32 forms' bits (form 3 has its own session test)
    monkeypatch.setattr(prefill, "FUSED_ATTN", True)
    monkeypatch.setattr(prefill, "ATTN_EXACT_KEYS", False)
    monkeypatch.setattr(prefill, "ATTN_OUT_ROPE", False)
    monkeypatch.setattr(prefill, "ATTN_OUT_SPLIT", False)  # per-group split scales: other bits (its own tests)
    want = GpuSession(m, ctx=1024, prefill_chunk=256).prefill(toks, all_logits=True)
    monkeypatch.setattr(prefill, "ATTN_EXACT_KEYS", True)
    g = GpuSession(m, ctx=1024, prefill_chunk=256)
    calls = []  # (exact_dims, inverse_rope given) of each fused launch
    real = type(g.K).prefill_attn
    monkeypatch.setattr(type(g.K), "prefill_attn",
                        lambda self, *a, **kw: calls.append((a[7], a[8] is not None)) or real(self, *a, **kw))
    got = g.prefill(toks, all_logits=True)
    assert calls and all(ex == m.config.n_nope and not inv for ex, inv in calls)
    assert np.array_equal(got, want)
    monkeypatch.setattr(prefill, "ATTN_OUT_ROPE", True)  # and the output's inverse RoPE in the kernel: the same bits
    calls.clear()
    both = GpuSession(m, ctx=1024, prefill_chunk=256).prefill(toks, all_logits=True)
    assert calls and all(inv for _, inv in calls)
    assert np.array_equal(both, want)
    monkeypatch.setattr(prefill, "ATTN_PACKED", True)  # and the keys from packed rows (DS4_GPU_ATTN_PACKED): the same bits
    packed = GpuSession(m, ctx=1024, prefill_chunk=256).prefill(toks, all_logits=True)
    assert np.array_equal(packed, want)


def test_prefill_attention_kernel_declines_odd_head_dims():
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device(DEV))
    q, win, comp, sel, sinks = _case(1, 4, 4, 96, 128, None, 0, 0, 0)
    assert K.prefill_attn(q, win, comp, sel, sinks, 0, 0) is None


def _small_f32_prefill(tmp_path, monkeypatch):
    """(model `small` without the rounding simulations, 600 tokens, every position's logits with the torch float32
    products). The torch form stays on for the rest of the test (the fused kernel is the default form), and the routed
    experts take the float16 hi/lo GEMMs: on mmq (the default) the activations are rounded to the decode kernels' 15
    bits, which turns float32-level attention differences into occasional flips of a near-tied expert choice (v11:
    2.1e-3 over all 600 positions), and this test is about the attention forms."""
    from conftest import quantize_cli

    from ds4.engine.gpu import moe_gemm, prefill
    from ds4.engine.gpu.session import Session as GpuSession

    monkeypatch.setattr(prefill, "FUSED_ATTN", False)
    monkeypatch.setattr(moe_gemm, "MOE_GEMM", "buckets")
    from ds4.engine.model import Model

    quantize_cli("synth", "--preset", "small", "--gguf", str(tmp_path / "small.gguf"), "--mix", "q2", "--quiet")
    m = Model.load(tmp_path / "small.gguf").with_numerics(fp8_kv=False, indexer_qat=False)
    toks = np.random.default_rng(9).integers(2, m.config.vocab_size, 600).tolist()
    ref = GpuSession(m, ctx=1024, prefill_chunk=256)
    ref.tf32_attn = False
    return m, toks, ref.prefill(toks, all_logits=True)


def test_fused_prefill_attention_in_the_session(monkeypatch, tmp_path):
    """small, 600 tokens in chunks of 256: past the window, the indexer's top-k and the ratio-128 rows."""
    from ds4.engine.gpu import prefill
    from ds4.engine.gpu.session import Session as GpuSession

    m, toks, want = _small_f32_prefill(tmp_path, monkeypatch)
    calls = []
    monkeypatch.setattr(prefill, "FUSED_ATTN", True)
    g = GpuSession(m, ctx=1024, prefill_chunk=256)
    real = type(g.K).prefill_attn
    monkeypatch.setattr(type(g.K), "prefill_attn", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    got = g.prefill(toks, all_logits=True)
    assert calls, "the fused kernel did not run"
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert err < 1e-3, f"rel err {err:.2e}"


def test_tf32_products_stay_near_float32_in_the_session(tmp_path, monkeypatch):
    """TF32 attention and indexer products against float32 ones on `small` (600 tokens: the indexer's top-k and the
    ratio-128 rows run): the median position within the engine's 1e-3, and not the same bits (the switch took
    effect). Not every position: a near-tied expert choice may flip (v10: 4.6e-3 over all positions)."""
    from ds4.engine.gpu import tc
    from ds4.engine.gpu.session import Session as GpuSession

    m, toks, want = _small_f32_prefill(tmp_path, monkeypatch)
    tf = GpuSession(m, ctx=1024, prefill_chunk=256)
    assert tf.tf32_attn == (tc.ATTN_MODE == "tf32")
    tf.tf32_attn = True
    got = tf.prefill(toks, all_logits=True)
    per = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    print(f"\ntf32 against f32 prefill products: median position rel {np.median(per):.2e}, worst {per.max():.2e}")
    assert 0 < np.median(per) < 1e-3, f"median rel err {np.median(per):.2e}"


def _fp8_case(seed, T, H, n_comp, k_sel, pos0, ratio, d=512):
    from ds4.engine.gpu import ops

    q, win, comp, sel, sinks = _case(seed, T, H, d, 128, n_comp, k_sel, pos0, ratio)
    n_nope = d - 64
    win = ops.fp8_kv_round(win, n_nope)
    comp = None if comp is None else ops.fp8_kv_round(comp, n_nope)
    return q, win, comp, sel, sinks, n_nope


def test_pack_keys_split_tail_writes_bfloat16_hi_and_lo():
    """pack_keys(split_tail=True), form 3's rows: the first pk_dims values as bfloat16 by truncation, then the other
    columns as bfloat16 hi (rounded to nearest even, as torch rounds) and lo = x - hi (rounded); the same row size."""
    from ds4.engine.gpu import ops
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device(DEV))
    d, pk = 512, 448
    x = ops.fp8_kv_round(torch.randn(37, d, generator=torch.Generator().manual_seed(6)).to(DEV), pk)
    got = K.pack_keys(x, pk, split_tail=True).cpu()
    assert got.shape == (37, pk + 2 * (d - pk))
    assert torch.equal(got[:, :pk], (x.cpu().view(torch.int32)[:, :pk] >> 16).to(torch.int16))
    tail = x.cpu()[:, pk:]
    hi = tail.to(torch.bfloat16)
    lo = (tail - hi.float()).to(torch.bfloat16)
    assert torch.equal(got[:, pk:d], hi.view(torch.int16)) and torch.equal(got[:, d:], lo.view(torch.int16))
    assert float(((hi.float() + lo.float()) - tail).abs().max() / tail.abs().max()) < 2 ** -16


@pytest.mark.parametrize("T,H,n_comp,k_sel,pos0,ratio", [
    (40, 64, 900, 512, 3000, 4),     # Flash: top-k rows, some not visible yet
    (9, 128, 700, 512, 2600, 4),     # Pro: four CTAs of 32 heads per query
    (24, 8, 20, 0, 2000, 128),       # small: 8 heads in a CTA of 32, all rows, the last ones not visible
    (50, 20, None, 0, 0, 0),         # window only from position 0, padded heads
])
def test_bf16_form_matches_the_float64_reference(T, H, n_comp, k_sel, pos0, ratio):
    """Form 3 (DS4_GPU_ATTN_FORM=3, attn_prefill_bf16.cu): the FP8-simulated key columns' products on the bfloat16
    tensor cores with the queries and weights split as bfloat16 hi + lo. Within 1e-5 of the float64 reference like the
    TF32 forms, within float32 rounding of form 2, and not form 2's bits (it ran)."""
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device(DEV))
    q, win, comp, sel, sinks, n_nope = _fp8_case(T + 11 * H, T, H, n_comp, k_sel, pos0, ratio)
    if sel is not None:  # invalid entries too: negative, past the rows, not yet visible
        sel[0, :3] = torch.tensor([-1, n_comp, n_comp - 1], device=DEV)
    ref = reference(q, win, comp, sel, sinks, pos0, ratio)
    two = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, exact_dims=n_nope, packed=True, form=2)
    three = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, exact_dims=n_nope, form=3)
    assert torch.isfinite(three).all()
    err3 = float((three.double() - ref).norm() / ref.norm())
    err2 = float((two.double() - ref).norm() / ref.norm())
    print(f"\nform 3 rel err {err3:.2e}, form 2 {err2:.2e}")
    assert err3 < 1e-5, f"rel err {err3:.2e}"
    assert float((three - two).norm() / two.norm()) < 5e-6
    assert not torch.equal(three, two)
    for mode in (0, 2):  # without the staged selection, and with prefetch 2 (as 1 in form 3): the same bits
        assert torch.equal(K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, exact_dims=n_nope, form=3,
                                          prefetch=mode), three), mode
    K.ext.set_attn_tma(0)  # the key tiles by cp.async pieces instead of bulk copies (DS4_GPU_ATTN_TMA=0): the same bits
    try:
        assert torch.equal(K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, exact_dims=n_nope, form=3), three)
    finally:
        K.ext.set_attn_tma(-1)


def test_bf16_form_falls_back_to_form_2_where_it_does_not_take_the_shapes():
    """Form 3 asked for with float32 keys (no exact columns) or another head size: form 2's bits."""
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device(DEV))
    q, win, comp, sel, sinks = _case(3, 30, 16, 512, 128, 300, 100, 900, 4)
    assert torch.equal(K.prefill_attn(q, win, comp, sel, sinks, 900, 4, form=3),
                       K.prefill_attn(q, win, comp, sel, sinks, 900, 4, form=2))
    q, win, comp, sel, sinks, n_nope = _fp8_case(4, 17, 20, 40, 16, 100, 4, d=128)
    assert torch.equal(K.prefill_attn(q, win, comp, sel, sinks, 100, 4, exact_dims=n_nope, form=3),
                       K.prefill_attn(q, win, comp, sel, sinks, 100, 4, exact_dims=n_nope, packed=True, form=2))


def test_bf16_form_with_query_post_inverse_rope_and_split_output():
    """Form 3 with the session's options (raw q_b rows post-processed as staged, the output's RoPE tail undone, the
    output as the o_a GEMM's float16 split per 8 heads): within float32 rounding of form 2 with the same options,
    and the split is to_half of form 3's own float32 output."""
    from ds4.engine.gpu.fused import Fused
    from ds4.engine.gpu.weights import to_half

    K = Fused(gpu.load(), torch.device(DEV))
    T, H, pos0, ratio = 33, 64, 2000, 4
    z, win, comp, sel, sinks, n_nope = _fp8_case(77, T, H, 700, 64, pos0, ratio)
    z = z * 7.0
    freq = (10000.0 ** (-torch.arange(32, dtype=torch.float32) / 32)).to(DEV)
    rs = (torch.rand(T, generator=torch.Generator().manual_seed(T)) + 0.5).to(DEV)
    kw = dict(exact_dims=n_nope, inverse_rope=(freq, 64), q_post=dict(norm=True, eps=1e-6, freq=freq, rope_dim=64,
                                                                       in_scale=rs))
    two = K.prefill_attn(z, win, comp, sel, sinks, pos0, ratio, packed=True, form=2, **kw)
    three = K.prefill_attn(z, win, comp, sel, sinks, pos0, ratio, form=3, **kw)
    assert float((three - two).norm() / two.norm()) < 5e-6 and not torch.equal(three, two)
    hi, lo, s = K.prefill_attn(z, win, comp, sel, sinks, pos0, ratio, form=3, split_heads=8, **kw)
    want_hi, want_lo, want_s = to_half(three.reshape(T, H // 8, 8 * 512), True)
    assert torch.equal(s, want_s.reshape(T, H // 8))
    assert torch.equal(hi, want_hi.reshape(T, H * 512)) and torch.equal(lo, want_lo.reshape(T, H * 512))


@pytest.mark.parametrize("T,H,post", [(33, 64, True), (9, 20, True), (12, 64, False)])
def test_bf16_form_query_rows_in_registers_give_the_same_bits(T, H, post):
    """DS4_GPU_ATTN_QREGS=1: form 3's query rows staged by whole rows per warp in registers, q_post applied there,
    against the float32 stage in shared memory: every output bit (with the session's options; 20 heads: rows past H in
    the CTA's 32; without q_post: the plain staging)."""
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device(DEV))
    pos0, ratio = 2000, 4
    z, win, comp, sel, sinks, n_nope = _fp8_case(31 + T, T, H, 700, 64, pos0, ratio)
    z = z * 7.0
    freq = (10000.0 ** (-torch.arange(32, dtype=torch.float32) / 32)).to(DEV)
    rs = (torch.rand(T, generator=torch.Generator().manual_seed(T)) + 0.5).to(DEV)
    kw = dict(exact_dims=n_nope, form=3)
    if post:
        kw.update(inverse_rope=(freq, 64), q_post=dict(norm=True, eps=1e-6, freq=freq, rope_dim=64, in_scale=rs))

    def run(mode: int):
        K.ext.set_attn_qregs(mode)
        try:
            out = K.prefill_attn(z, win, comp, sel, sinks, pos0, ratio, **kw)
            split = K.prefill_attn(z, win, comp, sel, sinks, pos0, ratio, split_heads=4, **kw) if post else ()
            return out, split
        finally:
            K.ext.set_attn_qregs(-1)

    (old, old_split), (new, new_split) = run(0), run(1)
    assert torch.isfinite(new).all()
    assert torch.equal(new, old)
    for a, b in zip(new_split, old_split):
        assert torch.equal(a, b)


@pytest.mark.parametrize("T,H,hpg,fp8", [(33, 64, 8, True), (33, 64, 8, False), (9, 20, 4, True), (12, 32, 16, False)])
def test_bf16_form_staged_split_output_gives_the_same_bits(T, H, hpg, fp8):
    """DS4_GPU_ATTN_OSTAGE=1: form 3's output staged in shared memory as float32 rows, then split and written in whole
    runs of 8 columns by one rolled loop (v41; v27-v40 staged the split itself), against the split stored from the
    fragments: every bit of hi, lo / the operand and the scales (with q_post and the inverse RoPE; 20 heads: rows past
    H in the CTA's 32)."""
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device(DEV))
    pos0, ratio = 2000, 4
    z, win, comp, sel, sinks, n_nope = _fp8_case(57 + T + H, T, H, 700, 64, pos0, ratio)
    z = z * 7.0
    freq = (10000.0 ** (-torch.arange(32, dtype=torch.float32) / 32)).to(DEV)
    kw = dict(exact_dims=n_nope, form=3, inverse_rope=(freq, 64), split_heads=hpg, split_fp8=fp8,
              q_post=dict(norm=True, eps=1e-6, freq=freq, rope_dim=64))

    def run(mode: int):
        K.ext.set_attn_ostage(mode)
        try:
            return K.prefill_attn(z, win, comp, sel, sinks, pos0, ratio, **kw)
        finally:
            K.ext.set_attn_ostage(-1)

    old, new = run(0), run(1)
    assert len(new) == len(old) == (4 if fp8 else 3)
    for a, b in zip(new, old):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_bf16_form_in_the_session(monkeypatch, tmp_path):
    """`small` (FP8 KV on), 600 tokens in chunks of 256 (the window, the top-k and the ratio-128 rows): every
    position's logits with form 3 against form 2. The FP8 KV simulation amplifies last-bit differences (a key near an
    e4m3 rounding boundary lands on the other side: a 1/8 step), so the bar is the sims' bar of
    test_gpu_session_cuda (median 2e-2; call 2 of v25: median 2.0e-3, worst 8.2e-2), and the forms must differ."""
    from conftest import quantize_cli

    from ds4.engine.gpu import fused
    from ds4.engine.gpu.session import Session as GpuSession
    from ds4.engine.model import Model

    quantize_cli("synth", "--preset", "small", "--gguf", str(tmp_path / "small.gguf"), "--mix", "q2", "--quiet")
    m = Model.load(tmp_path / "small.gguf")
    assert m.config.fp8_kv
    toks = np.random.default_rng(17).integers(2, m.config.vocab_size, 600).tolist()
    monkeypatch.setattr(fused, "ATTN_FORM", "2")
    want = GpuSession(m, ctx=1024, prefill_chunk=256).prefill(toks, all_logits=True)
    monkeypatch.setattr(fused, "ATTN_FORM", "3")
    got = GpuSession(m, ctx=1024, prefill_chunk=256).prefill(toks, all_logits=True)
    per = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    print(f"\nform 3 against form 2 in the session: median position rel {np.median(per):.2e}, worst {per.max():.2e}")
    assert 0 < np.median(per) < 2e-2, f"median rel err {np.median(per):.2e}"


@pytest.mark.parametrize("form", [2, 3])
def test_split_output_as_the_float8_operand(form):
    """split_fp8: the kernel writes fp8_split's float8 operand [groups, T, 2 K] in place of lo: bit for bit
    fp8_split.pack_x of each head group's (hi, lo) from the same launch with lo, and the same hi and s (form 2 on
    d = 128 heads, form 3 on the model's d = 512 with FP8-rounded keys)."""
    from ds4.engine.gpu import fp8_split
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device(DEV))
    hpg, pos0, ratio = 8, 2000, 4
    if form == 2:
        T, H, d = 24, 32, 128
        q, win, comp, sel, sinks = _case(90, T, H, d, 128, 60, 16, pos0, ratio)
        kw = {}
    else:
        T, H, d = 20, 64, 512
        q, win, comp, sel, sinks, n_nope = _fp8_case(91, T, H, 300, 64, pos0, ratio)
        kw = dict(exact_dims=n_nope)
    freq = (10000.0 ** (-torch.arange(32, dtype=torch.float32) / 32)).to(DEV)
    kw.update(inverse_rope=(freq, 64), form=form, split_heads=hpg)
    hi, lo, s = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, **kw)
    hi8, none, s8, a8 = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, split_fp8=True, **kw)
    G = H // hpg
    assert none is None and a8.shape == (G, T, 2 * hpg * d) and a8.dtype == torch.float8_e4m3fn
    assert torch.equal(hi8, hi) and torch.equal(s8, s)
    grouped = lambda t: t.view(T, G, hpg * d).transpose(0, 1)  # noqa: E731
    want = fp8_split.pack_x(grouped(hi), grouped(lo))
    assert torch.equal(a8.view(torch.uint8), want.view(torch.uint8))
