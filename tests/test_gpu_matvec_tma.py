"""The bulk-copy Q8_0 matvec (matvec_tma.cu, DS4_GPU_MV_TMA) against the register-streaming kernel it replaces.

It is meant to give the same bits: each row is one warp's with the same lanes, the same per-block arithmetic in the
same order and the same butterfly. So every case runs both kernels on the same inputs and asserts equal outputs,
checks the new kernel did launch (ext.mv_tma_launches), and holds the output to the float64 reference too. Outputs
start as NaN, so an unwritten row fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

from test_gpu_kernels import TOL, dequant, random_blocks, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason())),
              pytest.mark.usefixtures("ext_on_torch_stream")]

torch = pytest.importorskip("torch")


def upload(name: str, cols: int, rows: int, rng) -> tuple[object, np.ndarray]:
    raw = random_blocks(Q.Q8_0, rows, cols, rng)
    return gpu.upload(name, Q.Q8_0, (cols, rows), raw), dequant(Q.Q8_0, raw, cols)


def both(run) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """run() -> list of output tensors, under the streaming kernel and then the bulk-copy kernel."""
    ext = gpu.load()
    outs = []
    for mode in (0, 1):
        ext.set_mv_tma(mode)
        try:
            before = ext.mv_tma_launches()
            ys = run()
            torch.cuda.synchronize()
            launched = ext.mv_tma_launches() - before
        finally:
            ext.set_mv_tma(-1)
        assert (launched >= 1) if mode else (launched == 0), f"mode {mode}: {launched} bulk-copy launches"
        outs.append([y.cpu().numpy() for y in ys])
    return outs[0], outs[1]


def assert_same(ref: list[np.ndarray], got: list[np.ndarray]) -> None:
    for a, b in zip(ref, got):
        assert not np.isnan(b).any(), "rows left unwritten"
        assert np.array_equal(a, b), f"max diff {np.max(np.abs(a - b)):.3e}"


def x_vector(n: int, rng) -> np.ndarray:
    x = rng.standard_normal(n).astype(np.float32)
    x[: n // 8] *= 20.0  # uneven magnitudes across x blocks
    return x


@pytest.mark.parametrize("cols,rows,groups", [
    (1024, 32768, 1),  # attn_q_b
    (8192, 4096, 1),   # attn_output_b: rows of two slabs, streamed one after the other by their warp
    (16384, 300, 1),   # the widest Q8_0 row the staging takes: four slabs
    (4096, 8192, 8),   # attn_output_a: eight groups of 1024 rows, each its own x
    (2048, 4096, 1),   # ffn_down_shexp
    (1536, 1003, 1),   # rows of no particular multiple: a partial last item
])
def test_matvec_same_bits_as_streaming(cols: int, rows: int, groups: int) -> None:
    ext = gpu.load()
    rng = np.random.default_rng(cols + rows)
    w, wd = upload(f"tma.{cols}x{rows}", cols, rows, rng)
    k = cols
    x = x_vector(groups * k, rng)
    xa = ext.Array.from_numpy(x.reshape(1, -1))

    def run():
        y = ext.Array.from_numpy(np.full((1, rows), np.nan, np.float32))
        ext.matvec(w, xa, y, groups)
        return [torch.from_numpy(y.numpy())]

    ref, got = both(run)
    assert_same(ref, got)
    xg = x.astype(np.float64).reshape(groups, k)
    want = np.concatenate([wd[g * (rows // groups):(g + 1) * (rows // groups)] @ xg[g] for g in range(groups)])
    assert rel_err(got[0][0], want) <= TOL


def test_rms_norm_folded_same_bits() -> None:
    """q_b's form: x = rms_norm(x) * norm_w staged by the kernel (MV_X_RMS)."""
    ext = gpu.load()
    rng = np.random.default_rng(7)
    w, _ = upload("tma.rms", 1024, 8192, rng)
    x = torch.from_numpy(x_vector(1024, rng)).cuda().reshape(1, -1)
    nw = torch.from_numpy(rng.uniform(0.5, 1.5, 1024).astype(np.float32)).cuda()

    def run():
        y = torch.full((1, 8192), float("nan"), device="cuda")
        assert ext.matvec_multi([w], x.data_ptr(), [y.data_ptr()], norm_w=nw.data_ptr(), eps=1e-6)
        return [y]

    ref, got = both(run)
    assert_same(ref, got)


@pytest.mark.parametrize("cols,rows,swiglu", [
    (4096, (1024, 512), False),         # q_a + kv
    (1024, (1000, 7, 33, 256), False),  # four segments of odd sizes
    (2048, (4096,), True),              # shared down with SwiGLU staging of [g | u]
])
def test_segments_same_bits(cols: int, rows: tuple[int, ...], swiglu: bool) -> None:
    ext = gpu.load()
    rng = np.random.default_rng(cols + sum(rows))
    ws = [upload(f"tma.seg.{cols}.{i}.{r}", cols, r, rng)[0] for i, r in enumerate(rows)]
    x = torch.from_numpy(x_vector(2 * cols if swiglu else cols, rng)).cuda()

    def run():
        ys = [torch.full((1, w.nrows), float("nan"), device="cuda") for w in ws]
        assert ext.matvec_multi(ws, x.data_ptr(), [y.data_ptr() for y in ys], swiglu, 10.0)
        return ys

    ref, got = both(run)
    assert_same(ref, got)


def test_shared_quantized_x_same_bits() -> None:
    """matvec_shared quantizes x once and hands the planes to each product (the kernel copies them)."""
    ext = gpu.load()
    rng = np.random.default_rng(11)
    ws = [upload(f"tma.shared.{i}", 4096, r, rng)[0] for i, r in enumerate((2048, 2048))]
    xa = ext.Array.from_numpy(x_vector(4096, rng).reshape(1, -1))

    def run():
        ys = [ext.Array.from_numpy(np.full((1, w.nrows), np.nan, np.float32)) for w in ws]
        ext.matvec_shared(ws, xa, ys)
        return [torch.from_numpy(y.numpy()) for y in ys]

    ref, got = both(run)
    assert_same(ref, got)


def test_graph_replays_same_bits() -> None:
    """Captured once (as the decode graphs capture it), replayed: each launch initializes its slots' barriers, so
    no phase leaks from one replay into the next."""
    ext = gpu.load()
    rng = np.random.default_rng(13)
    w, _ = upload("tma.graph", 8192, 4096, rng)
    xa = ext.Array.from_numpy(x_vector(8192, rng).reshape(1, -1))
    y = ext.Array.from_numpy(np.full((1, 4096), np.nan, np.float32))
    ext.set_mv_tma(0)
    try:
        ext.matvec(w, xa, y, 1)
        ext.synchronize()
        ref = y.numpy().copy()
        ext.set_mv_tma(1)
        before = ext.mv_tma_launches()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ext.set_stream(torch.cuda.current_stream().cuda_stream)
            ext.matvec(w, xa, y, 1)
        ext.set_stream(torch.cuda.current_stream().cuda_stream)
        assert ext.mv_tma_launches() == before + 1
        for _ in range(3):
            y.fill(float("nan"))
            graph.replay()
            graph.replay()
            torch.cuda.synchronize()
            assert np.array_equal(y.numpy(), ref)
    finally:
        ext.set_mv_tma(-1)


def test_mode_2_takes_only_small_launches() -> None:
    """DS4_GPU_MV_TMA=2: launches of at most $DS4_GPU_MV_TMA_MAX_MB (7 MB) of weights go to the bulk-copy kernel, the
    35.6 MB ones stay on the streaming kernel; the outputs are the same bits either way."""
    ext = gpu.load()
    rng = np.random.default_rng(17)
    small, _ = upload("tma.mode2.small", 4096, 1024, rng)  # attn_q_a, 4.5 MB
    big, _ = upload("tma.mode2.big", 8192, 4096, rng)      # attn_output_b, 35.6 MB
    for w in (small, big):
        xa = ext.Array.from_numpy(x_vector(w.ncols, rng).reshape(1, -1))
        y0 = ext.Array.from_numpy(np.full((1, w.nrows), np.nan, np.float32))
        y2 = ext.Array.from_numpy(np.full((1, w.nrows), np.nan, np.float32))
        try:
            ext.set_mv_tma(0)
            ext.matvec(w, xa, y0, 1)
            ext.set_mv_tma(2)
            before = ext.mv_tma_launches()
            ext.matvec(w, xa, y2, 1)
            ext.synchronize()
            launched = ext.mv_tma_launches() - before
        finally:
            ext.set_mv_tma(-1)
        assert launched == (1 if w is small else 0)
        assert np.array_equal(y0.numpy(), y2.numpy())


def test_mode_3_leaves_q_b_and_grouped_launches() -> None:
    """DS4_GPU_MV_TMA=3: every Q8_0 launch on the bulk-copy kernel but q_b's shape (rows of 1024 columns, 35.6 MB) and
    grouped ones (o_a), where the v17 kernel bench has it slower."""
    ext = gpu.load()
    rng = np.random.default_rng(19)
    cases = [(upload("tma.mode3.o_b", 8192, 4096, rng)[0], 1, 1), (upload("tma.mode3.q_b", 1024, 32768, rng)[0], 1, 0),
             (upload("tma.mode3.o_a", 4096, 8192, rng)[0], 8, 0)]
    for w, groups, want in cases:
        xa = ext.Array.from_numpy(x_vector(groups * w.ncols, rng).reshape(1, -1))
        y = ext.Array.from_numpy(np.full((1, w.nrows), np.nan, np.float32))
        try:
            ext.set_mv_tma(3)
            before = ext.mv_tma_launches()
            ext.matvec(w, xa, y, groups)
            ext.synchronize()
            launched = ext.mv_tma_launches() - before
        finally:
            ext.set_mv_tma(-1)
        assert launched == want, (w.ncols, w.nrows, groups)
        assert not np.isnan(y.numpy()).any()
