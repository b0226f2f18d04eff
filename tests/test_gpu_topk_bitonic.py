"""The indexer's top-k by a bitonic sort in shared memory (topk.cu topk_bitonic_kernel, the default for rows of at most
8192 keys since v19) against the radix select (DS4_GPU_TOPK=radix, ext.set_topk_form(0)) and a numpy sort: the same
selection in the same ascending order for the decode form (float64 keys, one row, the visible-rows shortcut) and the
prefill form (float32 rows with a row stride), on keys with ties, infinities, NaN and signed zeros."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine import gpu

from test_gpu_fused import topk_key_sets, topk_rows_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]

torch = pytest.importorskip("torch")


def _select(ext, form: int, keys: torch.Tensor, k: int, pos: torch.Tensor | None = None, ratio: int = 1,
            rows: int = 0, n: int = 0) -> np.ndarray:
    """rows > 0: float32 rows [rows, ld] of which the first n columns are keys; else one float64 row."""
    ext.set_topk_form(form)
    try:
        sel = torch.full((max(rows, 1), k), -1, dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()
        p = pos.data_ptr() if pos is not None else 0
        if rows:
            ext.topk_rows_f32(keys.data_ptr(), n, keys.shape[1], rows, k, p, ratio, sel.data_ptr())
        else:
            ext.topk_rows(keys.data_ptr(), keys.numel(), k, p, ratio, sel.data_ptr())
        ext.synchronize()
        return sel.cpu().numpy()
    finally:
        ext.set_topk_form(-1)


@pytest.mark.parametrize("n", [2, 530, 2048, 2049, 4096, 8192])
def test_bitonic_selects_what_the_radix_select_does(n):
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    ext = gpu.load()
    rng = np.random.default_rng(100 + n)
    for name, keys_np in topk_key_sets(rng, n).items():
        keys = torch.from_numpy(keys_np).to("cuda")
        for k in sorted({1, min(512, n), n // 2 or 1, n}):
            bitonic = _select(ext, 1, keys, k)[0]
            assert np.array_equal(bitonic, _select(ext, 0, keys, k)[0]), (name, n, k)
            assert np.array_equal(bitonic, topk_rows_reference(keys_np, k)), (name, n, k)


def test_bitonic_visible_rows_shortcut():
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    ext = gpu.load()
    keys_np = np.full(2100, -np.inf)
    keys_np[:530] = np.random.default_rng(3).standard_normal(530)
    keys = torch.from_numpy(keys_np).to("cuda")
    pos = torch.tensor([2047], device="cuda")  # 512 visible rows: all of them, without a sort
    assert np.array_equal(_select(ext, 1, keys, 512, pos, 4)[0], np.arange(512))
    pos.fill_(2119)  # 530 visible
    assert np.array_equal(_select(ext, 1, keys, 512, pos, 4)[0], topk_rows_reference(keys_np, 512))


@pytest.mark.parametrize("n,ld", [(640, 640), (2000, 2048), (5000, 5003)])
def test_bitonic_prefill_rows_match_the_radix_select(n, ld):
    """float32 rows (the prefill indexer's scores per query), each with its own visible count through pos."""
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    ext = gpu.load()
    rng = np.random.default_rng(n)
    rows, k, ratio = 6, 512, 4
    scores = np.maximum(rng.standard_normal((rows, ld)), 0.0).astype(np.float32)  # relu scores: many ties at 0
    scores[1, : n // 2] = 1.0  # one row of equal keys
    scores[2, rng.random(ld) < 0.2] = np.nan
    keys = torch.from_numpy(scores).to("cuda")
    pos = torch.tensor([4 * n - 1, 4 * n - 1, 4 * n - 1, 4 * 300, 4 * n - 200, 4 * 513 - 1], device="cuda")
    got = _select(ext, 1, keys, k, pos, ratio, rows=rows, n=n)
    want = _select(ext, 0, keys, k, pos, ratio, rows=rows, n=n)
    assert np.array_equal(got, want)
    assert (np.diff(got, axis=1) > 0).all()
