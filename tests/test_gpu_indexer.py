"""The prefill indexer on the GPU (DS4_GPU_INDEX_PREFILL=fused): the scores kernel (indexer.cu, bfloat16 tensor cores
on the QAT'd values) against a float64 reference of model-spec §3.6's score, the per-query top-k launch (topk.cu over
rows of float32 scores) against sorting, and the session's prefill with it against the torch form. Skipped without a
usable CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from ds4.engine import gpu  # noqa: E402
from test_gpu_topk import topk_key_sets, topk_rows_reference  # noqa: E402

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and gpu.available()),
                                reason="needs a CUDA device and the built extension")

DEV = "cuda"


@pytest.fixture(scope="module")
def K():
    from ds4.engine.gpu.fused import Fused

    return Fused(gpu.load(), torch.device(DEV))


def _qat_case(seed: int, T: int, Hi: int, n: int):
    from ds4.engine.gpu import ops

    g = torch.Generator().manual_seed(seed)
    q = ops.indexer_qat(torch.randn(T, Hi, 128, generator=g) * 2.0)
    keys = ops.indexer_qat(torch.randn(n, 128, generator=g))
    w = torch.randn(T, Hi, generator=g) / np.sqrt(128 * Hi)
    n_vis = torch.randint(0, n + 6, (T,), generator=g)
    n_vis[0] = n  # at least one query sees every key
    return q.to(DEV), w.to(DEV), keys.to(DEV), n_vis.to(DEV)


@pytest.mark.parametrize("T,Hi,n", [(37, 64, 2048), (5, 16, 17), (130, 24, 300), (1, 8, 1), (9, 64, 8200)])
def test_index_scores_match_the_float64_reference(K, T, Hi, n):
    q, w, keys, n_vis = _qat_case(T * 7 + n, T, Hi, n)
    # the premise of the kernel: the QAT'd values are exact in bfloat16
    assert torch.equal(q.to(torch.bfloat16).float(), q) and torch.equal(keys.to(torch.bfloat16).float(), keys)
    got = K.index_scores(q, w, keys, n_vis)
    assert got.shape == (T, n) and got.dtype == torch.float32
    dots = torch.einsum("thd,cd->thc", q.double(), keys.double())
    ref = torch.einsum("th,thc->tc", w.double(), dots.clamp(min=0))
    vis = torch.arange(n, device=DEV)[None, :] < n_vis[:, None]
    assert torch.equal(torch.isinf(got) & (got < 0), ~vis), "-inf exactly past each query's visible rows"
    err = float((got.double()[vis] - ref[vis]).norm() / ref[vis].norm().clamp(min=1e-30))
    assert err < 1e-6, f"rel err {err:.2e}"


def test_index_scores_declines_other_shapes(K):
    q, w, keys, n_vis = _qat_case(3, 4, 16, 40)
    assert K.index_scores(q[..., :64].contiguous(), w, keys[:, :64].contiguous(), n_vis) is None  # key length 64
    assert K.index_scores(q[:, :12].contiguous(), w[:, :12].contiguous(), keys, n_vis) is None  # 12 heads


@pytest.mark.parametrize("n", [1, 530, 2049, 8200])
def test_topk_rows_of_float32_scores(K, n):
    """Every row of a batch against sorting (value descending, NaN last, lowest row first among equals; rows
    ascending), with ties, -inf, NaN and signed zeros; deterministic."""
    rng = np.random.default_rng(n + 3)
    rows = np.stack([v.astype(np.float32) for v in topk_key_sets(rng, n).values()])
    scores = torch.from_numpy(rows).to(DEV)
    for k in sorted({1, min(512, n), n}):
        got = K.topk_rows(scores, k)
        assert torch.equal(got, K.topk_rows(scores, k)), "not deterministic"
        for r in range(rows.shape[0]):
            want = topk_rows_reference(rows[r].astype(np.float64), k)
            assert np.array_equal(got[r].cpu().numpy(), want), (r, k)


def test_topk_rows_strided_rows_and_visible_shortcut(K):
    """Rows of a wider buffer (the row stride), and pos: rows whose (pos + 1) // ratio <= k take 0..k-1, the others
    select among their first (pos + 1) // ratio columns only (the visible rows)."""
    rng = np.random.default_rng(5)
    buf = torch.from_numpy(rng.standard_normal((6, 700)).astype(np.float32)).to(DEV)
    scores = buf[:, :600]
    pos = torch.tensor([0, 2047, 2051, 2099, 9000, 100], device=DEV)
    got = K.topk_rows(scores, 512, pos=pos, ratio=4).cpu().numpy()
    for r, p in enumerate(pos.tolist()):
        n_vis = (p + 1) // 4
        want = np.arange(512) if n_vis <= 512 else topk_rows_reference(scores[r, :n_vis].double().cpu().numpy(), 512)
        assert np.array_equal(got[r], want), r


def test_select_fused_in_blocks_equals_one_block(K, monkeypatch):
    """Queries in blocks (the scores' memory budget at long contexts) select what one block selects."""
    from ds4.engine.gpu import prefill

    T, Hi, n, k = 300, 64, 2100, 512
    q, w, keys, _ = _qat_case(9, T, Hi, n)
    n_vis = torch.randint(k + 1, n + 1, (T,), device=DEV)
    whole = torch.full((T, k), -1, dtype=torch.int64, device=DEV)
    assert prefill.select_fused(K, q, w, keys, n_vis, k, whole)
    monkeypatch.setattr(prefill, "ATTN_BLOCK", 64)  # block_rows: 64 queries per block
    blocks = torch.full((T, k), -1, dtype=torch.int64, device=DEV)
    assert prefill.select_fused(K, q, w, keys, n_vis, k, blocks)
    assert torch.equal(blocks, whole) and bool((whole >= 0).all())
    assert not prefill.select_fused(K, q[:, :12].contiguous(), w[:, :12].contiguous(), keys, n_vis, k, blocks)


def test_fused_indexer_in_the_session(monkeypatch, tmp_path):
    """`small` with the QAT on (the indexer's top-k runs from position 259), 600 tokens in chunks of 256: every
    position's logits with the fused indexer against the torch form. The routed experts take the float16 hi/lo GEMMs,
    as in test_gpu_prefill_attn: on mmq the activations' 15-bit rounding turns float32-level differences (here: the
    order of the selected rows, ascending against score order) into occasional near-tied expert flips."""
    from conftest import quantize_cli

    from ds4.engine.gpu import moe_gemm, prefill
    from ds4.engine.gpu.session import Session as GpuSession
    from ds4.engine.model import Model

    quantize_cli("synth", "--preset", "small", "--gguf", str(tmp_path / "small.gguf"), "--mix", "q2", "--quiet")
    m = Model.load(tmp_path / "small.gguf")
    assert m.config.indexer_qat
    monkeypatch.setattr(moe_gemm, "MOE_GEMM", "buckets")
    toks = np.random.default_rng(11).integers(2, m.config.vocab_size, 600).tolist()
    sels = {"torch": [], "fused": []}
    real_select = prefill.indexer_select_chunk

    def recording(ses, *a):
        sel = real_select(ses, *a)
        sels[prefill.INDEX_MODE].append(sel.cpu())
        return sel

    monkeypatch.setattr(prefill, "indexer_select_chunk", recording)
    monkeypatch.setattr(prefill, "INDEX_MODE", "torch")
    want = GpuSession(m, ctx=1024, prefill_chunk=256).prefill(toks, all_logits=True)
    monkeypatch.setattr(prefill, "INDEX_MODE", "fused")
    g = GpuSession(m, ctx=1024, prefill_chunk=256)
    calls = []
    real = type(g.K).index_scores
    monkeypatch.setattr(type(g.K), "index_scores", lambda self, *a: calls.append(1) or real(self, *a))
    got = g.prefill(toks, all_logits=True)
    assert calls, "the fused indexer did not run"
    a, b = torch.cat(sels["torch"]), torch.cat(sels["fused"])
    same = (a == b).all(dim=1).float().mean().item()  # rows ascending in both forms
    per = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    print(f"\nfused against torch indexer: {same:.4f} of the queries' selections equal; logits median position rel "
          f"{np.median(per):.2e}, worst {per.max():.2e}")
    assert same >= 0.99, f"only {same:.4f} of the selections agree"
    assert per.max() < 1e-3, f"worst position rel err {per.max():.2e}"
