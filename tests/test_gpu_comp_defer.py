"""Decode's compressor products deferred to each window's last step (ds4.engine.gpu.comp_defer), run by torch on the
CPU: the session with the ring against the same session computing the products every step, across window ends of both
ratios, a window begun by a prefill chunk, snapshots and prefill chunks taken in the middle of a window, and restores."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4.engine.gpu import comp_defer  # noqa: E402
from ds4.engine.gpu.session import Session as GpuSession  # noqa: E402
from ds4.engine.model import Model  # noqa: E402
from gpu_session_util import rel  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    return Model.load(tiny_gguf).with_numerics(fp8_kv=False, indexer_qat=False)


def _sessions(model, monkeypatch, ctx=256):
    monkeypatch.setattr(comp_defer, "DEFER", False)
    every = GpuSession(model, ctx=ctx, device="cpu")
    monkeypatch.setattr(comp_defer, "DEFER", True)
    deferred = GpuSession(model, ctx=ctx, device="cpu")
    assert every.comp_ring is None and deferred.comp_ring is not None
    return every, deferred


def test_step_kind_names_the_ratios_whose_window_ends(tiny):
    cfg = tiny.config
    assert set(comp_defer.ratios(cfg)) == {4, 128}  # the tiny preset has both kinds of compressed layers
    assert comp_defer.step_kind(cfg, 0) == ()
    assert comp_defer.step_kind(cfg, 3) == (4,)
    assert comp_defer.step_kind(cfg, 126) == ()
    assert comp_defer.step_kind(cfg, 127) == (4, 128)
    assert comp_defer.step_kind(cfg, 131) == (4,)


def test_deferred_products_give_the_every_step_logits(tiny, monkeypatch):
    """A prefill that ends inside both kinds of window (6 tokens), decode across the ratio-128 window's end and 32
    ratio-4 ends, a snapshot inside a window, then a prefill chunk that starts inside one."""
    every, deferred = _sessions(tiny, monkeypatch)
    toks = np.random.default_rng(3).integers(2, tiny.config.vocab_size, 160).tolist()
    assert rel(deferred.prefill(toks[:6]), every.prefill(toks[:6])) < 1e-6
    for t in toks[6:133]:
        assert rel(deferred.decode(t), every.decode(t)) < 1e-5
    # the frontiers hold the pending rows of both windows (133 % 4 == 1, 133 % 128 == 5) after the snapshot's flush
    a, b = np.frombuffer(every.snapshot(), np.uint8), np.frombuffer(deferred.snapshot(), np.uint8)
    assert len(a) == len(b) and np.array_equal(a[:52], b[:52])
    assert np.allclose(a[52:].view(np.float32), b[52:].view(np.float32), rtol=1e-4, atol=1e-5, equal_nan=True)  # float32 rounding: [r, n] products
    for t in toks[133:138]:  # decode again after the flush: the ring resumes at the flushed phase
        assert rel(deferred.decode(t), every.decode(t)) < 1e-5
    out_e, out_d = every.prefill(toks[138:150], all_logits=True), deferred.prefill(toks[138:150], all_logits=True)
    assert rel(out_d, out_e) < 1e-5
    for t in toks[150:160]:
        assert rel(deferred.decode(t), every.decode(t)) < 1e-5


def test_restore_inside_a_window_then_deferred_greedy(tiny, monkeypatch):
    every, deferred = _sessions(tiny, monkeypatch)
    toks = np.random.default_rng(4).integers(2, tiny.config.vocab_size, 70).tolist()
    every.prefill(toks[:40])
    for t in toks[40:70]:  # 70 % 4 == 2: a restore lands two tokens into a ratio-4 window
        every.decode(t)
    payload = every.snapshot()
    deferred.restore(payload)
    assert deferred.greedy(12) == every.greedy(12)
    assert rel(deferred.logits, every.logits) < 1e-5


def test_invalidate_starts_the_ring_over(tiny, monkeypatch):
    """A timeline rebuilt from scratch (sync to an unrelated prompt) after decode steps left rows pending."""
    every, deferred = _sessions(tiny, monkeypatch)
    rng = np.random.default_rng(5)
    first = rng.integers(2, tiny.config.vocab_size, 10).tolist()
    for s in (every, deferred):
        s.sync(first)
        s.decode(7)
        s.decode(9)
    other = rng.integers(2, tiny.config.vocab_size, 9).tolist()
    assert rel(deferred.sync(other), every.sync(other)) < 1e-6
    for t in (11, 12, 13, 14):
        assert rel(deferred.decode(t), every.decode(t)) < 1e-5


def _cuda_ready() -> bool:
    from ds4.engine import gpu

    return torch.cuda.is_available() and gpu.available()


@pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device and the built extension")
def test_cuda_deferred_products_match_every_step(tmp_path_factory, monkeypatch):
    """The fused kernels on `small` (q2 layout, F16 compressors): the deferred session's graphs, one per step kind,
    against every-step products, across ratio-4 and ratio-128 window ends, a snapshot inside a window and greedy
    decoding; eagerly (no graphs) too. The window's products come from one launch of the streaming kernel with a group
    per ring row (matvec_rows), whose row sums are the batch-1 launch's. Modes 1 and 2 (the window's slots written by torch ops, or read by the compress step kernel) the same
    bits; so are the ring rows written by the mHC kernel (DS4_GPU_RING_HC)."""
    from conftest import quantize_cli

    d = tmp_path_factory.mktemp("defer")
    quantize_cli("synth", "--preset", "small", "--gguf", str(d / "small.gguf"), "--mix", "q2", "--quiet")
    m = Model.load(d / "small.gguf").with_numerics(fp8_kv=False, indexer_qat=False)
    assert {4, 128} <= set(comp_defer.ratios(m.config))
    toks = np.random.default_rng(8).integers(2, m.config.vocab_size, 280).tolist()
    W = None

    def run(defer: bool, kernel_fill: bool = True, graphs: bool = True, hc_store: bool = False):
        nonlocal W
        monkeypatch.setattr(comp_defer, "DEFER", defer)
        monkeypatch.setattr(comp_defer, "KERNEL_FILL", kernel_fill)
        monkeypatch.setattr(comp_defer, "HC_STORE", hc_store)
        s = GpuSession(m, ctx=512, weights=W, graphs=graphs)
        W = s.W
        assert (s.comp_ring is not None) == defer
        s.sync(toks[:150])
        out = np.stack([s.decode(t) for t in toks[150:270]])  # ratio-4 window ends every 4th step, ratio 128 at 255
        return s, out

    every, want = run(False)
    deferred, got = run(True)
    _, got_eager = run(True, graphs=False)
    _, got_fill = run(True, kernel_fill=False)
    by_hc, got_hc = run(True, hc_store=True)
    _, got_hc_eager = run(True, graphs=False, hc_store=True)
    assert {pools for pools, _ in deferred._graphs} == {(), (4,), (4, 128)}
    assert W.ext.compress_ring_takes(4)
    errs = [max(rel(got[i], want[i]), rel(got_eager[i], want[i])) for i in range(len(want))]
    print(f"\ndeferred compressor products: decode rel median {np.median(errs):.2e} max {max(errs):.2e}; "
          f"bitwise equal to every step: {np.array_equal(got, want)}")
    assert max(errs) <= 1e-3
    assert np.array_equal(got_fill, got)
    # DS4_GPU_RING_HC: the mHC kernel wrote the ring rows (every compressed layer after the first mHC post, each step)
    assert by_hc.comp_ring.kernel_rows > 0
    assert np.array_equal(got_hc, got) and np.array_equal(got_hc_eager, got)
    a, b = every.snapshot(), deferred.snapshot()  # the deferred one flushes 2 and 14 pending rows into its frontiers
    assert len(a) == len(b) and a[:52] == b[:52]
    for li, (se, sd) in enumerate(zip(every.layers, deferred.layers)):
        for k in ("comp_kv", "comp_score", "idx_kv", "idx_score", "comp", "idx"):
            if k in se:
                x, y = se[k].cpu().numpy(), sd[k].cpu().numpy()
                fin = np.isfinite(x)
                assert np.array_equal(fin, np.isfinite(y)) and np.array_equal(x[~fin], y[~fin]), (li, k)
                assert rel(y[fin], x[fin]) < 1e-4, (li, k, rel(y[fin], x[fin]))
    assert deferred.greedy(10) == every.greedy(10)


def test_warm_steps_meet_every_step_kind(tiny):
    cfg = tiny.config
    for pos in (0, 5, 127, 300):
        n = comp_defer.steps_to_every_kind(cfg, pos)
        kinds = {comp_defer.step_kind(cfg, p) for p in range(pos, pos + n)}
        assert kinds == {(), (4,), (4, 128)}
        assert comp_defer.step_kind(cfg, pos + n - 1) not in {comp_defer.step_kind(cfg, p) for p in range(pos, pos + n - 1)}
