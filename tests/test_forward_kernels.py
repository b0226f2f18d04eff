"""Numerics and numba kernels held to their references (model-spec §3.1, §3.5-3.6)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ds4.engine import kernels, numerics
from ds4.engine.config import preset
from ds4.engine.forward import (attend_ref, compressor_scan_ref, empty_frontier, hc_pre, indexer_scores_ref,
                                topk_rows)
from ds4.engine.rope import apply_tail, cos_sin, inv_freq

F32 = np.float32


def _wide_values(rng, n):
    """Values spread over many binades, with exact grid points, ties and zeros mixed in."""
    x = rng.standard_normal(n).astype(F32) * np.exp2(rng.integers(-12, 9, n)).astype(F32)
    x[:64] = np.arange(64, dtype=F32) * F32(0.25) - 8  # many exact ties for e2m1 after scaling
    x[64:80] = 0.0
    return x


def test_e4m3_round_matches_ml_dtypes():
    rng = np.random.default_rng(1)
    x = np.clip(_wide_values(rng, 200_000), -448, 448)
    ref = x.astype(ml_dtypes.float8_e4m3fn).astype(F32)
    np.testing.assert_array_equal(numerics.e4m3_round(x), ref)


def test_e2m1_round_matches_ml_dtypes():
    rng = np.random.default_rng(2)
    x = np.clip(_wide_values(rng, 100_000) / 64, -6, 6).astype(F32)
    x[:200] = np.linspace(-6, 6, 200, dtype=F32)
    x[200:216] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, 6, -6], F32)
    ref = x.astype(ml_dtypes.float4_e2m1fn).astype(F32)
    np.testing.assert_array_equal(numerics.e2m1_round(x), ref)


def test_fp8_kv_round_blocks_and_tail():
    cfg = preset("tiny")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, cfg.head_dim)).astype(F32) * 3
    x[0, :64] *= 1e-7  # tiny block: amax floored at 1e-4
    y = numerics.fp8_kv_round(x, cfg.n_nope)
    np.testing.assert_array_equal(y[:, cfg.n_nope:], x[:, cfg.n_nope:])  # RoPE tail untouched
    blocks = x[:, :cfg.n_nope].reshape(5, -1, 64)
    amax = np.maximum(np.abs(blocks).max(-1, keepdims=True), F32(1e-4))
    scale = np.exp2(np.ceil(np.log2((amax / F32(448)).astype(np.float64)))).astype(F32)
    ref = (np.clip(blocks / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(F32) * scale).reshape(5, -1)
    np.testing.assert_array_equal(y[:, :cfg.n_nope], ref)
    assert not np.array_equal(y[:, :cfg.n_nope], x[:, :cfg.n_nope])


def test_hadamard_is_sylvester_matrix_and_qat_rounds_to_fp4_grid():
    n = 128
    Hm = np.array([[1.0]])
    while Hm.shape[0] < n:
        Hm = np.block([[Hm, Hm], [Hm, -Hm]])
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, n)).astype(F32)
    np.testing.assert_allclose(numerics.hadamard(x), x @ Hm.T / np.sqrt(n), atol=1e-5)
    q = numerics.indexer_qat(x)
    rot = numerics.hadamard(x).reshape(3, 4, 32)
    scale = np.exp2(np.ceil(np.log2(np.abs(rot).max(-1, keepdims=True) / 6)))
    codes = (q.reshape(3, 4, 32) / scale).ravel()
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])
    assert np.isin(np.abs(codes), grid).all()
    ref = (np.clip(rot / scale, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(F32) * scale).reshape(3, n)
    np.testing.assert_array_equal(q, ref.astype(F32))


def test_rope_tail_matches_complex_rotation_and_inverts():
    cfg = preset("tiny")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 3, cfg.head_dim)).astype(F32)
    pos = np.array([0, 1, 5, 127, 128, 1000, 65535])
    for compressed in (False, True):
        freq = inv_freq(cfg, compressed)
        cos, sin = cos_sin(freq, pos)
        y = apply_tail(x, cos, sin, cfg.rope_dim)
        tail = x[..., cfg.n_nope:]
        z = (tail[..., 0::2] + 1j * tail[..., 1::2]) * np.exp(1j * (pos[:, None, None] * freq.astype(np.float64)))
        np.testing.assert_allclose(y[..., cfg.n_nope::2], z.real, atol=2e-3)
        np.testing.assert_allclose(y[..., cfg.n_nope + 1::2], z.imag, atol=2e-3)
        np.testing.assert_array_equal(y[..., :cfg.n_nope], x[..., :cfg.n_nope])
        np.testing.assert_allclose(apply_tail(y, cos, sin, cfg.rope_dim, inverse=True), x, atol=1e-5)


def test_yarn_frequencies_follow_spec_ramp():
    cfg = preset("flash")
    base = 1.0 / cfg.compress_rope_base ** (np.arange(0, 64, 2) / 64)
    f = inv_freq(cfg, True).astype(np.float64)
    np.testing.assert_allclose(f[:15], base[:15], rtol=1e-6)  # pairs below low = 15 keep θ
    np.testing.assert_allclose(f[25:], base[25:] / 16, rtol=1e-6)  # pairs ≥ high = 25 divided by 16
    ramp = (np.arange(15, 25) - 15) / 10
    np.testing.assert_allclose(f[15:25], base[15:25] * (1 - ramp) + base[15:25] / 16 * ramp, rtol=1e-6)


@pytest.mark.parametrize("ratio,width,pos0,T", [(4, 64, 0, 37), (4, 64, 6, 13), (128, 32, 0, 300), (128, 32, 100, 61)])
def test_compressor_scan_kernel_matches_reference(ratio, width, pos0, T):
    rng = np.random.default_rng(ratio + pos0)
    kv = rng.standard_normal((T, width)).astype(F32)
    score = rng.standard_normal((T, width)).astype(F32) * 2
    pooled_w = width // 2 if ratio == 4 else width
    skv0, ssc0 = empty_frontier(ratio, width)
    if pos0:  # start from a frontier part-way through a window
        warm = rng.standard_normal((pos0, width)).astype(F32)
        compressor_scan_ref(warm, warm, 0, ratio, skv0, ssc0, np.empty((pos0 // ratio + 1, pooled_w), F32))
    outs = []
    for fn in (compressor_scan_ref, kernels.compressor_scan):
        skv, ssc = skv0.copy(), ssc0.copy()
        out = np.zeros((T // ratio + 1, pooled_w), F32)
        n = fn(kv, score, pos0, ratio, skv, ssc, out)
        outs.append((n, out[:n], skv, ssc))
    (n0, o0, k0, s0), (n1, o1, k1, s1) = outs
    assert n0 == n1 == (pos0 + T) // ratio - pos0 // ratio
    np.testing.assert_allclose(o1, o0, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(k1, k0)
    np.testing.assert_array_equal(s1, s0)


def test_compressor_ratio4_row0_uses_only_current_window():
    """Row 0 has no previous window: its A candidates are 0 / −inf (model-spec §3.5)."""
    rng = np.random.default_rng(9)
    kv = rng.standard_normal((4, 8)).astype(F32)
    sc = rng.standard_normal((4, 8)).astype(F32)
    skv, ssc = empty_frontier(4, 8)
    out = np.zeros((1, 4), F32)
    assert compressor_scan_ref(kv, sc, 0, 4, skv, ssc, out) == 1
    w = np.exp(sc[:, 4:] - sc[:, 4:].max(0))
    np.testing.assert_allclose(out[0], (kv[:, 4:] * w / w.sum(0)).sum(0), rtol=1e-6)


def test_indexer_scores_kernel_matches_reference():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((9, 16, 128)).astype(F32)
    w = rng.standard_normal((9, 16)).astype(F32)
    keys = rng.standard_normal((40, 128)).astype(F32)
    np.testing.assert_allclose(kernels.indexer_scores(q, w, keys), indexer_scores_ref(q, w, keys), rtol=1e-4, atol=1e-3)


def test_attend_kernel_matches_reference():
    rng = np.random.default_rng(7)
    T, H, d, N = 11, 4, 128, 70
    q = rng.standard_normal((T, H, d)).astype(F32)
    keys = rng.standard_normal((N, d)).astype(F32)
    mask = rng.random((T, N)) < 0.4
    mask[:, 0] = True
    sinks = rng.standard_normal(H).astype(F32) * 3
    ref = attend_ref(q, keys, mask, sinks, 1 / np.sqrt(d))
    np.testing.assert_allclose(kernels.attend(q, keys, mask, sinks, 1 / np.sqrt(d)), ref, rtol=1e-5, atol=1e-5)
    # the sink only adds to the denominator: a very negative sink gives plain softmax attention
    plain = attend_ref(q, keys, mask, np.full(H, -1e4, F32), 1 / np.sqrt(d))
    s = np.where(mask[:, None], np.einsum("thd,nd->thn", q, keys) / np.sqrt(d), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(plain, np.einsum("thn,nd->thd", p / p.sum(-1, keepdims=True), keys), atol=1e-5)


def test_f16_converter_matches_numpy_on_every_code():
    codes = np.arange(65536, dtype=np.uint16)
    ref = codes.view(np.float16).astype(F32)
    got = kernels.f16_to_f32(codes)
    # bit patterns: subnormals, ±0, ±inf and every NaN payload exactly as numpy converts them
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_dense_matmul_reads_every_half_code_exactly():
    """The products convert weights with the CPU's half → float (vcvtph2ps): every finite code,
    subnormals included, and ±inf must give the value numpy gives."""
    codes = np.arange(65536, dtype=np.uint16)
    finite = codes[np.isfinite(codes.view(np.float16))]
    w = finite.reshape(-1, 64)
    x = np.random.default_rng(3).standard_normal((2, 64)).astype(F32)
    np.testing.assert_array_equal(kernels.dense_matmul(w, x), kernels.dense_matmul_ref(w, x))
    inf = np.array([[0x7C00, 0x3C00], [0xFC00, 0x3C00]], np.uint16)
    assert kernels.dense_matmul(inf, np.ones((1, 2), F32)).tolist() == [[np.inf, -np.inf]]


@pytest.mark.parametrize("T,K,O", [(1, 64, 24), (7, 128, 1000), (33, 96, 513), (9, 200, 70)])
@pytest.mark.parametrize("half", [False, True])
def test_dense_matmul_lane_order_and_batch_invariance(T, K, O, half):
    rng = np.random.default_rng(T + K)
    x = rng.standard_normal((T, K)).astype(F32)
    W = rng.standard_normal((O, K)).astype(np.float16 if half else F32)
    w = W.view(np.uint16) if half else W
    out = kernels.dense_matmul(w, x)
    # the exact lane order of the readable reference, and a float64 product within rounding
    np.testing.assert_array_equal(out, kernels.dense_matmul_ref(w, x))
    np.testing.assert_allclose(out, x.astype(np.float64) @ W.astype(np.float64).T, rtol=1e-4, atol=1e-4)
    for t in range(T):  # each row alone gives exactly the same bits
        assert np.array_equal(kernels.dense_matmul(w, x[t:t + 1])[0], out[t])
    if half:  # half bits give the bits of their float32 conversion
        assert np.array_equal(kernels.dense_matmul(W.astype(F32), x), out)


def test_dense_matmul_threads_give_the_same_bits():
    import numba

    rng = np.random.default_rng(5)
    w = rng.standard_normal((3000, 512)).astype(np.float16).view(np.uint16)
    for T in (1, 6):
        x = rng.standard_normal((T, 512)).astype(F32)
        numba.set_num_threads(1)
        one = kernels.dense_matmul(w, x)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        assert np.array_equal(kernels.dense_matmul(w, x), one)


def test_hc_block_kernels_match_reference():
    from ds4.engine import forward

    cfg = preset("tiny")
    rng = np.random.default_rng(11)
    T, n, D = 5, cfg.n_hc, cfg.n_embd
    X = rng.standard_normal((T, n, D)).astype(F32)
    fn = (rng.standard_normal((cfg.hc_mix, n * D)) / 16).astype(np.float16)
    scale, base = rng.standard_normal(3).astype(F32), rng.standard_normal(cfg.hc_mix).astype(F32)
    norm = rng.standard_normal(D).astype(F32)
    a, post, comb = kernels.hc_pre_norm(X, fn.view(np.uint16), scale, base, norm, cfg.rms_eps, cfg.hc_eps,
                                        cfg.sinkhorn_iters)
    mix = numerics.rms_norm(X.reshape(T, -1), None, cfg.rms_eps) @ fn.astype(F32).T
    u, post_r, comb_r = hc_pre(X, mix, scale, base, cfg)
    np.testing.assert_allclose(a, numerics.rms_norm(u, norm, cfg.rms_eps), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(post, post_r, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(comb, comb_r, rtol=1e-4, atol=1e-6)
    for t in range(T):  # per token: the same bits alone
        a1, p1, c1 = kernels.hc_pre_norm(X[t:t + 1], fn.view(np.uint16), scale, base, norm, cfg.rms_eps,
                                         cfg.hc_eps, cfg.sinkhorn_iters)
        assert np.array_equal(a1[0], a[t]) and np.array_equal(p1[0], post[t]) and np.array_equal(c1[0], comb[t])
    y = rng.standard_normal((T, D)).astype(F32)
    np.testing.assert_allclose(kernels.hc_post(X, y, post, comb), forward.hc_post(X, y, post, comb), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 9])
def test_moe_kernel_equals_the_per_expert_loop(T):
    """kernels.moe_dense == forward.moe's per-expert loop (same matmuls and SwiGLU) bit for bit,
    and a float64 evaluation of the spec's formula within rounding."""
    rng = np.random.default_rng(T)
    E, F, D, k, limit = 8, 64, 128, 3, 2.5
    Wg, Wu = (rng.standard_normal((E, F, D)).astype(np.float16) / 8 for _ in range(2))
    Wd = rng.standard_normal((E, D, F)).astype(np.float16) / 8
    Sg, Su = (rng.standard_normal((F, D)).astype(np.float16) / 8 for _ in range(2))
    Sd = rng.standard_normal((D, F)).astype(np.float16) / 8
    x = rng.standard_normal((T, D)).astype(F32)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    ids[0, 1] = ids[0, 0]  # a repeated expert (hash routing can repeat one) adds twice
    w = rng.random((T, k)).astype(F32)
    u16 = [a.view(np.uint16) for a in (Wg, Wu, Wd, Sg, Su, Sd)]
    out, mid = kernels.moe_dense(*u16, x, ids, w, limit, want_mid=True)
    loop = np.zeros((T, D), F32)
    loop_mid = np.zeros((T, k, F), F32)
    for e in np.unique(ids):
        tt, slot = np.nonzero(ids == e)
        h = kernels.swiglu(kernels.dense_matmul(u16[0][e], x[tt]), kernels.dense_matmul(u16[1][e], x[tt]), limit,
                           w[tt, slot])
        loop_mid[tt, slot] = h
        np.add.at(loop, tt, kernels.dense_matmul(u16[2][e], h))
    sh = kernels.swiglu(kernels.dense_matmul(u16[3], x), kernels.dense_matmul(u16[4], x), limit)
    loop = loop + kernels.dense_matmul(u16[5], sh)
    assert np.array_equal(out, loop) and np.array_equal(mid, loop_mid)

    def f64(g, u):
        g = np.minimum(g, limit)
        return g / (1 + np.exp(-g)) * np.clip(u, -limit, limit)
    xd = x.astype(np.float64)
    ref = f64(xd @ Sg.astype(np.float64).T, xd @ Su.astype(np.float64).T) @ Sd.astype(np.float64).T
    for t in range(T):
        for s in range(k):
            e = ids[t, s]
            h = f64(Wg[e].astype(np.float64) @ xd[t], Wu[e].astype(np.float64) @ xd[t]) * w[t, s]
            ref[t] += Wd[e].astype(np.float64) @ h
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_topk_rows_ties_to_lowest_index():
    s = np.array([[1.0, 3.0, 3.0, 0.5, 3.0]])
    assert topk_rows(s, 2).tolist() == [[1, 2]]


def test_hc_pre_sinkhorn_is_doubly_stochastic():
    cfg = preset("tiny")
    rng = np.random.default_rng(8)
    X = rng.standard_normal((3, cfg.n_hc, cfg.n_embd)).astype(F32)
    fn = rng.standard_normal((cfg.hc_mix, cfg.n_hc * cfg.n_embd)).astype(F32) / 16
    mix = numerics.rms_norm(X.reshape(3, -1), None, cfg.rms_eps) @ fn.T
    u, post, comb = hc_pre(X, mix, np.ones(3, F32), rng.standard_normal(cfg.hc_mix).astype(F32), cfg)
    np.testing.assert_allclose(comb.sum(axis=1), 1, atol=1e-4)
    np.testing.assert_allclose(comb.sum(axis=2), 1, atol=1e-3)
    assert ((post > 0) & (post < 2)).all() and u.shape == (3, cfg.n_embd)


def test_fp8_and_rms_norm_kernels_match_numerics():
    rng = np.random.default_rng(21)
    x = (rng.standard_normal((200, 512)) * np.exp2(rng.integers(-14, 10, (200, 1)))).astype(F32)
    x[0, :64] = 0.0  # amax floor
    x[1, :64] = np.arange(64, dtype=F32) * F32(0.25) - 8  # ties
    np.testing.assert_array_equal(kernels.fp8_kv_round(x, 448), numerics.fp8_kv_round(x, 448))
    w = rng.standard_normal(512).astype(F32)
    for weight in (w, None):
        got = kernels.rms_norm(x.reshape(4, 50, 512), weight, 1e-6)
        np.testing.assert_allclose(got, numerics.rms_norm(x.reshape(4, 50, 512), weight, 1e-6), rtol=2e-6, atol=1e-30)
        assert np.array_equal(kernels.rms_norm(x[7:8], weight, 1e-6)[0], got.reshape(200, 512)[7])


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_kernel_is_apply_tail_bit_for_bit(inverse):
    cfg = preset("tiny")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 3, cfg.head_dim)).astype(F32)
    cos, sin = cos_sin(inv_freq(cfg, True), np.arange(100, 106))
    np.testing.assert_array_equal(kernels.apply_tail(x, cos, sin, cfg.rope_dim, inverse),
                                  apply_tail(x, cos, sin, cfg.rope_dim, inverse))
    np.testing.assert_array_equal(kernels.apply_tail(x[:, 0], cos, sin, cfg.rope_dim, inverse),
                                  apply_tail(x[:, 0], cos, sin, cfg.rope_dim, inverse))


def test_indexer_qat_kernel_is_numerics_bit_for_bit():
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((30, 4, 128)) * np.exp2(rng.integers(-20, 10, (30, 4, 1)))).astype(F32)
    x[0, 0] = 0.0
    np.testing.assert_array_equal(kernels.indexer_qat(x), numerics.indexer_qat(x))
