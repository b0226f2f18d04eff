"""A Q8_0 matvec in S column slices (ext.matvec_sliced, DS4_GPU_OB_SLICES): part s must be exactly the product of the
matrix's column slice s with x's slice s (the same kernel arithmetic as a plain launch of that slice uploaded on its own,
so the same bits), and the parts must sum to the whole product within float32 rounding. It declines (False, nothing
written) what it does not take."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

from test_gpu_kernels import random_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason())),
              pytest.mark.usefixtures("ext_on_torch_stream")]

torch = pytest.importorskip("torch")


def cuda(x: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).cuda()


def matvec(w, x, rows: int):
    ext = gpu.load()
    y = torch.full((1, rows), float("nan"), device="cuda")
    ext.matvec(w, ext.Array.view(x.data_ptr(), [1, w.ncols]), ext.Array.view(y.data_ptr(), [1, rows]))
    return y


@pytest.mark.parametrize("cols,rows,slices", [(8192, 4096, 2), (4096, 2048, 2), (8192, 1024, 4), (2048, 512, 2)])
def test_parts_are_the_slices_products(cols, rows, slices) -> None:
    ext = gpu.load()
    rng = np.random.default_rng(cols + rows + slices)
    raw = random_blocks(Q.Q8_0, rows, cols, rng)
    w = gpu.upload(f"sliced.{cols}.{rows}", Q.Q8_0, (cols, rows), raw)
    x = cuda(rng.standard_normal(cols) * 2.0)
    for _ in range(2):  # graph-free repeat: nothing carried between calls
        parts = torch.full((slices, rows), float("nan"), device="cuda")
        assert ext.matvec_sliced(w, x.data_ptr(), parts.data_ptr(), slices)
        torch.cuda.synchronize()
        k, row_bytes = cols // slices, raw.shape[1] // slices
        for s in range(slices):
            ws = gpu.upload(f"sliced.{cols}.{rows}.{s}", Q.Q8_0, (k, rows),
                            np.ascontiguousarray(raw[:, s * row_bytes:(s + 1) * row_bytes]))
            want = matvec(ws, x[s * k:(s + 1) * k].contiguous(), rows)
            assert torch.equal(parts[s:s + 1], want), f"part {s}"
        whole = matvec(w, x, rows)
        err = (parts.double().sum(0) - whole.double()).abs().max() / whole.double().abs().max()
        assert err < 1e-5


def test_declines_what_it_cannot_take() -> None:
    ext = gpu.load()
    rng = np.random.default_rng(5)
    q = gpu.upload("sliced.no.q", Q.Q8_0, (1536, 256), random_blocks(Q.Q8_0, 256, 1536, rng))  # 768 not 512-aligned
    f = gpu.upload("sliced.no.f", Q.F16, (2048, 256), random_blocks(Q.F16, 256, 2048, rng))
    x = cuda(rng.standard_normal(2048))
    parts = torch.full((4, 256), float("nan"), device="cuda")
    assert not ext.matvec_sliced(q, x.data_ptr(), parts.data_ptr(), 2)
    assert not ext.matvec_sliced(f, x.data_ptr(), parts.data_ptr(), 2)
    q2 = gpu.upload("sliced.no.q2", Q.Q8_0, (2048, 256), random_blocks(Q.Q8_0, 256, 2048, rng))
    assert not ext.matvec_sliced(q2, x.data_ptr(), parts.data_ptr(), 1)
    assert not ext.matvec_sliced(q2, x.data_ptr(), parts.data_ptr(), 5)
    assert not ext.matvec_sliced(q2, x[1:].data_ptr(), parts.data_ptr(), 2)  # x not 16-byte aligned
    torch.cuda.synchronize()
    assert torch.isnan(parts).all()
