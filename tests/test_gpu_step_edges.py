"""The decode step's two ends (engine/gpu/step_edges.cu, NOTES v32): the embedding rows in one launch (the bits of
torch's emb[tok].to(float32) expanded over the residual streams) and greedy's argmax read by a grid, which also feeds
the next step on the device (token, position, output list), so a greedy step is one graph replay."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from ds4.engine import gpu  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and gpu.available()),
                                                  reason="needs a CUDA device and the built extension")]


@pytest.fixture(scope="module")
def K():
    from ds4.engine.gpu.fused import Fused

    ext = gpu.load()
    yield Fused(ext, torch.device("cuda"))
    ext.reset_stream()


@pytest.mark.parametrize("n", [1023, 1024 * 127 + 5, 600_001])
def test_argmax_grid_is_torch_argmax_across_cta_slices(K, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).cuda()
    out = torch.full((1,), -7, dtype=torch.long, device="cuda")
    for a, b in ((1, n - 1), (n // 2 - 1, n // 2), (n - 2, 3)):  # ties in other CTAs' slices: the first index wins
        y = x.clone()
        y[a] = y[b] = float(y.max()) + 1.0
        K.argmax_into(y, out)
        assert int(out) == int(torch.argmax(y)) == min(a, b)
    y = x.clone()
    y[n - 3] = y[n // 3] = float("nan")
    K.argmax_into(y, out)
    assert int(out) == int(torch.argmax(y)) == n // 3


def test_argmax_feeds_the_next_step(K):
    x = torch.randn(129280, device="cuda")
    tok = torch.zeros(1, dtype=torch.long, device="cuda")
    pos = torch.full((1,), 9, dtype=torch.long, device="cuda")
    hist = torch.full((12,), -1, dtype=torch.long, device="cuda")
    K.argmax_into(x, tok, pos, hist)
    want = int(torch.argmax(x))
    assert int(tok) == want and int(pos) == 10 and hist[10].item() == want
    assert (hist[:10] == -1).all() and hist[11].item() == -1
    K.argmax_into(x, tok, pos, hist)
    K.argmax_into(x, tok, pos, hist)  # position 12 is past the list: clamped to its last entry
    assert int(pos) == 12 and hist[11].item() == want
    graph = torch.cuda.CUDAGraph()
    pos.fill_(0)
    with torch.cuda.graph(graph):  # each replay advances the position and records its own argmax
        K.argmax_into(x, tok, pos, hist)
    for i, j in enumerate((5, 77_777, 129_279)):
        x[j] = 1e6 + i
        graph.replay()
        torch.cuda.synchronize()
        assert int(tok) == j and int(pos) == i + 1 and hist[i + 1].item() == j


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("T,D", [(1, 4096), (5, 1000), (3, 4)])
def test_embed_is_torch_gather_expanded(K, dtype, T, D):
    g = torch.Generator().manual_seed(T * D)
    emb = (torch.randn(50, D, generator=g) * 3).to(dtype).cuda()
    tok = torch.randint(0, 50, (T,), generator=g).cuda()
    X = K.embed(emb, tok, 4)
    want = emb[tok].to(torch.float32)[:, None, :].expand(-1, 4, -1)
    assert X.shape == (T, 4, D) and torch.equal(X, want)
    bad = tok.clone()
    bad[-1] = 50
    Xb = K.embed(emb, bad, 4)
    assert torch.isnan(Xb[-1]).all() and torch.equal(Xb[:-1], want[:-1])


def test_embed_refuses_other_tables(K):
    with pytest.raises(ValueError, match="float16/float32"):
        K.embed(torch.zeros(4, 8, dtype=torch.bfloat16, device="cuda"), torch.zeros(1, dtype=torch.long,
                                                                                     device="cuda"), 4)


def test_greedy_graph_eager_and_host_tokens_agree(tiny_gguf):
    """Greedy with graph replays (the argmax feeding each replay), greedy without graphs, and decode() of host tokens
    give the same ids and logits; a decode() of a host token between two greedy runs takes its place."""
    from ds4.engine.gpu.session import Session
    from ds4.engine.model import Model

    m = Model.load(tiny_gguf).with_numerics(fp8_kv=False, indexer_qat=False)
    rng = np.random.default_rng(5)
    toks = rng.integers(2, m.config.vocab_size, 40).tolist()
    runs = {}
    for graphs in (True, False):
        s = Session(m, ctx=128, graphs=graphs)
        s.sync(toks)
        a = s.greedy(6)
        s.decode(a[-1] ^ 1)  # a host token that greedy would not have chosen
        b = s.greedy(5)
        runs[graphs] = (a, b, s.tokens, s.logits)
    assert runs[True][:3] == runs[False][:3]
    np.testing.assert_array_equal(runs[True][3], runs[False][3])
    a, b, tokens, _ = runs[True]
    assert tokens == toks + a + [a[-1] ^ 1] + b
    s = Session(m, ctx=128, graphs=True)
    logits = s.sync(toks)
    for i, t in enumerate(tokens[len(toks):]):  # the same timeline by host tokens: greedy's picks were the argmax
        if i != 6:  # (6: the host token)
            assert t == int(np.argmax(logits))
        logits = s.decode(t)
    np.testing.assert_array_equal(logits, runs[True][3])


def test_argmax_banned_index_counts_as_minus_inf_and_graphs_follow_it(K):
    x = torch.randn(129280, device="cuda")
    order = torch.argsort(x, descending=True)
    out = torch.zeros(1, dtype=torch.long, device="cuda")
    banned = torch.full((1,), int(order[0]), dtype=torch.long, device="cuda")
    graph = torch.cuda.CUDAGraph()
    K.argmax_into(x, out, banned=banned)
    assert int(out) == int(order[1])
    with torch.cuda.graph(graph):
        K.argmax_into(x, out, banned=banned)
    for b, want in ((-1, order[0]), (int(order[1]), order[0]), (int(order[0]), order[1]), (129280, order[0])):
        banned.fill_(b)  # -1 and an index past the end ban nothing
        graph.replay()
        torch.cuda.synchronize()
        assert int(out) == int(want)


def test_greedy_banned_is_argmax_excluding_and_the_sweep_runs_on_the_device(tiny_gguf):
    from ds4.engine.gpu.session import Session
    from ds4.engine.model import Model
    from ds4.speed_bench.frontier import argmax_excluding, sweep

    m = Model.load(tiny_gguf).with_numerics(fp8_kv=False, indexer_qat=False)
    toks = np.random.default_rng(6).integers(2, m.config.vocab_size, 40).tolist()
    s = Session(m, ctx=128)
    logits = s.sync(toks)
    banned = int(np.argmax(logits))  # the first pick is banned: greedy must take the runner-up
    got = s.greedy(8, banned=banned)
    h = Session(m, ctx=128)
    logits, want = h.sync(toks), []
    for _ in range(8):
        want.append(argmax_excluding(logits, banned))
        logits = h.decode(want[-1])
    assert got == want and banned not in got
    rows = sweep(Session(m, ctx=128), toks + got, [32, 40], 6, banned)
    assert [r.ctx_tokens for r in rows] == [32, 40] and all(r.gen_tps > 0 and r.prefill_tps > 0 for r in rows)


def test_ds4_bench_on_cuda_gives_the_cpu_backends_rows_shape(tiny_gguf, tmp_path):
    """ds4-bench --backend cuda end to end (its warm-up on the timed session itself: one copy of the weights; the
    generation through greedy(n, banned=EOS) on the device), with the bandwidth floor in the header."""
    import subprocess
    import sys

    from ds4.speed_bench.csvio import read_csv

    out, text = tmp_path / "cuda.csv", tmp_path / "prompt.txt"
    text.write_text(" ".join(f"word{i} and some more text, line {i}." for i in range(200)))  # no data dir needed
    r = subprocess.run([sys.executable, "-m", "ds4.speed_bench.cli", "-m", str(tiny_gguf), "--backend", "cuda",
                        "--ctx-start", "16", "--ctx-max", "70", "--step-incr", "24", "--gen-tokens", "5", "--csv",
                        str(out), "--prompt-file", str(text)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    run = read_csv(out)
    assert run.meta["backend"] == "cuda" and float(run.meta["floor_ms"]) > 0 and "of the floor" in r.stderr
    # the GPU memory in use with the session open: at least the weights' upload (tiny's 36 MiB of tensors)
    assert float(run.meta["gpu_mem_used_gib"]) >= 0.03 and float(run.meta["torch_peak_gib"]) >= 0
    assert "GPU memory in use after the sweep" in r.stderr
    # the device and the build switch beside the figures
    assert run.meta["gpu_device"] and run.meta["gpu_l2_evict_first"] == str(int(gpu.load().l2_evict_first()))
    assert [row.ctx_tokens for row in run.rows] == [16, 40, 64, 70]
    assert all(row.gen_tokens == 5 and row.gen_tps > 0 and row.prefill_tps > 0 for row in run.rows)


def test_a_graph_captured_before_the_scratch_moved_is_captured_again(tiny_gguf):
    """ds4-bench's order: a warm-up captures the decode graph, the timeline is dropped, then each frontier is a fresh
    prefill in several chunks, a snapshot, greedy on the device and a restore. Every frontier's tokens and logits
    must be those of a session that never saw the warm-up (one that captures its graph after the prefill). Between
    the two, the extension's scratch moves, as a longer prefill chunk makes it do: the graph captured before points
    into the freed buffer (on Flash, an illegal address at ds4-bench's second frontier) and must be captured again."""
    from ds4.engine.gpu.session import Session
    from ds4.engine.model import Model

    m = Model.load(tiny_gguf).with_numerics(fp8_kv=False, indexer_qat=False)
    toks = np.random.default_rng(9).integers(2, m.config.vocab_size, 700).tolist()
    s = Session(m, ctx=777, prefill_chunk=256)
    logits = s.sync(toks[:300])
    for _ in range(2):
        logits = s.decode(int(np.argmax(logits)))
    s.invalidate()
    ext, g0, n = s.W.ext, s.W.ext.scratch_generation(), 128 << 20
    while ext.scratch_generation() == g0:  # what a longer prefill chunk does: the ops' shared scratch moves
        ext.reserve_scratch(n)
        n *= 2
    for f in (256, 640):
        s.sync(toks[:f])
        snap = s.snapshot()
        got = s.greedy(12, banned=1)
        got_logits = s.logits
        s.restore(snap)
        fresh = Session(m, ctx=777, prefill_chunk=256)
        fresh.sync(toks[:f])
        assert got == fresh.greedy(12, banned=1), f"frontier {f}"
        np.testing.assert_array_equal(got_logits, fresh.logits)
        assert s.tokens == toks[:f]
