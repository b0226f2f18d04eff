"""Decode without the indexer while every compressed row is visible to it (ds4.engine.gpu.fused.SHORT_INDEX): model-spec
§3 runs the indexer only where a ratio-4 layer's visible compressed rows outnumber top-k, and the CPU engine does the
same; the GPU session decides it per step on the host, so each step kind gets a decode graph with the indexer and one
without. Held here: the step keys, the torch form on the CPU against the numpy engine and against the session that
always runs the indexer, across the position where the indexer starts, and (CUDA) the fused kernels' graphs."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4.engine.gpu import fused  # noqa: E402
from ds4.engine.gpu.session import Session as GpuSession  # noqa: E402
from ds4.engine.model import Model  # noqa: E402
from gpu_session_util import rel  # noqa: E402
from ds4.engine.session import Session as CpuSession  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    return Model.load(tiny_gguf).with_numerics(fp8_kv=False, indexer_qat=False)


def _first_indexed_pos(cfg) -> int:
    """The first decode position whose ratio-4 layers see more compressed rows than top-k."""
    return 4 * (cfg.indexer_top_k + 1) - 1


def test_step_key_runs_the_indexer_only_past_top_k(tiny, monkeypatch):
    cfg = tiny.config
    p1 = _first_indexed_pos(cfg)
    monkeypatch.setattr(fused, "SHORT_INDEX", True)
    s = GpuSession(tiny, ctx=256, device="cpu")
    assert any(fused.indexer_sized(s, li) for li in range(cfg.n_layer))
    assert [s._step_key(p)[1] for p in (0, p1 - 1, p1, p1 + 100)] == [False, False, True, True]
    with s.indexer_forced():
        assert s._step_key(0)[1] and s._step_key(p1 - 1)[1]
    assert not s._step_key(0)[1]  # the context restores it
    monkeypatch.setattr(fused, "SHORT_INDEX", False)
    assert s._step_key(0)[1]
    monkeypatch.setattr(fused, "SHORT_INDEX", True)
    unsized = GpuSession(tiny, ctx=4 * (cfg.indexer_top_k - 2), device="cpu")  # rows ctx / 4 + 2: one key
    assert not any(fused.indexer_sized(unsized, li) for li in range(cfg.n_layer))
    assert all(unsized._step_key(p)[1] for p in (0, p1 - 1))


@pytest.mark.parametrize("short", [False, True])
def test_decode_across_the_indexer_start_matches_the_cpu_engine(tiny, monkeypatch, short):
    """Decode from position 20 (tiny: top-k 8, the indexer starts at 35) to 70 in a session sized past top-k, so the
    indexer is built for every ratio-4 layer: with SHORT_INDEX the steps before 35 attend the first top-k rows."""
    cfg = tiny.config
    monkeypatch.setattr(fused, "SHORT_INDEX", short)
    toks = np.random.default_rng(3).integers(2, cfg.vocab_size, 70).tolist()
    c = CpuSession(tiny, ctx=256)
    g = GpuSession(tiny, ctx=256, device="cpu")
    assert rel(g.sync(toks[:20]), c.sync(toks[:20])) < 1e-5
    errs = [rel(g.decode(t), c.decode(t)) for t in toks[20:]]
    assert max(errs) < 1e-5, (np.argmax(errs) + 20, max(errs))


def test_short_index_gives_the_always_indexed_logits(tiny, monkeypatch):
    """Below the start the skipped indexer would have chosen every visible row: the logits equal the always-indexed
    session's to float rounding (the attention sums the rows in index order, as the top-k kernel returns them)."""
    cfg = tiny.config
    toks = np.random.default_rng(4).integers(2, cfg.vocab_size, 60).tolist()
    outs = []
    for short in (False, True):
        monkeypatch.setattr(fused, "SHORT_INDEX", short)
        g = GpuSession(tiny, ctx=256, device="cpu")
        g.sync(toks[:5])
        outs.append(np.stack([g.decode(t) for t in toks[5:]]))
    assert rel(outs[1], outs[0]) < 1e-6


def _cuda_ready() -> bool:
    from ds4.engine import gpu

    return torch.cuda.is_available() and gpu.available()


@pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device and the built extension")
def test_cuda_graphs_without_the_indexer_match_the_indexed_ones(tmp_path_factory, monkeypatch):
    """The fused kernels on `small` (q2 layout; top-k 64, so the indexer starts at position 259): decode graphs from
    position 200 to 300 with SHORT_INDEX against the always-indexed session, the graph keys of both sides of the
    start, a warm-up under indexer_forced capturing the indexed graphs at a short position, and greedy ids."""
    from conftest import quantize_cli

    d = tmp_path_factory.mktemp("short_index")
    quantize_cli("synth", "--preset", "small", "--gguf", str(d / "small.gguf"), "--mix", "q2", "--quiet")
    m = Model.load(d / "small.gguf").with_numerics(fp8_kv=False, indexer_qat=False)
    p1 = _first_indexed_pos(m.config)
    toks = np.random.default_rng(8).integers(2, m.config.vocab_size, 300).tolist()
    W, outs, sessions = None, [], []
    for short in (False, True):
        monkeypatch.setattr(fused, "SHORT_INDEX", short)
        s = GpuSession(m, ctx=1024, weights=W)
        W = s.W
        s.sync(toks[:200])
        outs.append(np.stack([s.decode(t) for t in toks[200:]]))
        sessions.append(s)
    keys = set(sessions[1]._graphs)
    assert {on for _, on in keys} == {False, True}
    err_before = rel(outs[1][:p1 - 200], outs[0][:p1 - 200])
    err_after = rel(outs[1][p1 - 200:], outs[0][p1 - 200:])
    print(f"\nshort index: rel before the start {err_before:.2e}, after {err_after:.2e}")
    assert err_before < 1e-4 and err_after < 1e-4
    assert sessions[1].greedy(8) == sessions[0].greedy(8)
    monkeypatch.setattr(fused, "SHORT_INDEX", True)
    s = GpuSession(m, ctx=1024, weights=W)
    s.sync(toks[:20])
    with s.indexer_forced():
        for t in toks[20:30]:
            s.decode(t)
    assert {on for _, on in s._graphs} == {True}
