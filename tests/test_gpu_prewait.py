"""DS4_GPU_PREWAIT (ext.set_prewait): norm_rope, the ratio-4 compressor steps and the attention combine stage their
position-only inputs (the position, norm weights, RoPE factors, sinks) before griddepcontrol.wait, and the ratio-4 step
loads its window at once; mode 2 also the mHC pre's scale, base and norm weight, the router's bias, the position in the
attention partials, the top-k and the index keys, and the index keys' older rows. Each kernel must give the v23 kernels' outputs bit for bit, and so must the session's decode
logits (eager and graph-replayed). Skipped without a CUDA device and the built extension."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from ds4.engine import gpu  # noqa: E402

DEV = "cuda"
HAVE_GPU = torch.cuda.is_available() and gpu.available()
pytestmark = pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA device and the built extension")


@pytest.fixture(scope="module")
def K():
    from ds4.engine.gpu.fused import Fused

    ext = gpu.load()
    yield Fused(ext, torch.device(DEV))
    ext.set_prewait(-1)
    ext.reset_stream()


def rnd(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).float().to(DEV)


def freq_table(rope_dim, base=160000.0):
    return (1.0 / base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)).float().to(DEV)


def both(K, run):
    """run() under the v23 kernels (mode 0), then with the prologues (modes 1 and 2); (off, on) results with `on` the
    mode-2 run, synchronized, after checking that mode 1 gave mode 2's result."""
    outs = []
    try:
        for mode in (0, 1, 2):
            K.ext.set_prewait(mode)
            outs.append(run())
    finally:
        K.ext.set_prewait(-1)
    torch.cuda.synchronize()
    one, two = outs[1:]
    for a, b in zip(one if isinstance(one, (list, tuple)) else [one], two if isinstance(two, (list, tuple)) else [two]):
        assert torch.equal(a, b)
    return outs[0], outs[2]


@pytest.mark.parametrize("p", [0, 7, 2047, 40000])
def test_norm_rope_decode_jobs_same_bits(K, p):
    """The decode launch's three jobs (query heads: norm and RoPE; the KV row: weighted norm, RoPE, FP8, into the ring;
    the indexer's query: RoPE and Hadamard + FP4) give the same bits with the prologue."""
    g = torch.Generator().manual_seed(p + 3)
    rd, H, d, Hi, di, cap = 64, 64, 512, 16, 128, 128
    q, kv, qi = rnd(g, H * d, scale=3.0), rnd(g, d, scale=2.0), rnd(g, Hi * di)
    w, freq, pos = rnd(g, d), freq_table(rd), torch.tensor([p], device=DEV)

    def run():
        ring, qi_out = torch.zeros(cap, d, device=DEV), torch.empty(Hi, di, device=DEV)
        also = [dict(x=kv, d=d, rows_per_token=1, norm=True, w=w, eps=1e-6, freq=freq, rope_dim=rd, fp8_nope=448,
                     out=ring, ring_cap=cap),
                dict(x=qi, d=di, rows_per_token=Hi, freq=freq, rope_dim=rd, qat=True, out=qi_out)]
        out = K.norm_rope(q, d, H, pos, norm=True, eps=1e-6, freq=freq, rope_dim=rd, also=also)
        return out.clone(), ring, qi_out

    off, on = both(K, run)
    assert torch.isfinite(off[0]).all() and (off[1][p % cap] != 0).any()
    for a, b in zip(off, on):
        assert torch.equal(a, b)


def test_norm_rope_prefill_rows_same_bits(K):
    """Several tokens (each row's own position), the rows' deferred rescale (in_scale) and the inverse RoPE."""
    g = torch.Generator().manual_seed(5)
    rd, H, d, T = 64, 8, 512, 5
    x, s, freq = rnd(g, T * H, d), rnd(g, T).abs() + 0.5, freq_table(rd)
    pos = torch.tensor([3, 4, 900, 901, 70000], device=DEV)
    for kw in (dict(norm=True, in_scale=s), dict(inverse=True)):
        off, on = both(K, lambda: K.norm_rope(x, d, H, pos, eps=1e-6, freq=freq, rope_dim=rd, **kw).clone())
        assert torch.isfinite(off).all()
        assert torch.equal(off, on)


def compress_jobs(g, n_rows):
    """A ratio-4 layer's two compressors (the attention's: FP8 rows; the indexer's: FP4 QAT rows), empty frontiers."""
    rd, jobs = 64, []
    for width, fp8, qat in ((1024, 448, False), (256, 0, True)):
        d = width // 2
        jobs.append(dict(ape=rnd(g, 4, width, scale=0.3), norm_w=rnd(g, d), r=4, eps=1e-6, freq=freq_table(rd),
                         rope_dim=rd, fp8_nope=fp8, qat=qat))
    return jobs


def fresh_state(width, d, n_rows, frontier):
    return [torch.zeros(frontier, width, device=DEV), torch.full((frontier, width), -math.inf, device=DEV),
            torch.zeros(n_rows, d, device=DEV)]


@pytest.mark.parametrize("one_launch", [True, False])
def test_compress_step_ratio4_same_bits(K, one_launch):
    """Over four pooling windows (and the steps between), the frontier state and the finished rows of both compressors
    of a ratio-4 layer, in one launch of two blocks or a launch each, are the v23 kernel's bit for bit."""
    g = torch.Generator().manual_seed(11)
    n_rows, steps = 8, 17
    jobs = compress_jobs(g, n_rows)
    inputs = [[(rnd(g, 1, w, scale=2.0), rnd(g, 1, w, scale=3.0)) for w in (1024, 256)] for _ in range(steps)]

    def run():
        states = [fresh_state(w, w // 2, n_rows, 8) for w in (1024, 256)]
        for p in range(steps):
            pos = torch.tensor([p], device=DEV)
            args = [dict(kv=kv, sc=sc, s_kv=st[0], s_sc=st[1], rows=st[2], **j)
                    for j, st, (kv, sc) in zip(jobs, states, inputs[p])]
            if one_launch:
                K.compress_step(pos=pos, **args[0], also=args[1])
            else:
                for a in args:
                    K.compress_step(pos=pos, **a)
        return [t for st in states for t in st]

    off, on = both(K, run)
    assert torch.isfinite(off[2][:4]).all() and (off[2][:4] != 0).any() and (off[5][:4] != 0).any()
    for a, b in zip(off, on):
        assert torch.equal(a, b)


def test_compress_step_other_ratios_unchanged(K):
    """Ratio 16 keeps the v23 path under the switch (its launch only gets the larger shared memory)."""
    g = torch.Generator().manual_seed(12)
    r, width, rd, n_rows = 16, 512, 64, 3
    ape, norm_w, freq = rnd(g, r, width, scale=0.3), rnd(g, width), freq_table(rd)
    inputs = [(rnd(g, 1, width, scale=2.0), rnd(g, 1, width, scale=3.0)) for _ in range(2 * r + 1)]

    def run():
        st = fresh_state(width, width, n_rows, r)
        for p, (kv, sc) in enumerate(inputs):
            K.compress_step(kv, sc, ape, *st, torch.tensor([p], device=DEV), r, norm_w, 1e-6, freq, rd, 0, False)
        return st

    off, on = both(K, run)
    assert (off[2][:2] != 0).any()
    for a, b in zip(off, on):
        assert torch.equal(a, b)


@pytest.mark.parametrize("p,H,n_comp,use_sel", [(2300, 64, 600, True), (300, 16, 40, False), (40, 6, 40, False),
                                                (32767, 64, 256, False)])
def test_decode_attention_combine_same_bits(K, p, H, n_comp, use_sel):
    """The combine with the sinks and the inverse RoPE factors staged before its wait, and each chunk's m and l read once."""
    g = torch.Generator().manual_seed(40 + p)
    d, rd, cap, r = 512, 64, 128, 4
    q, raw, comp = rnd(g, H, d), rnd(g, cap, d), rnd(g, n_comp, d)
    sinks, freq, pos = rnd(g, H), freq_table(rd), torch.tensor([p], device=DEV)
    sel = torch.randperm(n_comp, generator=g)[:min(512, n_comp * 3 // 5)].to(DEV) if use_sel else None
    off, on = both(K, lambda: K.attention(q, raw, comp, sel, r, pos, sinks, freq, rd).clone())
    assert torch.isfinite(off).all()
    assert torch.equal(off, on)


@pytest.mark.parametrize("n,p", [(528, 2111), (516, 2063), (2064, 8255), (600, 1000)])
def test_topk_position_read_early_same_bits(K, n, p):
    """The decode top-k (mode 2 reads the position before its wait): the same selection, including the early exit where
    every visible row fits (p = 1000: 250 visible rows of 600)."""
    g = torch.Generator().manual_seed(n + p)
    keys = torch.randn(n, generator=g, dtype=torch.float64).to(DEV)
    keys[7] = keys[9]  # a tie
    pos = torch.tensor([p], device=DEV)
    off, on = both(K, lambda: K.topk(keys, 512, pos, 4).clone())
    assert torch.equal(off, on)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from conftest import quantize_cli
    from ds4.engine.model import Model

    path = tmp_path_factory.mktemp("prewait") / "small.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(path), "--mix", "q2", "--quiet")
    return Model.load(path)


@pytest.mark.parametrize("graphs", [True, False])
def test_session_decode_logits_same_bits(small_model, graphs):
    """16 decode steps after a 30-token prompt (pooling steps of the ratio-4 layers among them): the logits with the
    prologues are the v23 kernels' bit for bit."""
    from ds4.engine.gpu.session import Session

    ext = gpu.load()
    toks = np.random.default_rng(9).integers(2, small_model.config.vocab_size, 46).tolist()
    runs, W = [], None
    try:
        for mode in (0, 2):
            ext.set_prewait(mode)
            s = Session(small_model, ctx=256, graphs=graphs, weights=W)
            W = s.W
            s.sync(toks[:30])
            runs.append(np.stack([s.decode(t) for t in toks[30:]]))
    finally:
        ext.set_prewait(-1)
    assert np.isfinite(runs[0]).all()
    assert np.array_equal(runs[0].view(np.uint32), runs[1].view(np.uint32))
