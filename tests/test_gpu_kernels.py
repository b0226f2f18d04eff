"""CUDA kernels (ds4.engine.gpu) against the numpy dequantize-then-matmul reference.

Weights are fresh random GGUF blocks (every bit pattern of the codes is valid; the f16 scales are
set to finite values), at the Flash shapes of model-spec §2.4. The reference is
ds4.gguf_tools.quants.dequantize in float64. Outputs are poisoned with NaN before each run, so an
unwritten element fails. Skipped without a built extension and a CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import BLOCK, QuantType as Q, row_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]

TOL = 1e-3  # issue 6: relative error for fp32 accumulation


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row_bytes] of valid random blocks with scales in a realistic range."""
    if qtype == Q.F16:
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16).view(np.uint8)
    info = BLOCK[qtype]
    nblk = rows * cols // info.elements
    raw = rng.integers(0, 256, size=(nblk, info.nbytes), dtype=np.uint8)

    def put_f16(off: int, lo: float, hi: float, signed: bool = False) -> None:
        v = rng.uniform(lo, hi, nblk)
        if signed:
            v *= rng.choice([-1.0, 1.0], nblk)
        raw[:, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(nblk, 2)

    if qtype == Q.Q8_0:
        put_f16(0, 1e-3, 2e-3, signed=True)
    elif qtype == Q.Q2_K:
        put_f16(80, 2e-3, 8e-3)
        put_f16(82, 1e-3, 4e-3)
    elif qtype == Q.Q4_K:
        put_f16(0, 2e-4, 1e-3)
        put_f16(2, 2e-4, 1e-3)
    elif qtype == Q.IQ2_XXS:
        put_f16(0, 1e-3, 4e-3)
    return raw.reshape(rows, row_bytes(qtype, cols))


def dequant(qtype: Q, raw: np.ndarray, cols: int) -> np.ndarray:
    if qtype == Q.F16:
        return raw.view(np.float16).astype(np.float64).reshape(raw.shape[0], cols)
    from ds4.gguf_tools.quants import dequantize

    return dequantize(qtype, np.ascontiguousarray(raw), cols).astype(np.float64)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    assert np.isfinite(got).all(), "output has NaN/inf (unwritten or overflow)"
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def run_matvec(w, x: np.ndarray, groups: int = 1) -> np.ndarray:
    ext = gpu.load()
    y = ext.Array.empty([x.shape[0], w.nrows])
    y.fill(float("nan"))
    ext.matvec(w, ext.Array.from_numpy(np.ascontiguousarray(x)), y, groups)
    return y.numpy()


def check_matvec(qtype: Q, cols: int, rows: int, batches: tuple[int, ...], seed: int, groups: int = 1,
                 sample: int = 384) -> None:
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, rows, cols, rng)
    w = gpu.upload(f"test.{qtype.name}.{cols}x{rows}", qtype, (cols, rows), raw)
    assert w.gguf_nbytes == raw.nbytes
    pick = np.sort(rng.choice(rows, size=min(rows, sample), replace=False))
    wd = dequant(qtype, raw[pick], cols)  # [sample, cols]
    for b in batches:
        x = rng.standard_normal((b, groups * cols)).astype(np.float32)
        x[:, : cols // 8] *= 20.0  # uneven magnitudes across x blocks
        y = run_matvec(w, x, groups)
        assert y.shape == (b, rows)
        xg = x.astype(np.float64).reshape(b, groups, cols)[:, pick // (rows // groups), :]  # [b, sample, cols]
        ref = np.einsum("sc,bsc->bs", wd, xg)
        err = rel_err(y[:, pick], ref)
        assert err <= TOL, f"{qtype.name} {cols}x{rows} B={b}: rel err {err:.2e}"


# (cols = ne0, rows = ne1) of the Flash matrices that each type serves.
Q8_SHAPES = [(4096, 1024), (1024, 32768), (4096, 512), (8192, 4096), (4096, 2048), (2048, 4096)]
F16_SHAPES = [(4096, 1024), (4096, 512), (1024, 8192), (4096, 64), (4096, 256), (16384, 24)]
EXPERT_SHAPES = [(4096, 2048), (2048, 4096)]


@pytest.mark.parametrize("cols,rows", Q8_SHAPES)
def test_q8_0_matvec_flash_shapes(cols: int, rows: int) -> None:
    check_matvec(Q.Q8_0, cols, rows, (1, 8), seed=cols + rows)


def test_q8_0_all_batch_widths() -> None:
    check_matvec(Q.Q8_0, 4096, 1024, (2, 3, 4, 5, 6, 7), seed=7)


def test_q8_0_grouped_attn_output_a() -> None:
    # attn_output_a: 8 groups of 1024 rows, each group reads its own 4096-wide slice of the input
    check_matvec(Q.Q8_0, 4096, 8192, (1, 3), seed=11, groups=8)


def test_q8_0_output_head() -> None:
    check_matvec(Q.Q8_0, 4096, 129280, (1, 2), seed=13, sample=256)


@pytest.mark.parametrize("cols,rows", F16_SHAPES)
def test_f16_matvec_flash_shapes(cols: int, rows: int) -> None:
    check_matvec(Q.F16, cols, rows, (1, 4, 8), seed=cols * 3 + rows)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q4_K, Q.IQ2_XXS])
@pytest.mark.parametrize("cols,rows", EXPERT_SHAPES)
def test_expert_types_matvec(qtype: Q, cols: int, rows: int) -> None:
    check_matvec(qtype, cols, rows, (1, 2, 5, 8), seed=int(qtype) * 100 + cols)


def moe_reference(gate_raw, up_raw, down_raw, qg: Q, qd: Q, x, ids, wts, clamp) -> np.ndarray:
    T, k = ids.shape
    n_ff, n_embd = gate_raw.shape[1], x.shape[1]
    cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    y = np.zeros((T, n_embd))
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if e not in cache:
                cache[e] = (dequant(qg, gate_raw[e], n_embd), dequant(qg, up_raw[e], n_embd),
                            dequant(qd, down_raw[e], n_ff))
            wg, wu, wd = cache[e]
            g = np.minimum(wg @ x[t], clamp)
            u = np.clip(wu @ x[t], -clamp, clamp)
            h = g / (1.0 + np.exp(-g)) * u * wts[t, j]
            y[t] += wd @ h
    return y


@pytest.mark.parametrize("mix", ["q2", "q4"])
def test_routed_moe(mix: str) -> None:
    qg, qd = (Q.IQ2_XXS, Q.Q2_K) if mix == "q2" else (Q.Q4_K, Q.Q4_K)
    n_embd, n_ff, n_expert, k = 4096, 2048, 16, 6  # Flash expert shapes; 16 of the 256 experts
    rng = np.random.default_rng(5 if mix == "q2" else 6)
    gate_raw = random_blocks(qg, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1)
    up_raw = random_blocks(qg, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1)
    down_raw = random_blocks(qd, n_expert * n_embd, n_ff, rng).reshape(n_expert, n_embd, -1)
    gate = gpu.upload("blk.3.ffn_gate_exps.weight", qg, (n_embd, n_ff, n_expert), gate_raw)
    up = gpu.upload("blk.3.ffn_up_exps.weight", qg, (n_embd, n_ff, n_expert), up_raw)
    down = gpu.upload("blk.3.ffn_down_exps.weight", qd, (n_ff, n_embd, n_expert), down_raw)
    for T in (1, 3):
        x = rng.standard_normal((T, n_embd)).astype(np.float32) * 2.0
        ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)]).astype(np.int32)
        wts = rng.uniform(0.1, 0.5, (T, k)).astype(np.float32)
        ref = moe_reference(gate_raw, up_raw, down_raw, qg, qd, x.astype(np.float64), ids, wts, 10.0)
        ext = gpu.load()
        y = ext.Array.empty([T, n_embd])
        y.fill(float("nan"))
        ext.moe(gate, up, down, ext.Array.from_numpy(x), ext.Array.from_numpy(ids), ext.Array.from_numpy(wts), y, 10.0)
        err = rel_err(y.numpy(), ref)
        assert err <= TOL, f"moe {mix} T={T}: rel err {err:.2e}"
    # an expert id out of range poisons that token's output instead of reading stray memory
    bad = np.array([[0, 1, 2, 3, 4, n_expert]], dtype=np.int32)
    out = gpu.moe_host(gate, up, down, np.ones((1, n_embd), np.float32), bad, np.full((1, k), 0.2, np.float32))
    assert np.isnan(out).all()


def test_graph_replay_matches_direct_calls() -> None:
    ext = gpu.load()
    # the extension's own stream: an earlier session test in this process may have left torch's legacy stream set,
    # which cannot be captured
    ext.reset_stream()
    rng = np.random.default_rng(21)
    raw = random_blocks(Q.Q8_0, 1024, 4096, rng)
    w = gpu.upload("g", Q.Q8_0, (4096, 1024), raw)
    x = ext.Array.from_numpy(rng.standard_normal((2, 4096)).astype(np.float32))
    y = ext.Array.empty([2, 1024])
    ext.matvec(w, x, y)  # sizes the scratch before capture
    direct = y.numpy()
    y.fill(float("nan"))
    ext.capture_begin()
    ext.matvec(w, x, y)
    graph = ext.capture_end()
    graph.launch(2)
    np.testing.assert_array_equal(y.numpy(), direct)
    assert graph.time_ms(iters=5, warmup=1) > 0


def test_errors_name_the_tensor() -> None:
    raw = np.zeros(100, np.uint8)
    with pytest.raises(ValueError, match="blk.7.attn_kv.weight"):
        gpu.upload("blk.7.attn_kv.weight", Q.Q8_0, (4096, 512), raw)
    with pytest.raises(MemoryError, match="needs .* MiB free of"):
        gpu.load().Array.empty([1 << 40])


def test_resident_model_from_written_gguf(tmp_path) -> None:
    from ds4.gguf_tools.reader import open_gguf
    from ds4.gguf_tools.writer import write_tensors

    rng = np.random.default_rng(3)
    mats = {f"m.{q.name}": (q, rng.standard_normal((64, 512)).astype(np.float32))
            for q in (Q.F16, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS)}
    path = write_tensors(tmp_path / "t.gguf", {}, {**mats, "norm": (Q.F32, rng.standard_normal(512).astype(np.float32)),
                                                 "ids": (Q.I32, np.arange(12, dtype=np.int32).reshape(2, 6))})
    f = open_gguf(path)
    model = gpu.ResidentModel(f)
    assert len(model) == 7
    np.testing.assert_array_equal(model["ids"].numpy(), np.arange(12, dtype=np.int32).reshape(2, 6))
    x = rng.standard_normal((1, 512)).astype(np.float32)
    for name, (q, _) in mats.items():
        ref = dequant(q, f.raw(name), 512) @ x[0].astype(np.float64)
        assert rel_err(gpu.matvec_host(model[name], x)[0], ref) <= TOL, name


# ---- the batch-1 Q8_0 kernels: DS4_GPU_MV=1 matvec.cu's general kernel, 2 matvec_stream.cu's, 3 the same
# with programmatic dependent launch (4, the default, adds F16 and several matrices per launch).
# The variable is read once per process, so a variant runs in a subprocess that writes its outputs;
# this process holds them to the float64 reference and to the default kernel (same activation
# quantization, so only the float summation order differs).
MV2_CASES = [  # (cols, rows, groups): Flash shapes, then odd ones (rows of no particular multiple)
    (1024, 32768, 1), (8192, 4096, 1), (4096, 1024, 1), (4096, 8192, 8), (2048, 4096, 1),
    (768, 1000, 1), (256, 999, 1), (512, 21, 3), (4096, 5, 1),
]
SHARED_ROWS = (1024, 520)  # matvec_shared (x quantized once, the kernel reads the planes): q_a, kv-like


def mv2_inputs(i: int) -> tuple[np.ndarray, np.ndarray]:
    cols, rows, groups = MV2_CASES[i]
    rng = np.random.default_rng(1000 + i)
    raw = random_blocks(Q.Q8_0, rows, cols, rng)
    x = rng.standard_normal((1, groups * cols)).astype(np.float32)
    x[:, : cols // 8] *= 20.0
    return raw, x


def shared_inputs() -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(77)
    raws = [random_blocks(Q.Q8_0, rows, 4096, rng) for rows in SHARED_ROWS]
    return raws, rng.standard_normal((1, 4096)).astype(np.float32) * 3.0


def mv_takes(variant: str, rows: int, groups: int) -> bool:
    """Shapes a variant's kernel takes (the general kernel needs rows per group in multiples of 8)."""
    return variant != "1" or (rows // groups) % 8 == 0


def mv2_outputs(path: str) -> None:
    """Run in the subprocess: every case through ext.matvec / ext.matvec_shared, saved to `path`."""
    import os

    assert os.environ.get("DS4_GPU_MV") in ("1", "2", "3")
    ext = gpu.load()
    ys = {}
    for i, (cols, rows, groups) in enumerate(MV2_CASES):
        if not mv_takes(os.environ["DS4_GPU_MV"], rows, groups):
            continue
        raw, x = mv2_inputs(i)
        ys[f"y{i}"] = run_matvec(gpu.upload(f"mv2.{i}", Q.Q8_0, (cols, rows), raw), x, groups)
    raws, x = shared_inputs()
    ws = [gpu.upload(f"mv2.shared{j}", Q.Q8_0, (4096, r.shape[0]), r) for j, r in enumerate(raws)]
    outs = [ext.Array.empty([1, w.nrows]) for w in ws]
    for y in outs:
        y.fill(float("nan"))
    ext.matvec_shared(ws, ext.Array.from_numpy(x), outs)
    for j, y in enumerate(outs):
        ys[f"shared{j}"] = y.numpy()
    np.savez(path, **ys)


@pytest.mark.parametrize("variant", ["1", "2", "3"])
def test_q8_0_batch1_kernel_v2_matches_reference_and_default(variant: str, tmp_path) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "y.npz"
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_gpu_kernels as t; t.mv2_outputs(sys.argv[1])"
    env = {**os.environ, "DS4_GPU_MV": variant}
    res = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    got = np.load(out)
    default_here = os.environ.get("DS4_GPU_MV", "4") in ("", "4")
    for i, (cols, rows, groups) in enumerate(MV2_CASES):
        if not mv_takes(variant, rows, groups):
            continue
        raw, x = mv2_inputs(i)
        y2 = got[f"y{i}"]
        assert y2.shape == (1, rows)
        pick = np.sort(np.random.default_rng(i).choice(rows, size=min(rows, 384), replace=False))
        xg = x.astype(np.float64).reshape(groups, cols)[pick // (rows // groups)]
        ref = np.einsum("sc,sc->s", dequant(Q.Q8_0, raw[pick], cols), xg)
        err = rel_err(y2[0, pick], ref)
        assert err <= TOL, f"DS4_GPU_MV={variant} {cols}x{rows} groups={groups}: rel err {err:.2e}"
        if default_here:  # the default (streaming) kernel in this process
            y1 = run_matvec(gpu.upload(f"mv1.{i}", Q.Q8_0, (cols, rows), raw), x, groups)
            d = rel_err(y2, y1)
            assert d <= 1e-5, f"DS4_GPU_MV={variant} {cols}x{rows}: {d:.2e} from the default kernel"
    raws, x = shared_inputs()
    for j, r in enumerate(raws):
        ref = dequant(Q.Q8_0, r, 4096) @ x[0].astype(np.float64)
        err = rel_err(got[f"shared{j}"][0], ref)
        assert err <= TOL, f"DS4_GPU_MV={variant} matvec_shared {j}: rel err {err:.2e}"
