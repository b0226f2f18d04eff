"""The int8 mma.sync gate/up kernel of the routed MoE for IQ2_XXS experts (engine/gpu/moe_mma.cu).

CPU part: a numpy model of the kernel's lane arithmetic (the grid-offset and sign-mask bit tricks, the
fragment placement of PTX ISA "Matrix Fragments for mma.m16n8k32", the epilogue) against the dequantized
float64 product, so the design is checked where no GPU exists; and the extension's switches.
GPU part: the kernel against the rows kernel (same integer sums per 32 columns, so only the float summation
order differs: rel err <= 1e-5) and against the numpy reference, at Flash shapes and small ones, plus the
NaN poisoning of an expert id out of range. Skipped without a CUDA device.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q
from test_gpu_kernels import TOL, dequant, moe_reference, random_blocks, rel_err

GPU_DIR = Path(__file__).resolve().parent.parent / "engine" / "gpu"
needs_gpu = pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))
M32 = 0xFFFFFFFF


def built_ext():
    try:
        return importlib.import_module("ds4.engine.gpu._ext")
    except ImportError as e:
        pytest.skip(f"the CUDA extension is not built: {e}")


# ---------------------------------------------------------------- numpy model of the kernel


def grid_words() -> np.ndarray:
    sys.path.insert(0, str(GPU_DIR))
    try:
        import gen_tables
    finally:
        sys.path.pop(0)
    return np.array(gen_tables.grid_words(), dtype=np.uint64)


def quantize_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """repack.cu quantize_x_kernel for one vector: (hi, lo, scale) with x ~= scale (254 hi + lo)."""
    v = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(v).max(axis=1, keepdims=True)
    s = (amax / np.float32(127)).astype(np.float32)
    t = np.where(amax > 0, v / np.where(s > 0, s, 1), 0).astype(np.float32)
    hr = np.rint(t)
    lo = np.clip(np.rint((t - hr) * np.float32(254)), -127, 127)
    return hr.astype(np.int8).ravel(), lo.astype(np.int8).ravel(), (s[:, 0] / np.float32(254)).astype(np.float32)


def prmt(a: np.ndarray, b, sel: int) -> np.ndarray:
    """PTX prmt.b32 (generic mode) on uint32 values: selector nibble j picks byte (nibble & 7) of {b, a}
    for result byte j; nibble bit 3 replicates that byte's sign bit instead."""
    src = (np.asarray(b, np.uint64) << np.uint64(32)) | np.asarray(a, np.uint64)
    out = np.zeros_like(src)
    for j in range(4):
        ctl = (sel >> (4 * j)) & 0xF
        byte = (src >> np.uint64(8 * (ctl & 7))) & np.uint64(0xFF)
        if ctl & 8:
            byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= byte << np.uint64(8 * j)
    return out


def iq2_group(a0: np.ndarray, a1: np.ndarray, i: int, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """moe_mma.cu iq2_group for the 32 lanes, in uint32 arithmetic (held in uint64, reduced mod 2^32)."""
    lane8 = np.uint64(8) * LANE.astype(np.uint64)
    off = prmt(a0, lane8, 0x5504 | (i << 4))  # grid_offset: byte offset into the lane-replicated table
    assert ((off & np.uint64(0xFF)) == lane8).all()  # every lane reads its own column (its own banks)
    g = grid[(off >> np.uint64(8)).astype(np.int64)]
    gx, gy = g & np.uint64(M32), g >> np.uint64(32)
    t = a1 >> np.uint64(7 * i)
    f = t & np.uint64(127)
    popc = np.array([bin(int(v)).count("1") for v in f], dtype=np.uint64)
    plo = (f * np.uint64(0x10204080)) & np.uint64(M32)
    phi = ((t & np.uint64(0x70)) * np.uint64(0x01020408) + popc * np.uint64(0x81020400)) & np.uint64(M32)

    def negate_bytes(w, m):
        return (w & ~m & np.uint64(M32)) | (((np.uint64(0x01010100) - w) & np.uint64(M32)) & m)

    return negate_bytes(gx, prmt(plo, 0, 0xBA98)), negate_bytes(gy, prmt(phi, 0, 0xBA98))


LANE = np.arange(32)
G, QD = LANE >> 2, LANE & 3


def reg_bytes(regs: np.ndarray) -> np.ndarray:
    """[32] uint32 registers -> [32, 4] int8, lowest element in the low byte."""
    return regs.astype(np.uint32).view(np.uint8).reshape(32, 4).view(np.int8).astype(np.int64)


def mma_m16n8k32(a: list[np.ndarray], b: list[np.ndarray], c: np.ndarray) -> np.ndarray:
    """D = A B + C from per-lane fragments, placed as the PTX ISA lays out m16n8k32 .s8/.s32."""
    A = np.zeros((16, 32), np.int64)
    B = np.zeros((32, 8), np.int64)
    for r in range(4):  # A: row g (+8 for regs 1, 3), K 4q + byte (+16 for regs 2, 3)
        A[(G + 8 * (r & 1))[:, None], (4 * QD + 16 * (r >> 1))[:, None] + np.arange(4)] = reg_bytes(a[r])
    for r in range(2):  # B: column g, K 4q + byte (+16 for reg 1)
        B[(4 * QD + 16 * r)[:, None] + np.arange(4), G[:, None]] = reg_bytes(b[r])
    D = A @ B
    out = c.copy()
    for r in range(4):  # C/D: row g (+8 for c2, c3), column 2q (+1 for c1, c3)
        out[:, r] += D[G + 8 * (r >> 1), 2 * QD + (r & 1)]
    return out


def emulate_tile(raw: np.ndarray, x: np.ndarray, grid: np.ndarray, mma=mma_m16n8k32) -> np.ndarray:
    """16 rows (GGUF IQ2_XXS blocks, [16, row_bytes]) . x as moe_mma.cu computes one matrix of a unit."""
    nb = raw.shape[1] // 66
    blocks = raw.reshape(16, nb, 66)
    d = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
    words = blocks[:, :, 2:].copy().view("<u4").astype(np.uint64)  # [16, nb, 16]: sub-block j = words 2j, 2j+1
    hi, lo, xs = quantize_x(x)
    acc = np.zeros((32, 2), np.float32)  # lane: rows g, g+8
    bmask = (G >> 1) == QD
    for blk in range(nb):
        for s in range(2):
            sb = 2 * QD + s  # this lane's sub-block of the block
            a0 = [words[G + 8 * h, blk, 2 * sb] for h in (0, 1)]
            a1 = [words[G + 8 * h, blk, 2 * sb + 1] for h in (0, 1)]
            plane = np.where((G & 1)[:, None] == 0, hi.reshape(-1, 32)[8 * blk + sb], lo.reshape(-1, 32)[8 * blk + sb])
            bx = plane.astype(np.int8).view(np.uint32).astype(np.uint64)  # [32 lanes, 8 words]
            bx = np.where(bmask[:, None], bx, np.uint64(0))
            c = np.zeros((32, 4), np.int64)
            for i in range(4):
                lo0, hi0 = iq2_group(a0[0], a1[0], i, grid)
                lo1, hi1 = iq2_group(a0[1], a1[1], i, grid)
                c = mma([lo0, lo1, hi0, hi1], [bx[:, 2 * i], bx[:, 2 * i + 1]], c)
            xss = xs[8 * blk + sb]
            for h in (0, 1):
                t = (254 * c[:, 2 * h] + c[:, 2 * h + 1]).astype(np.float32)
                sub_scale = (a1[h] >> np.uint64(28)).astype(np.float32)
                dscale = d[G + 8 * h, blk] * np.float32(0.25) * (np.float32(0.5) + sub_scale)
                acc[:, h] += dscale * xss * t
    rows = np.zeros(16)
    for h in (0, 1):
        rows[np.arange(8) + 8 * h] = acc[:, h].reshape(8, 4).sum(axis=1)  # the quad's 4 lanes
    return rows


@pytest.mark.parametrize("ncols", [256, 1024])
def test_numpy_model_of_the_mma_kernel_matches_the_dequantized_product(ncols: int) -> None:
    rng = np.random.default_rng(ncols)
    raw = random_blocks(Q.IQ2_XXS, 16, ncols, rng)
    x = rng.standard_normal(ncols).astype(np.float32) * 2.0
    x[: ncols // 8] *= 20.0
    got = emulate_tile(raw, x, grid_words())
    ref = dequant(Q.IQ2_XXS, raw, ncols) @ x.astype(np.float64)
    assert rel_err(got, ref) <= 1e-4


def test_numpy_model_detects_a_transposed_fragment() -> None:
    """The model is sensitive to the placement: swapping A's row halves (regs 0/1) breaks the result."""
    rng = np.random.default_rng(3)
    raw = random_blocks(Q.IQ2_XXS, 16, 256, rng)
    x = rng.standard_normal(256).astype(np.float32)
    grid = grid_words()
    good = emulate_tile(raw, x, grid)

    def swapped(a, b, c):
        return mma_m16n8k32([a[1], a[0], a[2], a[3]], b, c)

    bad = emulate_tile(raw, x, grid, mma=swapped)
    assert rel_err(bad, good) > 0.1


# ---------------------------------------------------------------- switches (extension built, no GPU needed)


def test_mma_switch_follows_the_environment() -> None:
    built_ext()
    code = "import ds4.engine.gpu._ext as m; print(m.gateup_mma_enabled())"
    for env_value, want in (("1", "True"), ("0", "False"), (None, "False")):
        env = {k: v for k, v in os.environ.items() if k != "DS4_GPU_GU_MMA"}
        if env_value is not None:
            env["DS4_GPU_GU_MMA"] = env_value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == want


def test_set_gateup_mma_overrides_and_checks_splits() -> None:
    ext = built_ext()
    try:
        ext.set_gateup_mma(True)
        assert ext.gateup_mma_enabled()
        ext.set_gateup_mma(False, 8)
        assert not ext.gateup_mma_enabled()
        with pytest.raises(ValueError, match="splits"):
            ext.set_gateup_mma(True, 3)
    finally:
        ext.set_gateup_mma(None)


# ---------------------------------------------------------------- GPU


@lru_cache(maxsize=2)
def experts(n_embd: int, n_ff: int, n_expert: int, seed: int):
    rng = np.random.default_rng(seed)
    gate_raw = random_blocks(Q.IQ2_XXS, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1)
    up_raw = random_blocks(Q.IQ2_XXS, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1)
    gate = gpu.upload("mma.ffn_gate_exps", Q.IQ2_XXS, (n_embd, n_ff, n_expert), gate_raw)
    up = gpu.upload("mma.ffn_up_exps", Q.IQ2_XXS, (n_embd, n_ff, n_expert), up_raw)
    return gate_raw, up_raw, gate, up


def run_gateup(gate, up, x: np.ndarray, ids: np.ndarray, wts: np.ndarray, n_ff: int, mma: bool, splits: int = 0,
               clamp: float = 10.0) -> np.ndarray:
    ext = gpu.load()
    h = ext.Array.empty([ids.size, n_ff])
    h.fill(float("nan"))
    ext.set_gateup_mma(mma, splits)
    try:
        dev = [ext.Array.from_numpy(a) for a in (x, ids, wts)]
        ext.moe_gateup(gate, up, *dev, h, clamp)
        return h.numpy()
    finally:
        ext.set_gateup_mma(None)


def h_reference(gate_raw, up_raw, x, ids, wts, rows: np.ndarray, clamp: float = 10.0) -> np.ndarray:
    """h[pair, rows] in float64 from the dequantized rows."""
    n_embd = x.shape[1]
    T, k = ids.shape
    out = np.zeros((T * k, rows.size))
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            g = np.minimum(dequant(Q.IQ2_XXS, gate_raw[e][rows], n_embd) @ x[t].astype(np.float64), clamp)
            u = np.clip(dequant(Q.IQ2_XXS, up_raw[e][rows], n_embd) @ x[t].astype(np.float64), -clamp, clamp)
            out[t * k + j] = g / (1.0 + np.exp(-g)) * u * wts[t, j]
    return out


# name, n_embd, n_ff, n_expert, k, T, splits (0 = automatic)
SHAPES = [
    ("flash-T1", 4096, 2048, 16, 6, 1, 0),
    ("flash-T3", 4096, 2048, 16, 6, 3, 0),
    ("flash-T1-splits1", 4096, 2048, 16, 6, 1, 1),
    ("flash-T1-splits8", 4096, 2048, 16, 6, 1, 8),
    ("small", 256, 32, 4, 2, 2, 0),
    ("small-more-splits-than-blocks", 512, 48, 3, 2, 1, 8),
]


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name,n_embd,n_ff,n_expert,k,T,splits", SHAPES, ids=[s[0] for s in SHAPES])
def test_gateup_mma_matches_rows_kernel_and_reference(name, n_embd, n_ff, n_expert, k, T, splits) -> None:
    gate_raw, up_raw, gate, up = experts(n_embd, n_ff, n_expert, seed=n_embd + n_ff)
    rng = np.random.default_rng(T * 10 + splits)
    x = rng.standard_normal((T, n_embd)).astype(np.float32) * 2.0
    x[:, : n_embd // 8] *= 10.0  # uneven magnitudes across x blocks
    ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)]).astype(np.int32)
    wts = rng.uniform(0.1, 0.5, (T, k)).astype(np.float32)
    h_rows = run_gateup(gate, up, x, ids, wts, n_ff, mma=False)
    h_mma = run_gateup(gate, up, x, ids, wts, n_ff, mma=True, splits=splits)
    err = rel_err(h_mma, h_rows)
    assert err <= 1e-5, f"{name}: mma vs rows kernel rel err {err:.2e}"
    # every row position of a 16-row tile, in several tiles
    rows = np.unique(np.concatenate([np.arange(16), rng.choice(n_ff, min(n_ff, 112), replace=False)]))
    ref = h_reference(gate_raw, up_raw, x, ids, wts, rows)
    err = rel_err(h_mma[:, rows], ref)
    assert err <= TOL, f"{name}: mma vs reference rel err {err:.2e}"


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_gateup_mma_poisons_an_expert_id_out_of_range(splits: int) -> None:
    n_embd, n_ff, n_expert, k = 512, 64, 4, 4
    _, _, gate, up = experts(n_embd, n_ff, n_expert, seed=1)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, n_embd)).astype(np.float32)
    ids = np.array([[0, n_expert, 2, -1], [3, 1, 2, 0]], dtype=np.int32)
    wts = np.full((2, k), 0.3, np.float32)
    h = run_gateup(gate, up, x, ids, wts, n_ff, mma=True, splits=splits).reshape(2, k, n_ff)
    bad = (ids < 0) | (ids >= n_expert)
    assert np.isnan(h[bad]).all()
    assert np.isfinite(h[~bad]).all()
    good_ids = np.where(bad, 0, ids).astype(np.int32)
    h_rows = run_gateup(gate, up, x, good_ids, wts, n_ff, mma=False).reshape(2, k, n_ff)
    assert rel_err(h[~bad], h_rows[~bad]) <= 1e-5


@needs_gpu
@pytest.mark.gpu
def test_gateup_mma_falls_back_where_the_shape_does_not_fit() -> None:
    n_embd, n_ff, n_expert, k = 256, 40, 2, 2  # n_ff % 16 != 0: the rows kernel runs
    _, _, gate, up = experts(n_embd, n_ff, n_expert, seed=4)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, n_embd)).astype(np.float32)
    ids = np.array([[1, 0]], dtype=np.int32)
    wts = np.full((1, k), 0.5, np.float32)
    np.testing.assert_array_equal(run_gateup(gate, up, x, ids, wts, n_ff, mma=True),
                                  run_gateup(gate, up, x, ids, wts, n_ff, mma=False))


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n_embd,n_ff,n_expert,T", [(4096, 2048, 16, 1), (512, 256, 8, 3)])  # Q2_K down: n_ff of whole 256-blocks
def test_routed_moe_with_the_mma_gateup(n_embd: int, n_ff: int, n_expert: int, T: int) -> None:
    k = 6
    gate_raw, up_raw, gate, up = experts(n_embd, n_ff, n_expert, seed=n_embd + n_ff)
    rng = np.random.default_rng(9)
    down_raw = random_blocks(Q.Q2_K, n_expert * n_embd, n_ff, rng).reshape(n_expert, n_embd, -1)
    down = gpu.upload("mma.ffn_down_exps", Q.Q2_K, (n_ff, n_embd, n_expert), down_raw)
    x = rng.standard_normal((T, n_embd)).astype(np.float32) * 2.0
    ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)]).astype(np.int32)
    wts = rng.uniform(0.1, 0.5, (T, k)).astype(np.float32)
    ext = gpu.load()
    out = {}
    for mma in (False, True):
        y = ext.Array.empty([T, n_embd])
        y.fill(float("nan"))
        ext.set_gateup_mma(mma)
        try:
            ext.moe(gate, up, down, *[ext.Array.from_numpy(a) for a in (x, ids, wts)], y, 10.0)
            out[mma] = y.numpy()
        finally:
            ext.set_gateup_mma(None)
    assert rel_err(out[True], out[False]) <= 1e-5
    ref = moe_reference(gate_raw, up_raw, down_raw, Q.IQ2_XXS, Q.Q2_K, x.astype(np.float64), ids, wts, 10.0)
    assert rel_err(out[True], ref) <= TOL
