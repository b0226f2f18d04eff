"""Decode's routed MoE in two launches (DS4_GPU_GU_XQ=1, engine/gpu/moe.cu GU_X_QUANT; =2: x only): the gate/up kernel
quantizes the token's x into shared memory and h into the down kernel's input itself, with quantize_x_kernel's
arithmetic, so the outputs are bitwise those of the four-launch path (NaN-poisoned ones included), and both are
held to the numpy reference. The h blocks' arrival counts are reset by the kernel: repeated calls and graph
replays give the same bits. The switch is read once per process, so each setting runs in its own subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4.engine import gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]

# mix: (gate/up type, down type, n_embd, n_ff, tokens). Every gate/up type once; q2 at Flash's expert shape;
# "odd" (n_ff % 256 != 0) and "t3" (3 tokens) are shapes XQ declines: the four-launch path runs in both settings.
MIXES = {
    "q2": ("IQ2_XXS", "Q2_K", 4096, 2048, 1),
    "q4": ("Q4_K", "Q4_K", 2048, 1024, 1),
    "q8": ("Q8_0", "Q8_0", 2048, 1024, 1),
    "k2": ("Q2_K", "IQ2_XXS", 2048, 1024, 1),
    "odd": ("Q8_0", "Q8_0", 512, 288, 1),
    "t3": ("Q4_K", "Q4_K", 1024, 512, 3),
}

SCRIPT = r"""
import json, sys, numpy as np
sys.path.insert(0, sys.argv[1])
from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q
from test_gpu_kernels import moe_reference, random_blocks
MIXES = json.loads(sys.argv[4])

def kernel_counts(fn):
    # launches per call of quantize_x, gate/up and down (CUPTI through torch); -1s without a CUDA torch
    try:
        import torch
        if not torch.cuda.is_available():
            return [-1, -1, -1]
        from ds4.engine.gpu.bench_session import profile_kernels
    except ImportError:
        return [-1, -1, -1]
    top = profile_kernels(fn, top=1000)["top"]
    names = ("quantize_x_kernel", "moe_gateup_rows_kernel", "moe_down_kernel")
    return [sum(r["count"] for r in top if n in r["name"]) for n in names]

ext = gpu.load()
out = {}
n_expert, k = 8, 6
for mix, (qg, qd, n_embd, n_ff, T) in MIXES.items():
    qg, qd = Q[qg], Q[qd]
    rng = np.random.default_rng(41)
    raws = [random_blocks(qg, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1) for _ in range(2)]
    down_raw = random_blocks(qd, n_expert * n_embd, n_ff, rng).reshape(n_expert, n_embd, -1)
    gate, up = (gpu.upload(f"xq.{mix}.{i}", qg, (n_embd, n_ff, n_expert), r) for i, r in enumerate(raws))
    down = gpu.upload(f"xq.{mix}.down", qd, (n_ff, n_embd, n_expert), down_raw)
    x = rng.standard_normal((T, n_embd)).astype(np.float32) * 2.0
    ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)]).astype(np.int32)
    wts = rng.uniform(0.1, 0.5, (T, k)).astype(np.float32)
    out[mix] = gpu.moe_host(gate, up, down, x, ids, wts)
    out[mix + "_again"] = gpu.moe_host(gate, up, down, x, ids, wts)  # the arrival counts were reset
    bad = ids.copy()
    bad[0, 2], bad[0, 4] = n_expert, -1  # out of range: token 0's output is poisoned
    out[mix + "_bad"] = gpu.moe_host(gate, up, down, x, bad, wts)
    out[mix + "_after_bad"] = gpu.moe_host(gate, up, down, x, ids, wts)
    if sys.argv[3] == "ref":
        out[mix + "_ref"] = moe_reference(raws[0], raws[1], down_raw, qg, qd, x.astype(np.float64), ids, wts, 10.0)
    if mix == "q2":
        out["q2_counts"] = np.array(kernel_counts(lambda: gpu.moe_host(gate, up, down, x, ids, wts)))
        # one CUDA graph of the call, replayed three times
        xa, ia, wa = (ext.Array.from_numpy(a) for a in (x, ids, wts))
        y = ext.Array.empty([T, n_embd])
        ext.moe(gate, up, down, xa, ia, wa, y, 10.0)  # sizes the scratch before the capture
        y.fill(float("nan"))
        ext.capture_begin()
        ext.moe(gate, up, down, xa, ia, wa, y, 10.0)
        graph = ext.capture_end()
        graph.launch(3)
        out["q2_graph"] = y.numpy()
np.savez(sys.argv[2], **out)
"""


def run(tmp_path: Path, xq: str | None, ref: bool) -> dict:
    """xq: DS4_GPU_GU_XQ's value ("1": x and h quantized by gate/up, "2": x only), None: unset."""
    env = {k: v for k, v in os.environ.items() if k not in ("DS4_GPU_GU_XQ", "DS4_GPU_GU_MMA", "DS4_GPU_GU_XS")}
    if xq:
        env["DS4_GPU_GU_XQ"] = xq
    out = tmp_path / f"moe_xq{xq or 0}.npz"
    tests = str(Path(__file__).resolve().parent)
    done = subprocess.run([sys.executable, "-c", SCRIPT, tests, str(out), "ref" if ref else "-",
                           json.dumps(MIXES)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(out))


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("mode,quantize_launches", [("1", 0), ("2", 1)])
def test_two_launch_moe_gives_the_four_launch_bits_and_the_reference(tmp_path, mode, quantize_launches) -> None:
    from test_gpu_kernels import TOL, rel_err

    on, off = run(tmp_path, mode, True), run(tmp_path, None, False)
    for mix in MIXES:
        for case in ("", "_again", "_bad", "_after_bad"):
            assert np.array_equal(bits(on[mix + case]), bits(off[mix + case])), mix + case
        assert np.array_equal(bits(on[mix + "_again"]), bits(on[mix])), mix
        assert np.array_equal(bits(on[mix + "_after_bad"]), bits(on[mix])), mix
        assert np.isnan(on[mix + "_bad"][0]).all(), mix
        if len(on[mix + "_bad"]) > 1:  # the other tokens keep their outputs
            assert np.array_equal(bits(on[mix + "_bad"][1:]), bits(on[mix][1:])), mix
        assert rel_err(on[mix], on[mix + "_ref"]) <= TOL, mix
    assert np.array_equal(bits(on["q2_graph"]), bits(on["q2"]))
    assert np.array_equal(bits(off["q2_graph"]), bits(off["q2"]))
    if (on["q2_counts"] >= 0).all():  # the switch removed exactly its quantize_x launches
        assert on["q2_counts"].tolist() == [quantize_launches, 1, 1], on["q2_counts"]
        assert off["q2_counts"].tolist() == [2, 1, 1], off["q2_counts"]


SESSION = r"""
import sys, numpy as np
from ds4.engine.model import Model
from ds4.engine.gpu.session import Session
m = Model.load(sys.argv[1])
toks = np.random.default_rng(8).integers(2, m.config.vocab_size, 24).tolist()
g = Session(m, ctx=256)
np.save(sys.argv[2], np.stack([g.decode(t) for t in toks]))
"""


def test_decode_session_logits_are_bitwise_the_four_launch_ones(tmp_path) -> None:
    """The small preset (n_embd 512, n_ff 256: shapes XQ takes) decoded through the session's graphs."""
    from conftest import quantize_cli

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("the session needs torch with CUDA")
    model = tmp_path / "small.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(model), "--mix", "q2", "--quiet")
    logits = []
    for xq in ("1", "2", None):
        env = {k: v for k, v in os.environ.items() if k not in ("DS4_GPU_GU_XQ", "DS4_GPU_GU_MMA", "DS4_GPU_GU_XS")}
        env["DS4_GPU_COMPILE"] = "0"  # the same elementwise code in both runs, without torch.compile's time
        if xq:
            env["DS4_GPU_GU_XQ"] = xq
        out = tmp_path / f"logits_xq{xq or 0}.npy"
        done = subprocess.run([sys.executable, "-c", SESSION, str(model), str(out)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        logits.append(np.load(out))
    assert np.isfinite(logits[0]).all()
    assert np.array_equal(bits(logits[0]), bits(logits[2]))
    assert np.array_equal(bits(logits[1]), bits(logits[2]))
