"""`ds4-imatrix collect --power N` as a real subprocess on the tiny model: byte-identical output
files (legacy .dat and GGUF) and a reported busy fraction near N %."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

TEXT = "\n".join(f"\n===== DS4_IMATRIX_PROMPT p{i} test nothink src =====\n"
                 f"<｜begin▁of▁sentence｜><｜User｜>Prompt {i}: how do glaciers carve valleys?"
                 f"<｜Assistant｜></think>Slowly, by plucking and abrasion ... {i}<｜end▁of▁sentence｜>"
                 for i in range(5))
BUSY = re.compile(r"--power (\d+): busy fraction ([0-9.]+) \(([0-9.]+) s busy, ([0-9.]+) s slept\)")


def _collect(model, src, out, *extra):
    r = subprocess.run([sys.executable, "-m", "ds4.imatrix.cli", "collect", "-m", str(model), "--rendered",
                        str(src), "-o", str(out), "--chunk", "16", "-q", *extra],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r


@pytest.mark.parametrize("suffix,extra", [(".dat", ()), (".gguf", ("--all-tensors",))], ids=["dat", "gguf-all"])
def test_power_output_byte_identical(tiny_gguf, tmp_path, suffix, extra):
    src = tmp_path / "calib.txt"
    src.write_text(TEXT)
    full = _collect(tiny_gguf, src, tmp_path / f"full{suffix}", *extra)
    half = _collect(tiny_gguf, src, tmp_path / f"half{suffix}", *extra, "--power", "50")
    assert (tmp_path / f"full{suffix}").read_bytes() == (tmp_path / f"half{suffix}").read_bytes()
    assert "busy fraction" not in full.stderr
    m = BUSY.search(half.stderr)
    assert m, half.stderr
    assert int(m[1]) == 50 and 0.3 < float(m[2]) < 0.7
    assert float(m[4]) > 0.3 * float(m[3]) > 0  # it really slept, about as long as it worked


def test_power_out_of_range_is_a_usage_error(tiny_gguf, tmp_path):
    r = subprocess.run([sys.executable, "-m", "ds4.imatrix.cli", "collect", "-m", str(tiny_gguf), "-o",
                        str(tmp_path / "x.dat"), "--power", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--power" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.dat").exists()
