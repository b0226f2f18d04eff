"""The CUDA engine's graph (ds4.engine.gpu.session) run by torch on the CPU, held to the numpy engine.

Same code as on the GPU except the weight products (float32 matmuls here, the extension's kernels
there): prefill path, static decode path (the one captured in a CUDA graph), compressors,
indexer top-k, snapshot/restore. With the FP8/FP4 rounding simulations off the two engines agree
to float32 rounding; with them on, different summation orders flip a few roundings, so the check
there is looser.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4.engine.model import Model  # noqa: E402
from ds4.engine.session import Session as CpuSession  # noqa: E402
from ds4.engine.gpu import ops  # noqa: E402
from ds4.engine.gpu.session import Session as GpuSession  # noqa: E402
from ds4.engine import numerics  # noqa: E402


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    return Model.load(tiny_gguf)


def _prompt(cfg, n, seed=0):
    return np.random.default_rng(seed).integers(2, cfg.vocab_size, n).tolist()


def test_simulated_values_are_exact_in_the_tensor_core_formats():
    """The premises of two GPU kernels, over magnitudes from 1e-6 to 1e4: the FP8 KV simulation's values have no bits
    below TF32's mantissa (attn_prefill.cu's exact_dims skips their zero lo part), and the indexer QAT's values (e2m1
    codes times powers of two) fit bfloat16 (indexer.cu multiplies them there)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 512)).astype(np.float32) * np.logspace(-6, 4, 64, dtype=np.float32)[:, None]
    kv = ops.fp8_kv_round(torch.from_numpy(x), 448)[:, :448].numpy()
    assert not (kv.view(np.uint32) & np.uint32(0x1FFF)).any()  # TF32 keeps the top 19 bits
    qat = ops.indexer_qat(torch.from_numpy(x.reshape(-1, 128))).numpy()
    assert not (qat.view(np.uint32) & np.uint32(0xFFFF)).any()  # bfloat16 keeps the top 16 bits


def test_rounding_twins_match_numpy():
    x = np.random.default_rng(0).standard_normal((5, 512)).astype(np.float32) * 3
    t = torch.from_numpy(x)
    assert np.array_equal(ops.fp8_kv_round(t, 448).numpy(), numerics.fp8_kv_round(x, 448))
    y = x[:, :128]
    assert np.allclose(ops.indexer_qat(torch.from_numpy(y)).numpy(), numerics.indexer_qat(y), atol=1e-6)


@pytest.mark.parametrize("chunk", [64, 1000])
def test_prefill_and_decode_match_the_cpu_engine(tiny, chunk):
    m = tiny.with_numerics(fp8_kv=False, indexer_qat=False)
    cfg = m.config
    toks = _prompt(cfg, 300)  # past the raw window, top-k (8 for tiny) and two ratio-128 rows
    c = CpuSession(m, ctx=512, prefill_chunk=chunk)
    g = GpuSession(m, ctx=512, prefill_chunk=chunk, device="cpu")
    assert rel(g.sync(toks[:290]), c.sync(toks[:290])) < 1e-5
    for t in toks[290:]:
        assert rel(g.decode(t), c.decode(t)) < 1e-5
    a, b = np.frombuffer(c.snapshot(), np.uint8), np.frombuffer(g.snapshot(), np.uint8)
    assert len(a) == len(b) and np.array_equal(a[:52], b[:52])
    fa, fb = a[52:].view(np.float32), b[52:].view(np.float32)
    assert np.allclose(fa, fb, rtol=1e-4, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("block, budget", [(7, None), (0, 1)])
def test_prefill_attention_in_query_blocks(tiny, monkeypatch, block, budget):
    """Prefill attention and the indexer run in blocks of queries (each reading its window view and its
    top-k rows): a fixed size (7), or the byte budget's (1 byte: the 64-query minimum); the block size must
    not change the result."""
    from ds4.engine.gpu import prefill

    m = tiny.with_numerics(fp8_kv=False, indexer_qat=False)
    toks = _prompt(m.config, 200, seed=6)
    whole = GpuSession(m, ctx=256, device="cpu").prefill(toks, all_logits=True)
    monkeypatch.setattr(prefill, "ATTN_BLOCK", block)
    if budget is not None:
        monkeypatch.setattr(prefill, "ATTN_BYTES", budget)
        assert prefill.block_rows(10**6) == 64
    blocks = GpuSession(m, ctx=256, device="cpu").prefill(toks, all_logits=True)
    ref = CpuSession(m, ctx=256).prefill(toks, all_logits=True)
    assert rel(blocks, whole) < 1e-6
    assert rel(blocks, ref) < 1e-5


def test_chunked_prefill_equals_decode_and_rounding_sims_stay_close(tiny):
    cfg = tiny.config
    toks = _prompt(cfg, 160, seed=1)
    g1 = GpuSession(tiny, ctx=256, prefill_chunk=32, device="cpu")
    g2 = GpuSession(tiny, ctx=256, prefill_chunk=256, device="cpu")
    c = CpuSession(tiny, ctx=256)
    l1 = g1.prefill(toks, all_logits=True)
    l2 = np.stack([g2.decode(t) for t in toks])
    lc = c.prefill(toks, all_logits=True)
    assert np.mean([rel(l1[i], l2[i]) for i in range(len(toks))]) < 1e-3
    assert np.median([rel(l1[i], lc[i]) for i in range(len(toks))]) < 2e-3


def test_restore_round_trip_and_greedy(tiny):
    m = tiny.with_numerics(fp8_kv=False, indexer_qat=False)
    toks = _prompt(m.config, 140, seed=2)
    c = CpuSession(m, ctx=256)
    c.sync(toks)
    g = GpuSession(m, ctx=256, device="cpu")
    g.restore(c.snapshot())
    assert g.tokens == toks
    ids = g.greedy(8)
    want = []
    logits = c.logits
    for _ in range(8):
        want.append(int(np.argmax(logits)))
        logits = c.decode(want[-1])
    assert ids == want and g.tokens == toks + want


def test_greedy_banned_token_is_never_chosen(tiny):
    """The torch form of greedy's device feed with a banned id (ds4-bench's EOS): argmax_excluding's tokens."""
    from ds4.speed_bench.frontier import argmax_excluding

    m = tiny.with_numerics(fp8_kv=False, indexer_qat=False)
    toks = _prompt(m.config, 40, seed=4)
    c = CpuSession(m, ctx=128)
    logits = c.sync(toks)
    banned = int(np.argmax(logits))
    g = GpuSession(m, ctx=128, device="cpu")
    g.restore(c.snapshot())
    ids = g.greedy(6, banned=banned)
    want = []
    for _ in range(6):
        want.append(argmax_excluding(logits, banned))
        logits = c.decode(want[-1])
    assert ids == want and banned not in ids


def test_hooks_are_refused(tiny):
    from ds4.engine.session import SessionError

    with pytest.raises(SessionError, match="hooks"):
        GpuSession(tiny, ctx=64, hooks=object(), device="cpu")


def test_quantize_hilo_matches_the_kernel_rule():
    # ops.quantize_hilo is the CPU statement of repack.cu's quantize_x_kernel (x = s/254 (254 hi + lo))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 256)).astype(np.float32) * np.float32(5.0)
    x[0, :32] = 0.0  # an all-zero block stays zero
    got = ops.quantize_hilo(torch.from_numpy(x)).numpy()
    b = x.reshape(3, 8, 32).astype(np.float64)
    s = np.abs(b).max(-1, keepdims=True) / 127.0
    assert np.all(np.abs(got.reshape(3, 8, 32) - b) <= s / 508.0 * 1.001 + 1e-12)
    assert np.all(got[0, :32] == 0.0)
    # the representable grid: 254 hi + lo is an integer with |lo| <= 127
    q = got.reshape(3, 8, 32)[1:] / (np.float32(s[1:]) / np.float32(254.0))
    assert np.allclose(q, np.round(q), atol=2e-3)


@pytest.mark.slow
def test_chunked_prefill_equals_decode_with_kernel_rounding_and_same_routing(tmp_path):
    """The CUDA engine's 'chunked prefill != decode' (NOTES.md) reproduced and explained on the CPU.

    With the kernels' activation rounding emulated, prefill (chunks of 16) and decode differ by ~1e-5;
    where a router's k-th and (k+1)-th scores are closer than that, the two paths route differently
    (a discontinuity, not a bug). Replaying the prefill's routing in decode must then agree to 1e-3
    at every position, and every unforced routing difference must be a near-tie.
    """
    from conftest import quantize_cli
    from ds4.engine.gpu.routing import RouteRecorder, RouteReplayer
    from ds4.engine.gpu.session import Weights

    quantize_cli("synth", "--preset", "small", "--gguf", str(tmp_path / "s.gguf"), "--mix", "q2", "--quiet")
    m = Model.load(tmp_path / "s.gguf").with_numerics(fp8_kv=False, indexer_qat=False)
    toks = _prompt(m.config, 40, seed=4)
    W = Weights(m, torch.device("cpu"), emulate_kernels=True)
    a = GpuSession(m, ctx=128, prefill_chunk=16, device="cpu", weights=W)
    ra = RouteRecorder(a)
    la = a.prefill(toks, all_logits=True)
    free = GpuSession(m, ctx=128, device="cpu", weights=W)
    rf = RouteRecorder(free)
    lf = np.stack([free.decode(t) for t in toks])
    for li, p in ra.differences(rf):
        assert min(ra.gap[li][p], rf.gap[li][p]) < 1e-3, f"layer {li} pos {p} routed differently without a near-tie"
    first = min([p for _, p in ra.differences(rf)], default=len(toks))
    assert max(rel(la[i], lf[i]) for i in range(first)) <= 1e-3
    forced = GpuSession(m, ctx=128, device="cpu", weights=W)
    RouteReplayer(forced, ra)
    lb = np.stack([forced.decode(t) for t in toks])
    errs = [rel(la[i], lb[i]) for i in range(len(toks))]
    assert max(errs) <= 1e-3, f"max rel {max(errs):.2e} at {int(np.argmax(errs))}"


def test_prefetch_spec_parses_points_and_refuses_bad_ones():
    from ds4.engine.gpu.session import parse_prefetch
    from ds4.engine.session import SessionError

    assert parse_prefetch("") == {}
    assert parse_prefetch("oa, ob:0.25+sh") == {"oa": 1.0, "ob": 0.25, "sh": 1.0}
    for bad in ("xx", "oa:2", "ob:half", "qb:-0.1"):
        with pytest.raises(SessionError, match="DS4_GPU_PREFETCH"):
            parse_prefetch(bad)


@pytest.mark.parametrize("exact", [True, False])
def test_split_products_hold_float32_precision(exact):
    """tc.mm of two Splits (hi + lo float16 parts) is a float32-level product; without the lo parts
    (DS4_GPU_PREFILL_GEMM=f16) it is a float16-level one. Views and gathers act on both parts."""
    from ds4.engine.gpu import tc

    rng = np.random.default_rng(2)
    a = torch.from_numpy(rng.standard_normal((6, 5, 64)).astype(np.float32) * 30)
    b = torch.from_numpy(rng.standard_normal((70, 64)).astype(np.float32) * 0.01)
    win = tc.each(tc.split(b, exact), lambda v: v.unfold(0, 9, 1)[:6])  # [6, 64, 9] overlapping windows
    got = tc.mm(tc.split(a, exact), win).numpy()
    want = np.einsum("thd,tdn->thn", a.double().numpy(), b.double().numpy()[np.arange(6)[:, None] + np.arange(9)].transpose(0, 2, 1))
    sel = torch.from_numpy(rng.integers(0, 70, (6, 4)))
    got2 = tc.mm(tc.split(a, exact), tc.t(tc.each(tc.split(b, exact), lambda v: v[sel]))).numpy()
    want2 = np.einsum("thd,tkd->thk", a.double().numpy(), b.double().numpy()[sel.numpy()])
    err = max(rel(got, want), rel(got2, want2))
    assert (err < 1e-6) if exact else (1e-5 < err < 3e-3), err


def test_prefill_with_split_attention_products_matches_the_cpu_engine(tiny, monkeypatch):
    """The tensor-core path of prefill attention and the indexer (tc.Splits), run on the CPU: past the window,
    the top-k and ratio-128 rows, all logits agree with the CPU engine at float32 level."""
    from ds4.engine.gpu import tc

    shapes = []
    real_split = tc.split
    monkeypatch.setattr(tc, "split", lambda x, exact=True: shapes.append(tuple(x.shape)) or real_split(x, exact))
    m = tiny.with_numerics(fp8_kv=False, indexer_qat=False)
    cfg = m.config
    toks = _prompt(cfg, 300, seed=8)
    g = GpuSession(m, ctx=512, prefill_chunk=128, device="cpu")
    g.tc_attn = True
    got = g.prefill(toks, all_logits=True)
    ref = CpuSession(m, ctx=512, prefill_chunk=128).prefill(toks, all_logits=True)
    assert rel(got, ref) < 1e-5
    # queries, window keys, compressed rows and the indexer's queries and keys all went through splits
    assert {len(s) for s in shapes} == {2, 3} and any(s[-1] == cfg.indexer_dim for s in shapes)


def test_split_of_no_rows_is_empty():
    """Before the first compressed row exists the split of comp[:0] is empty, not an error."""
    from ds4.engine.gpu import tc

    sp = tc.split(torch.zeros((0, 16)))
    assert sp.hi.shape == (0, 16) and float(sp.s) == 1.0


def test_prefill_attention_modes_are_checked():
    from ds4.engine.gpu import tc

    assert tc.parse_attn_mode("") == "fused" and tc.parse_attn_mode(" TF32 ") == "tf32"
    with pytest.raises(ValueError, match="unknown mode.*f32, tf32, tc, fused"):
        tc.parse_attn_mode("fp16")


def test_prefill_gemm_modes_are_checked():
    from ds4.engine.gpu import weights

    assert weights.parse_prefill_gemm("") == "fp8" and weights.parse_prefill_gemm(" Exact ") == "exact"
    with pytest.raises(ValueError, match="unknown mode.*fp8, exact, f16, mmq"):
        weights.parse_prefill_gemm("fp16")


def test_an_unknown_gpu_switch_value_is_a_cli_error_not_a_fallback():
    """With a CUDA device the ds4 CLI imports the CUDA session, whose switches are read then: an unknown
    DS4_GPU_PREFILL_GEMM is a one-line CLI error naming the known modes, not a traceback or a silent CPU fallback
    (a fresh interpreter: the switch is read at import; the device check is stubbed, nothing runs on it)."""
    import os
    import subprocess
    import sys

    code = ("from ds4.engine import cli, gpu\n"
            "gpu.available = lambda: True\n"
            "try:\n"
            "    cli._gpu_session_class()\n"
            "except cli.CliError as e:\n"
            "    print('CliError:', e)\n")
    env = dict(os.environ, DS4_GPU_PREFILL_GEMM="fp16")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "CliError: DS4_GPU_PREFILL_GEMM='fp16': unknown mode (known: fp8, exact, f16, mmq)" in out.stdout


def test_sessions_of_one_model_share_one_upload(tiny):
    """Weights.shared: a session opened while another lives reuses its weights (Flash q2 does not fit an H200
    twice); a model with other numerics, or one whose sessions are all gone, gets its own upload."""
    import gc

    a = GpuSession(tiny, ctx=64, device="cpu")
    b = GpuSession(tiny, ctx=128, device="cpu")
    other = tiny.with_numerics(fp8_kv=False, indexer_qat=False)
    c = GpuSession(other, ctx=64, device="cpu")
    assert a.W is b.W and c.W is not a.W
    toks = _prompt(tiny.config, 20, seed=7)
    np.testing.assert_array_equal(a.sync(toks), b.sync(toks))  # sharing changes nothing in the arithmetic
    import weakref

    upload = weakref.ref(a.W)
    del a, b
    gc.collect()
    assert upload() is None  # the cache holds no session's weights alive
    d = GpuSession(tiny, ctx=64, device="cpu")
    np.testing.assert_array_equal(d.sync(toks), GpuSession(tiny, ctx=64, device="cpu", weights=d.W).sync(toks))
