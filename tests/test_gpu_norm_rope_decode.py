"""Decode's norm_rope launches on the one-warp-per-row kernel (DS4_GPU_NR_WARP_DECODE=1, fused.cu norm_rope_warp_kernel
with a second job): the 64 query heads with RMS norm and RoPE, and the KV row (norm, RoPE, FP8 simulation of the
non-RoPE part) written into its ring slot pos % cap, in one launch; and the indexer's query rows (RoPE, Hadamard +
FP4). Against the block kernel (the default): the same rows within float rounding (the norm's sum runs in another
order), the same ring slot written and no other. The switch is read once per process: each setting runs in its own
subprocess."""

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
import sys, numpy as np, torch
from ds4.engine import gpu
from ds4.engine.gpu.fused import Fused
K = Fused(gpu.load(), torch.device("cuda"))
rng = np.random.default_rng(4)
t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).cuda()
H, d, rd, cap, p = 64, 512, 64, 128, 2051
freq = t(1.0 / 10000.0 ** (np.arange(0, rd, 2) / rd))
pos = torch.tensor([p], device="cuda")
q_lin, kv_lin = t(rng.standard_normal((1, H * d)) * 3.0), t(rng.standard_normal((1, d)))
ring = t(np.full((cap, d), 7.0))
kv_job = dict(x=kv_lin, d=d, rows_per_token=1, norm=True, w=t(rng.uniform(0.5, 1.5, d)), eps=1e-6, freq=freq,
              rope_dim=rd, fp8_nope=448, out=ring, ring_cap=cap)
q = K.norm_rope(q_lin, d, H, pos, norm=True, eps=1e-6, freq=freq, rope_dim=rd, also=kv_job)
qi = K.norm_rope(t(rng.standard_normal((1, 64 * 128))), 128, 64, pos, freq=freq, rope_dim=64, qat=True)
torch.cuda.synchronize()
np.savez(sys.argv[1], q=q.cpu().numpy(), ring=ring.cpu().numpy(), qi=qi.cpu().numpy())
"""


def _run(tmp_path: Path, warp: str) -> dict[str, np.ndarray]:
    out = tmp_path / f"nr{warp}.npz"
    env = dict(os.environ, DS4_GPU_NR_WARP_DECODE=warp)
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    with np.load(out) as z:
        return dict(z)


def test_warp_kernel_gives_the_block_kernels_rows(tmp_path):
    pytest.importorskip("torch")
    block, warp = _run(tmp_path, "0"), _run(tmp_path, "1")
    slot = 2051 % 128
    for name in ("q", "qi"):
        err = np.linalg.norm(warp[name] - block[name]) / np.linalg.norm(block[name])
        assert err <= 1e-6, f"{name}: {err:.2e}"
    others = np.delete(np.arange(128), slot)
    for r in (block, warp):
        assert (r["ring"][others] == 7.0).all(), "a ring row other than pos % cap was written"
        assert not (r["ring"][slot] == 7.0).any()
    a, b = warp["ring"][slot], block["ring"][slot]
    assert np.abs(a[448:] - b[448:]).max() <= 1e-5 * np.abs(b[448:]).max()  # the RoPE part: float rounding only
    # the FP8 part: a value within float rounding of an FP8 rounding boundary may land one FP8 step (1/8) apart
    diff = np.nonzero(a[:448] != b[:448])[0]
    assert len(diff) <= 4, f"{len(diff)} FP8 values differ"
    assert (np.abs(a[diff] - b[diff]) <= 0.13 * np.abs(b[diff])).all()
