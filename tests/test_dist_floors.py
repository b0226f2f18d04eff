"""Memory per rank and decode floors of the expert-parallel layout (engine/dist/floors.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ds4.engine.dist.floors import expected_max_local, floors_for_plan
from ds4.engine.dist.shard import expert_range


def exact_expected_max(n_expert: int, k: int, world: int) -> float:
    owner = np.empty(n_expert, int)
    for r in range(world):
        e0, e1 = expert_range(n_expert, r, world)
        owner[e0:e1] = r
    combos = list(itertools.combinations(range(n_expert), k))
    return float(np.mean([np.bincount(owner[list(c)], minlength=world).max() for c in combos]))


@pytest.mark.parametrize("n_expert,k,world", [(12, 3, 2), (12, 3, 4), (10, 4, 3)])
def test_expected_max_matches_enumeration(n_expert, k, world):
    assert expected_max_local(n_expert, k, world) == pytest.approx(exact_expected_max(n_expert, k, world), abs=0.02)


def test_edge_cases_of_the_slowest_rank():
    assert expected_max_local(256, 6, 1) == 6.0
    assert expected_max_local(8, 6, 8) == 1.0  # one expert per rank
    assert 6 / 4 < expected_max_local(256, 6, 4) < expected_max_local(256, 6, 2) < 6


def test_flash_and_pro_budgets():
    one = floors_for_plan("flash", "q2", 1, 2048)
    four = floors_for_plan("flash", "q2", 4, 2048)
    # the whole Flash q2 file on one rank, a quarter of its experts plus everything else on each of four
    assert one["rank_bytes"] / 2**30 == pytest.approx(80.8, abs=0.1)
    assert four["rank_bytes"] < one["rank_bytes"] / 2
    assert one["decode_tps"] < four["decode_tps"] < four["decode_tps_all_split"]
    assert one["comm_payload_per_token"] == 43 * 4096 * 4
    pro = floors_for_plan("pro", "q2", 4, 8192)
    assert pro["rank_bytes"] / 2**30 < 139  # PRO q2 fits four H200s
    assert floors_for_plan("pro", "q2", 2, 8192)["rank_bytes"] / 2**30 > 139  # and not two
