"""The indexer keys' top-k (topk.cu, ds4.engine.gpu.fused.Fused.topk) against a numpy model of its order and against
sorting: random keys, ties, infinities and NaNs, the visible-rows shortcut, CUDA graph capture. The numpy model's own
tests run everywhere; the kernel's are skipped without a CUDA device and the built extension.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

DEV = "cuda"


@pytest.fixture(scope="module")
def K(fused_kernels):
    return fused_kernels


def order_codes(keys: np.ndarray) -> np.ndarray:
    """uint64 codes whose unsigned order is the float order (NaN lowest, -0.0 == +0.0), as topk.cu."""
    x = np.where(keys == 0.0, 0.0, keys).astype(np.float64)
    b = x.view(np.uint64)
    code = np.where(b >> np.uint64(63) != 0, ~b, b | np.uint64(1 << 63))
    code[np.isnan(keys)] = 0
    return code


def topk_rows_model(keys: np.ndarray, k: int, pos: int | None = None, ratio: int = 1) -> np.ndarray:
    """The exact algorithm of topk_rows_kernel: radix select over 8-bit digits from the top (early exit once
    the threshold's whole bucket is taken or all its codes are equal), then the compaction positions from
    exclusive prefix counts."""
    assert 1 <= k <= len(keys)
    if pos is not None and (pos + 1) // ratio <= k:
        return np.arange(k)
    if pos is not None:  # rows at or past the visible ones are no candidates
        keys = keys[:(pos + 1) // ratio]
    n = len(keys)
    code = order_codes(keys)
    prefix, gt, shift = 0, 0, 64
    for p in range(8):
        s = 56 - 8 * p
        cand = np.ones(n, bool) if p == 0 else (code >> np.uint64(s + 8)) == np.uint64(prefix)
        if np.bitwise_or.reduce(code[cand]) == np.bitwise_and.reduce(code[cand]):  # all tied
            prefix, shift = int(code[cand][0]), 0
            break
        hist = np.bincount(((code[cand] >> np.uint64(s)) & np.uint64(255)).astype(np.int64), minlength=256)
        above = gt + np.cumsum(hist[::-1])[::-1] - hist  # codes above each digit's bucket
        (d,) = np.nonzero((above < k) & (above + hist >= k))[0]
        prefix, gt, shift = prefix << 8 | int(d), int(above[d]), s
        if hist[d] == k - gt:
            break
    top = code >> np.uint64(shift)
    is_gt, is_eq = top > np.uint64(prefix), top == np.uint64(prefix)
    gt_before, eq_before = np.cumsum(is_gt) - is_gt, np.cumsum(is_eq) - is_eq
    need = k - gt
    sel = np.full(k, -1, np.int64)
    sel[gt_before[is_gt] + np.minimum(eq_before[is_gt], need)] = np.nonzero(is_gt)[0]
    take_eq = is_eq & (eq_before < need)
    sel[gt_before[take_eq] + eq_before[take_eq]] = np.nonzero(take_eq)[0]
    assert (sel >= 0).all()
    return sel


def topk_rows_reference(keys: np.ndarray, k: int) -> np.ndarray:
    """By sorting: value descending (NaN last), lowest index first among equal values; rows ascending."""
    nan = np.isnan(keys)
    order = np.lexsort((np.arange(len(keys)), -np.where(nan, 0.0, keys), nan))
    return np.sort(order[:k])


def topk_key_sets(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    inf_heavy = rng.standard_normal(n)
    inf_heavy[rng.random(n) < 0.9] = -np.inf
    nan_some = rng.standard_normal(n)
    nan_some[rng.random(n) < 0.3] = np.nan
    zeros = np.where(rng.random(n) < 0.5, 0.0, -0.0)
    zeros[rng.random(n) < 0.01] = 1.0
    # as index_keys writes them: relu scores (many exact zeros) minus row * 1e-300, -inf past n_vis
    idx_like = np.maximum(rng.standard_normal(n), 0.0) - np.arange(n) * 1e-300
    idx_like[n * 3 // 4:] = -np.inf
    return {"normal": rng.standard_normal(n), "ties": rng.integers(0, 7, n).astype(np.float64),
            "inf_heavy": inf_heavy, "nan_some": nan_some, "zeros": zeros, "idx_like": idx_like,
            "tiny_spread": 1.0 + rng.integers(0, 3, n) * np.finfo(np.float64).eps}


@pytest.mark.parametrize("n", [1, 530, 2049, 8200])
def test_topk_rows_model_matches_sorting(n):
    rng = np.random.default_rng(n)
    for name, keys in topk_key_sets(rng, n).items():
        for k in sorted({1, min(512, n), n // 2 or 1, n}):
            got = topk_rows_model(keys, k)
            assert np.array_equal(got, topk_rows_reference(keys, k)), (name, k)


def test_topk_rows_model_visible_shortcut():
    keys = np.full(1000, -np.inf)
    keys[:100] = np.random.default_rng(0).standard_normal(100)
    assert np.array_equal(topk_rows_model(keys, 512, pos=403, ratio=4), np.arange(512))  # 101 rows visible
    # the shortcut is what the full selection gives for index_keys' output (-inf past n_vis)
    assert np.array_equal(topk_rows_model(keys, 512, pos=403, ratio=4), topk_rows_model(keys, 512))
    keys[:600] = np.random.default_rng(1).standard_normal(600)
    assert np.array_equal(topk_rows_model(keys, 512, pos=2399, ratio=4), topk_rows_reference(keys, 512))


def _gpu_topk_check(K, keys_np: np.ndarray, k: int) -> torch.Tensor:
    keys = torch.from_numpy(keys_np).to(DEV)
    got = K.topk(keys, k)
    assert got.dtype == torch.int64 and got.shape == (k,)
    assert torch.equal(got, K.topk(keys, k)), "not deterministic"
    g = got.cpu().numpy()
    assert (np.diff(g) > 0).all(), "not ascending"
    assert np.array_equal(g, topk_rows_model(keys_np, k))
    if not np.isnan(keys_np).any():  # torch.topk ranks NaN highest; we rank it lowest
        ref = torch.topk(keys, k)
        assert torch.equal(torch.sort(keys[got]).values, torch.sort(ref.values).values)
        if len(np.unique(keys_np)) == len(keys_np):
            assert set(g.tolist()) == set(ref.indices.cpu().tolist())
    return got


# the block's threads follow n (8 keys each up to 8192, 16 up to 16384, then re-read): both ends of each form
@pytest.mark.parametrize("n", [7, 100, 530, 2049, 8192, 8200, 16384, 16385, 70000])
def test_topk_rows_random(K, n):
    keys = np.random.default_rng(n).standard_normal(n)
    for k in sorted({1, min(512, n), n}):
        _gpu_topk_check(K, keys, k)


@pytest.mark.parametrize("n", [530, 8200, 16384, 70000])
def test_topk_rows_ties_inf_nan(K, n):
    sets = topk_key_sets(np.random.default_rng(n + 1), n)
    for name, keys in sets.items():
        got = _gpu_topk_check(K, keys, 512).cpu().numpy()
        if name == "ties":  # the threshold value's rows are the lowest ones holding it
            t = keys[got].min()
            tied = np.nonzero(keys == t)[0]
            assert np.array_equal(got[keys[got] == t], tied[:np.sum(keys[got] == t)])


def test_topk_rows_visible_shortcut_and_args(K):
    keys_np = np.full(2000, -np.inf)
    keys_np[:300] = np.random.default_rng(5).standard_normal(300)
    keys = torch.from_numpy(keys_np).to(DEV)
    pos = torch.tensor([1203], device=DEV)  # (1203 + 1) // 4 = 301 <= 512 visible rows
    assert torch.equal(K.topk(keys, 512, pos, 4).cpu(), torch.arange(512))
    keys_np[:1000] = np.random.default_rng(6).standard_normal(1000)
    keys = torch.from_numpy(keys_np).to(DEV)
    pos.fill_(3999)
    assert np.array_equal(K.topk(keys, 512, pos, 4).cpu().numpy(), topk_rows_reference(keys_np, 512))
    for bad in (0, 2001):
        with pytest.raises(ValueError, match="topk_rows"):
            K.topk(keys, bad)
            torch.cuda.synchronize()


@pytest.mark.parametrize("n,p", [(8210, 2399), (8210, 2402), (530, 2111)])
def test_topk_with_pos_never_picks_rows_past_the_visible_ones(K, n, p):
    """With pos, rows at or past (pos + 1) // ratio are no candidates (a decode graph is sized for the session's whole
    context: 8210 rows at 32k, 600 visible at position 2399): larger values and NaN there are never picked, and the
    selection is that of the visible rows alone; and the model says the same."""
    rng = np.random.default_rng(n + p)
    keys_np = rng.standard_normal(n)
    n_vis = min(n, (p + 1) // 4)
    keys_np[n_vis:] = 1e300
    keys_np[n_vis + 1:n_vis + 3] = np.nan
    got = K.topk(torch.from_numpy(keys_np).to(DEV), 512, torch.tensor([p], device=DEV), 4).cpu().numpy()
    want = topk_rows_reference(keys_np[:n_vis], 512)
    assert np.array_equal(got, want)
    assert np.array_equal(topk_rows_model(keys_np, 512, pos=p, ratio=4), want)


def test_topk_rows_in_cuda_graph(K):
    n, k = 8200, 512
    keys = torch.full((n,), -math.inf, dtype=torch.float64, device=DEV)
    pos = torch.tensor([0], device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        K.topk(keys, k, pos, 4)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sel = K.topk(keys, k, pos, 4)
    rng = np.random.default_rng(7)
    for p in (100, 2999, 4 * n - 1):
        keys_np = np.full(n, -np.inf)
        vis = (p + 1) // 4
        keys_np[:vis] = rng.integers(0, 50, vis).astype(np.float64)  # ties at the threshold too
        keys.copy_(torch.from_numpy(keys_np))
        pos.fill_(p)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(sel, K.topk(keys, k, pos, 4)), p
        assert np.array_equal(sel.cpu().numpy(), topk_rows_model(keys_np, k, p, 4)), p
