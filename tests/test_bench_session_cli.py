"""bench_session's argument checks run before anything touches a GPU: out-of-range flags exit 2 with a message."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv,needle", [
    (["--profile-prefill", "100", "--profile-from", "100"], "--profile-from must be in 0..N-1"),
    (["--profile-prefill", "100", "--profile-from", "-1"], "--profile-from must be in 0..N-1"),
    (["--profile-top", "0"], "--profile-top must be in 1..1000"),
])
def test_out_of_range_flags_exit_2_with_a_message(argv, needle):
    r = subprocess.run([sys.executable, "-m", "ds4.engine.gpu.bench_session", "model.gguf", *argv],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("argv,needle", [
    (["--session-launches", "2", "--session-ratio", "5"], "--session-ratio: invalid choice"),
    (["--session-launches", "2", "--session-output", "half"], "--session-output: invalid choice"),
])
def test_bench_attn_session_flags_are_checked(argv, needle):
    r = subprocess.run([sys.executable, "-m", "ds4.engine.gpu.bench_attn", *argv], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
