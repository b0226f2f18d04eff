"""Decode attention in one launch (attn_decode.cu). DS4_GPU_ATTN_ONE=1 (attn_one_kernel): the partial blocks as the
two-launch path, and the last block of each head group combines the group's heads; =2 (attn_one_wait_kernel):
one combine block per head waits for its group's partial blocks. Both combine with the same device function and
reduction order as attn_combine_kernel, so the outputs are bitwise equal to the two-launch path.
The switch is read once per process, so each setting runs in its own subprocess; every run also holds its
outputs to a float64 reference, calls each case three times in a row (the arrival counters reset themselves)
and replays a CUDA graph of the op at several positions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4.engine import gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]

# (name, heads, head dim, rope dim, ring rows, compressed rows (0: none), selection size (0: all rows), ratio, pos)
CASES = [
    ("flash_comp_wrapped", 64, 512, 64, 128, 600, 0, 4, 2300),
    ("flash_sel_wrapped", 64, 512, 64, 128, 600, 512, 4, 2300),
    ("flash_sel_early", 64, 512, 64, 128, 600, 512, 4, 5),
    ("flash_raw_early", 64, 512, 64, 128, 0, 0, 1, 40),
    ("flash_raw_wrapped", 64, 512, 64, 128, 0, 0, 1, 1000),
    ("h8_comp", 8, 512, 64, 128, 40, 0, 4, 300),
    ("h8_small_d_many_chunks", 8, 64, 16, 32, 9000, 0, 4, 40000),  # 565 chunks: more than 512 per head
    ("h4_ratio128_sel", 4, 128, 32, 64, 100, 60, 128, 7000),
    ("h6_small_d", 6, 64, 16, 16, 24, 0, 4, 50),  # 6 heads: a head group that divides 6
    ("h16_first_token", 16, 64, 16, 128, 40, 0, 4, 0),  # one visible key, no compressed row visible
    ("h24_d128", 24, 128, 32, 128, 300, 200, 4, 1500),
]
GRAPH_POSITIONS = (700, 2047, 2600)

SCRIPT = r"""
import math, sys, numpy as np, torch
from ds4.engine import gpu
from ds4.engine.gpu import ops
from ds4.engine.gpu.fused import Fused

DEV = "cuda"
CASES, GRAPH_POSITIONS = eval(sys.argv[2]), eval(sys.argv[3])
ext = gpu.load()
K = Fused(ext, torch.device(DEV))


def rnd(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64).float().to(DEV)


def inputs(H, d, rd, cap, n_comp, n_sel, seed):
    g = torch.Generator().manual_seed(seed)
    q, raw = rnd(g, H, d), rnd(g, cap, d)
    comp = rnd(g, n_comp, d) if n_comp else None
    sel = torch.randperm(n_comp, generator=g)[:n_sel].to(DEV) if n_sel else None
    sinks = rnd(g, H)
    freq = (1.0 / 10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)).float().to(DEV)
    return q, raw, comp, sel, sinks, freq


def reference(q, raw, comp, sel, sinks, freq, rd, ratio, p):
    # session._attn_step's masked softmax with sinks in float64, then the inverse RoPE of the output tail
    H, d = q.shape
    cap = raw.shape[0]
    key_pos = p - torch.remainder(p - torch.arange(cap, device=DEV), cap)
    keys, mask = raw, key_pos >= 0
    if comp is not None:
        ids = sel if sel is not None else torch.arange(comp.shape[0], device=DEV)
        keys, mask = torch.cat([raw, comp[ids]]), torch.cat([mask, ids < (p + 1) // ratio])
    keys = keys.double()
    s = (q.double() @ keys.T) / math.sqrt(d)
    s = torch.where(mask[None, :], s, torch.full_like(s, -math.inf))
    m = torch.maximum(s.amax(-1), sinks.double())
    e = torch.exp(s - m[:, None])
    o = (e / (e.sum(-1) + torch.exp(sinks.double() - m))[:, None]) @ keys
    cos, sin = ops.cos_sin(freq, torch.tensor([p], device=DEV))
    return ops.apply_tail(o[None].float(), cos, sin, rd, inverse=True)[0]


out = {}
for i, (name, H, d, rd, cap, n_comp, n_sel, ratio, p) in enumerate(CASES):
    q, raw, comp, sel, sinks, freq = inputs(H, d, rd, cap, n_comp, n_sel, 100 + i)
    pos = torch.tensor([p], device=DEV)
    runs = [K.attention(q, raw, comp, sel, ratio, pos, sinks, freq, rd) for _ in range(3)]  # no sync between
    torch.cuda.synchronize()
    for k, r in enumerate(runs):
        out[f"{name}.{k}"] = r.cpu().numpy()
    out[f"{name}.ref"] = reference(q, raw, comp, sel, sinks, freq, rd, ratio, p).cpu().numpy()

# a CUDA graph of the Flash-shaped op with a selection, replayed at several positions
H, d, rd, cap, n_comp, n_sel, ratio = 64, 512, 64, 128, 700, 512, 4
q, raw, comp, sel, sinks, freq = inputs(H, d, rd, cap, n_comp, n_sel, 7)
pos = torch.tensor([GRAPH_POSITIONS[0]], device=DEV)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    K.attention(q, raw, comp, sel, ratio, pos, sinks, freq, rd)  # warm-up outside the capture
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    got = K.attention(q, raw, comp, sel, ratio, pos, sinks, freq, rd)
for p in GRAPH_POSITIONS:
    pos.fill_(p)
    graph.replay()
    torch.cuda.synchronize()
    out[f"graph.{p}"] = got.cpu().numpy()
    out[f"graph_eager.{p}"] = K.attention(q, raw, comp, sel, ratio, pos, sinks, freq, rd).cpu().numpy()
    out[f"graph_ref.{p}"] = reference(q, raw, comp, sel, sinks, freq, rd, ratio, p).cpu().numpy()
try:  # which attention kernels one eager call launches (CUPTI sees every stream)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        K.attention(q, raw, comp, sel, ratio, pos, sinks, freq, rd)
        torch.cuda.synchronize()
    out["dot"] = np.array("\n".join(e.name for e in prof.events() if "attn" in e.name))
except Exception as e:  # reported by the test that needs it
    out["dot_error"] = np.array(repr(e))
ext.reset_stream()
np.savez(sys.argv[1], **out)
"""


def run(tmp_path: Path, mode: str | None, heads: int | None) -> dict:
    """Run SCRIPT in a subprocess with DS4_GPU_ATTN_ONE=mode and DS4_GPU_ATTN_ONE_HEADS=heads (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DS4_GPU_ATTN_ONE", "DS4_GPU_ATTN_ONE_HEADS")}
    if mode is not None:
        env["DS4_GPU_ATTN_ONE"] = mode
    if heads is not None:
        env["DS4_GPU_ATTN_ONE_HEADS"] = str(heads)
    tag = f"{mode}_{heads}"
    out, dot = tmp_path / f"attn_{tag}.npz", tmp_path / f"attn_{tag}.dot"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(out), repr(CASES), repr(GRAPH_POSITIONS), str(dot)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(out))


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """results(mode, heads): the outputs of a subprocess with that setting, each setting run once per module."""
    cache: dict = {}

    def get(mode: str | None, heads: int | None = None) -> dict:
        if (mode, heads) not in cache:
            cache[mode, heads] = run(tmp_path_factory.mktemp("attn"), mode, heads)
        return cache[mode, heads]

    return get


def check_run(res: dict) -> None:
    """Within one process: the reference, three calls in a row alike, graph replays == eager calls."""
    for name, *_ in CASES:
        assert np.isfinite(res[f"{name}.0"]).all(), name
        assert rel(res[f"{name}.0"], res[f"{name}.ref"]) < 2e-5, name
        for k in (1, 2):
            assert np.array_equal(res[f"{name}.{k}"], res[f"{name}.0"]), (name, k)
    for p in GRAPH_POSITIONS:
        assert np.array_equal(res[f"graph.{p}"], res[f"graph_eager.{p}"]), p
        assert rel(res[f"graph.{p}"], res[f"graph_ref.{p}"]) < 2e-5, p


def test_two_launch_path_matches_the_reference(results) -> None:
    check_run(results(None))


# heads None: the default head group of mode 1 (mode 2 always groups as the two-launch path)
@pytest.mark.parametrize("mode,heads", [("1", None), ("1", 1), ("1", 4), ("1", 8), ("2", None)])
def test_one_launch_gives_the_two_launch_bits(results, mode, heads) -> None:
    one, two = results(mode, heads), results(None)
    check_run(one)
    for name, *_ in CASES:
        for k in range(3):
            assert np.array_equal(one[f"{name}.{k}"], two[f"{name}.0"]), (name, k)
    for p in GRAPH_POSITIONS:
        assert np.array_equal(one[f"graph.{p}"], two[f"graph.{p}"]), p


def test_the_switch_selects_the_kernels(results) -> None:
    for res, want, not_want in ((results("1"), "attn_one_kernel", "attn_partial_kernel"),
                                (results("2"), "attn_one_wait_kernel", "attn_partial_kernel"),
                                (results(None), "attn_combine_kernel", "attn_one_")):
        assert "dot" in res, str(res.get("dot_error"))
        dot = str(res["dot"])
        assert want in dot and not_want not in dot, want
