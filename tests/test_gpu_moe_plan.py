"""The bucket plan of prefill's routed experts (moe_gemm.plan_buckets) and mmf's activation layout: host code. The
plan is checked by the properties the grouped GEMMs rely on, on counts shaped like a real chunk's (one very busy
expert, a bulk near the mean, a tail of rarely used ones, unused ones)."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine.gpu.moe_gemm import plan_buckets
from ds4.gguf_tools.constants import QuantType as Q


def _counts(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    c = rng.poisson(176, 256)
    c[7] = 4255  # the synthetic router's favourite
    c[rng.choice(256, 20, replace=False)] = rng.integers(0, 9, 20)
    return c.tolist()


@pytest.mark.parametrize("seed,spread,small,round_to", [(0, 1.25, 64, 1), (1, 1.1, 64, 1), (2, 1.0, 0, 1),
                                                         (3, 2.0, 16, 1), (4, 1.25, 64, 16)])
def test_every_used_expert_gets_one_slot_in_a_bucket_that_holds_its_rows(seed, spread, small, round_to):
    counts = _counts(seed)
    used, buckets, rows = plan_buckets(counts, spread, small, round_to)
    assert sorted(used) == [e for e, c in enumerate(counts) if c > 0]
    assert [counts[e] for e in used] == sorted((c for c in counts if c > 0), reverse=True)
    slot, row = 0, 0
    for b in buckets:  # contiguous slots and rows, in order
        assert (b.slot0, b.row0) == (slot, row) and b.slots >= 1
        members = [counts[e] for e in used[b.slot0:b.slot0 + b.slots]]
        assert b.cap % round_to == 0 and max(members) <= b.cap < max(members) + round_to
        assert max(members) <= small or max(members) <= spread * min(members)
        slot, row = slot + b.slots, row + b.slots * b.cap
    assert slot == len(used) and row == rows
    # each expert is padded to at most spread times its rows, or to the small bucket's cap
    assert rows <= sum(max(spread * c, small) + round_to - 1 for c in counts if c > 0) + 1e-9


def test_a_spread_below_one_or_a_zero_rounding_is_refused():
    with pytest.raises(ValueError, match="SPREAD"):
        plan_buckets([3, 4], 0.5)
    with pytest.raises(ValueError, match="ROUND"):
        plan_buckets([3, 4], 1.25, 64, 0)


def test_expert_tiles_cover_every_row_once():
    from ds4.engine.gpu.moe_gemm import expert_tiles

    counts = [0, 64, 65, 1, 0, 200]
    tiles = expert_tiles(counts, 64)
    rows = [r for a, n, e, _ in tiles for r in range(a, a + n)]
    assert rows == list(range(sum(counts))) and all(1 <= n <= 64 for _, n, _, _ in tiles)
    assert [e for _, _, e, _ in tiles] == [1, 2, 2, 3, 5, 5, 5, 5]


@pytest.mark.parametrize("qtype,group", [(Q.Q2_K, 16), (Q.Q4_K, 32), (Q.IQ2_XXS, None)])
def test_mmf_activations_layout(qtype, group):
    """The activations as mmf.cu takes them (CPU): x / s split to float16 hi + lo, and for the K-quants 16 group sums
    of x / s per 256 columns (Q4_K: 8 sums of 32 columns, then 8 zeros), split alike (to float32 level)."""
    import torch

    from ds4.engine.gpu import weights
    from ds4.engine.gpu.moe_gemm import mmf_activations

    x = torch.from_numpy(np.random.default_rng(4).standard_normal((5, 512)).astype(np.float32))
    xa = mmf_activations(lambda t: weights.to_half(t, True), x, int(qtype))
    xn = xa.hi.double() + xa.lo.double()
    assert torch.allclose(xn * xa.s.double(), x.double(), rtol=0, atol=1e-6 * float(x.abs().max()))
    if group is None:
        assert xa.sum_hi is None and xa.sum_lo is None
        return
    assert xa.sum_hi.shape == (5, 2, 16) and xa.sum_hi.dtype == torch.float16
    sums = xa.sum_hi.double() + xa.sum_lo.double()
    n = 256 // group
    want = (x.double() / xa.s.double()).view(5, 2, n, group).sum(-1)
    assert torch.allclose(sums[..., :n], want, rtol=0, atol=1e-6 * group)
    assert (sums[..., n:] == 0).all()


@pytest.mark.parametrize("dtype", ["int64", "int32"])
def test_expert_counts_equal_bincount(dtype):
    """moe_gemm.expert_counts (the device tile table's counts, without bincount's host sync) counts as bincount does,
    unused experts included, for the router's int32 ids as for int64."""
    torch = pytest.importorskip("torch")
    from ds4.engine.gpu.moe_gemm import expert_counts

    rng = np.random.default_rng(5)
    ids = torch.from_numpy(rng.choice(200, size=(300, 6)).astype(dtype))  # experts 200..255 unused
    got = expert_counts(ids, 256)
    assert got.dtype == torch.int64 and got.shape == (256,)
    assert torch.equal(got, torch.bincount(ids.reshape(-1).long(), minlength=256))
    assert int(got[200:].sum()) == 0 and int(got.sum()) == ids.numel()
