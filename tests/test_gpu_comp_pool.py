"""The compressors' prefill pooling in one kernel (compress_prefill.cu, DS4_GPU_COMP_POOL) against the torch form of
prefill.compress_chunk, in float64 on fresh random input, and in a session against the torch form (skipped without a
CUDA device and the built extension)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

DEV = "cuda"


@pytest.fixture(scope="module")
def K(fused_kernels):
    return fused_kernels


def torch_form(kv, kv_r, sc, sc_r, ape, s_kv, s_sc, r, off, live0, pos0):
    """compress_chunk's torch pooling (the sequence, the windows' candidates, softmax, sum), the products rescaled and
    the APE added in float32 as the session does, the pooling in float64."""
    T, width = kv.shape
    d = width // 2 if r == 4 else width
    kvs = kv if kv_r is None else kv * kv_r
    scs = (sc if sc_r is None else sc * sc_r) + ape[(pos0 + torch.arange(T, device=DEV)) % r]
    seq_kv = torch.cat([s_kv[live0:live0 + off], kvs]).double()
    seq_sc = torch.cat([s_sc[live0:live0 + off], scs]).double()
    n_full = (off + T) // r
    win_kv = seq_kv[:n_full * r].reshape(n_full, r, width)
    win_sc = seq_sc[:n_full * r].reshape(n_full, r, width)
    if r == 4:
        cand_kv = torch.cat([torch.cat([s_kv[None, :4, :d].double(), win_kv[:-1, :, :d]]), win_kv[:, :, d:]], dim=1)
        cand_sc = torch.cat([torch.cat([s_sc[None, :4, :d].double(), win_sc[:-1, :, :d]]), win_sc[:, :, d:]], dim=1)
    else:
        cand_kv, cand_sc = win_kv, win_sc
    return (cand_kv * torch.softmax(cand_sc, dim=1)).sum(dim=1)


def random_case(g, r, width, T, rescaled: bool):
    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).float().to(DEV)

    rows = 2 * r if r == 4 else r
    s_kv, s_sc = rnd(rows, width), rnd(rows, width, scale=2.0)
    kv, sc, ape = rnd(T, width, scale=30.0), rnd(T, width, scale=40.0), rnd(r, width, scale=0.5)
    kv_r = (torch.rand(T, 1, generator=g, dtype=torch.float64) * 0.1 + 0.01).float().to(DEV) if rescaled else None
    sc_r = (torch.rand(T, 1, generator=g, dtype=torch.float64) * 0.05 + 0.01).float().to(DEV) if rescaled else None
    return kv, kv_r, sc, sc_r, ape, s_kv, s_sc


@pytest.mark.parametrize("r,width", [(4, 1024), (4, 256), (128, 512), (16, 96)])
@pytest.mark.parametrize("off", [0, 1, 3])
@pytest.mark.parametrize("rescaled", [True, False])
def test_chunk_pooling_matches_the_torch_form(K, r, width, off, rescaled) -> None:
    g = torch.Generator().manual_seed(r * 131 + off * 7 + width + rescaled)
    T = 5 * r + 3 - off
    live0 = r if r == 4 else 0
    for filled in (False, True):
        if off and not filled and r != 4:
            continue  # live rows come from a frontier that has them
        kv, kv_r, sc, sc_r, ape, s_kv, s_sc = random_case(g, r, width, T, rescaled)
        if r == 4 and not filled:  # no window before position 0: the frontier's rows 0-3 are 0 with score -inf
            s_kv[:4].zero_()
            s_sc[:4].fill_(-float("inf"))
        pos0 = (7 if filled else 0) * r + off
        n_full = (off + T) // r
        got = K.comp_pool_chunk(kv, kv_r, sc, sc_r, ape, s_kv, s_sc, r, off, live0, n_full)
        want = torch_form(kv, kv_r, sc, sc_r, ape, s_kv, s_sc, r, off, live0, pos0)
        assert got.shape == want.shape == (n_full, width // 2 if r == 4 else width)
        err = float(torch.linalg.norm(got.double() - want) / torch.linalg.norm(want))
        assert err < 2e-6, (r, width, off, filled, err)


def test_chunk_pooling_refuses_what_it_cannot_take(K) -> None:
    assert not K.ext.comp_pool_takes(1, 64) and not K.ext.comp_pool_takes(4, 63)
    kv = torch.zeros(8, 64, device=DEV)
    assert K.comp_pool_chunk(kv, None, kv, None, torch.zeros(1, 64, device=DEV), kv, kv, 1, 0, 0, 8) is None
    with pytest.raises(ValueError, match="one rescale per row"):
        K.comp_pool_chunk(kv, torch.ones(3, device=DEV), kv, None, torch.zeros(4, 64, device=DEV), kv, kv, 4, 0, 4, 2)


def test_compress_chunk_matches_the_torch_form(monkeypatch, tmp_path) -> None:
    """prefill.compress_chunk on small (q2, the simulations off) with the pooling kernel against its torch form, from
    the same frontier and input: for a ratio-4 layer (both compressors) and a ratio-128 layer, at window offsets 0, 1,
    3 and 70 with chunks on the GEMM path (the rescale left to the kernel) and on the matvec path (3 rows), the
    frontier bit for bit and the rows within float rounding; then a whole prefill in chunks of 99 within 1e-3."""
    from conftest import quantize_cli

    from ds4.engine import gpu
    from ds4.engine.gpu import prefill
    from ds4.engine.gpu import session as gpu_session
    from ds4.engine.model import Model

    if not (torch.cuda.is_available() and gpu.available()):
        pytest.skip("needs a CUDA device and the built extension")
    quantize_cli("synth", "--preset", "small", "--gguf", str(tmp_path / "small.gguf"), "--mix", "q2", "--quiet")
    m = Model.load(tmp_path / "small.gguf").with_numerics(fp8_kv=False, indexer_qat=False)
    cfg = m.config
    ses = gpu_session.Session(m, ctx=1024, prefill_chunk=128)
    layers = [next(li for li in range(cfg.n_layer) if cfg.ratio(li) == r) for r in (4, 128)]
    g = torch.Generator().manual_seed(5)
    checked = 0
    for li in layers:
        st = ses.layers[li]
        for indexer in ((False, True) if cfg.ratio(li) == 4 else (False,)):
            r = 4 if indexer else cfg.ratio(li)
            for off in (0, 1, 3, 70):
                if off >= r:
                    continue
                for T in (3, 61, 2 * r + 5):
                    pos0 = r * 2 + off
                    start = {k: v.clone() for k, v in st.items()}
                    a = torch.randn(T, cfg.n_embd, generator=g).to(DEV)
                    monkeypatch.setattr(prefill, "COMP_POOL", False)  # the frontier at pos0, by the torch form
                    prefill.compress_chunk(ses, li, torch.randn(pos0, cfg.n_embd, generator=g).to(DEV), 0, indexer)
                    filled = {k: v.clone() for k, v in st.items()}
                    out = {}
                    for on in (False, True):
                        for k, v in filled.items():
                            st[k].copy_(v)
                        monkeypatch.setattr(prefill, "COMP_POOL", on)
                        n = prefill.compress_chunk(ses, li, a, pos0, indexer)
                        out[on] = n, {k: v.clone() for k, v in st.items()}
                    (n0, want), (n1, got) = out[False], out[True]
                    assert n0 == n1
                    rows, fr = ("idx", ("idx_kv", "idx_score")) if indexer else ("comp", ("comp_kv", "comp_score"))
                    for k in fr:
                        assert torch.equal(want[k], got[k]), (li, indexer, off, T, k)
                    w, v = want[rows][:n0].double(), got[rows][:n0].double()
                    err = float(torch.linalg.norm(w - v) / torch.linalg.norm(w)) if n0 else 0.0
                    assert err < 1e-5, (li, indexer, off, T, err)
                    for k, v in start.items():
                        st[k].copy_(v)
                    checked += 1
    assert checked >= 12
    toks = np.random.default_rng(41).integers(2, cfg.vocab_size, 300).tolist()
    logits = {}
    for on in (False, True):
        monkeypatch.setattr(prefill, "COMP_POOL", on)
        logits[on] = gpu_session.Session(m, ctx=512, prefill_chunk=99).sync(toks)
    assert float(np.linalg.norm(logits[True] - logits[False]) / np.linalg.norm(logits[False])) < 1e-3
