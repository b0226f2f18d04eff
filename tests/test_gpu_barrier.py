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


@pytest.mark.parametrize("ctas", [2, 5, "most"])
def test_flag_relay_hands_every_store_on(ctas):
    """flag_relay: each hop's acquire sees the plain store its predecessor made before the release, lap after lap."""
    import torch

    ext = gpu.load()
    ctas = ext.flag_relay_max_ctas() if ctas == "most" else ctas
    laps = 200
    flags, data = (torch.zeros(ctas, dtype=torch.int32, device="cuda") for _ in range(2))
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    ext.flag_relay(ctas, flags.data_ptr(), data.data_ptr(), laps, bad.data_ptr())
    torch.cuda.synchronize()
    assert int(bad.item()) == 0, f"{ctas} CTAs: {int(bad.item())} stale or timed-out hops"
    assert (flags == laps).all(), f"{ctas} CTAs: flags {flags.unique().tolist()}"
    want = laps * ctas + torch.arange(ctas, dtype=torch.int32, device="cuda")
    assert torch.equal(data, want), f"{ctas} CTAs: the last lap's plain stores"


@pytest.mark.parametrize("ctas", [2, 3, 8])
def test_cluster_relay_hands_every_store_on(ctas):
    """cluster_relay: each hop's cluster-scope acquire sees the store its predecessor made into its shared memory."""
    import torch

    ext = gpu.load()
    bad, hops = (torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(2))
    torch.cuda.synchronize()
    ext.cluster_relay(ctas, 300, bad.data_ptr(), hops.data_ptr())
    torch.cuda.synchronize()
    assert int(bad.item()) == 0, f"{ctas} CTAs: {int(bad.item())} stale or timed-out hops"
    assert int(hops.item()) == ctas * 300 - 1
    with pytest.raises(ValueError, match="2..8 CTAs"):
        ext.cluster_relay(9, 1, bad.data_ptr(), hops.data_ptr())


def test_flag_relay_checks_its_grid():
    ext = gpu.load()
    with pytest.raises(ValueError, match="one per SM"):
        ext.flag_relay(1, 0, 0, 1, 0)
    with pytest.raises(ValueError, match="one per SM"):
        ext.flag_relay(ext.flag_relay_max_ctas() + 1, 0, 0, 1, 0)


def test_bench_barrier_runs():
    from ds4.engine.gpu import bench_barrier

    assert bench_barrier.main(["--iters", "50", "--loaded"]) == 0
