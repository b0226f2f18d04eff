"""probe_kernel's command line (no GPU needed: its arguments are checked before the extension loads)."""

from __future__ import annotations

import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds4.engine.gpu.probe_kernel", *args], capture_output=True, text=True,
                          timeout=120)


def test_help_lists_the_ops() -> None:
    done = _run("--help")
    assert done.returncode == 0
    for op in ("q_b", "o_b", "o_a", "gateup", "moe"):
        assert op in done.stdout


def test_bad_arguments_exit_2_with_one_line() -> None:
    done = _run("o_b", "--calls", "0")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["probe_kernel: --calls and --copies must be at least 1"]
    unknown = _run("nope")
    assert unknown.returncode == 2 and "invalid choice" in unknown.stderr
