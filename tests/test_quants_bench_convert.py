"""`python -m ds4.gguf_tools.quants.bench_convert` on a reduced checkpoint: it runs, and every
quantized tensor of the converted q2 file equals our kernels' bytes and (when llama-cpp-python is
installed) ggml's `ggml_quantize_chunk` bytes for the same matrices and importance."""

from __future__ import annotations

import subprocess
import sys

from ds4.gguf_tools.quants import ggml_oracle
from ds4.gguf_tools.synth import synth_checkpoint

from ds4_tool_util import reduced_config


def test_bench_convert_reports_identical_bytes(tmp_path):
    hf = synth_checkpoint(reduced_config(n_expert=8), tmp_path / "hf", seed=2)
    cmd = [sys.executable, "-m", "ds4.gguf_tools.quants.bench_convert", "--hf", str(hf), "--threads", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line[:4] in ("Q8_0", "Q2_K", "IQ2_")}
    assert set(rows) == {"Q8_0", "Q2_K", "IQ2_XXS"}
    assert all(row[-1] == "yes" for row in rows.values())
    assert "end-to-end convert" in r.stdout
    if ggml_oracle.available():
        assert "ggml quantization alone" in r.stdout
    bad = subprocess.run([*cmd[:3], "--hf", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
