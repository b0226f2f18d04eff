"""Decode's routed Q2_K down with its units staged by cp.async (DS4_GPU_DOWN_PF=1, ext.set_down_pf): every unit of a
lane is requested before the first product, where the default kernel loads one unit after the other's products. The
units are summed in the same order from the same bytes, so the output must be the default's bits, for one token and
several, k = 6 (Flash: three units per lane, one window) and k = 8 (four: a second, partial window), with an expert id
out of range (the token's output is NaN either way); and both held to the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

from test_gpu_kernels import TOL, moe_reference, random_blocks, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]


def moe_with_pf(mode: int, gate, up, down, x, ids, wts) -> np.ndarray:
    ext = gpu.load()
    ext.set_down_pf(mode)
    try:
        before = ext.down_pf_launches()
        y = gpu.moe_host(gate, up, down, x, ids, wts)
        assert ext.down_pf_launches() - before == mode  # the staged form ran exactly when asked
        return y
    finally:
        ext.set_down_pf(-1)


@pytest.mark.parametrize("k", [6, 8])
def test_staged_down_gives_the_default_bits(k: int) -> None:
    gpu.load().reset_stream()
    n_embd, n_ff, n_expert = 4096, 2048, 12  # Flash expert shapes
    rng = np.random.default_rng(60 + k)
    raws = [random_blocks(Q.IQ2_XXS, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1) for _ in range(2)]
    down_raw = random_blocks(Q.Q2_K, n_expert * n_embd, n_ff, rng).reshape(n_expert, n_embd, -1)
    gate, up = (gpu.upload(f"pf{k}.{i}", Q.IQ2_XXS, (n_embd, n_ff, n_expert), r) for i, r in enumerate(raws))
    down = gpu.upload(f"pf{k}.down", Q.Q2_K, (n_ff, n_embd, n_expert), down_raw)
    for T in (1, 3):
        x = rng.standard_normal((T, n_embd)).astype(np.float32) * 2.0
        ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)]).astype(np.int32)
        wts = rng.uniform(0.1, 0.5, (T, k)).astype(np.float32)
        on, off = moe_with_pf(1, gate, up, down, x, ids, wts), moe_with_pf(0, gate, up, down, x, ids, wts)
        assert np.isfinite(on).all() and (on != 0).any()
        assert np.array_equal(on.view(np.uint32), off.view(np.uint32)), f"T={T} k={k}"
        ref = moe_reference(raws[0], raws[1], down_raw, Q.IQ2_XXS, Q.Q2_K, x.astype(np.float64), ids, wts, 10.0)
        assert rel_err(on, ref) <= TOL, f"T={T} k={k}"
        ids[-1, 1] = n_expert  # out of range: that token's output is poisoned, the others keep their bits
        bad_on, bad_off = moe_with_pf(1, gate, up, down, x, ids, wts), moe_with_pf(0, gate, up, down, x, ids, wts)
        assert np.isnan(bad_on[-1]).all() and np.isnan(bad_off[-1]).all()
        assert np.array_equal(bad_on[:-1].view(np.uint32), on[:-1].view(np.uint32))


def test_gateup_offsets_give_the_default_bits() -> None:
    """DS4_GPU_GU_OFF32=1 (ext.set_gu_off32): the IQ2_XXS gate/up rows kernel addressing its rows by 32-bit offsets
    loads the same bytes in the same order, so h must be the default's bits (an expert id out of range included)."""
    ext = gpu.load()
    ext.reset_stream()
    n_embd, n_ff, n_expert, k = 4096, 2048, 12, 6
    rng = np.random.default_rng(71)
    gate, up = (gpu.upload(f"off32.{i}", Q.IQ2_XXS, (n_embd, n_ff, n_expert),
                           random_blocks(Q.IQ2_XXS, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1))
                for i in range(2))
    for T in (1, 3):
        x = ext.Array.from_numpy((rng.standard_normal((T, n_embd)) * 2.0).astype(np.float32))
        ids_np = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)]).astype(np.int32)
        ids_np[-1, -1] = n_expert
        ids = ext.Array.from_numpy(ids_np)
        wts = ext.Array.from_numpy(rng.uniform(0.1, 0.5, (T, k)).astype(np.float32))
        outs = []
        for mode in (0, 1):
            ext.set_gu_off32(mode)
            try:
                before = ext.gu_off32_launches()
                h = ext.Array.empty([T * k, n_ff])
                h.fill(123.0)
                ext.moe_gateup(gate, up, x, ids, wts, h, 10.0)
                ext.synchronize()
                assert ext.gu_off32_launches() - before == mode
                outs.append(h.numpy())
            finally:
                ext.set_gu_off32(-1)
        assert np.isnan(outs[1][-1]).all() and np.isfinite(outs[1][:-1]).all() and (outs[1][:-1] != 123.0).any()
        assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), f"T={T}"
