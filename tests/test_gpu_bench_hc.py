"""`python -m ds4.engine.gpu.bench_hc`: bad flags are refused without a traceback (runs anywhere); on a GPU it times the
mHC kernel at each iteration count against the 0-iteration peer (skipped without a CUDA device)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ds4.engine import gpu


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds4.engine.gpu.bench_hc", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("args", [("--iters", "-1"), ("--reps", "0"), ("--prefill-mix", "-5")])
def test_out_of_range_flags_exit_2_with_one_line(args) -> None:
    r = _run(*args)
    assert r.returncode == 2
    assert "bench_hc:" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))
def test_times_each_iteration_count_against_the_peer() -> None:
    r = _run("--iters", "20", "1", "--reps", "60")
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ["0", "20", "1"]
    assert all(float(row[1]) > 0 for row in rows) and float(rows[0][2]) == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))
def test_prefill_mix_times_the_kernel_against_torchs_gemm() -> None:
    r = _run("--prefill-mix", "512")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    line = next(ln for ln in lines if ln.startswith("prefill mix of 512 rows: hc_mix_rows"))
    assert "torch float32 GEMM" in line and float(line.split("max diff from float64 ")[1].split()[0]) < 1e-6
    pm = next(ln for ln in lines if ln.startswith("prefill post + mix of 512 rows: hc_post_mix"))
    assert float(pm.split("hc_post_mix ")[1].split()[0]) > 0 and pm.endswith("x")
