"""Decode's routed experts with the shared expert in the same two launches (DS4_GPU_MOE_SHEXP, engine/gpu/moe.cu
moe_gateup_shexp_kernel and the down kernel's shared-expert blocks): the routed sum is bitwise ext.moe's (the same rows'
arithmetic, only dealt to other warps), NaN-poisoned for an expert id out of range; the shared expert's output is held
to the numpy reference; shapes and types the kernels do not run are declined, not run."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]

# gate/up type, down type, n_embd, n_ff (q2: Flash's expert shape)
MIXES = {"q2": (Q.IQ2_XXS, Q.Q2_K, 4096, 2048), "q4": (Q.Q4_K, Q.Q4_K, 2048, 1024), "q8": (Q.Q8_0, Q.Q8_0, 1024, 512)}


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _experts(mix: str, n_expert: int, rng):
    from test_gpu_kernels import random_blocks

    qg, qd, n_embd, n_ff = MIXES[mix]
    raws = [random_blocks(qg, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1) for _ in range(2)]
    down_raw = random_blocks(qd, n_expert * n_embd, n_ff, rng).reshape(n_expert, n_embd, -1)
    sh_raw = [random_blocks(Q.Q8_0, n_ff, n_embd, rng)[None] for _ in range(2)] + \
        [random_blocks(Q.Q8_0, n_embd, n_ff, rng)[None]]
    gate, up = (gpu.upload(f"sh.{mix}.{i}", qg, (n_embd, n_ff, n_expert), r) for i, r in enumerate(raws))
    down = gpu.upload(f"sh.{mix}.down", qd, (n_ff, n_embd, n_expert), down_raw)
    shexp = [gpu.upload(f"sh.{mix}.s{i}", Q.Q8_0, ne, r[0])
             for i, (ne, r) in enumerate(zip([(n_embd, n_ff), (n_embd, n_ff), (n_ff, n_embd)], sh_raw))]
    return (gate, up, down), shexp, (raws, down_raw, sh_raw)


def _run(ext, routed, shexp, x, ids, wts):
    arrays = [ext.Array.from_numpy(a) for a in (x, ids, wts)]
    y, ys = ext.Array.empty(list(x.shape)), ext.Array.empty(list(x.shape))
    assert ext.moe_shexp(*routed, *shexp, *arrays, y, ys, 10.0)
    return y.numpy(), ys.numpy()


@pytest.mark.parametrize("mix", list(MIXES))
def test_moe_with_the_shared_expert_keeps_the_routed_bits_and_meets_the_reference(mix):
    from test_gpu_kernels import TOL, moe_reference, rel_err

    ext = gpu.load()
    n_expert, k = 8, 6
    rng = np.random.default_rng(77)
    routed, shexp, (raws, down_raw, sh_raw) = _experts(mix, n_expert, rng)
    qg, qd, n_embd, n_ff = MIXES[mix]
    assert ext.moe_shexp_takes(routed[0], routed[2], *shexp)
    x = rng.standard_normal((1, n_embd)).astype(np.float32) * 2.0
    ids = rng.choice(n_expert, (1, k), replace=False).astype(np.int32)
    wts = rng.uniform(0.1, 0.5, (1, k)).astype(np.float32)
    y, ys = _run(ext, routed, shexp, x, ids, wts)
    assert np.array_equal(bits(y), bits(gpu.moe_host(*routed, x, ids, wts))), "routed sum differs from ext.moe"
    assert np.array_equal(bits(_run(ext, routed, shexp, x, ids, wts)[1]), bits(ys)), "not deterministic"
    one = np.zeros((1, 1), np.int32)
    ref_sh = moe_reference(*sh_raw, Q.Q8_0, Q.Q8_0, x.astype(np.float64), one, np.ones((1, 1)), 10.0)
    assert rel_err(ys, ref_sh) <= TOL
    ref = moe_reference(raws[0], raws[1], down_raw, qg, qd, x.astype(np.float64), ids, wts, 10.0)
    assert rel_err(y, ref) <= TOL
    bad = ids.copy()
    bad[0, 1] = n_expert  # out of range: the routed sum is poisoned, the shared expert's output is not
    yb, ysb = _run(ext, routed, shexp, x, bad, wts)
    assert np.isnan(yb).all() and np.array_equal(bits(ysb), bits(ys))


def test_shapes_the_kernels_do_not_run_are_declined():
    ext = gpu.load()
    rng = np.random.default_rng(78)
    routed, shexp, _ = _experts("q8", 4, rng)
    assert not ext.moe_shexp_takes(routed[0], routed[2], shexp[1], shexp[0], shexp[0])  # down of the wrong shape
    x = np.zeros((2, MIXES["q8"][2]), np.float32)  # two tokens: decode's one only
    ids = np.zeros((2, 2), np.int32)
    arrays = [ext.Array.from_numpy(a) for a in (x, ids, np.ones((2, 2), np.float32))]
    y, ys = ext.Array.empty(list(x.shape)), ext.Array.empty(list(x.shape))
    assert not ext.moe_shexp(*routed, *shexp, *arrays, y, ys, 10.0)
