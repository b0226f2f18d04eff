"""The kernel bench's launch ceiling (speed_bench/gpu_kernels.py): pure arithmetic, so it runs without a GPU."""

import pytest

from ds4.speed_bench.gpu_kernels import FLASH_MATVECS, launch_ceiling
from ds4.gguf_tools.constants import row_bytes


def test_ceiling_is_the_copy_time_over_launch_plus_copy():
    # 4.282 MB at 4282 GB/s is 1 us of copy; with a 1 us launch the best is half of copy
    assert launch_ceiling(4_282_000, 4282.0, 1.0) == pytest.approx(0.5)
    assert launch_ceiling(4_282_000, 4282.0, 0.0) == pytest.approx(1.0)


def test_ceiling_grows_with_bytes_and_falls_with_launch_cost():
    small, large = launch_ceiling(500_000, 4282.0, 0.5), launch_ceiling(50_000_000, 4282.0, 0.5)
    assert small < large < 1.0
    assert launch_ceiling(500_000, 4282.0, 1.0) < small


def test_flash_small_matvecs_sit_under_the_goal_at_a_half_microsecond_launch():
    # the indexer's proj (4096 x 64 F16, 0.52 MB) cannot stream at 0.80 of copy as a launch of its own; q_b can
    sizes = {name: row_bytes(q, ne[0]) * ne[1] for name, q, ne, _ in FLASH_MATVECS}
    assert launch_ceiling(sizes["indexer.proj"], 4282.0, 0.51) < 0.25
    assert launch_ceiling(sizes["attn_q_b"], 4282.0, 0.51) > 0.9


@pytest.mark.parametrize("args", [(0, 4282.0, 0.5), (1000, 0.0, 0.5), (1000, 4282.0, -1.0)])
def test_ceiling_rejects_meaningless_inputs(args):
    with pytest.raises(ValueError):
        launch_ceiling(*args)
