"""The fused layer kernels (ds4.engine.gpu.fused / fused.cu) against the torch ops they replace.

Every kernel gets fresh random input on the GPU; the reference is the torch code of the session's
unfused path (ds4.engine.gpu.ops and the formulas of session.py) in float64 where it is plain
arithmetic. FP8/FP4 simulations are discontinuous, so those checks allow a few flipped codes.
Skipped without a CUDA device and the built extension.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from ds4.engine import gpu  # noqa: E402

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and gpu.available()),
                                reason="needs a CUDA device and the built extension")

from ds4.engine.gpu import ops  # noqa: E402

DEV = "cuda"


@pytest.fixture(scope="module")
def K():
    from ds4.engine.gpu.fused import Fused

    return Fused(gpu.load(), torch.device(DEV))


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def rnd(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).float().to(DEV)


def freq_table(rope_dim, base=10000.0):
    return (1.0 / base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)).float().to(DEV)


def test_rms_norm(K):
    g = torch.Generator().manual_seed(0)
    x, w = rnd(g, 5, 4096, scale=3.0), rnd(g, 4096)
    assert rel(K.rms_norm(x, w, 1e-6), ops.rms_norm(x.double(), w.double(), 1e-6)) < 1e-6
    assert rel(K.rms_norm(x, None, 1e-6), ops.rms_norm(x.double(), None, 1e-6)) < 1e-6


@pytest.mark.parametrize("head", [False, True])
def test_hc_pre(K, head):
    g = torch.Generator().manual_seed(1)
    T, n, D = 3, 4, 1024
    M = n if head else (2 + n) * n
    X, Wf = rnd(g, T, n, D), rnd(g, M, n * D, scale=0.02)
    scale, base, nw = rnd(g, 3) if not head else rnd(g, 1), rnd(g, M, scale=0.5), rnd(g, D)
    mix_raw = X.reshape(T, n * D) @ Wf.T
    out, post, comb = K.hc_pre(X, mix_raw, scale, base, nw, 20, 1e-6, 1e-6, head=head)
    Xd = X.double()
    mix = ops.rms_norm(Xd.reshape(T, n * D), None, 1e-6) @ Wf.double().T
    if head:
        pre = torch.sigmoid(mix * scale.double()[0] + base.double()) + 1e-6
    else:
        pre, post_r, comb_r = ops.hc_weights(mix, scale.double(), base.double(), n, 20, 1e-6)
        assert rel(post, post_r) < 1e-5 and rel(comb, comb_r) < 1e-5
    assert rel(out, ops.rms_norm(ops.stream_sum(pre, Xd), nw.double(), 1e-6)) < 1e-5


def test_hc_post(K):
    g = torch.Generator().manual_seed(2)
    T, n, D = 2, 4, 1000
    X, y1, y2, post, comb = rnd(g, T, n, D), rnd(g, T, D), rnd(g, T, D), rnd(g, T, n), rnd(g, T, n, n)
    ref = ops.hc_post(X.double(), (y1 + y2).double(), post.double(), comb.double())
    assert rel(K.hc_post(X, y1, y2, post, comb), ref) < 1e-6
    assert rel(K.hc_post(X, y1, None, post, comb), ops.hc_post(X.double(), y1.double(), post.double(), comb.double())) < 1e-6


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


@pytest.mark.parametrize("use_sel", [False, True])
@pytest.mark.parametrize("p", [5, 300])
def test_decode_attention(K, use_sel, p):
    g = torch.Generator().manual_seed(8 + p)
    H, d, rd, cap, n_comp, r = 16, 512, 64, 128, 40, 4
    q, raw, comp = rnd(g, H, d), rnd(g, cap, d), rnd(g, n_comp, d)
    sinks, freq = rnd(g, H), freq_table(rd, 160000.0)
    pos = torch.tensor([p], device=DEV)
    sel = torch.randperm(n_comp, generator=g)[:24].to(DEV) if use_sel else None
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
