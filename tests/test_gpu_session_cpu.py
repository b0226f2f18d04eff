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


def test_hooks_are_refused(tiny):
    from ds4.engine.session import SessionError

    with pytest.raises(SessionError, match="hooks"):
        GpuSession(tiny, ctx=64, hooks=object(), device="cpu")
