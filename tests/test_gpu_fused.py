"""The fused layer kernels (ds4.engine.gpu.fused / fused.cu, hc.cu) against the torch ops they replace.

Every kernel gets fresh random input on the GPU; the reference is the torch code of the session's
unfused path (ds4.engine.gpu.ops and the formulas of session.py) in float64 where it is plain
arithmetic. FP8/FP4 simulations are discontinuous, so those checks allow a few flipped codes.
Skipped without a CUDA device and the built extension (the top-k's kernel and numpy model: test_gpu_topk.py).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from ds4.engine.gpu import ops  # noqa: E402

DEV = "cuda"


@pytest.fixture(scope="module")
def K(fused_kernels):
    return fused_kernels


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def rnd(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).float().to(DEV)


def check_hc_pre(Xd, Wf, scale, base, nw, head, out, post, comb) -> None:
    """The mHC pre's outputs of streams Xd [T, n, D] (float64) against the float64 ops: out, and post / comb unless
    head (20 Sinkhorn iterations, eps 1e-6 everywhere)."""
    T, n, D = Xd.shape
    mix = ops.rms_norm(Xd.reshape(T, n * D), None, 1e-6) @ Wf.double().T
    if head:
        pre = torch.sigmoid(mix * scale.double()[0] + base.double()) + 1e-6
    else:
        pre, post_r, comb_r = ops.hc_weights(mix, scale.double(), base.double(), n, 20, 1e-6)
        assert rel(post, post_r) < 1e-5 and rel(comb, comb_r) < 1e-5
    assert rel(out, ops.rms_norm(ops.stream_sum(pre, Xd), nw.double(), 1e-6)) < 1e-5


def freq_table(rope_dim, base=10000.0):
    return (1.0 / base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)).float().to(DEV)


def test_rms_norm(K):
    g = torch.Generator().manual_seed(0)
    x, w = rnd(g, 5, 4096, scale=3.0), rnd(g, 4096)
    assert rel(K.rms_norm(x, w, 1e-6), ops.rms_norm(x.double(), w.double(), 1e-6)) < 1e-6
    assert rel(K.rms_norm(x, None, 1e-6), ops.rms_norm(x.double(), None, 1e-6)) < 1e-6


# T = 1 and 3: one launch (the last mix block of a token finishes it; run twice, so the per-token count
# must have been reset); 3 at D = 6144: the two-launch path (D too wide for it); 70 and 300: the mix as one GEMM,
# then the rows kernel (the norm from the rows it holds; D = 4480 fills its registers), at 6144 the v14 pass 2.
@pytest.mark.parametrize("T,D", [(1, 4096), (3, 1024), (3, 6144), (70, 512), (300, 4096), (70, 4480), (70, 6144)])
@pytest.mark.parametrize("head", [False, True])
def test_hc_pre(K, head, T, D):
    g = torch.Generator().manual_seed(1)
    n = 4
    M = n if head else (2 + n) * n
    X, Wf = rnd(g, T, n, D), rnd(g, M, n * D, scale=0.02)
    scale, base, nw = rnd(g, 3) if not head else rnd(g, 1), rnd(g, M, scale=0.5), rnd(g, D)
    for _ in range(2):
        out, post, comb = K.hc_pre(X, Wf, scale, base, nw, 20, 1e-6, 1e-6, head=head)
    check_hc_pre(X.double(), Wf, scale, base, nw, head, out, post, comb)


def fewest_wave_splits(T: int, K_cols: int, sms: int, max_splits: int = 8) -> int:
    """hc_mix.cu's column slices by the rule its comment states (one CTA per SM, 64-row blocks, 128-column stages):
    the power of two S of the fewest stage rounds per SM, ceil(blocks S / SMs) x stages / S, ties to the smaller S."""
    blocks, stages = -(-T // 64), K_cols // 128
    best, S, s = -(-blocks // sms) * stages, 1, 2
    while s <= max_splits and stages % s == 0:
        cost = -(-(blocks * s) // sms) * (stages // s)
        if cost < best:
            best, S = cost, s
        s *= 2
    return S


def test_hc_mix_splits_fill_the_waves(K):
    """DS4_GPU_HC_SPLIT_WAVES: 1 (default) the fewest stage waves, 0 the v30 rule (S doubles while 2 S blocks fit one
    wave). A 6144-row chunk (96 blocks on 132 SMs) ran one wave on 96 SMs under the v30 rule; under the default it is
    cut in 4. At 2048, 4096 and 8192 rows both rules agree."""
    sms = K.ext.device_info()["sms"]
    try:
        K.ext.set_hc_split_waves(0)
        old = {T: K.ext.hc_mix_rows_splits(T, 16384) for T in (2048, 4096, 6144, 8192)}
        K.ext.set_hc_split_waves(1)
        new = {T: K.ext.hc_mix_rows_splits(T, 16384) for T in (2048, 4096, 6144, 8192)}
    finally:
        K.ext.set_hc_split_waves(-1)
    for T in old:
        blocks, S = -(-T // 64), 1
        while S < 8 and blocks * 2 * S <= sms:
            S *= 2
        assert old[T] == S
        assert new[T] == fewest_wave_splits(T, 16384, sms)
    if sms == 132:  # the H200
        assert (old[6144], new[6144]) == (1, 4)
        assert all(old[T] == new[T] for T in (2048, 4096, 8192))


@pytest.mark.parametrize("ptrs", [0, 1])
@pytest.mark.parametrize("T,K_cols,M", [(1, 128, 24), (70, 16384, 24), (200, 4096, 4), (64, 1024, 17),
                                         (9000, 256, 24)])
def test_hc_mix_rows_matches_float64(K, T, K_cols, M, ptrs):
    """hc_mix_rows (DS4_GPU_HC_MIX): the mHC's mix of prefill rows, X [T, K] . Wf [M, K]^T in float32, within 1e-6 of
    the float64 product relative to sum |x w| per output (one row, partial row tiles, the head's 4 outputs, an M that
    leaves part of a thread's outputs unused; column slices with their scratch where few row blocks would leave SMs
    idle, two at 9000 rows of two stages (141 row blocks: 3 waves of one stage against 2 of two); slices of one and
    two stages included), with the loads from per-thread pointers or per
    element (DS4_GPU_HC_MIX_PTRS), both with the same bits; a launch that needs a scratch and has none is refused;
    and in hc_pre (the rows form) under the switch, the float64 ops' bars."""
    from ds4.engine.gpu import fused

    g = torch.Generator().manual_seed(T + M)
    X, Wf = rnd(g, T, K_cols, scale=2.0), rnd(g, M, K_cols, scale=0.02)
    out = torch.full((T, M), float("nan"), device=DEV)
    S = K.ext.hc_mix_rows_splits(T, K_cols)
    assert S == fewest_wave_splits(T, K_cols, K.ext.device_info()["sms"])
    scratch = torch.full((S, T, M), float("nan"), device=DEV)
    other = torch.full_like(out, float("nan"))
    try:
        for mode, dst in ((ptrs, out), (1 - ptrs, other)):
            K.ext.set_hc_mix_ptrs(mode)
            K.ext.hc_mix_rows(X.data_ptr(), Wf.data_ptr(), T, K_cols, M, dst.data_ptr(), scratch.data_ptr())
        torch.cuda.synchronize()
    finally:
        K.ext.set_hc_mix_ptrs(-1)
    assert torch.equal(out, other)  # the loads' addressing (DS4_GPU_HC_MIX_PTRS) moves loads, not sums
    ref = X.double() @ Wf.double().T
    mag = X.double().abs() @ Wf.double().abs().T
    assert torch.isfinite(out).all()
    assert float(((out.double() - ref).abs() / mag).max()) < 1e-6
    with pytest.raises(ValueError, match="hc_mix_rows"):
        K.ext.hc_mix_rows(X.data_ptr(), Wf.data_ptr(), T, 100, M, out.data_ptr(), scratch.data_ptr())
    if S > 1:
        with pytest.raises(ValueError, match="scratch"):
            K.ext.hc_mix_rows(X.data_ptr(), Wf.data_ptr(), T, K_cols, M, out.data_ptr())
    if K_cols == 16384 and M == 24:  # the session's shape: hc_pre's rows form with the kernel's mix
        n, D = 4, 4096
        Xs = X.reshape(T, n, D)
        scale, base, nw = rnd(g, 3), rnd(g, M, scale=0.5), rnd(g, D)
        saved = fused.HC_MIX
        fused.HC_MIX = True
        try:
            outs = K.hc_pre(Xs, Wf, scale, base, nw, 20, 1e-6, 1e-6)
        finally:
            fused.HC_MIX = saved
        check_hc_pre(Xs.double(), Wf, scale, base, nw, False, *outs)


@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("with_y2,D", [(False, 4096), (True, 4096), (True, 1000)])  # 1000: a partial last mix block
def test_hc_post_pre(K, head, with_y2, D):
    """hc_post then the next hc_pre in one launch: X' as hc_post computes it, the pre outputs as the float64 ops."""
    g = torch.Generator().manual_seed(2)
    T, n = 2, 4
    M = n if head else (2 + n) * n
    X, y1 = rnd(g, T, n, D), rnd(g, T, D)
    y2 = rnd(g, T, D) if with_y2 else None
    post_in, comb_in = rnd(g, T, n), rnd(g, T, n, n, scale=0.5)
    Wf = rnd(g, M, n * D, scale=0.02)
    scale, base, nw = rnd(g, 3) if not head else rnd(g, 1), rnd(g, M, scale=0.5), rnd(g, D)
    for _ in range(2):  # twice: the per-token count of the last block must be reset
        Xn, out, post, comb = K.hc_post_pre(X, y1, y2, post_in, comb_in, Wf, scale, base, nw, 20, 1e-6, 1e-6, head=head)
    assert rel(Xn, K.hc_post(X, y1, y2, post_in, comb_in)) < 1e-7
    Xd = ops.hc_post(X.double(), y1.double() if y2 is None else y1.double() + y2.double(), post_in.double(),
                     comb_in.double())
    assert rel(Xn, Xd) < 1e-6
    check_hc_pre(Xd, Wf, scale, base, nw, head, out, post, comb)


@pytest.mark.parametrize("logit_scale", [0.5, 8.0])  # 8: near one-hot rows, sums far from 1
def test_sinkhorn_by_reciprocals_gives_the_same_bits(K, logit_scale):
    """DS4_GPU_HC_RCP (ext.set_hc_rcp): Sinkhorn's fast divisions as rcp.approx and multiplies in the one-launch
    mHC kernel and the prefill rows kernel: the same comb, post and out, bit for bit (div.approx.f32 is that product
    for normal divisors)."""
    g = torch.Generator().manual_seed(5)
    T, n, D = 3, 4, 4096
    M = (2 + n) * n
    X, y1 = rnd(g, T, n, D), rnd(g, T, D)
    post_in, comb_in = rnd(g, T, n), rnd(g, T, n, n, scale=0.5)
    Wf = rnd(g, M, n * D, scale=0.02)
    scale, base, nw = rnd(g, 3).abs() * logit_scale, rnd(g, M, scale=0.5), rnd(g, D)
    Xr = rnd(g, 64, n, D)  # prefill rows: hc_pre's rows kernel from DS4_GPU_HC_GEMM_MIN (64) rows
    runs = []
    for mode in (0, 1):
        K.ext.set_hc_rcp(mode)
        try:
            one = K.hc_post_pre(X, y1, None, post_in, comb_in, Wf, scale, base, nw, 20, 1e-6, 1e-6)
            rows = K.hc_pre(Xr, Wf, scale, base, nw, 20, 1e-6, 1e-6)
            torch.cuda.synchronize()
            runs.append([t.clone() for t in (*one, *rows)])
        finally:
            K.ext.set_hc_rcp(-1)
    for a, b in zip(*runs):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_deferred_sinkhorn_gives_the_same_bits(K):
    """hc_post_pre(..., logits=) writes comb's logits instead of comb, and sinkhorn() makes comb from them: the one-launch
    kernel's Sinkhorn on the same logits, so the same comb (and X', out, post) bit for bit, under both division forms."""
    g = torch.Generator().manual_seed(9)
    T, n, D = 2, 4, 4096
    M = (2 + n) * n
    X, y1, y2 = rnd(g, T, n, D), rnd(g, T, D), rnd(g, T, D)
    post_in, comb_in = rnd(g, T, n), rnd(g, T, n, n, scale=0.5)
    Wf = rnd(g, M, n * D, scale=0.02)
    scale, base, nw = rnd(g, 3), rnd(g, M, scale=0.5), rnd(g, D)
    for rcp, cluster in ((0, 0), (1, 0), (0, 1), (1, 1)):  # both division forms, both mHC kernels
        K.ext.set_hc_rcp(rcp)
        K.ext.set_hc_cluster(cluster)
        try:
            want = K.hc_post_pre(X, y1, y2, post_in, comb_in, Wf, scale, base, nw, 20, 1e-6, 1e-6)
            logits = torch.empty((T, 16), dtype=torch.float32, device=DEV)
            got = K.hc_post_pre(X, y1, y2, post_in, comb_in, Wf, scale, base, nw, 20, 1e-6, 1e-6, logits=logits)
            K.sinkhorn(logits, 20, 1e-6, got[3])
            torch.cuda.synchronize()
        finally:
            K.ext.set_hc_rcp(-1)
            K.ext.set_hc_cluster(-1)
        for a, b in zip(want, got):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"rcp={rcp} cluster={cluster}"
    with pytest.raises(ValueError, match="float32"):
        K.sinkhorn(torch.empty((T, 8), device=DEV), 20, 1e-6, got[3])


def test_hc_post_pre_refuses_in_place(K):
    g = torch.Generator().manual_seed(12)
    T, n, D = 1, 4, 1024
    X, y1, post_in, comb_in = rnd(g, T, n, D), rnd(g, T, D), rnd(g, T, n), rnd(g, T, n, n)
    Wf, scale, base = rnd(g, 24, n * D, scale=0.02), rnd(g, 3), rnd(g, 24)
    part = torch.empty((T, K.ext.hc_parts(n, D), 25), device=DEV)
    out, post, comb = torch.empty(T, D, device=DEV), torch.empty(T, n, device=DEV), torch.empty(T, n, n, device=DEV)
    with pytest.raises(ValueError, match="overlap"):
        K.ext.hc_post_pre(X.data_ptr(), y1.data_ptr(), 0, post_in.data_ptr(), comb_in.data_ptr(), X.data_ptr(),
                          Wf.data_ptr(), part.data_ptr(), scale.data_ptr(), base.data_ptr(), 0, T, n, D, 20, 1e-6,
                          1e-6, False, out.data_ptr(), post.data_ptr(), comb.data_ptr())


def misaligned(t):
    """A copy of t whose data does not start on a 16-byte boundary (the kernels' generic, unvectorized paths)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    v = buf[1:].view(t.shape)
    v.copy_(t)
    assert v.data_ptr() % 16 != 0
    return v


def test_hc_post(K):
    g = torch.Generator().manual_seed(2)
    T, n, D = 2, 4, 1000
    X, y1, y2, post, comb = rnd(g, T, n, D), rnd(g, T, D), rnd(g, T, D), rnd(g, T, n), rnd(g, T, n, n)
    ref = ops.hc_post(X.double(), (y1 + y2).double(), post.double(), comb.double())
    assert rel(K.hc_post(X, y1, y2, post, comb), ref) < 1e-6
    assert rel(K.hc_post(X, y1, None, post, comb), ops.hc_post(X.double(), y1.double(), post.double(), comb.double())) < 1e-6


def test_hc_post_four_stream_kernel_gives_the_generic_kernels_bits(K):
    """n = 4 with 16-byte aligned rows takes hc_post4_kernel (float4 columns, comb and post in registers); a
    misaligned copy of the same values takes the generic kernel: the bits must agree (prefill and decode share them)."""
    g = torch.Generator().manual_seed(12)
    T, n, D = 5, 4, 1000
    X, y1, y2, post, comb = rnd(g, T, n, D), rnd(g, T, D), rnd(g, T, D), rnd(g, T, n), rnd(g, T, n, n)

    for y2_ in (y2, None):
        fast = K.hc_post(X, y1, y2_, post, comb)
        generic = K.hc_post(misaligned(X), misaligned(y1), y2_, post, comb)
        assert torch.equal(fast, generic)
        ref = ops.hc_post(X.double(), (y1 if y2_ is None else y1 + y2_).double(), post.double(), comb.double())
        assert rel(fast, ref) < 1e-6


def test_hc_post_applies_the_row_scales_of_unscaled_products(K):
    """DS4_GPU_FOLD_POST: y1, y2 handed over as ops.Unscaled (z, r) give the bits of hc_post on z * r, in the four-stream
    kernel and the generic one (misaligned rows), with one or both summands unscaled; a wrong scale count is refused."""
    g = torch.Generator().manual_seed(21)
    T, n, D = 6, 4, 1024
    X, z1, z2, post, comb = rnd(g, T, n, D), rnd(g, T, D), rnd(g, T, D), rnd(g, T, n), rnd(g, T, n, n)
    r1, r2 = rnd(g, T, 1).abs() + 0.5, rnd(g, T, 1).abs() * 3.0
    u1, u2 = ops.Unscaled(z1, r1), ops.Unscaled(z2, r2)

    for y1, y2 in ((u1, u2), (z1, u2), (u1, None)):
        want = K.hc_post(X, ops.scaled(y1), ops.scaled(y2), post, comb)
        assert torch.equal(K.hc_post(X, y1, y2, post, comb), want)
        mis = [ops.Unscaled(misaligned(y.z), y.r) if isinstance(y, ops.Unscaled) else
               (None if y is None else misaligned(y)) for y in (y1, y2)]
        assert torch.equal(K.hc_post(misaligned(X), *mis, post, comb), want)
    with pytest.raises(ValueError, match="row scales"):
        K.hc_post(X, ops.Unscaled(z1, r1[:-1]), None, post, comb)


@pytest.mark.parametrize("T,D,M", [(70, 4096, 24), (2048, 4096, 24), (6144, 4096, 24), (9000, 256, 24),
                                   (130, 1024, 17)])
@pytest.mark.parametrize("form", ["tensors", "unscaled", "one_y"])
def test_hc_post_mix_gives_hc_posts_bits_and_the_mix(K, T, D, M, form):
    """hc_post_mix (DS4_GPU_HC_POST_MIX): X' bit for bit hc_post's (four-stream kernel) on tensors, ops.Unscaled products
    or one summand, and the mix of X' within 1e-6 of the float64 product relative to sum |x w| (partial row tiles, column
    slices with their scratch, four at 6144 rows, an M leaving outputs unused); then hc_post_pre under the switch gives
    the two-launch form's X' bits and its outputs to float rounding."""
    from ds4.engine.gpu import fused

    g = torch.Generator().manual_seed(T + D + M + len(form))
    n = 4
    X, z1, z2, post, comb = rnd(g, T, n, D), rnd(g, T, D), rnd(g, T, D), rnd(g, T, n), rnd(g, T, n, n, scale=0.5)
    Wf = rnd(g, M, n * D, scale=0.02)
    r1, r2 = rnd(g, T, 1).abs() + 0.5, rnd(g, T, 1).abs() * 3.0
    y1, y2 = {"tensors": (z1, z2), "unscaled": (ops.Unscaled(z1, r1), ops.Unscaled(z2, r2)), "one_y": (z1, None)}[form]
    assert K.ext.hc_post_mix_takes(n, D, M)
    Xn, mix = K.hc_post_mix(X, y1, y2, post, comb, Wf)
    torch.cuda.synchronize()
    assert torch.equal(Xn, K.hc_post(X, y1, y2, post, comb))
    flat = Xn.reshape(T, n * D).double()
    ref, mag = flat @ Wf.double().T, flat.abs() @ Wf.double().abs().T
    assert torch.isfinite(mix).all() and float(((mix.double() - ref).abs() / mag).max()) < 1e-6
    if M == 24 and D == 4096:  # the session's call: hc_post_pre's prefill rows with the switch on and off
        scale, base, nw = rnd(g, 3), rnd(g, M, scale=0.5), rnd(g, D)
        saved = fused.HC_POST_MIX
        outs = {}
        try:
            for on in (False, True):
                fused.HC_POST_MIX = on
                outs[on] = K.hc_post_pre(X, y1, y2, post, comb, Wf, scale, base, nw, 20, 1e-6, 1e-6)
        finally:
            fused.HC_POST_MIX = saved
        assert torch.equal(outs[True][0], outs[False][0])
        for a, b in zip(outs[True][1:], outs[False][1:]):
            assert rel(a, b) < 1e-5


def test_hc_post_mix_refuses_what_it_cannot_take(K):
    assert not K.ext.hc_post_mix_takes(2, 4096, 24) and not K.ext.hc_post_mix_takes(4, 1000, 24)
    assert not K.ext.hc_post_mix_takes(4, 4096, 25)
    X = torch.zeros(100, 4, 4096, device=DEV)
    y, out = torch.zeros(100, 4096, device=DEV), torch.zeros(100, 24, device=DEV)
    with pytest.raises(ValueError, match="scratch"):
        K.ext.hc_post_mix(X.data_ptr(), y.data_ptr(), 0, y.data_ptr(), y.data_ptr(), 0, 0, y.data_ptr(), 100, 4096,
                          24, X.data_ptr(), out.data_ptr(), 0)


def test_swiglu_applies_the_row_scales_of_unscaled_products(K):
    """DS4_GPU_FOLD_SWIGLU: gate and up handed over as ops.Unscaled (z, r) give the bits of swiglu on z * r, with both
    or one of them unscaled; a wrong scale count is refused."""
    g = torch.Generator().manual_seed(31)
    T, F, limit = 37, 2048, 7.0
    zg, zu = rnd(g, T, F, scale=4.0), rnd(g, T, F, scale=4.0)
    rg, ru = rnd(g, T, 1).abs() + 0.25, rnd(g, T, 1).abs() * 2.0
    for a, b in ((ops.Unscaled(zg, rg), ops.Unscaled(zu, ru)), (zg, ops.Unscaled(zu, ru)), (ops.Unscaled(zg, rg), zu)):
        want = K.swiglu(ops.scaled(a), ops.scaled(b), limit)
        assert torch.equal(K.swiglu(a, b, limit), want)
    assert rel(K.swiglu(ops.Unscaled(zg, rg), zu, limit), ops.swiglu((zg * rg).double(), zu.double(), limit)) < 1e-6
    with pytest.raises(ValueError, match="row scales"):
        K.swiglu(ops.Unscaled(zg, rg[:-1]), zu, limit)


def test_norm_rope_heads_kv_ring_and_inverse(K):
    g = torch.Generator().manual_seed(3)
    T, H, d, rd = 2, 8, 512, 64
    freq, pos = freq_table(rd), torch.tensor([5, 900], device=DEV)
    cos, sin = ops.cos_sin(freq, pos)
    x = rnd(g, T, H * d, scale=2.0)
    got = K.norm_rope(x, d, H, pos, norm=True, freq=freq, rope_dim=rd).reshape(T, H, d)
    ref = ops.apply_tail(ops.rms_norm(x.reshape(T, H, d), None, 1e-6), cos, sin, rd)
    assert rel(got, ref) < 1e-6
    inv = K.norm_rope(x, d, H, pos, freq=freq, rope_dim=rd, inverse=True).reshape(T, H, d)
    assert rel(inv, ops.apply_tail(x.reshape(T, H, d), cos, sin, rd, inverse=True)) < 1e-6
    # kv: weight + FP8 simulation, written into ring row pos % cap only
    w, kv = rnd(g, d), rnd(g, 1, d, scale=2.0)
    ring = torch.full((128, d), 7.0, device=DEV)
    p1 = torch.tensor([130], device=DEV)
    K.norm_rope(kv, d, 1, p1, norm=True, w=w, freq=freq, rope_dim=rd, fp8_nope=d - rd, out=ring, ring_cap=128)
    c1, s1 = ops.cos_sin(freq, p1)
    ref = ops.fp8_kv_round(ops.apply_tail(ops.rms_norm(kv, w, 1e-6), c1, s1, rd), d - rd)[0]
    assert (ring[2] == ref).float().mean() > 0.98 and rel(ring[2], ref) < 1e-3
    assert torch.all(ring[torch.arange(128, device=DEV) != 2] == 7.0)


@pytest.mark.parametrize("norm,weight,inverse", [(True, False, False), (True, True, False), (False, False, True)])
def test_norm_rope_warp_kernel_for_many_rows(K, norm, weight, inverse):
    """From 256 rows (prefill) norm_rope runs one warp per row: against the float64 ops, and against the block
    kernel (the same rows in launches of fewer than 256) up to the norm's summation order; the RoPE alone
    (inverse, no norm: attention output) is the same bits."""
    g = torch.Generator().manual_seed(14)
    T, H, d, rd = 9, 64, 512, 64
    freq, pos = freq_table(rd), torch.arange(1000, 1000 + T, device=DEV)
    cos, sin = ops.cos_sin(freq, pos)
    x, w = rnd(g, T, H * d, scale=2.0), (rnd(g, d) if weight else None)
    kw = dict(norm=norm, w=w, freq=freq, rope_dim=rd, inverse=inverse)
    got = K.norm_rope(x, d, H, pos, **kw).reshape(T, H, d)  # 576 rows: the warp kernel
    block = torch.cat([K.norm_rope(x[t:t + 1], d, H, pos[t:t + 1], **kw).reshape(1, H, d) for t in range(T)])
    xd = x.double().reshape(T, H, d)
    ref = ops.apply_tail(ops.rms_norm(xd, None if w is None else w.double(), 1e-6) if norm else xd,
                         cos.double(), sin.double(), rd, inverse=inverse)
    assert rel(got, ref) < 1e-6
    if norm:
        assert rel(got, block) < 1e-6
    else:
        assert torch.equal(got, block)


def test_norm_rope_two_jobs_in_one_launch(K):
    """Decode's query heads and KV ring row in one launch: each exactly as its own launch writes it."""
    g = torch.Generator().manual_seed(13)
    H, d, rd = 16, 512, 64
    freq, pos = freq_table(rd), torch.tensor([300], device=DEV)
    q_lin, kv, w = rnd(g, 1, H * d, scale=2.0), rnd(g, 1, d, scale=2.0), rnd(g, d)
    rings = [torch.full((128, d), 7.0, device=DEV) for _ in range(2)]
    kv_job = dict(x=kv, d=d, rows_per_token=1, norm=True, w=w, freq=freq, rope_dim=rd, fp8_nope=d - rd,
                  out=rings[0], ring_cap=128)
    q = K.norm_rope(q_lin, d, H, pos, norm=True, freq=freq, rope_dim=rd, also=kv_job)
    q_alone = K.norm_rope(q_lin, d, H, pos, norm=True, freq=freq, rope_dim=rd)
    K.norm_rope(**{**kv_job, "out": rings[1]}, pos=pos)
    assert torch.equal(q, q_alone) and torch.equal(rings[0], rings[1])
    assert torch.all(rings[0][torch.arange(128, device=DEV) != 300 % 128] == 7.0)
    with pytest.raises(ValueError, match="out"):
        K.norm_rope(q_lin, d, H, pos, norm=True, freq=freq, rope_dim=rd, also={**kv_job, "out": None})


def test_norm_rope_warp_kernel_fp8_and_qat_rows(K):
    """Prefill's FP8 KV rows and the indexer's FP4 query rows (256+ rows) on the warp kernel: the Hadamard + FP4
    rows are the block kernel's bits (no sum to reorder); the FP8 rows differ from it only through the norm's
    summation order, i.e. in a few codes next to a rounding boundary."""
    g = torch.Generator().manual_seed(15)
    T, Hi, di, rd = 6, 64, 128, 64
    freq, pos = freq_table(rd, 160000.0), torch.arange(2000, 2000 + T, device=DEV)
    x = rnd(g, T, Hi * di, scale=3.0)
    got = K.norm_rope(x, di, Hi, pos, freq=freq, rope_dim=rd, qat=True).reshape(T, Hi, di)  # 384 rows
    block = torch.cat([K.norm_rope(x[t:t + 1], di, Hi, pos[t:t + 1], freq=freq, rope_dim=rd, qat=True)
                       .reshape(1, Hi, di) for t in range(T)])
    assert torch.equal(got, block)
    cos, sin = ops.cos_sin(freq, pos)
    ref = ops.indexer_qat(ops.apply_tail(x.reshape(T, Hi, di), cos, sin, rd))
    assert (got == ref).float().mean() > 0.98 and rel(got, ref) < 2e-2

    R, d = 300, 512
    kv, w, kpos = rnd(g, R, d, scale=2.0), rnd(g, d), torch.arange(R, device=DEV)
    kw = dict(norm=True, w=w, freq=freq_table(rd), rope_dim=rd, fp8_nope=d - rd)
    got = K.norm_rope(kv, d, 1, kpos, **kw)
    block = torch.cat([K.norm_rope(kv[i:i + 100], d, 1, kpos[i:i + 100], **kw) for i in range(0, R, 100)])
    nope = d - rd  # the RoPE tail is not rounded: there the norm's order shows in the last bits
    assert (got[:, :nope] == block[:, :nope]).float().mean() > 0.999 and rel(got, block) < 1e-3
    c, s = ops.cos_sin(freq_table(rd), kpos)
    ref = ops.fp8_kv_round(ops.apply_tail(ops.rms_norm(kv, w, 1e-6), c, s, rd), d - rd)
    assert (got == ref).float().mean() > 0.98 and rel(got, ref) < 1e-3


def test_norm_rope_indexer_qat(K):
    g = torch.Generator().manual_seed(4)
    Hi, di, rd = 16, 128, 64
    freq, pos = freq_table(rd, 160000.0), torch.tensor([77], device=DEV)
    cos, sin = ops.cos_sin(freq, pos)
    x = rnd(g, 1, Hi * di, scale=3.0)
    got = K.norm_rope(x, di, Hi, pos, freq=freq, rope_dim=rd, qat=True).reshape(1, Hi, di)
    ref = ops.indexer_qat(ops.apply_tail(x.reshape(1, Hi, di), cos, sin, rd))
    assert (got == ref).float().mean() > 0.98 and rel(got, ref) < 2e-2


@pytest.mark.parametrize("hashed", [False, True])
def test_router(K, hashed):
    g = torch.Generator().manual_seed(5)
    T, E, k = 6, 256, 6
    logits, bias = rnd(g, T, E, scale=3.0), rnd(g, E, scale=0.1)
    tok = torch.tensor([3, 99, 7, 3, 1000, 5], device=DEV)
    table = torch.randint(0, E, (1200, k), generator=g).to(DEV)
    ids, w = K.router(logits, None if hashed else bias, table if hashed else None, tok, k, 1.5)
    s = torch.sqrt(torch.nn.functional.softplus(logits.double()))
    ref_ids = table[tok] if hashed else torch.topk(s + bias.double(), k, dim=-1).indices
    assert torch.equal(torch.sort(ids.long(), dim=1).values, torch.sort(ref_ids, dim=1).values)
    ws = torch.gather(s, 1, ids.long())
    assert rel(w, ws / torch.clamp(ws.sum(1, keepdim=True), min=6.1035e-5) * 1.5) < 1e-6


@pytest.mark.parametrize("E", [64, 256])
def test_router_ties_pick_lowest_index_in_score_order(K, E):
    g = torch.Generator().manual_seed(50 + E)
    k = 6
    levels = torch.tensor([0.5, 1.0, 2.0, 2.0, 3.0])  # many exact ties, also at the k-th place
    logits = levels[torch.randint(0, 5, (3, E), generator=g)].to(DEV)
    logits[2, 7] = float("nan")
    ids, _ = K.router(logits, None, None, torch.zeros(3, dtype=torch.long, device=DEV), k, 1.0)
    s = torch.sqrt(torch.nn.functional.softplus(logits.double())).cpu()
    for t in range(3):
        key = torch.where(torch.isnan(s[t]), torch.full_like(s[t], -math.inf), s[t])
        order = sorted(range(E), key=lambda e: (-key[e].item(), e))[:k]  # k argmax passes, lowest index first
        assert ids[t].tolist() == order


def test_swiglu(K):
    g = torch.Generator().manual_seed(6)
    a, b = rnd(g, 3, 700, scale=8.0), rnd(g, 3, 700, scale=8.0)
    assert rel(K.swiglu(a, b, 10.0), ops.swiglu(a.double(), b.double(), 10.0)) < 1e-6


def compress_ref(kv, sc, ape, s_kv, s_sc, rows, p, r, norm_w, freq, rd):
    """The torch decode compressor step of session._compress_step (sims off), on host values."""
    width = kv.shape[-1]
    d = width // 2 if r == 4 else width
    slot = (r + p % r) if r == 4 else p % r
    s_kv[slot], s_sc[slot] = kv, sc + ape[p % r]
    if (p + 1) % r:
        return
    if r == 4:
        ck, cs = torch.cat([s_kv[:4, :d], s_kv[4:, d:]]), torch.cat([s_sc[:4, :d], s_sc[4:, d:]])
    else:
        ck, cs = s_kv, s_sc
    pooled = (ck * torch.softmax(cs, dim=0)).sum(0, keepdim=True)
    i = (p + 1) // r - 1
    cos, sin = ops.cos_sin(freq, torch.tensor([i * r], device=kv.device))
    rows[i] = ops.apply_tail(ops.rms_norm(pooled, norm_w, 1e-6), cos, sin, rd)[0]
    if r == 4:
        s_kv[:4], s_sc[:4] = s_kv[4:].clone(), s_sc[4:].clone()
        s_kv[4:], s_sc[4:] = 0.0, -math.inf
    else:
        s_kv[:], s_sc[:] = 0.0, -math.inf


@pytest.mark.parametrize("r,width", [(4, 1024), (4, 256), (16, 512)])
def test_compress_step_sequence(K, r, width):
    g = torch.Generator().manual_seed(7 + r + width)
    rd, n_rows = 64, 8
    d = width // 2 if r == 4 else width
    freq, ape, norm_w = freq_table(rd, 160000.0), rnd(g, r, width, scale=0.3), rnd(g, d)
    fr = 2 * r if r == 4 else r
    state = [torch.zeros(fr, width, device=DEV), torch.full((fr, width), -math.inf, device=DEV),
             torch.zeros(n_rows, d, device=DEV)]
    ref = [t.clone() for t in state]
    for p in range(3 * r + 2):
        kv, sc = rnd(g, 1, width), rnd(g, 1, width)
        K.compress_step(kv, sc, ape, *state, torch.tensor([p], device=DEV), r, norm_w, 1e-6, freq, rd, 0, False)
        compress_ref(kv[0], sc[0], ape, *ref, p, r, norm_w, freq, rd)
    assert torch.equal(torch.isinf(state[1]), torch.isinf(ref[1]))
    fin = torch.isfinite(ref[1])
    assert rel(state[0], ref[0]) < 1e-6 and rel(state[1][fin], ref[1][fin]) < 1e-6
    assert rel(state[2][:3], ref[2][:3]) < 1e-5 and torch.all(state[2][3:] == 0)


@pytest.mark.parametrize("r,width", [(4, 1024)])
def test_compress_step_regs_same_bits(K, r, width):
    """DS4_GPU_COMPRESS_REGS (ext.set_compress_regs): the ratio-4 pooling with the candidates' loads in flight (v16)
    gives every state and row tensor of the v15 loops bit for bit, over two windows."""
    g = torch.Generator().manual_seed(31 + r)
    rd, n_rows = 64, 4
    d = width // 2 if r == 4 else width
    freq, ape, norm_w = freq_table(rd, 160000.0), rnd(g, r, width, scale=0.3), rnd(g, d)
    fr = 2 * r if r == 4 else r
    states = [[torch.zeros(fr, width, device=DEV), torch.full((fr, width), -math.inf, device=DEV),
               torch.zeros(n_rows, d, device=DEV)] for _ in range(2)]
    try:
        for p in range(2 * r + 1):
            kv, sc = rnd(g, 1, width, scale=2.0), rnd(g, 1, width, scale=3.0)
            for mode, st in zip((0, 1), states):
                K.ext.set_compress_regs(mode)
                K.compress_step(kv, sc, ape, *st, torch.tensor([p], device=DEV), r, norm_w, 1e-6, freq, rd, 0, False)
    finally:
        K.ext.set_compress_regs(-1)
    torch.cuda.synchronize()
    assert torch.isfinite(states[1][2][:2]).all() and (states[1][2][:2] != 0).any()
    for a, b in zip(*states):
        assert torch.equal(a, b)


@pytest.mark.parametrize("r,width", [(128, 512), (16, 512), (16, 128)])
def test_compress_step_wide_pooling_matches_the_loops(K, r, width):
    """DS4_GPU_COMPRESS_WIDE (ext.set_compress_wide, default since v25): the pooling of ratios other than 4 split over the
    block's warps. Not the v15 loops' bits (another summation order), so: the frontier state bitwise as the loops leave
    it, the finished rows within float32 rounding of the loops' (no FP8 rounding here: its steps would magnify a last-bit
    difference), over two pooling windows."""
    g = torch.Generator().manual_seed(50 + r + width)
    rd, n_rows = 64, 3
    freq = freq_table(rd, 160000.0)
    ape, norm_w = rnd(g, r, width, scale=0.3), rnd(g, width)
    inputs = [(rnd(g, 1, width, scale=2.0), rnd(g, 1, width, scale=3.0)) for _ in range(2 * r)]
    runs = []
    try:
        for wide in (0, 1):
            K.ext.set_compress_wide(wide)
            st = [torch.zeros(r, width, device=DEV), torch.full((r, width), -math.inf, device=DEV),
                  torch.zeros(n_rows, width, device=DEV)]
            for p, (kv, sc) in enumerate(inputs):
                K.compress_step(kv, sc, ape, *st, torch.tensor([p], device=DEV), r, norm_w, 1e-6, freq, rd, 0, False)
            runs.append(st)
    finally:
        K.ext.set_compress_wide(-1)
    torch.cuda.synchronize()
    loops, wide = runs
    assert torch.equal(loops[0], wide[0]) and torch.equal(loops[1], wide[1])  # the shifted frontier
    assert (wide[2][:2] != 0).any() and torch.isfinite(wide[2]).all()
    rel = float(torch.linalg.norm((wide[2] - loops[2]).double()) / torch.linalg.norm(loops[2].double()))
    assert rel < 2e-6


def test_compress_step_two_jobs_in_one_launch(K):
    """A ratio-4 layer's two compressors (the attention's, FP8 rows; the indexer's, FP4 QAT rows) stepped in one launch
    of two blocks: every state and row tensor bitwise as with a launch each, over three pooling windows."""
    g = torch.Generator().manual_seed(21)
    rd, n_rows = 64, 8
    jobs = []
    for width, fp8, qat in ((1024, 448, False), (256, 0, True)):
        d = width // 2
        jobs.append(dict(ape=rnd(g, 4, width, scale=0.3), norm_w=rnd(g, d), r=4, eps=1e-6,
                         freq=freq_table(rd, 160000.0), rope_dim=rd, fp8_nope=fp8, qat=qat,
                         state=[torch.zeros(8, width, device=DEV), torch.full((8, width), -math.inf, device=DEV),
                                torch.zeros(n_rows, d, device=DEV)]))
    apart = [[t.clone() for t in j["state"]] for j in jobs]
    for p in range(14):
        pos = torch.tensor([p], device=DEV)
        ins = [(rnd(g, 1, j["state"][0].shape[1]), rnd(g, 1, j["state"][0].shape[1])) for j in jobs]
        args = [dict(kv=kv, sc=sc, ape=j["ape"], s_kv=j["state"][0], s_sc=j["state"][1], rows=j["state"][2],
                     r=4, norm_w=j["norm_w"], eps=1e-6, freq=j["freq"], rope_dim=rd, fp8_nope=j["fp8_nope"],
                     qat=j["qat"]) for j, (kv, sc) in zip(jobs, ins)]
        K.compress_step(pos=pos, **args[0], also=args[1])
        for a, st in zip(args, apart):
            K.compress_step(pos=pos, **{**a, "s_kv": st[0], "s_sc": st[1], "rows": st[2]})
    torch.cuda.synchronize()
    for j, st in zip(jobs, apart):
        assert torch.isfinite(j["state"][2][:3]).all() and (j["state"][2][:3] != 0).any()
        for got, want in zip(j["state"], st):
            assert torch.equal(got, want)


@pytest.mark.parametrize("p,H,n_comp,use_sel", [(2300, 64, 600, True), (300, 16, 40, False), (40, 6, 40, False)])
def test_decode_attention_register_tiles_same_bits(K, p, H, n_comp, use_sel):
    """DS4_GPU_ATTN_TILES (ext.set_attn_tiles): scores in 4 x 4 (head, key) tiles and P.V by head quads give the per-head
    loops' output bit for bit, with a partial last head quad (6 heads) too."""
    g = torch.Generator().manual_seed(30 + p)
    d, rd, cap, r = 512, 64, 128, 4
    q, raw, comp = rnd(g, H, d), rnd(g, cap, d), rnd(g, n_comp, d)
    sinks, freq = rnd(g, H), freq_table(rd, 160000.0)
    pos = torch.tensor([p], device=DEV)
    sel = torch.randperm(n_comp, generator=g)[:min(512, n_comp * 3 // 5)].to(DEV) if use_sel else None
    outs = []
    try:
        for mode in (0, 1):
            K.ext.set_attn_tiles(mode)
            outs.append(K.attention(q, raw, comp, sel, r, pos, sinks, freq, rd).clone())
    finally:
        K.ext.set_attn_tiles(-1)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("use_sel", [False, True])
@pytest.mark.parametrize("p,H,n_comp", [(5, 16, 40), (300, 16, 40), (2300, 64, 600), (40, 8, 40)])
def test_decode_attention(K, use_sel, p, H, n_comp):
    g = torch.Generator().manual_seed(8 + p)
    d, rd, cap, r = 512, 64, 128, 4
    q, raw, comp = rnd(g, H, d), rnd(g, cap, d), rnd(g, n_comp, d)
    sinks, freq = rnd(g, H), freq_table(rd, 160000.0)
    pos = torch.tensor([p], device=DEV)
    sel = torch.randperm(n_comp, generator=g)[:min(512, n_comp * 3 // 5)].to(DEV) if use_sel else None
    got = K.attention(q, raw, comp, sel, r, pos, sinks, freq, rd)
    # reference: session._attn_step's masked softmax with sinks (float64)
    j = torch.arange(cap, device=DEV)
    key_pos = p - torch.remainder(p - j, cap)
    ids = sel if use_sel else torch.arange(n_comp, device=DEV)
    keys = torch.cat([raw, comp[ids]]).double()
    mask = torch.cat([key_pos >= 0, ids < (p + 1) // r])
    s = (q.double() @ keys.T) / math.sqrt(d)
    s = torch.where(mask[None, :], s, torch.full_like(s, -math.inf))
    m = torch.maximum(s.amax(-1), sinks.double())
    e = torch.exp(s - m[:, None])
    o = (e / (e.sum(-1) + torch.exp(sinks.double() - m))[:, None]) @ keys
    cos, sin = ops.cos_sin(freq, pos)
    ref = ops.apply_tail(o[None].float(), cos, sin, rd, inverse=True)[0]
    assert rel(got, ref) < 1e-5


@pytest.mark.parametrize("p", [2, 300, 1203])
def test_decode_attention_skips_chunks_past_the_visible_rows(K, p):
    """Compressed rows in order (no selection: the ratio-128 layers) in a buffer sized for a longer context: the chunks
    past the visible rows are empty (their rows hold NaN here: never read) and the output is bit for bit that of a
    buffer of just the visible rows plus a few (a partly visible last chunk); none visible at p = 2."""
    g = torch.Generator().manual_seed(50 + p)
    d, rd, cap, r, H = 512, 64, 128, 4, 64
    n_vis = (p + 1) // r
    q, raw, comp = rnd(g, H, d), rnd(g, cap, d), rnd(g, 2050, d)
    comp[n_vis:] = float("nan")
    sinks, freq, pos = rnd(g, H), freq_table(rd, 160000.0), torch.tensor([p], device=DEV)
    whole = K.attention(q, raw, comp, None, r, pos, sinks, freq, rd)
    short = K.attention(q, raw, comp[:n_vis + 5].contiguous(), None, r, pos, sinks, freq, rd)
    torch.cuda.synchronize()
    assert torch.isfinite(whole).all()
    assert torch.equal(whole, short)


def test_index_keys_past_the_visible_rows_are_minus_inf(K):
    """index_keys over a buffer sized for a longer context (2050 rows, 301 visible, NaN past them): the visible keys
    bit for bit those of a buffer of just the visible rows plus a few, every later key -inf."""
    g = torch.Generator().manual_seed(10)
    Hi, di = 64, 128
    q, w, idx = rnd(g, Hi, di), rnd(g, Hi), rnd(g, 2050, di)
    pos = torch.tensor([1203], device=DEV)
    idx[301:] = float("nan")
    whole = K.index_keys(q, w, idx, pos, 4, 0.01)
    short = K.index_keys(q, w, idx[:310].contiguous(), pos, 4, 0.01)
    torch.cuda.synchronize()
    assert torch.equal(whole[:310], short)
    assert torch.isfinite(whole[:301]).all() and bool((whole[301:] == -math.inf).all())


def test_index_keys(K):
    g = torch.Generator().manual_seed(9)
    Hi, di, n = 64, 128, 50
    q, w, idx = rnd(g, Hi, di), rnd(g, Hi), rnd(g, n, di)
    pos = torch.tensor([97], device=DEV)
    keys = K.index_keys(q, w, idx, pos, 4, 0.01)
    scores = (w.double()[:, None] * 0.01 * torch.clamp(q.double() @ idx.double().T, min=0)).sum(0)
    vis = torch.arange(n, device=DEV) < 98 // 4
    assert torch.all(torch.isinf(keys[~vis])) and rel(keys[vis], scores[vis]) < 1e-5
    top = torch.topk(keys, 10).indices
    assert torch.equal(torch.sort(top).values, torch.sort(torch.topk(torch.where(vis, scores, -math.inf), 10).indices).values)


@pytest.mark.parametrize("T,D", [(1, 4096), (3, 4096), (1, 512), (2, 1024)])  # 512: CTAs of one warp (`small`)
@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("post_form", ["none", "y1", "y1+y2"])
def test_hc_cluster_kernel_matches_the_one_launch_kernel(K, T, D, head, post_form):
    """DS4_GPU_HC_CLUSTER (ext.set_hc_cluster): decode's mHC pre as one cluster of 16 CTAs per token (partials through
    distributed shared memory, out's norm through the Gram matrix of the streams). X' as hc_post computes it; out,
    post and comb as the float64 ops and within float rounding of the arrival-count kernel. Run twice per mode (no
    state may carry between launches)."""
    g = torch.Generator().manual_seed(40 + T + D)
    n = 4
    M = n if head else (2 + n) * n
    X, y1, y2 = rnd(g, T, n, D), rnd(g, T, D), rnd(g, T, D)
    if post_form != "y1+y2":
        y2 = None
    post_in, comb_in = rnd(g, T, n), rnd(g, T, n, n, scale=0.5)
    Wf = rnd(g, M, n * D, scale=0.02)
    scale, base, nw = rnd(g, 3) if not head else rnd(g, 1), rnd(g, M, scale=0.5), rnd(g, D)
    runs = []
    for mode in (1, 0):
        K.ext.set_hc_cluster(mode)
        try:
            assert K.ext.hc_cluster_takes(n, D, M) == bool(mode)
            for _ in range(2):
                if post_form == "none":
                    res = (X, *K.hc_pre(X, Wf, scale, base, nw, 20, 1e-6, 1e-6, head=head))
                else:
                    res = K.hc_post_pre(X, y1, y2, post_in, comb_in, Wf, scale, base, nw, 20, 1e-6, 1e-6, head=head)
            torch.cuda.synchronize()
            runs.append([t.clone() for t in res])
        finally:
            K.ext.set_hc_cluster(-1)
    (Xn, out, post, comb), (Xn0, out0, post0, comb0) = runs
    if post_form != "none":
        assert rel(Xn, K.hc_post(X, y1, y2, post_in, comb_in)) < 1e-7
    assert rel(out, out0) < 2e-6
    if not head:
        assert rel(post, post0) < 2e-6 and rel(comb, comb0) < 2e-6
    check_hc_pre(Xn.double(), Wf, scale, base, nw, head, out, post, comb)
