"""`python -m ds4.engine.gpu.bench_compress`: a bad flag is refused without a traceback (runs anywhere); on a GPU it times
each compressor-step form at a pooling and at a storing step (skipped without a CUDA device)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ds4.engine import gpu


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds4.engine.gpu.bench_compress", *args], capture_output=True,
                          text=True, timeout=300)


def test_out_of_range_reps_exit_2_with_one_line() -> None:
    r = _run("--reps", "0")
    assert r.returncode == 2
    assert "bench_compress: --reps" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))
def test_times_pooling_against_storing_steps() -> None:
    r = _run("--reps", "40")
    assert r.returncode == 0, r.stderr
    rows = [line.rsplit(None, 3) for line in r.stdout.splitlines()[1:]]
    assert len(rows) == 4
    for name, pool, store, ratio in rows:
        assert float(pool) > float(store) > 0, name  # pooling does the storing step's work and more
        assert abs(float(ratio) - float(pool) / float(store)) < 0.01 * float(ratio) + 0.01
