"""The read-only stream peer of the kernel benchmark (read_stream.cu, ext.read_bandwidth): it reports the bytes it was
asked to read (rounded down to 16) and a rate between the L2-free floor of a slow device and the copy bandwidth's
bytes moved per second doubled (a pure read cannot beat twice a read-plus-write copy's total)."""

from __future__ import annotations

import pytest

from ds4.engine import gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]


def test_read_bandwidth_reports_a_plausible_rate() -> None:
    ext = gpu.load()
    copy = ext.copy_bandwidth(256 << 20, 5)
    read = ext.read_bandwidth((256 << 20) + 7, 5)
    assert read["bytes"] == 256 << 20
    assert read["ms"] > 0 and read["gbps"] == pytest.approx(read["bytes"] / (read["ms"] * 1e-3) / 1e9)
    assert 0.1 * copy["gbps"] < read["gbps"] < 2.0 * copy["gbps"]
