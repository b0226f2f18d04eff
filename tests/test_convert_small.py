"""Streaming check on the `small` preset: converting never holds the model in memory (slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ds4.engine.config import preset
from ds4.gguf_tools.reader import open_model

# Runs one ds4-quantize command in a fresh interpreter and prints that process's peak RSS in bytes.
PEAK_RSS = """
import resource, sys
from ds4.gguf_tools.quantize import main
rc = main(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
sys.exit(rc)
"""


def peak_rss(*args: str) -> int:
    r = subprocess.run([sys.executable, "-c", PEAK_RSS, *args], capture_output=True, text=True, check=True)
    return int(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_small_convert_peak_rss_is_far_below_model_size(tmp_path):
    hf_dir, out = tmp_path / "small-hf", tmp_path / "small.gguf"
    synth_peak = peak_rss("synth", "--preset", "small", "--seed", "0", "--quiet", str(hf_dir))
    convert_peak = peak_rss("convert", str(hf_dir), str(out), "--type", "f16", "--quiet")
    f = open_model(out)
    assert f.config == preset("small")
    tensor_bytes = sum(t.nbytes for t in f.tensors.values())
    hf_bytes = json.loads((hf_dir / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    print(f"\nsmall: GGUF tensor bytes {tensor_bytes / 2**20:.1f} MiB, checkpoint {hf_bytes / 2**20:.1f} MiB, "
          f"peak RSS convert {convert_peak / 2**20:.1f} MiB, synth {synth_peak / 2**20:.1f} MiB")
    # the largest tensor (token_embd, f16) is ~126 MiB; the tokenizer.json parse alone peaks near 150 MiB
    assert convert_peak < 0.5 * tensor_bytes
    assert synth_peak < 0.5 * hf_bytes
