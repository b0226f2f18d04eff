"""The int8 tensor-core prefill products (mmq.cu: DS4_GPU_PREFILL_GEMM=mmq for the dense weights, DS4_GPU_MOE_GEMM=mmq
for the routed experts) against a float64 reference: the activation quantized as the decode kernels quantize it
(ops.quantize_hilo, the CPU twin of quantize_x_kernel) times the dequantized weight; against the batch-1..8 matvec
kernel on the same weight (the same block arithmetic); and in the session on `small` against the CPU engine.
Skipped without a built extension and a CUDA device."""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

from test_gpu_kernels import dequant, random_blocks, rel_err, run_matvec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]


def run_mmq(w, x: np.ndarray, groups: int = 1) -> np.ndarray:
    ext = gpu.load()
    y = ext.Array.empty([x.shape[0], w.nrows])
    y.fill(float("nan"))
    assert ext.mmq(w, ext.Array.from_numpy(np.ascontiguousarray(x)), y, groups)
    return y.numpy()


def quantized(x: np.ndarray) -> np.ndarray:
    import torch

    from ds4.engine.gpu import ops

    return ops.quantize_hilo(torch.from_numpy(x)).numpy().astype(np.float64)


@contextlib.contextmanager
def decode_planes():
    """The routed experts' activations on decode's 32-column scales (DS4_GPU_MMQ_XROW=0), for the tests that hold a
    kernel form to another bit for bit or to the 32-column reference: XROW's one scale per row exists only in the
    four-CTA row-pointer forms (its own tests hold it)."""
    ext = gpu.load()
    ext.set_mmq_xrow(0)
    try:
        yield
    finally:
        ext.set_mmq_xrow(-1)


@pytest.mark.parametrize("cols,rows,T,groups", [
    (128, 64, 1, 1),        # one tile, one stage
    (1024, 200, 100, 1),    # partial tiles in both directions (q_b's width)
    (4096, 1024, 300, 1),   # q_a
    (256, 8 * 96, 70, 8),   # grouped, partial tiles per group
    (4096, 8192, 130, 8),   # the attention output's first projection (8 groups of 1024 rows)
])
def test_mmq_matches_the_quantized_reference(cols, rows, T, groups):
    rng = np.random.default_rng(cols + rows + T)
    raw = random_blocks(Q.Q8_0, rows, cols, rng)
    w = gpu.upload(f"mmq.{cols}x{rows}", Q.Q8_0, (cols, rows), raw)
    x = rng.standard_normal((T, groups * cols)).astype(np.float32)
    x[:, : cols // 8] *= 20.0  # uneven magnitudes across x blocks
    y = run_mmq(w, x, groups)
    wd = dequant(Q.Q8_0, raw, cols).reshape(groups, rows // groups, cols)
    xq = quantized(x).reshape(T, groups, cols)
    ref = np.einsum("goc,tgc->tgo", wd, xq).reshape(T, rows)
    err = rel_err(y, ref)
    assert err <= 1e-5, f"{cols}x{rows} T={T} groups={groups}: rel err {err:.2e}"


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q4_K, Q.IQ2_XXS])
def test_mmq_expert_types_match_the_quantized_reference(qtype):
    """The K-quants' min terms use the activation's own 16-column sums (as the matvec kernels do), so the reference
    on the quantized activation is off by the quantization there (~1e-5): 1e-4 for them, 1e-5 for IQ2_XXS."""
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, 200, 2048, rng)
    w = gpu.upload(f"mmq.{qtype.name}", qtype, (2048, 200), raw)
    x = rng.standard_normal((90, 2048)).astype(np.float32)
    ref = quantized(x) @ dequant(qtype, raw, 2048).T
    err = rel_err(run_mmq(w, x), ref)
    assert err <= (1e-5 if qtype == Q.IQ2_XXS else 1e-4), f"{qtype.name}: rel err {err:.2e}"


@pytest.mark.parametrize("qtype,cols,rows", [(Q.Q8_0, 4096, 512), (Q.Q2_K, 2048, 256), (Q.Q4_K, 2048, 256),
                                             (Q.IQ2_XXS, 4096, 256)])
def test_mmq_agrees_with_the_matvec_kernel(qtype, cols, rows):
    """Up to 8 rows the matvec kernels take the same activation quantization and block sums: only the order of the
    float sums differs."""
    rng = np.random.default_rng(5)
    raw = random_blocks(qtype, rows, cols, rng)
    w = gpu.upload(f"mmq.mv.{qtype.name}", qtype, (cols, rows), raw)
    x = rng.standard_normal((8, cols)).astype(np.float32)
    assert rel_err(run_mmq(w, x), run_matvec(w, x)) <= 1e-6


@pytest.mark.parametrize("gate_type", [Q.IQ2_XXS, Q.Q2_K, Q.Q4_K, Q.Q8_0])
def test_mmq_experts_match_the_reference(gate_type):
    """Activation rows sorted by expert, tiles of at most mmq_tile_rows() rows (64, or 128 under DS4_GPU_MMQ_ROWS):
    an unused expert, experts of one row, one of 150; 200 rows per expert (a partial tile of weight rows)."""
    import torch

    from ds4.engine.gpu.moe_gemm import expert_tiles

    ext = gpu.load()
    rng = np.random.default_rng(7)
    n_embd, n_ff, n_expert = 512, 200, 10
    raw = random_blocks(gate_type, n_ff * n_expert, n_embd, rng)
    w = gpu.upload(f"blk.0.ffn_gate_exps.mmq{gate_type.name}", gate_type, (n_embd, n_ff, n_expert), raw)
    counts = [3, 0, 150, 1, 64, 65, 1, 20, 128, 129]
    x = rng.standard_normal((sum(counts), n_embd)).astype(np.float32)
    tiles = torch.tensor(expert_tiles(counts, ext.mmq_tile_rows()), dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()  # torch's copy runs on its stream; the extension's own stream does not wait for it
    y = ext.Array.empty([sum(counts), n_ff])
    y.fill(float("nan"))
    assert ext.mmq_takes(w, n_expert)
    with decode_planes():
        assert ext.mmq_experts(w, ext.Array.from_numpy(x), tiles.data_ptr(), tiles.shape[0], y)
    wd = dequant(gate_type, raw, n_embd).reshape(n_expert, n_ff, n_embd)
    expert = np.repeat(np.arange(n_expert), counts)
    ref = np.einsum("rc,roc->ro", quantized(x), wd[expert])
    err = rel_err(y.numpy(), ref)
    assert err <= (1e-4 if gate_type in (Q.Q2_K, Q.Q4_K) else 1e-5), f"rel err {err:.2e}"


def test_mmq_experts_gathered_pair_equals_separate_products():
    """Gate and up on one quantization of x's rows read through an index (rows repeat, as a token's k experts do) give
    the bits of two products on the gathered copy; the index and the pair are checked for shapes."""
    import torch

    from ds4.engine.gpu.moe_gemm import expert_tiles

    ext = gpu.load()
    rng = np.random.default_rng(8)
    n_embd, n_ff, n_expert = 512, 96, 6
    ws = [gpu.upload(f"blk.0.ffn_{nm}_exps.pair", Q.IQ2_XXS, (n_embd, n_ff, n_expert),
                     random_blocks(Q.IQ2_XXS, n_ff * n_expert, n_embd, rng)) for nm in ("gate", "up")]
    counts = [5, 0, 70, 1, 33, 64]
    base = rng.standard_normal((40, n_embd)).astype(np.float32)
    rows = rng.integers(0, 40, sum(counts))
    tiles = torch.tensor(expert_tiles(counts, ext.mmq_tile_rows()), dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()  # torch's copy runs on its stream; the extension's own stream does not wait for it
    nt = tiles.shape[0]
    sep = [ext.Array.empty([sum(counts), n_ff]) for _ in ws]
    for w, y in zip(ws, sep):
        assert ext.mmq_experts(w, ext.Array.from_numpy(base[rows]), tiles.data_ptr(), nt, y)
    pair = [ext.Array.empty([sum(counts), n_ff]) for _ in ws]
    idx = torch.from_numpy(rows).to("cuda")
    torch.cuda.synchronize()
    assert ext.mmq_experts(ws[0], ext.Array.from_numpy(base), tiles.data_ptr(), nt, pair[0], idx.data_ptr(), ws[1],
                           pair[1])
    for a, b in zip(sep, pair):
        assert np.array_equal(a.numpy(), b.numpy())
    with pytest.raises(ValueError, match="x must be"):  # without the index, x must have a row per activation row
        ext.mmq_experts(ws[0], ext.Array.from_numpy(base), tiles.data_ptr(), nt, pair[0])
    with pytest.raises(ValueError, match="go together"):
        ext.mmq_experts(ws[0], ext.Array.from_numpy(base), tiles.data_ptr(), nt, pair[0], idx.data_ptr(), ws[1])


@pytest.mark.parametrize("T,k,n", [(1, 1, 4), (37, 6, 512), (300, 8, 4096)])
def test_moe_combine_sums_each_tokens_rows(T, k, n):
    import torch

    ext = gpu.load()
    g = torch.Generator().manual_seed(T + k)
    y_sorted = torch.randn(T * k, n, generator=g).cuda()
    order = torch.randperm(T * k, generator=g).cuda()  # sorted position p holds slot order[p]
    slot_row = torch.empty_like(order)
    slot_row[order] = torch.arange(T * k, device="cuda")
    out = torch.full((T, n), float("nan"), device="cuda")
    ext.moe_combine(y_sorted.data_ptr(), slot_row.data_ptr(), T, k, n, out.data_ptr())
    y = torch.empty_like(y_sorted, dtype=torch.float64)
    y[order] = y_sorted.double()
    ref = y.view(T, k, n).sum(1)
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-6


def test_swiglu_with_row_weights_is_swiglu_then_the_multiply():
    import torch

    ext = gpu.load()
    g0 = torch.Generator().manual_seed(4)
    R, width = 300, 96
    g, u = (torch.randn(R, width, generator=g0).cuda() * 4 for _ in range(2))
    w = torch.rand(R, generator=g0).cuda()
    order = torch.randperm(R, generator=g0).cuda()
    plain, weighted = torch.empty_like(g), torch.empty_like(g)
    ext.swiglu(g.data_ptr(), u.data_ptr(), g.numel(), 7.0, plain.data_ptr())
    ext.swiglu(g.data_ptr(), u.data_ptr(), g.numel(), 7.0, weighted.data_ptr(), w.data_ptr(), width, order.data_ptr())
    assert torch.equal(weighted, plain * w[order, None])
    with pytest.raises(ValueError, match="multiple of width"):
        ext.swiglu(g.data_ptr(), u.data_ptr(), g.numel(), 7.0, weighted.data_ptr(), w.data_ptr(), 7, 0)


@pytest.mark.parametrize("counts", [[3, 0, 150, 1, 64, 65, 1, 20, 128, 129], [0] * 7 + [5], [64] * 256,
                                    list(np.random.default_rng(3).integers(0, 400, 1000))])
def test_expert_tiles_on_the_device_equal_the_host_table(counts):
    """ext.expert_tiles builds moe_gemm.expert_tiles' table from device counts, then empty tiles up to max_tiles."""
    import torch

    from ds4.engine.gpu.moe_gemm import expert_tiles

    ext = gpu.load()
    nt = ext.mmq_tile_rows()
    want = expert_tiles([int(c) for c in counts], nt)
    max_tiles = -(-sum(counts) // nt) + len(counts)
    assert len(want) <= max_tiles
    c = torch.tensor(counts, dtype=torch.int64, device="cuda")
    tiles = torch.full((max_tiles, 4), -1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    ext.expert_tiles(c.data_ptr(), len(counts), nt, tiles.data_ptr(), max_tiles)
    ext.synchronize()
    got = tiles.cpu().numpy()
    np.testing.assert_array_equal(got[:len(want)], np.array(want, dtype=np.int32).reshape(-1, 4))
    assert (got[len(want):] == 0).all()
    with pytest.raises(ValueError, match="experts"):
        ext.expert_tiles(c.data_ptr(), 2000, nt, tiles.data_ptr(), max_tiles)


class SwigluDown(NamedTuple):
    """A routed Q2_K down product's inputs: the gate and up products g, u [R, n_ff], the routing weights through the
    expert order (or None), the tile table, the weight (and its raw blocks) and h = the SwiGLU launch's output."""
    g: Any
    u: Any
    wts: Any
    order: Any
    tiles: Any
    raw: np.ndarray
    w: Any
    h: Any
    counts: list
    n_embd: int


def swiglu_down_case(seed: int, n_ff: int, weighted: bool, name: str) -> SwigluDown:
    import torch

    from ds4.engine.gpu.moe_gemm import expert_tiles

    ext = gpu.load()
    rng = np.random.default_rng(seed)
    n_embd, n_expert = 512, 6
    counts = [70, 0, 1, 64, 129, 9]
    R = sum(counts)
    g0 = torch.Generator().manual_seed(seed)
    g, u = (torch.randn(R, n_ff, generator=g0).cuda() * 5 for _ in range(2))
    wts = torch.rand(R, generator=g0).cuda() if weighted else None
    order = torch.randperm(R, generator=g0).cuda() if weighted else None
    tiles = torch.tensor(expert_tiles(counts, ext.mmq_tile_rows()), dtype=torch.int32, device="cuda")
    raw = random_blocks(Q.Q2_K, n_embd * n_expert, n_ff, rng)
    w = gpu.upload(f"blk.0.ffn_down_exps.{name}{int(weighted)}", Q.Q2_K, (n_ff, n_embd, n_expert), raw)
    h = torch.empty_like(g)
    ext.swiglu(g.data_ptr(), u.data_ptr(), g.numel(), 7.0, h.data_ptr(), _ptr(wts), n_ff, _ptr(order))
    torch.cuda.synchronize()  # torch's stream against the extension's
    return SwigluDown(g, u, wts, order, tiles, raw, w, h, counts, n_embd)


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _arr(t):
    return gpu.load().Array.view(t.data_ptr(), list(t.shape), False)


def swiglu_down(c: SwigluDown, source: Any) -> Any:
    """The down product from the SwiGLU source (source None: g and u, quantized straight from them) or of the stored
    rows `source`, into a fresh [R, n_embd] torch array."""
    import torch

    ext = gpu.load()
    y = torch.full((sum(c.counts), c.n_embd), float("nan"), device="cuda")
    torch.cuda.synchronize()
    if source is None:
        assert ext.mmq_experts(c.w, _arr(c.g), c.tiles.data_ptr(), c.tiles.shape[0], _arr(y), s256=0, up=_arr(c.u),
                               limit=7.0, row_w=_ptr(c.wts), row_of=_ptr(c.order))
    else:
        assert ext.mmq_experts(c.w, _arr(source), c.tiles.data_ptr(), c.tiles.shape[0], _arr(y), s256=0)
    ext.synchronize()
    return y


@pytest.mark.parametrize("weighted", [False, True])
def test_mmq_experts_swiglu_source_equals_swiglu_then_the_product(weighted):
    """The routed down product quantizing swiglu(g, u) (times the routing weights through the expert order) straight
    from g and u gives every bit of the SwiGLU launch followed by the product of its stored output (on decode's
    32-column planes: the stored rows never take XROW's, which the SwiGLU source does by default)."""
    import torch

    c = swiglu_down_case(57, 256, weighted, "swiglu_q")
    with decode_planes():
        want, got = swiglu_down(c, c.h), swiglu_down(c, None)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    with pytest.raises(ValueError, match="up must have"):
        gpu.load().mmq_experts(c.w, _arr(c.g), c.tiles.data_ptr(), c.tiles.shape[0], _arr(got), up=_arr(c.u[:5]))


def test_mmq_xrow_gate_and_up_match_the_reference():
    """DS4_GPU_MMQ_XROW=1 (v44): the routed IQ2_XXS gate and up on activations with one scale per row, through the
    XROW kernel (the row's scale applied once, at the store). Against the same planes through the per-block kernel
    (mode 2: the same sums, to float rounding), against the float64 product of x quantized per row, and the gate/up
    pair against separate products. Expert tiles full and partial through the row table (the session's form). Not
    taken, so decode's 32-column scales and the bits of mode 0: Q2_K weights, 8-bit activations, rows longer than
    4096."""
    import torch

    from ds4.engine.gpu import ops
    from ds4.engine.gpu.moe_gemm import expert_tiles

    ext = gpu.load()
    rng = np.random.default_rng(44)
    n_ff, n_expert, T = 136, 6, 90
    counts = [64, 1, 20, 65, 128, 33]
    R = sum(counts)
    x_rows = rng.integers(0, T, R)
    tiles = torch.tensor(expert_tiles(counts, ext.mmq_tile_rows()), dtype=torch.int32, device="cuda")
    rows = torch.tensor(x_rows, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()  # torch's copies run on its stream; the extension's own stream does not wait for them

    def experts(w, x, mode, w2=None, x8=0):
        ys = [ext.Array.empty([R, n_ff]) for _ in range(1 if w2 is None else 2)]
        for y in ys:
            y.fill(float("nan"))
        ext.set_mmq_xrow(mode)
        ext.set_moe_x8(x8)
        try:
            assert ext.mmq_xrow_mode() == mode
            assert ext.mmq_experts(w, ext.Array.from_numpy(x), tiles.data_ptr(), tiles.shape[0], ys[0], rows.data_ptr(),
                                   w2, ys[1] if w2 is not None else None)
        finally:
            ext.set_mmq_xrow(-1)
            ext.set_moe_x8(-1)
        return [y.numpy() for y in ys]

    n_embd = 1024
    gate, up = (gpu.upload(f"blk.0.ffn_{nm}_exps.xrow", Q.IQ2_XXS, (n_embd, n_ff, n_expert),
                           random_blocks(Q.IQ2_XXS, n_ff * n_expert, n_embd, rng)) for nm in ("gate", "up"))
    raw = random_blocks(Q.IQ2_XXS, n_ff * n_expert, n_embd, rng)
    w = gpu.upload("blk.0.ffn_gate_exps.xrow_ref", Q.IQ2_XXS, (n_embd, n_ff, n_expert), raw)
    x = (rng.standard_normal((T, n_embd)) * rng.choice([1e-2, 1.0, 30.0], size=(T, 1))).astype(np.float32)
    x[:, 7] *= 25.0  # an outlier column: the row's scale is coarser than the 32-column one there
    (got,), (same_planes,), (per_block,) = experts(w, x, 1), experts(w, x, 2), experts(w, x, 0)
    assert np.isfinite(got).all()
    assert rel_err(got, same_planes) <= 1e-6
    assert not np.array_equal(got, same_planes), "the XROW kernel did not run (its sums round in another order)"
    xq = ops.quantize_hilo(torch.from_numpy(x), group=n_embd).numpy().astype(np.float64)[x_rows]
    wd = dequant(Q.IQ2_XXS, raw, n_embd).reshape(n_expert, n_ff, n_embd)
    expert = np.repeat(np.arange(n_expert), counts)
    ref = np.einsum("rc,roc->ro", xq, wd[expert])
    assert rel_err(got, ref) <= 1e-5
    assert not np.array_equal(got, per_block)  # x's rows quantized otherwise than decode's 32-column blocks
    pair = experts(gate, x, 1, up)
    for wt, y in zip((gate, up), pair):
        assert np.array_equal(experts(wt, x, 1)[0], y)
    # not taken: Q2_K, 8-bit activations, rows of more than 4096 columns
    q2k = gpu.upload("blk.0.ffn_down_exps.xrow", Q.Q2_K, (n_embd, n_ff, n_expert),
                     random_blocks(Q.Q2_K, n_ff * n_expert, n_embd, rng))
    assert np.array_equal(experts(q2k, x, 1)[0], experts(q2k, x, 0)[0])
    assert np.array_equal(experts(w, x, 1, x8=1)[0], experts(w, x, 0, x8=1)[0])
    wide = gpu.upload("blk.0.ffn_gate_exps.xrow4608", Q.IQ2_XXS, (4608, n_ff, n_expert),
                      random_blocks(Q.IQ2_XXS, n_ff * n_expert, 4608, rng))
    xw = rng.standard_normal((T, 4608)).astype(np.float32)
    assert np.array_equal(experts(wide, xw, 1)[0], experts(wide, xw, 0)[0])


def test_mmq_s256_q2k_experts_match_the_reference():
    """DS4_GPU_MMQ_S256's form (Q2_K, x per 256 columns, the super-block's sums in the mma's int32 registers) against
    the float64 product of x quantized per 256 columns; other weight types and gate/up pairs ignore the request."""
    import torch

    from ds4.engine.gpu.moe_gemm import expert_tiles

    ext = gpu.load()
    rng = np.random.default_rng(256)
    n_embd, n_ff, n_expert = 1024, 200, 10
    counts = [3, 0, 150, 1, 64, 65, 1, 20, 128, 129]
    x = rng.standard_normal((sum(counts), n_embd)).astype(np.float32)
    x[:, 5] *= 40.0  # an outlier column: the 256-column scale is coarser than the 32-column one there
    tiles = torch.tensor(expert_tiles(counts, ext.mmq_tile_rows()), dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()  # torch's copy runs on its stream; the extension's own stream does not wait for it
    expert = np.repeat(np.arange(n_expert), counts)

    def product(w, s256, w2=None):
        y = ext.Array.empty([sum(counts), n_ff])
        y.fill(float("nan"))
        y2 = None if w2 is None else ext.Array.empty([sum(counts), n_ff])
        assert ext.mmq_experts(w, ext.Array.from_numpy(x), tiles.data_ptr(), tiles.shape[0], y, 0, w2, y2, s256)
        return y.numpy()

    raw = random_blocks(Q.Q2_K, n_ff * n_expert, n_embd, rng)
    w = gpu.upload("blk.0.ffn_down_exps.s256", Q.Q2_K, (n_embd, n_ff, n_expert), raw)
    wd = dequant(Q.Q2_K, raw, n_embd).reshape(n_expert, n_ff, n_embd)
    from ds4.engine.gpu import ops

    x256 = ops.quantize_hilo(torch.from_numpy(x), group=256).numpy().astype(np.float64)
    got = product(w, 1)
    assert np.isfinite(got).all()
    err = rel_err(got, np.einsum("rc,roc->ro", x256, wd[expert]))
    assert err <= 1e-4, f"rel err {err:.2e}"
    exact = np.einsum("rc,roc->ro", x.astype(np.float64), wd[expert])
    assert rel_err(got, exact) < 1e-3  # and near the unquantized product (the coarser scale costs a little)
    assert not np.array_equal(got, product(w, 0))  # the request took effect
    raw_iq = random_blocks(Q.IQ2_XXS, n_ff * n_expert, n_embd, rng)
    w_iq = gpu.upload("blk.0.ffn_gate_exps.s256", Q.IQ2_XXS, (n_embd, n_ff, n_expert), raw_iq)
    assert np.array_equal(product(w_iq, 1), product(w_iq, 0))  # IQ2_XXS: not taken
    assert np.array_equal(product(w, 1, w), product(w, 0, w))  # a pair: not taken


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.Q2_K, Q.Q4_K, Q.Q8_0])
def test_mmq_straight_fragments_give_the_same_bits(qtype):
    """v14's straight fragments (no test between a warp's n8 fragments when all hold tile rows) against v13's tested
    loop: every output bit, for full tiles, partial ones (1, 20, 65 rows of a 64-row tile), the S256 form and the
    dense form (100 rows: one partial tile)."""
    import torch

    from ds4.engine.gpu.moe_gemm import expert_tiles

    ext = gpu.load()
    rng = np.random.default_rng(14)
    n_embd, n_ff, n_expert = 512, 136, 6
    counts = [64, 1, 20, 65, 128, 33]
    x = rng.standard_normal((sum(counts), n_embd)).astype(np.float32)
    tiles = torch.tensor(expert_tiles(counts, ext.mmq_tile_rows()), dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()  # torch's copy runs on its stream; the extension's own stream does not wait for it
    w = gpu.upload(f"blk.0.ffn_down_exps.straight{qtype.name}", qtype, (n_embd, n_ff, n_expert),
                   random_blocks(qtype, n_ff * n_expert, n_embd, rng))

    def product(straight: int, s256: int) -> np.ndarray:
        ext.set_mmq_straight(straight)
        try:
            y = ext.Array.empty([sum(counts), n_ff])
            y.fill(float("nan"))
            assert ext.mmq_experts(w, ext.Array.from_numpy(x), tiles.data_ptr(), tiles.shape[0], y, 0, None, None,
                                   s256)
            return y.numpy(), run_mmq(w, x[:100])  # and the dense form: one matrix of all experts' rows
        finally:
            ext.set_mmq_straight(-1)

    for s256 in ((0, 1) if qtype == Q.Q2_K else (0,)):
        (old, old_dense), (new, new_dense) = product(0, s256), product(1, s256)
        assert np.isfinite(new).all()
        assert np.array_equal(new, old), s256
        assert np.array_equal(new_dense, old_dense)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q4_K])
@pytest.mark.parametrize("mode", [1, 2])
def test_mmq_min_terms_on_the_tensor_cores(qtype, mode):
    """DS4_GPU_MMQ_MINMMA=1: the K-quants' min terms as TF32 products once per 128-column stage, against the per-block
    FFMAs (another order of the same sums, and ~21-bit operands: within 1e-6), against the batch-1..8 matvec kernel
    (1e-6, as the default form) and the reference (1e-4); expert tiles full and partial (1, 20, 65 rows) and the dense
    form. Mode 2: the same with one buffer for the decoded weights (four CTAs per SM)."""
    import torch

    from ds4.engine.gpu.moe_gemm import expert_tiles

    ext = gpu.load()
    rng = np.random.default_rng(27)
    n_embd, n_ff, n_expert = 1024, 136, 6
    counts = [64, 1, 20, 65, 128, 33]
    raw = random_blocks(qtype, n_ff * n_expert, n_embd, rng)
    w = gpu.upload(f"blk.0.ffn_down_exps.minmma{qtype.name}", qtype, (n_embd, n_ff, n_expert), raw)
    x = rng.standard_normal((sum(counts), n_embd)).astype(np.float32)
    x[:, :64] += 3.0  # blocks whose 16-column sums are large: the min terms weigh there
    tiles = torch.tensor(expert_tiles(counts, ext.mmq_tile_rows()), dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()  # torch's copy runs on its stream; the extension's own stream does not wait for it

    def product(mode: int):
        ext.set_mmq_min_mma(mode)
        try:
            y = ext.Array.empty([sum(counts), n_ff])
            y.fill(float("nan"))
            assert ext.mmq_experts(w, ext.Array.from_numpy(x), tiles.data_ptr(), tiles.shape[0], y)
            return y.numpy(), run_mmq(w, x[:100]), run_mmq(w, x[:8])
        finally:
            ext.set_mmq_min_mma(-1)

    (old, old_dense, _), (new, new_dense, new8) = product(0), product(mode)
    assert np.isfinite(new).all() and np.isfinite(new_dense).all()
    assert not np.array_equal(new, old)  # the switch took effect
    assert rel_err(new, old) <= 1e-6 and rel_err(new_dense, old_dense) <= 1e-6
    assert rel_err(new8, run_matvec(w, x[:8])) <= 1e-6
    wd = dequant(qtype, raw, n_embd).reshape(n_expert, n_ff, n_embd)
    ref = np.einsum("rc,roc->ro", quantized(x), wd[np.repeat(np.arange(n_expert), counts)])
    assert rel_err(new, ref) <= 1e-4


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.Q2_K, Q.Q4_K])
def test_mmq_one_weights_buffer_gives_the_same_bits(qtype):
    """Four CTAs per SM with one buffer for the decoded weights (ONEW: DS4_GPU_MMQ_FOUR=1 for IQ2_XXS,
    DS4_GPU_MMQ_MINMMA=2 for the K-quants) against the double-buffered form (three CTAs; MINMMA=1): every output bit,
    expert tiles full and partial and the dense form."""
    import torch

    from ds4.engine.gpu.moe_gemm import expert_tiles

    ext = gpu.load()
    rng = np.random.default_rng(28)
    n_embd, n_ff, n_expert = 1024, 136, 6
    counts = [64, 1, 20, 65, 128, 33]
    w = gpu.upload(f"blk.0.ffn_gate_exps.onew{qtype.name}", qtype, (n_embd, n_ff, n_expert),
                   random_blocks(qtype, n_ff * n_expert, n_embd, rng))
    x = rng.standard_normal((sum(counts), n_embd)).astype(np.float32)
    tiles = torch.tensor(expert_tiles(counts, ext.mmq_tile_rows()), dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()  # torch's copy runs on its stream; the extension's own stream does not wait for it
    switch, modes = (ext.set_mmq_four, (0, 1)) if qtype == Q.IQ2_XXS else (ext.set_mmq_min_mma, (1, 2))

    def product(mode: int):
        switch(mode)
        try:
            y = ext.Array.empty([sum(counts), n_ff])
            y.fill(float("nan"))
            with decode_planes():
                assert ext.mmq_experts(w, ext.Array.from_numpy(x), tiles.data_ptr(), tiles.shape[0], y)
            return y.numpy(), run_mmq(w, x[:100])
        finally:
            switch(-1)

    (old, old_dense), (new, new_dense) = product(modes[0]), product(modes[1])
    assert np.isfinite(new).all() and np.isfinite(new_dense).all()
    assert np.array_equal(new, old) and np.array_equal(new_dense, old_dense)


@pytest.mark.parametrize("x8", [0, 1])
@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.Q2_K, Q.Q4_K])
def test_mmq_row_pointers_give_the_same_bits(qtype, x8):
    """DS4_GPU_MMQ_XPTR=1 (v29): the four-CTA kernels find their activation rows once per CTA, not per stage, against
    the per-stage form: every output bit, for expert tiles full and partial (1, 20, 65 rows) read through a row table
    (the session's form: token rows quantized once) and as gathered rows, the dense form (one partial tile) and the
    grouped one (8 groups: each group's columns start past the first), with 16-bit and 8-bit activations; and with
    DS4_GPU_MMQ_PAIRS=1 (v30: the fragments in pairs, one tile-rows test per pair) on top, the same bits again."""
    import torch

    from ds4.engine.gpu.moe_gemm import expert_tiles

    ext = gpu.load()
    rng = np.random.default_rng(29)
    n_embd, n_ff, n_expert, T = 1024, 136, 6, 90
    counts = [64, 1, 20, 65, 128, 33]
    R = sum(counts)
    w = gpu.upload(f"blk.0.ffn_gate_exps.xptr{qtype.name}", qtype, (n_embd, n_ff, n_expert),
                   random_blocks(qtype, n_ff * n_expert, n_embd, rng))
    wg = gpu.upload(f"blk.0.attn_output_a.xptr{qtype.name}", qtype, (256, 8 * 40),
                    random_blocks(qtype, 8 * 40, 256, rng))
    x = rng.standard_normal((T, n_embd)).astype(np.float32)
    x_rows = rng.integers(0, T, R)
    gathered = np.ascontiguousarray(x[x_rows])
    xg = rng.standard_normal((70, 8 * 256)).astype(np.float32)
    tiles = torch.tensor(expert_tiles(counts, ext.mmq_tile_rows()), dtype=torch.int32, device="cuda")
    rows = torch.tensor(x_rows, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()  # torch's copies run on its stream; the extension's own stream does not wait for them

    def experts(xs: np.ndarray, table: int) -> np.ndarray:
        y = ext.Array.empty([R, n_ff])
        y.fill(float("nan"))
        assert ext.mmq_experts(w, ext.Array.from_numpy(xs), tiles.data_ptr(), tiles.shape[0], y, table)
        return y.numpy()

    def product(mode: int, pairs: int = 0):
        ext.set_mmq_xptr(mode)
        ext.set_mmq_pairs(pairs)
        ext.set_moe_x8(x8)
        try:
            with decode_planes():
                return experts(x, rows.data_ptr()), experts(gathered, 0), run_mmq(w, gathered[:100]), run_mmq(wg, xg, 8)
        finally:
            ext.set_mmq_xptr(-1)
            ext.set_mmq_pairs(-1)
            ext.set_moe_x8(-1)

    old = product(0)
    for new in (product(1), product(1, pairs=1)):
        for a, b in zip(old, new):
            assert np.isfinite(b).all()
            assert np.array_equal(a, b)
        assert np.array_equal(new[0], new[1])  # through the row table or gathered: the same rows


def test_mmq_declines_other_weights_and_checks_shapes():
    ext = gpu.load()
    rng = np.random.default_rng(6)
    f16 = gpu.upload("mmq.f16", Q.F16, (256, 64), random_blocks(Q.F16, 64, 256, rng))
    odd = gpu.upload("mmq.odd", Q.Q8_0, (160, 64), random_blocks(Q.Q8_0, 64, 160, rng))
    x, y = ext.Array.empty([4, 256]), ext.Array.empty([4, 64])
    assert not ext.mmq(f16, x, y, 1)
    assert not ext.mmq(odd, ext.Array.empty([4, 160]), y, 1)
    w = gpu.upload("mmq.ok", Q.Q8_0, (256, 64), random_blocks(Q.Q8_0, 64, 256, rng))
    with pytest.raises(ValueError, match="mmq 'mmq.ok': x must be"):
        ext.mmq(w, ext.Array.empty([4, 128]), y, 1)


@pytest.fixture(scope="module")
def small_reference(tmp_path_factory):
    """(`small` without the rounding simulations, 600 tokens, the CPU engine's logits after them)."""
    from conftest import quantize_cli

    from ds4.engine.model import Model
    from ds4.engine.session import Session as CpuSession

    path = tmp_path_factory.mktemp("mmq") / "small.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(path), "--mix", "q2", "--quiet")
    m = Model.load(path).with_numerics(fp8_kv=False, indexer_qat=False)
    toks = np.random.default_rng(3).integers(2, m.config.vocab_size, 600).tolist()
    return m, toks, CpuSession(m, ctx=1024, prefill_chunk=256).sync(toks)


@pytest.mark.parametrize("dense,experts,s256,min_mma", [(True, False, False, 0), (False, True, False, 0),
                                                       (True, True, False, 0), (False, True, True, 0),
                                                       (False, True, False, 1), (False, True, False, 2)])
def test_mmq_prefill_in_the_session(monkeypatch, small_reference, dense, experts, s256, min_mma):
    """small, 600 tokens in chunks of 256: the prefill with the products on mmq against the CPU engine (its 1e-3);
    s256: the routed experts' Q2_K down product in the S256 form (DS4_GPU_MMQ_S256); min_mma: the K-quants' min terms
    on the tensor cores (DS4_GPU_MMQ_MINMMA; 0 here is the v26 form, whatever the environment says)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    from ds4.engine.gpu import moe_gemm, weights
    from ds4.engine.gpu.session import Session as GpuSession

    m, toks, want = small_reference
    calls = []
    monkeypatch.setattr(weights, "MMQ_GEMM", dense)
    monkeypatch.setattr(moe_gemm, "MOE_GEMM", "mmq" if experts else "buckets")
    monkeypatch.setattr(moe_gemm, "MMQ_S256", s256)
    g = GpuSession(m, ctx=1024, prefill_chunk=256)
    g.W.ext = _Counting(g.W.ext, calls)
    gpu.load().set_mmq_min_mma(min_mma)
    try:
        got = g.sync(toks)
    finally:
        gpu.load().set_mmq_min_mma(-1)
    assert any(calls), "no product went through mmq"
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    print(f"\nmmq prefill (dense {dense}, experts {experts}, s256 {s256}, min_mma {min_mma}) against the CPU engine: "
          f"rel {err:.2e} "
          f"({len(calls)} mmq calls)")
    assert err <= 1e-3


def test_mmq_row_pointers_in_the_session(small_reference):
    """DS4_GPU_MMQ_XPTR=1 in the session (small, 600 tokens in chunks of 256: the routed experts on mmq): every
    position's logits bit for bit against the per-stage form; DS4_GPU_MMQ_PAIRS=1 on top of it too."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    from ds4.engine.gpu.session import Session as GpuSession

    m, toks, _ = small_reference
    ext = gpu.load()

    def logits(mode: int, pairs: int = 0) -> np.ndarray:
        ext.set_mmq_xptr(mode)
        ext.set_mmq_pairs(pairs)
        try:
            with decode_planes():
                return GpuSession(m, ctx=1024, prefill_chunk=256).prefill(toks, all_logits=True)
        finally:
            ext.set_mmq_xptr(-1)
            ext.set_mmq_pairs(-1)

    base = logits(0)
    assert np.array_equal(logits(1), base)
    assert np.array_equal(logits(1, pairs=1), base)


@pytest.mark.parametrize("weighted", [False, True])
def test_mmq_xrow_down_matches_the_reference(weighted):
    """DS4_GPU_MMQ_XROW=3 (v44): the routed Q2_K down on its SwiGLU source quantized with one scale per row, the
    min terms' sums in units of that scale, through the XROW form of the MMIN kernel. Against the same planes (their
    sums as they are) through the per-block kernel (mode 2), against the float64 product of the stored SwiGLU output
    quantized per row; mode 1 leaves the down on decode's 32-column planes (mode 0's bits)."""
    from ds4.engine.gpu import ops

    ext = gpu.load()
    n_ff, n_expert = 1024, 6
    c = swiglu_down_case(443, n_ff, weighted, "xrow")

    def down(mode: int) -> np.ndarray:
        ext.set_mmq_xrow(mode)
        try:
            return swiglu_down(c, None).cpu().numpy()
        finally:
            ext.set_mmq_xrow(-1)

    got, same_planes, per_block = down(3), down(2), down(0)
    assert np.isfinite(got).all()
    assert rel_err(got, same_planes) <= 1e-6
    assert not np.array_equal(got, same_planes), "the XROW kernel did not run (its sums round in another order)"
    hq = ops.quantize_hilo(c.h.cpu(), group=n_ff).numpy().astype(np.float64)
    wd = dequant(Q.Q2_K, c.raw, n_ff).reshape(n_expert, c.n_embd, n_ff)
    expert = np.repeat(np.arange(n_expert), c.counts)
    assert rel_err(got, np.einsum("rc,roc->ro", hq, wd[expert])) <= 1e-4
    assert np.array_equal(down(1), per_block)


@pytest.mark.parametrize("mode", [1, 3])
def test_mmq_xrow_in_the_session(small_reference, mode):
    """DS4_GPU_MMQ_XROW=1 and 3 in the session (small, 600 tokens in chunks of 256: the routed gate and up, and with
    3 the down, on activations with one scale per row) against the CPU engine (the issue's 1e-3), and not the
    per-block form's logits."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    from ds4.engine.gpu.session import Session as GpuSession

    m, toks, want = small_reference
    ext = gpu.load()

    def logits(mode: int) -> np.ndarray:
        ext.set_mmq_xrow(mode)
        try:
            return GpuSession(m, ctx=1024, prefill_chunk=256).sync(toks)
        finally:
            ext.set_mmq_xrow(-1)

    got, base = logits(mode), logits(0)
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    err0 = float(np.linalg.norm(base - want) / np.linalg.norm(want))
    print(f"\nmmq XROW={mode} prefill against the CPU engine: rel {err:.2e} (32-column scales: {err0:.2e})")
    assert err <= 1e-3
    assert not np.array_equal(got, base)


class _Counting:
    """The extension module with its product calls counted: whether each took the shapes, into calls, and per kernel
    into by_kernel (everything else passes through)."""

    COUNTED = ("mmq", "mmq_experts", "mmf_experts", "mmw_experts")

    def __init__(self, ext, calls):
        self._ext, self._calls, self.by_kernel = ext, calls, {}

    def __getattr__(self, name):
        fn = getattr(self._ext, name)
        if name not in self.COUNTED:
            return fn

        def counted(*a, **kw):
            took = fn(*a, **kw)
            self._calls.append(took)
            self.by_kernel[name] = self.by_kernel.get(name, 0) + 1
            return took

        return counted
