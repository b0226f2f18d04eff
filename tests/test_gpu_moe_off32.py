"""Decode's IQ2_XXS gate/up rows kernel with its rows addressed by 32-bit offsets from the planes' bases
(DS4_GPU_GU_OFF32=1, ext.set_gu_off32) against the 64-bit row pointers of the default: the same loads in the same
order, so h must be the same bits."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

from test_gpu_kernels import random_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]


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
