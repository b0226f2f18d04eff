"""The bucket plan of prefill's routed experts (moe_gemm.plan_buckets): pure host code, checked by the
properties the grouped GEMMs rely on, on counts shaped like a real chunk's (one very busy expert, a bulk
near the mean, a tail of rarely used ones, unused ones)."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine.gpu.moe_gemm import plan_buckets


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
