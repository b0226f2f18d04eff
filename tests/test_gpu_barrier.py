"""Grid-wide barriers inside one resident grid (barrier.cu), the brick of a persistent decode kernel: every form
holds every CTA until all have arrived, barrier after barrier, at the most CTAs that fit and at a few; grids that
cannot be resident are refused. Skipped without a built extension and a CUDA device."""

from __future__ import annotations

import pytest

from ds4.engine import gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_barriers_hold_every_cta(mode):
    import torch

    ext = gpu.load()
    most = ext.barrier_max_ctas(256)
    for ctas in (7, most):
        iters = 300
        slots = torch.zeros(iters, dtype=torch.int32, device="cuda")
        data = torch.zeros(iters, ctas, dtype=torch.int32, device="cuda")
        bad = torch.zeros(1, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        ext.barrier_check(mode, ctas, 256, slots.data_ptr(), data.data_ptr(), iters, bad.data_ptr())
        torch.cuda.synchronize()
        assert int(bad.item()) == 0, f"form {mode}, {ctas} CTAs: {int(bad.item())} early passes"
        assert (slots == ctas).all(), f"form {mode}, {ctas} CTAs: arrivals {slots.unique().tolist()}"
        want = torch.arange(1, iters + 1, dtype=torch.int32, device="cuda")[:, None].expand(iters, ctas)
        assert torch.equal(data, want), f"form {mode}, {ctas} CTAs: the plain stores"


def test_barrier_grids_must_fit():
    ext = gpu.load()
    most = ext.barrier_max_ctas(256)
    with pytest.raises(ValueError, match="every CTA must be resident"):
        ext.barrier_check(1, most + 1, 256, 0, 0, 1, 0)
    with pytest.raises(ValueError, match="mode 0"):
        ext.barrier_check(3, 1, 256, 0, 0, 1, 0)


def test_bench_barrier_runs():
    from ds4.engine.gpu import bench_barrier

    assert bench_barrier.main(["--iters", "50"]) == 0
