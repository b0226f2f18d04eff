"""Decode's IQ2_XXS gate/up forms against the rows kernel with 64-bit row pointers: rows addressed by 32-bit offsets
from the planes' bases (DS4_GPU_GU_OFF32=1, ext.set_gu_off32) and, on Flash's 4096 columns, that form unrolled with
immediate offsets (DS4_GPU_GU_UNROLL=1, ext.set_gu_unroll). Each loads the same bytes and sums them in the same order,
so h must be the same bits."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

from test_gpu_kernels import random_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]

# (off32, unroll) settings: the 64-bit rows kernel first, the reference of the others
FORMS = ((0, 0), (1, 0), (1, 1))


def gateup_by_form(n_embd: int, n_ff: int, T: int, seed: int) -> list[tuple[np.ndarray, int, int]]:
    """h of one moe_gateup call (T tokens, k = 6 of 12 experts, the last token's last id out of range) under each
    form, with the launches of the offset and unrolled forms that call counted."""
    ext = gpu.load()
    ext.reset_stream()
    n_expert, k = 12, 6
    rng = np.random.default_rng(seed)
    gate, up = (gpu.upload(f"forms.{n_embd}.{n_ff}.{i}", Q.IQ2_XXS, (n_embd, n_ff, n_expert),
                           random_blocks(Q.IQ2_XXS, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1))
                for i in range(2))
    x = ext.Array.from_numpy((rng.standard_normal((T, n_embd)) * 2.0).astype(np.float32))
    ids_np = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)]).astype(np.int32)
    ids_np[-1, -1] = n_expert
    ids = ext.Array.from_numpy(ids_np)
    wts = ext.Array.from_numpy(rng.uniform(0.1, 0.5, (T, k)).astype(np.float32))
    out = []
    for off32, unroll in FORMS:
        ext.set_gu_off32(off32)
        ext.set_gu_unroll(unroll)
        try:
            off_before, unroll_before = ext.gu_off32_launches(), ext.gu_unroll_launches()
            h = ext.Array.empty([T * k, n_ff])
            h.fill(123.0)
            ext.moe_gateup(gate, up, x, ids, wts, h, 10.0)
            ext.synchronize()
            out.append((h.numpy(), ext.gu_off32_launches() - off_before, ext.gu_unroll_launches() - unroll_before))
        finally:
            ext.set_gu_off32(-1)
            ext.set_gu_unroll(-1)
    return out


@pytest.mark.parametrize("n_embd,n_ff,T", [(4096, 2048, 1), (4096, 2048, 3), (4096, 256, 1), (2048, 2048, 2)])
def test_gateup_forms_give_the_rows_kernels_bits(n_embd: int, n_ff: int, T: int) -> None:
    """Flash's shape at one token and three (a warp's units then span tokens), fewer units than warps (n_ff 256), and
    2048 columns (the unrolled form declines: the rolled loop runs): every form's h is the 64-bit rows kernel's bits,
    an expert id out of range included (its rows NaN), and each form ran the kernel it names."""
    out = gateup_by_form(n_embd, n_ff, T, seed=71 + n_embd + n_ff + T)
    ref = out[0][0]
    assert np.isnan(ref[-1]).all() and np.isfinite(ref[:-1]).all() and (ref[:-1] != 123.0).any()
    for (off32, unroll), (h, off_launches, unroll_launches) in zip(FORMS, out):
        assert (off_launches, unroll_launches) == (off32, unroll * (n_embd == 4096)), (off32, unroll)
        assert np.array_equal(ref.view(np.uint32), h.view(np.uint32)), (off32, unroll)
