"""Prepared in v32 (engine/gpu/NOTES.md): the routed gate/up rows kernel taking its units from a counter
(DS4_GPU_GU_DYN=1) and the streaming matvec's grid capped in total CTAs (ext.set_mv_grid_cap, DS4_GPU_SIDE_CTAS on the
shared expert's branch). Neither changes what a unit or a row computes, so both must give the default's bits: over
several launches in a row (the counter must be zero again after each) and in the decode session."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

from test_gpu_kernels import random_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]


def test_gateup_counter_gives_the_static_deals_bits_launch_after_launch() -> None:
    ext = gpu.load()
    ext.reset_stream()
    n_embd, n_ff, n_expert, k = 4096, 2048, 12, 6  # Flash expert shapes
    rng = np.random.default_rng(31)
    gate = gpu.upload("dyn.gate_exps", Q.IQ2_XXS, (n_embd, n_ff, n_expert),
                      random_blocks(Q.IQ2_XXS, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1))
    up = gpu.upload("dyn.up_exps", Q.IQ2_XXS, (n_embd, n_ff, n_expert),
                    random_blocks(Q.IQ2_XXS, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1))
    for T in (1, 2):
        x = ext.Array.from_numpy((rng.standard_normal((T, n_embd)) * 2.0).astype(np.float32))
        ids = ext.Array.from_numpy(np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)]).astype(np.int32))
        wts = ext.Array.from_numpy(rng.uniform(0.1, 0.5, (T, k)).astype(np.float32))
        outs = {}
        for mode in (0, 1, 1, 1, 0):  # three counter launches in a row: each must find the counter back at zero
            ext.set_gateup_dyn(mode)
            try:
                h = ext.Array.empty([T * k, n_ff])
                h.fill(123.0)
                ext.moe_gateup(gate, up, x, ids, wts, h, 10.0)
                ext.synchronize()
                outs.setdefault(mode, []).append(h.numpy())
            finally:
                ext.set_gateup_dyn(-1)
        ref = outs[0][0]
        assert np.isfinite(ref).all() and (ref != 123.0).all()
        for got in outs[0][1:] + outs[1]:
            assert np.array_equal(ref.view(np.uint32), got.view(np.uint32)), f"T={T}"


@pytest.mark.parametrize("cap", [1, 7, 32])
def test_grid_cap_gives_the_same_sums(cap) -> None:
    ext = gpu.load()
    ext.reset_stream()
    rng = np.random.default_rng(cap)
    rows, cols = 4096, 2048  # the shared expert's down shape (x: the gate/up's 2048 outputs)
    w = gpu.upload("cap.w", Q.Q8_0, (cols, rows), random_blocks(Q.Q8_0, rows, cols, rng))
    x = ext.Array.from_numpy(rng.standard_normal(cols).astype(np.float32))
    ys = []
    for c in (0, cap):
        ext.set_mv_grid_cap(c)
        try:
            y = ext.Array.empty([rows])
            ext.matvec(w, x, y)
            ext.synchronize()
            ys.append(y.numpy())
        finally:
            ext.set_mv_grid_cap(0)
    assert np.array_equal(ys[0].view(np.uint32), ys[1].view(np.uint32))


SESSION = r"""
import sys, numpy as np
from ds4.engine.gpu.session import Session
from ds4.engine.model import Model
m = Model.load(sys.argv[1]).with_numerics(fp8_kv=False, indexer_qat=False)
toks = np.random.default_rng(8).integers(2, m.config.vocab_size, 300).tolist()
s = Session(m, ctx=400)
s.sync(toks)
ids = s.greedy(12)
np.save(sys.argv[2], np.concatenate([np.asarray(ids, np.float32), s.logits]))
"""


def test_session_decode_is_bitwise_the_same_with_both_switches(tiny_gguf, tmp_path) -> None:
    outs = []
    for env in ({}, {"DS4_GPU_GU_DYN": "1", "DS4_GPU_SIDE_CTAS": "24"}):
        out = tmp_path / f"run{len(outs)}.npy"
        r = subprocess.run([sys.executable, "-c", SESSION, str(tiny_gguf), str(out)], capture_output=True, text=True,
                           timeout=600, env={**os.environ, **env})
        assert r.returncode == 0, r.stderr
        outs.append(np.load(out))
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
