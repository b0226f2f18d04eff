"""The routed gate/up rows kernel with its IQ2_XXS sign masks from shared-memory tables (DS4_GPU_GU_LUT: form 3, the default since v21, reads form 2's tables by byte offsets)
against the same kernel with the masks computed: the decoded codes are the same integers, so h must be the same bits,
for one token (decode) and several, with an expert id out of range among them (its h is NaN either way)."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

from test_gpu_kernels import random_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]


def test_sign_tables_give_the_same_bits() -> None:
    ext = gpu.load()
    ext.reset_stream()
    n_embd, n_ff, n_expert, k = 4096, 2048, 12, 6  # Flash expert shapes
    rng = np.random.default_rng(23)
    gate = gpu.upload("lut.gate_exps", Q.IQ2_XXS, (n_embd, n_ff, n_expert),
                      random_blocks(Q.IQ2_XXS, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1))
    up = gpu.upload("lut.up_exps", Q.IQ2_XXS, (n_embd, n_ff, n_expert),
                    random_blocks(Q.IQ2_XXS, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1))
    for T in (1, 3):
        x = ext.Array.from_numpy((rng.standard_normal((T, n_embd)) * 2.0).astype(np.float32))
        ids_np = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)]).astype(np.int32)
        ids_np[-1, -1] = n_expert  # out of range: NaN-poisoned h rows
        ids = ext.Array.from_numpy(ids_np)
        wts = ext.Array.from_numpy(rng.uniform(0.1, 0.5, (T, k)).astype(np.float32))
        outs = []
        for mode in (0, 1, 2, 3):
            ext.set_gateup_lut(mode)
            try:
                h = ext.Array.empty([T * k, n_ff])
                h.fill(123.0)
                ext.moe_gateup(gate, up, x, ids, wts, h, 10.0)
                ext.synchronize()
                outs.append(h.numpy())
            finally:
                ext.set_gateup_lut(-1)
        ref = outs[0]
        assert np.isnan(ref[-1]).all()
        for mode, got in enumerate(outs[1:], start=1):
            assert np.isnan(got[-1]).all()
            assert np.isfinite(got[:-1]).all() and (got[:-1] != 123.0).any()
            assert np.array_equal(ref.view(np.uint32), got.view(np.uint32)), f"T={T} mode {mode}"
