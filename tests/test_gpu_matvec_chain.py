"""Two dependent batch-1 matvecs in one launch: phase A, a grid barrier, phase B on A's output, in the register
form (matvec_chain.cu) and the bulk-copy form (matvec_tma.cu, set_mv_chain_form(2)). Each row is summed by one warp
in the streaming kernel's order and B stages x with the same arithmetic, so a chain must give exactly the bits of
the two separate launches, every time it is called (the barrier's count must return to zero). The bulk-copy form
takes rows of whole 512-column chunks: Flash's shapes; the small model's o_b (256 columns) falls back to the register
form."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

from test_gpu_kernels import random_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason())),
              pytest.mark.usefixtures("ext_on_torch_stream")]

torch = pytest.importorskip("torch")


def upload(name: str, qtype: Q, cols: int, rows: int, rng):
    return gpu.upload(name, qtype, (cols, rows), random_blocks(qtype, rows, cols, rng))


def nan(n: int):
    return torch.full((1, n), float("nan"), device="cuda")


def cuda(x: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).cuda()


@pytest.fixture(params=[1, 2], ids=["registers", "bulk"])
def chain_form(request):
    """The chain kernel form under test, and a check that the bulk-copy form did (or did not) take a call."""
    ext = gpu.load()
    ext.set_mv_chain_form(request.param)
    yield request.param
    ext.set_mv_chain_form(-1)


def chained(form: int, bulk_takes: bool, call) -> bool:
    """call() under the chosen form; with form 2 the bulk-copy chain must have run exactly where it takes the shapes."""
    ext = gpu.load()
    before = ext.mv_tma_launches()
    ok = call()
    assert ext.mv_tma_launches() - before == (1 if form == 2 and bulk_takes and ok else 0)
    return ok


def separate_grouped(wa, x, groups, wb):
    ext = gpu.load()
    mid, y = nan(wa.nrows), nan(wb.nrows)
    ext.matvec(wa, ext.Array.view(x.data_ptr(), [1, wa.ncols * groups]), ext.Array.view(mid.data_ptr(), [1, wa.nrows]),
               groups)
    ext.matvec(wb, ext.Array.view(mid.data_ptr(), [1, wb.ncols]), ext.Array.view(y.data_ptr(), [1, wb.nrows]))
    return mid, y


@pytest.mark.parametrize("cols,rows,groups,out_rows", [
    (4096, 8192, 8, 4096),  # Flash o_a (8 groups of 1024 rows) -> o_b
    (2048, 256, 2, 512),    # the small test model's o_a -> o_b
])
def test_grouped_then_plain_gives_the_separate_bits(cols, rows, groups, out_rows, chain_form) -> None:
    ext = gpu.load()
    rng = np.random.default_rng(cols + rows)
    wa = upload(f"chain.oa.{cols}", Q.Q8_0, cols, rows, rng)
    wb = upload(f"chain.ob.{cols}", Q.Q8_0, rows, out_rows, rng)
    x = cuda(rng.standard_normal(cols * groups) * 3.0)
    want_mid, want = separate_grouped(wa, x, groups, wb)
    for _ in range(3):  # the barrier is reused launch after launch
        mid, y = nan(rows), nan(out_rows)
        assert chained(chain_form, out_rows == 4096,
                       lambda: ext.matvec_chain([wa], x.data_ptr(), [mid.data_ptr()], groups, wb, y.data_ptr()))
        torch.cuda.synchronize()
        assert torch.equal(mid, want_mid) and torch.equal(y, want)


@pytest.mark.parametrize("cols,ff", [(4096, 2048), (512, 256)])  # Flash / small shared expert
def test_gate_up_then_swiglu_down_gives_the_separate_bits(cols, ff, chain_form) -> None:
    ext = gpu.load()
    rng = np.random.default_rng(ff)
    gate, up = (upload(f"chain.{n}.{ff}", Q.Q8_0, cols, ff, rng) for n in ("g", "u"))
    down = upload(f"chain.d.{ff}", Q.Q8_0, ff, cols, rng)
    x = cuda(rng.standard_normal(cols) * 2.0)
    gu, y = nan(2 * ff), nan(cols)
    assert ext.matvec_multi([gate, up], x.data_ptr(), [gu.data_ptr(), gu[:, ff:].data_ptr()])
    assert ext.matvec_multi([down], gu.data_ptr(), [y.data_ptr()], True, 10.0)
    for _ in range(2):
        gu2, y2 = nan(2 * ff), nan(cols)
        assert chained(chain_form, ff % 512 == 0,
                       lambda: ext.matvec_chain([gate, up], x.data_ptr(), [gu2.data_ptr(), gu2[:, ff:].data_ptr()], 1,
                                                down, y2.data_ptr(), True, 10.0))
        torch.cuda.synchronize()
        assert torch.equal(gu2, gu) and torch.equal(y2, y)


def test_declines_what_it_cannot_take(chain_form) -> None:
    """False and nothing written: F16 weights, a phase B of another width, SwiGLU halves that do not follow
    each other."""
    ext = gpu.load()
    rng = np.random.default_rng(3)
    a = upload("chain.no.a", Q.Q8_0, 4096, 1024, rng)
    b = upload("chain.no.b", Q.Q8_0, 2048, 512, rng)
    c = upload("chain.no.c", Q.Q8_0, 1024, 512, rng)
    f = upload("chain.no.f", Q.F16, 1024, 512, rng)
    x = cuda(rng.standard_normal(4096))
    mid, y = nan(2048), nan(512)
    assert not ext.matvec_chain([a], x.data_ptr(), [mid.data_ptr()], 1, b, y.data_ptr())  # 1024 != 2048
    assert not ext.matvec_chain([a], x.data_ptr(), [mid.data_ptr()], 1, f, y.data_ptr())
    assert not ext.matvec_chain([a, a], x.data_ptr(), [mid.data_ptr(), mid[:, 1040:].data_ptr()], 1, c,
                                y.data_ptr(), True, 10.0)
    torch.cuda.synchronize()
    assert torch.isnan(mid).all() and torch.isnan(y).all()


@pytest.mark.parametrize("cols,rows,out_rows", [(4096, 1024, 1024), (1024, 4096, 4096), (2048, 8192, 512)])
def test_bulk_chain_on_other_row_shapes(cols, rows, out_rows, chain_form) -> None:
    """Rows of 1, 2 and 4 per slot in either phase, and phase-B rows cut into slabs (8192 columns): the separate bits."""
    ext = gpu.load()
    rng = np.random.default_rng(cols * 7 + rows)
    wa = upload(f"chain.sh.a.{cols}.{rows}", Q.Q8_0, cols, rows, rng)
    wb = upload(f"chain.sh.b.{cols}.{rows}", Q.Q8_0, rows, out_rows, rng)
    x = cuda(rng.standard_normal(cols) * 1.5)
    want_mid, want = separate_grouped(wa, x, 1, wb)
    for _ in range(2):
        mid, y = nan(rows), nan(out_rows)
        ok = chained(chain_form, True,
                     lambda: ext.matvec_chain([wa], x.data_ptr(), [mid.data_ptr()], 1, wb, y.data_ptr()))
        torch.cuda.synchronize()
        if chain_form == 1 and not ok:  # the register form takes one row per tile only (not 2048 -> 8192)
            assert torch.isnan(mid).all() and torch.isnan(y).all()
            continue
        assert ok and torch.equal(mid, want_mid) and torch.equal(y, want)
