"""The decode MoE router in one launch (ext.router_one, router.cu; DS4_GPU_ROUTER_ONE=1 in the session).

The kernel runs the streaming F16 matvec's building blocks on the same grid plan, so its logits must be the
bits of ext.matvec's launch, and its last CTA runs router_kernel's code (router.cuh) on them, so ids and
weights must be those of ext.router on those logits. Both are also held to the spec's routing in float64.
Every call must work after the previous one (the CTAs' arrival count returns to 0), in and out of a CUDA
graph. The session switch is read once per process, so each setting decodes in its own subprocess, and the
logits must be bitwise equal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

from conftest import quantize_cli
from test_gpu_kernels import random_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason())),
              pytest.mark.usefixtures("ext_on_torch_stream")]

torch = pytest.importorskip("torch")
SCORE_TOL = 1e-6  # routing weights against float64 (as tests/test_gpu_fused.py::test_router)


def _p(t) -> int:
    return 0 if t is None else t.data_ptr()


def cuda(x: np.ndarray, dtype=torch.float32):
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype).cuda()


def routing_inputs(mode: str, E: int, k: int, rng):
    """(bias, table, tok) of a layer: `bias` a biased one, `plain` without bias, `hashed` a tid2eid table."""
    if mode == "hashed":
        table = cuda(rng.integers(0, E, (1000, k)), torch.int64)
        return None, table, torch.tensor([int(rng.integers(0, 1000))], dtype=torch.int64, device="cuda")
    bias = cuda(rng.standard_normal(E) * 0.1) if mode == "bias" else None
    return bias, None, torch.tensor([3], dtype=torch.int64, device="cuda")


def outputs(E: int, k: int):
    """logits, ids, wts filled with values no launch writes (an unwritten output fails the comparisons)."""
    return (torch.full((1, E), float("nan"), device="cuda"), torch.full((1, k), -7, dtype=torch.int32, device="cuda"),
            torch.full((1, k), float("nan"), device="cuda"))


def two_launches(w, x, bias, table, tok, k: int, scale: float):
    """The default decode path: ext.matvec (batch 1: the streaming F16 kernel), then router_kernel."""
    ext = gpu.load()
    logits, ids, wts = outputs(w.nrows, k)
    ext.matvec(w, ext.Array.view(x.data_ptr(), [1, w.ncols]), ext.Array.view(logits.data_ptr(), [1, w.nrows]))
    ext.router(_p(logits), _p(bias), _p(table), _p(tok), 1, w.nrows, k, scale, _p(ids), _p(wts))
    torch.cuda.synchronize()
    return logits, ids, wts


def one_launch(w, x, bias, table, tok, k: int, scale: float):
    ext = gpu.load()
    logits, ids, wts = outputs(w.nrows, k)
    took = ext.router_one(w, _p(x), _p(logits), _p(bias), _p(table), _p(tok), k, scale, _p(ids), _p(wts))
    torch.cuda.synchronize()
    assert took, "router_one declined an F16 router it should take"
    return logits, ids, wts


def check_spec(logits, ids, wts, bias, table, tok, k: int, scale: float) -> None:
    """ids and weights against model-spec §3.7 in float64 (softplus, sqrt, top-k of score + bias or the table)."""
    s = torch.sqrt(torch.nn.functional.softplus(logits.double()))
    want = table[tok] if table is not None else torch.topk(s + (bias.double() if bias is not None else 0.0), k).indices
    assert torch.equal(torch.sort(ids.long(), dim=1).values, torch.sort(want, dim=1).values)
    ws = torch.gather(s, 1, ids.long())
    ref = ws / torch.clamp(ws.sum(1, keepdim=True), min=6.1035e-5) * scale
    assert float(torch.linalg.norm(wts.double() - ref) / torch.linalg.norm(ref)) < SCORE_TOL


def assert_same(got, want) -> None:
    for name, a, b in zip(("logits", "ids", "wts"), got, want):
        assert torch.equal(a, b), f"{name} differ from the two launches"


@pytest.mark.parametrize("E,K,k", [
    (256, 4096, 6),  # Flash: 256 experts x n_embd 4096
    (32, 512, 6),    # the small test model
    (8, 64, 2),      # the tiny test model
])
@pytest.mark.parametrize("mode", ["bias", "plain", "hashed"])
@pytest.mark.parametrize("cluster", [0, 1])
def test_one_launch_gives_the_bits_of_the_two_launches(E, K, k, mode, cluster) -> None:
    """cluster = 1 (the default): DS4_GPU_ROUTER_CLUSTER's kernel (one cluster of 16 CTAs, logits into CTA 0's shared
    memory); it takes widths that are multiples of 256, and for others (the tiny model's 64 columns) router_one
    declines with nothing written, so the caller runs the two launches. cluster = 0: the arrival-count kernel."""
    ext = gpu.load()
    rng = np.random.default_rng(E + K + len(mode))
    w = gpu.upload(f"router_one.{E}.{K}.{mode}", Q.F16, (K, E), random_blocks(Q.F16, E, K, rng))
    bias, table, tok = routing_inputs(mode, E, k, rng)
    ext.set_router_cluster(cluster)
    try:
        assert ext.router_cluster_takes(E, K) == bool(cluster and K % 256 == 0)
        if cluster and K % 256:
            logits, ids, wts = outputs(E, k)
            x = cuda(rng.standard_normal((1, K)))
            assert not ext.router_one(w, _p(x), _p(logits), _p(bias), _p(table), _p(tok), k, 1.5, _p(ids), _p(wts))
            return
        for call in range(3):  # a fresh x each time: a stale arrival count would leave ids/wts unwritten
            x = cuda(rng.standard_normal((1, K)) * (1.0 + call))
            want = two_launches(w, x, bias, table, tok, k, 1.5)
            got = one_launch(w, x, bias, table, tok, k, 1.5)
            assert_same(got, want)
            check_spec(*got, bias, table, tok, k, 1.5)
    finally:
        ext.set_router_cluster(-1)


def test_calls_alternating_between_layers() -> None:
    """Two layers' routers one after the other on the stream, no synchronization between them (decode)."""
    ext = gpu.load()
    rng = np.random.default_rng(77)
    E, K, k = 256, 4096, 6
    ws = [gpu.upload(f"router_one.alt.{i}", Q.F16, (K, E), random_blocks(Q.F16, E, K, rng)) for i in range(2)]
    ins = [routing_inputs(mode, E, k, rng) for mode in ("bias", "hashed")]
    xs = [cuda(rng.standard_normal((1, K))) for _ in range(6)]
    outs = []
    for i, x in enumerate(xs):
        o = outputs(E, k)
        bias, table, tok = ins[i % 2]
        assert ext.router_one(ws[i % 2], _p(x), *map(_p, (o[0], bias, table, tok)), k, 2.5, _p(o[1]), _p(o[2]))
        outs.append(o)
    torch.cuda.synchronize()
    for i, x in enumerate(xs):
        assert_same(outs[i], two_launches(ws[i % 2], x, *ins[i % 2], k, 2.5))


@pytest.mark.parametrize("cluster", [0, 1])
def test_graph_replays(cluster) -> None:
    """Captured once, replayed with new x: every replay routes (the count is back at 0 after each)."""
    from ds4.engine.gpu.fused import Fused

    ext = gpu.load()
    ext.set_router_cluster(cluster)
    try:
        _graph_replays(ext, Fused)
    finally:
        ext.set_router_cluster(-1)


def _graph_replays(ext, Fused) -> None:
    K_ = Fused(ext, torch.device("cuda"))
    rng = np.random.default_rng(5)
    E, K, k = 256, 4096, 6
    w = gpu.upload("router_one.graph", Q.F16, (K, E), random_blocks(Q.F16, E, K, rng))
    bias, table, tok = routing_inputs("bias", E, k, rng)
    x = cuda(rng.standard_normal((1, K)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert K_.router_one(w, x, bias, table, tok, k, 1.5) is not None  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = K_.router_one(w, x, bias, table, tok, k, 1.5)
    ext.set_stream(torch.cuda.current_stream().cuda_stream)
    for rep in range(3):
        x.copy_(cuda(rng.standard_normal((1, K)) * (1.0 + rep)))
        for t in got:
            t.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(got, two_launches(w, x, bias, table, tok, k, 1.5))


def test_declines_what_the_kernel_does_not_take() -> None:
    """More than 256 experts, quantized routers, k > 16, x not 16-byte aligned: False, nothing written."""
    ext = gpu.load()
    rng = np.random.default_rng(9)
    cases = [(gpu.upload("router_one.wide", Q.F16, (512, 384), random_blocks(Q.F16, 384, 512, rng)), 6, 0),
             (gpu.upload("router_one.q8", Q.Q8_0, (512, 64), random_blocks(Q.Q8_0, 64, 512, rng)), 6, 0),
             (gpu.upload("router_one.k", Q.F16, (512, 64), random_blocks(Q.F16, 64, 512, rng)), 17, 0),
             (gpu.upload("router_one.align", Q.F16, (512, 64), random_blocks(Q.F16, 64, 512, rng)), 6, 1)]
    for w, k, off in cases:
        xs = cuda(rng.standard_normal((1, 512 + 4)))
        logits, ids, wts = outputs(w.nrows, k)
        tok = torch.tensor([0], dtype=torch.int64, device="cuda")
        assert not ext.router_one(w, xs.data_ptr() + 4 * off, _p(logits), 0, 0, _p(tok), k, 1.0, _p(ids), _p(wts))
        torch.cuda.synchronize()
        assert torch.isnan(logits).all() and (ids == -7).all()


SCRIPT = r"""
import sys, numpy as np
from ds4.engine import gpu
from ds4.engine.gpu import fused
from ds4.engine.gpu.session import Session
from ds4.engine.model import Model
ext = gpu.load()
taken = []
real = ext.router_one
ext.router_one = lambda *a: taken.append(real(*a)) or taken[-1]
m = Model.load(sys.argv[1])
toks = np.random.default_rng(11).integers(2, m.config.vocab_size, 48).tolist()
g = Session(m, ctx=256)
g.sync(toks[:24])  # prefill chunk (T > 1): the two launches in both settings
graph = np.stack([g.decode(t) for t in toks[24:]])
e = Session(m, ctx=256, graphs=False, weights=g.W)
eager = np.stack([e.decode(t) for t in toks[:12]])
np.savez(sys.argv[2], graph=graph, eager=eager, on=np.array(fused.ROUTER_ONE), taken=np.array(taken, dtype=bool))
"""


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("router-one-models")
    quantize_cli("synth", "--preset", "tiny", "--gguf", str(d / "tiny.gguf"), "--type", "f16", "--mix", "none", "--quiet")
    quantize_cli("synth", "--preset", "small", "--gguf", str(d / "small.gguf"), "--mix", "q2", "--quiet")
    return {"tiny": d / "tiny.gguf", "small": d / "small.gguf"}


def decode_in_subprocess(model: Path, out: Path, on: bool, cluster: bool) -> dict:
    drop = ("DS4_GPU_ROUTER_ONE", "DS4_GPU_ROUTER_CLUSTER", "DS4_GPU_MV", "DS4_GPU_FUSED")  # the switches, what bypasses
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["DS4_GPU_COMPILE"] = "0"  # torch.compile does not touch the router; without it each run starts faster
    env["DS4_GPU_ROUTER_ONE"] = "1" if on else "0"
    env["DS4_GPU_ROUTER_CLUSTER"] = "1" if cluster else "0"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model), str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(out))


@pytest.mark.parametrize("name,cluster", [("small", True), ("tiny", False)])  # tiny's 64 columns: not the cluster's
def test_session_logits_bitwise_equal_with_the_switch(model_paths, tmp_path, name, cluster) -> None:
    on = decode_in_subprocess(model_paths[name], tmp_path / "on.npz", True, cluster)
    off = decode_in_subprocess(model_paths[name], tmp_path / "off.npz", False, cluster)
    assert bool(on["on"]) and not bool(off["on"])
    assert len(on["taken"]) > 0 and on["taken"].all(), "the one-launch router did not take every decode router"
    assert len(off["taken"]) == 0, "router_one ran with the switch off"
    assert np.isfinite(on["graph"]).all()
    assert np.array_equal(on["graph"], off["graph"]), "graph decode logits differ"
    assert np.array_equal(on["eager"], off["eager"]), "eager decode logits differ"
