"""The routed-MoE gate/up with the token's x staged in shared memory (DS4_GPU_GU_XS=1, decode: one token):
the same loads in the same order as the default kernel, so the outputs are bitwise equal; both are held to the
numpy reference. The switch is read once per process, so each setting runs in its own subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4.engine import gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]

SCRIPT = r"""
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q
from test_gpu_kernels import random_blocks
out = {}
for mix, (qg, qd) in {"q2": (Q.IQ2_XXS, Q.Q2_K), "q4": (Q.Q4_K, Q.Q4_K), "q8": (Q.Q8_0, Q.Q8_0)}.items():
    n_embd, n_ff, n_expert, k = 4096, 2048, 8, 6
    rng = np.random.default_rng(40)
    raws = [random_blocks(qg, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1) for _ in range(2)]
    down_raw = random_blocks(qd, n_expert * n_embd, n_ff, rng).reshape(n_expert, n_embd, -1)
    gate, up = (gpu.upload(f"xs.{mix}.{i}", qg, (n_embd, n_ff, n_expert), r) for i, r in enumerate(raws))
    down = gpu.upload(f"xs.{mix}.down", qd, (n_ff, n_embd, n_expert), down_raw)
    x = rng.standard_normal((1, n_embd)).astype(np.float32) * 2.0
    ids = rng.choice(n_expert, (1, k), replace=False).astype(np.int32)
    wts = rng.uniform(0.1, 0.5, (1, k)).astype(np.float32)
    out[mix] = gpu.moe_host(gate, up, down, x, ids, wts)
    ids[0, 2] = n_expert  # out of range: the token's output is poisoned
    out[mix + "_bad"] = gpu.moe_host(gate, up, down, x, ids, wts)
    if sys.argv[3] == "ref":
        from test_gpu_kernels import moe_reference
        ids[0, 2] = min(set(range(n_expert)) - set(ids[0].tolist()))  # a valid expert not picked yet
        out[mix + "_got"] = gpu.moe_host(gate, up, down, x, ids, wts)
        out[mix + "_ref"] = moe_reference(raws[0], raws[1], down_raw, qg, qd, x.astype(np.float64), ids, wts, 10.0)
np.savez(sys.argv[2], **out)
"""


def run(tmp_path: Path, xs: bool, ref: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DS4_GPU_GU_XS"}
    if xs:
        env["DS4_GPU_GU_XS"] = "1"
    out = tmp_path / f"moe_xs{int(xs)}.npz"
    tests = str(Path(__file__).resolve().parent)
    done = subprocess.run([sys.executable, "-c", SCRIPT, tests, str(out), "ref" if ref else "-"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(out))


def test_staged_x_gives_the_default_bits_and_the_reference(tmp_path) -> None:
    from test_gpu_kernels import TOL, rel_err

    on, off = run(tmp_path, True, True), run(tmp_path, False, False)
    for mix in ("q2", "q4", "q8"):
        assert np.array_equal(on[mix], off[mix]), mix
        assert np.isnan(on[mix + "_bad"]).all() and np.isnan(off[mix + "_bad"]).all(), mix
        assert rel_err(on[mix + "_got"], on[mix + "_ref"]) <= TOL, mix
