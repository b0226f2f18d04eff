"""The kernel benchmark's command line (ds4.speed_bench.gpu_kernels): its arguments are checked before it looks for a
GPU, so a bad one gets its own one-line error (exit 2) on any machine; with good arguments and no GPU it says why it
cannot run (exit 2), and on a GPU machine it is not run here (it takes minutes)."""

from __future__ import annotations

import subprocess
import sys

from ds4.engine import gpu


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds4.speed_bench.gpu_kernels", *args], capture_output=True, text=True,
                          timeout=120)


def test_help_names_the_filters() -> None:
    done = _run("--help")
    assert done.returncode == 0
    for flag in ("--only", "--k-sweep", "--batch", "--json"):
        assert flag in done.stdout


def test_bad_arguments_exit_2_with_one_line() -> None:
    bad_regex = _run("--only", "(")
    assert bad_regex.returncode == 2
    lines = bad_regex.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_kernels: --only is not a valid regex")
    bad_batch = _run("--batch", "9")
    assert bad_batch.returncode == 2
    assert bad_batch.stderr.strip().splitlines() == ["gpu_kernels: --batch values must be 1..8"]


def test_without_a_gpu_it_says_why() -> None:
    if gpu.available():
        return  # the full benchmark is a device-machine command, not a test
    done = _run("--batch", "1", "--only", "attn_q_a")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"gpu_kernels: {gpu.unavailable_reason()}"]
