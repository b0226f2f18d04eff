"""The decode query's norm and RoPE inside the attention's partial blocks (DS4_GPU_ATTN_QPOST, attn_decode.cu).

The kernel claims the bits of two launches: norm_rope's warp kernel on the raw q_b rows, then the attention. The
session claims the same logits as the norm_rope launch within float rounding (that launch's block kernel sums the
norm in another order) in every mode of the KV row's launch, eager and graph-replayed. Skipped without a CUDA device.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from ds4.engine import gpu  # noqa: E402

DEV = "cuda"
HAVE_GPU = torch.cuda.is_available() and gpu.available()
pytestmark = pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA device and the built extension")

NR_WARP_MIN_ROWS = 256  # fused.cu: norm_rope takes its warp kernel from this many rows


@pytest.fixture(scope="module")
def K():
    from ds4.engine.gpu.fused import Fused

    return Fused(gpu.load(), torch.device(DEV))


def rnd(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DEV)


def freq_table(rope_dim, base=10000.0):
    return (1.0 / base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)).float().to(DEV)


def warp_norm_rope(K, q, pos, post):
    """q's rows through norm_rope's warp kernel: the rows repeated up to its row threshold (each row is processed
    alone, so the copies do not change the first H)."""
    H, d = q.shape
    reps = -(-NR_WARP_MIN_ROWS // H)
    return K.norm_rope(q.repeat(reps, 1), d, H * reps, pos, **post)[:H]


@pytest.mark.parametrize("p,H,d,n_comp,use_sel", [
    (2300, 64, 512, 600, True),   # Flash: 64 heads of 512, an indexer selection
    (300, 16, 512, 40, False),
    (40, 6, 512, 40, False),      # fewer heads than a block's 8 warps
    (77, 8, 128, 20, False),      # a shorter head (d = 4 x 32)
])
def test_partial_blocks_give_the_bits_of_norm_rope_then_attention(K, p, H, d, n_comp, use_sel):
    g = torch.Generator().manual_seed(40 + p)
    rd, cap, r = 64, 128, 4
    q_raw = rnd(g, H, d, scale=3.0)
    raw, comp, sinks = rnd(g, cap, d), rnd(g, n_comp, d), rnd(g, H)
    freq = freq_table(rd, 160000.0)
    pos = torch.tensor([p], device=DEV)
    sel = torch.randperm(n_comp, generator=g)[:min(512, n_comp * 3 // 5)].to(DEV) if use_sel else None
    post = dict(norm=True, eps=1e-6, freq=freq, rope_dim=rd)
    want = K.attention(warp_norm_rope(K, q_raw, pos, post), raw, comp, sel, r, pos, sinks, freq, rd)
    got = K.attention(q_raw, raw, comp, sel, r, pos, sinks, freq, rd, q_post=post)
    torch.cuda.synchronize()
    assert torch.isfinite(want).all()
    assert torch.equal(got, want)
    # and the query post itself is norm_rope's (block kernel) within float rounding of the norm's sum
    block = K.norm_rope(q_raw, d, H, pos, **post)
    assert torch.allclose(warp_norm_rope(K, q_raw, pos, post), block, rtol=1e-5, atol=1e-6)


def test_query_post_declines_what_it_does_not_take(K):
    g = torch.Generator().manual_seed(3)
    H, d, rd, cap = 8, 520, 64, 128  # d % 32 != 0
    q, raw, sinks = rnd(g, H, d), rnd(g, cap, d), rnd(g, H)
    freq = freq_table(rd)
    pos = torch.tensor([5], device=DEV)
    with pytest.raises(Exception, match="query's post"):
        K.attention(q, raw, None, None, 0, pos, sinks, freq, rd, q_post=dict(norm=True, eps=1e-6, freq=freq,
                                                                             rope_dim=rd))


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from conftest import quantize_cli
    from ds4.engine.model import Model

    path = tmp_path_factory.mktemp("qpost") / "small.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(path), "--mix", "q2", "--quiet")
    return Model.load(path)


def decode_logits(model, toks, graphs: bool, weights=None):
    """(decode logits after a 40-token prefill, the session's uploaded weights for the next session)."""
    from ds4.engine.gpu.session import Session

    s = Session(model, ctx=256, graphs=graphs, weights=weights)
    s.sync(toks[:40])
    return np.stack([s.decode(t) for t in toks[40:56]]), s.W


@pytest.mark.parametrize("graphs", [True, False])
def test_session_modes_agree(small_model, monkeypatch, graphs):
    """Every KV-row placement (1 after q_b, 2 beside it, 3 before it) gives the same logits, bit for bit (the KV row's
    launch is the same kernel wherever it runs), and all are the norm_rope launch's within float rounding."""
    from ds4.engine.gpu import fused

    toks = np.random.default_rng(5).integers(2, small_model.config.vocab_size, 56).tolist()
    outs, W = {}, None
    for mode in (0, 1, 2, 3):
        monkeypatch.setattr(fused, "ATTN_QPOST", mode)
        outs[mode], W = decode_logits(small_model, toks, graphs, W)
    assert np.isfinite(outs[0]).all()
    assert np.array_equal(outs[1], outs[2]) and np.array_equal(outs[1], outs[3])
    err = np.linalg.norm(outs[1] - outs[0]) / np.linalg.norm(outs[0])
    assert err < 1e-4, f"relative error {err:.2e} against the norm_rope launch"
    assert (outs[1].argmax(-1) == outs[0].argmax(-1)).mean() >= 0.9
