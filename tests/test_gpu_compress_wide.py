"""DS4_GPU_COMPRESS_WIDE (ext.set_compress_wide, v24, prepared): the decode compressor's pooling for ratios other than 4
split over the block's warps (pool_wide in fused.cu). Not the v15 loops' bits (another summation order), so: the
frontier state bitwise as the loops leave it, the finished rows within float32 rounding of the loops' (no FP8 rounding
here: its steps would magnify a last-bit difference), over two pooling windows. Skipped without a CUDA device and the
built extension."""

from __future__ import annotations

import math

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
    ext.set_compress_wide(-1)
    ext.reset_stream()


def rnd(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).float().to(DEV)


@pytest.mark.parametrize("r,width", [(128, 512), (16, 512), (16, 128)])
def test_wide_pooling_matches_the_loops(K, r, width):
    g = torch.Generator().manual_seed(50 + r + width)
    rd, n_rows = 64, 3
    freq = (1.0 / 160000.0 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)).float().to(DEV)
    ape, norm_w = rnd(g, r, width, scale=0.3), rnd(g, width)
    inputs = [(rnd(g, 1, width, scale=2.0), rnd(g, 1, width, scale=3.0)) for _ in range(2 * r)]
    runs = []
    try:
        for wide in (0, 1):
            K.ext.set_compress_wide(wide)
            st = [torch.zeros(r, width, device=DEV), torch.full((r, width), -math.inf, device=DEV),
                  torch.zeros(n_rows, width, device=DEV)]
            for p, (kv, sc) in enumerate(inputs):
                K.compress_step(kv, sc, ape, *st, torch.tensor([p], device=DEV), r, norm_w, 1e-6, freq, rd, 0, False)
            runs.append(st)
    finally:
        K.ext.set_compress_wide(-1)
    torch.cuda.synchronize()
    loops, wide = runs
    assert torch.equal(loops[0], wide[0]) and torch.equal(loops[1], wide[1])  # the shifted frontier
    assert (wide[2][:2] != 0).any() and torch.isfinite(wide[2]).all()
    rel = float(torch.linalg.norm((wide[2] - loops[2]).double()) / torch.linalg.norm(loops[2].double()))
    assert rel < 2e-6
