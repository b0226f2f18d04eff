"""Several matrices in one launch (ext.matvec_multi, matvec_stream.cu) against the float64 reference.

Decode merges the products that read the same activation (q_a + kv, shared gate + up, compressor kv +
score) and applies the shared expert's SwiGLU while the down projection stages its input. Each output is
held to dequantize-then-matmul in float64; outputs start as NaN so an unwritten row fails.
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
F16_TOL = 1e-5  # f16 weights times f32 activations, f32 sums: only rounding of the sums


def upload(name: str, qtype: Q, cols: int, rows: int, rng) -> tuple[object, np.ndarray]:
    raw = random_blocks(qtype, rows, cols, rng)
    return gpu.upload(name, qtype, (cols, rows), raw), dequant(qtype, raw, cols)


def multi(ws, x: np.ndarray, swiglu: bool = False, clamp: float = 0.0):
    ext = gpu.load()
    xt = torch.from_numpy(np.ascontiguousarray(x, np.float32)).cuda()
    ys = [torch.full((1, w.nrows), float("nan"), device="cuda") for w in ws]
    ok = ext.matvec_multi(ws, xt.data_ptr(), [y.data_ptr() for y in ys], swiglu, clamp)
    torch.cuda.synchronize()
    return ok, [y.cpu().numpy()[0] for y in ys]


@pytest.mark.parametrize("qtype,cols,rows,tol", [
    (Q.Q8_0, 4096, (1024, 512), TOL),        # q_a + kv
    (Q.Q8_0, 4096, (2048, 2048), TOL),       # shared gate + up
    (Q.Q8_0, 1024, (1000, 7, 33, 256), TOL),  # four segments, rows of no particular multiple
    (Q.Q8_0, 1280, (300, 40), TOL),          # a width that leaves the last step part padding
    (Q.F16, 4096, (1024, 1024), F16_TOL),    # compressor kv + score (ratio 4)
    (Q.F16, 4096, (256, 256, 64), F16_TOL),  # indexer compressor kv + score, indexer weights
    (Q.F16, 1024, (8192,), F16_TOL),         # indexer q_b
    (Q.F16, 520, (5, 3), F16_TOL),           # odd widths: a partial chunk
])
def test_segments_match_reference(qtype: Q, cols: int, rows: tuple[int, ...], tol: float) -> None:
    rng = np.random.default_rng(cols + sum(rows))
    mats = [upload(f"multi.{qtype.name}.{i}", qtype, cols, r, rng) for i, r in enumerate(rows)]
    x = rng.standard_normal(cols).astype(np.float32)
    x[: cols // 8] *= 20.0  # uneven magnitudes across x blocks
    ok, ys = multi([w for w, _ in mats], x)
    assert ok
    for (w, wd), y in zip(mats, ys):
        err = rel_err(y, wd @ x.astype(np.float64))
        assert err <= tol, f"{qtype.name} {cols}x{w.nrows} of {rows}: rel err {err:.2e}"


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.F16])
def test_swiglu_input(qtype: Q) -> None:
    """down · swiglu(g, u) with x = [g | u]: the clamp on g (above) and u (both sides) is exercised."""
    rng = np.random.default_rng(5)
    F, D, clamp = 2048, 4096, 10.0
    w, wd = upload(f"swiglu.{qtype.name}", qtype, F, D, rng)
    gu = (rng.standard_normal(2 * F) * 8.0).astype(np.float32)
    ok, (y,) = multi([w], gu, swiglu=True, clamp=clamp)
    assert ok
    g = np.minimum(gu[:F].astype(np.float64), clamp)
    u = np.clip(gu[F:].astype(np.float64), -clamp, clamp)
    assert (gu[:F] > clamp).any() and (np.abs(gu[F:]) > clamp).any()
    ref = wd @ (g / (1.0 + np.exp(-g)) * u)
    err = rel_err(y, ref)
    assert err <= (TOL if qtype == Q.Q8_0 else F16_TOL), f"{qtype.name}: rel err {err:.2e}"


def test_f16_groups() -> None:
    """Block-diagonal F16 rows through ext.matvec (batch 1 takes the streaming kernel): y[r] = W[r] . x[g(r)]."""
    from test_gpu_kernels import run_matvec

    rng = np.random.default_rng(11)
    cols, rows, groups = 512, 64, 4
    w, wd = upload("f16.groups", Q.F16, cols, rows, rng)
    x = rng.standard_normal((1, groups * cols)).astype(np.float32)
    y = run_matvec(w, x, groups)[0]
    ref = np.einsum("rc,rc->r", wd, x.astype(np.float64).reshape(groups, cols)[np.arange(rows) // (rows // groups)])
    assert rel_err(y, ref) <= F16_TOL


def test_declines_what_it_cannot_take() -> None:
    """False and nothing written: 2-bit experts, mixed widths, more than five matrices (Q8_0 beside F16 is taken:
    test_gpu_idx_merge.py)."""
    rng = np.random.default_rng(9)
    iq2, _ = upload("decline.iq2", Q.IQ2_XXS, 4096, 64, rng)
    a, _ = upload("decline.a", Q.Q8_0, 4096, 64, rng)
    b, _ = upload("decline.b", Q.Q8_0, 2048, 64, rng)
    f, _ = upload("decline.f", Q.F16, 4096, 64, rng)
    x = rng.standard_normal(4096).astype(np.float32)
    for ws in ([iq2], [a, b], [f, b], [a] * 6):
        ok, ys = multi(ws, x)
        assert not ok, [w.name for w in ws]
        assert all(np.isnan(y).all() for y in ys)


def test_shared_expert_through_weights(tmp_path) -> None:
    """Weights.swiglu_ffn on the device (two launches) equals the separate products and SwiGLU."""
    from ds4.engine.gpu import ops
    from ds4.engine.gpu.weights import Weights

    rng = np.random.default_rng(3)
    names = ["gate", "up", "down"]
    mats = {n: upload(f"ffn.{n}", Q.Q8_0, c, r, rng) for n, (c, r) in zip(names, [(4096, 2048)] * 2 + [(2048, 4096)])}

    class Resident(Weights):  # the uploaded matrices, without a model file
        def mat(self, name):
            return mats[name][0]

    W = Resident(None, torch.device("cuda"))
    x = torch.from_numpy(rng.standard_normal((1, 4096)).astype(np.float32) * 4).cuda()
    y = W.swiglu_ffn(names, x, 7.0, ops.swiglu).cpu().numpy()[0]
    xd = x.cpu().numpy()[0].astype(np.float64)
    g, u = (mats[n][1] @ xd for n in names[:2])
    g = np.minimum(g, 7.0)
    ref = mats["down"][1] @ (g / (1.0 + np.exp(-g)) * np.clip(u, -7.0, 7.0))
    assert rel_err(y, ref) <= TOL


@pytest.mark.parametrize("mode", [0, 1])
def test_l2_prefetch_leaves_the_products(mode: int) -> None:
    """L2 prefetch requests (bulk or per line, whole or part of the weights, both planes) change no result and
    fail no later kernel; more than 16 ranges or groups that do not divide the rows are a ValueError."""
    ext = gpu.load()
    rng = np.random.default_rng(21)
    mats = [upload(f"pf.{mode}.{i}", qt, 4096, r, rng) for i, (qt, r) in enumerate([(Q.Q8_0, 1024), (Q.F16, 256)])]
    x = rng.standard_normal(4096).astype(np.float32)
    _, want = multi([mats[0][0]], x)
    for fraction, groups in ((0.0, 1), (0.37, 1), (1.0, 1), (0.5, 8)):
        ws = [w for w, _ in mats] if groups == 1 else [mats[0][0]]  # 8 groups x 2 planes: 16 ranges
        ext.prefetch_l2(ws, fraction, 4, mode, groups)
        ok, got = multi([mats[0][0]], x)
        assert ok and np.array_equal(got[0], want[0]), f"fraction {fraction}"
    with pytest.raises(ValueError):
        ext.prefetch_l2([mats[0][0]] * 9)  # 18 ranges
    with pytest.raises(ValueError):
        ext.prefetch_l2([mats[0][0]], 1.0, 0, mode, 3)  # 3 does not divide 1024 rows


_PER_SM_SCRIPT = r"""
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from ds4.engine import gpu
from test_gpu_matvec_stream import multi, upload
from ds4.gguf_tools.constants import QuantType as Q
gpu.load().set_stream(torch.cuda.current_stream().cuda_stream)
rng = np.random.default_rng(31)
ws = [upload(f"persm.{i}", Q.Q8_0, 4096, r, rng)[0] for i, r in enumerate((4096, 1024))]
x = rng.standard_normal(4096).astype(np.float32)
ok, ys = multi(ws, x)
assert ok
np.save(sys.argv[2], np.concatenate(ys))
"""


def test_grid_cap_per_sm_gives_the_same_bits(tmp_path) -> None:
    """DS4_GPU_MV_PER_SM=1 (a smaller persistent grid) deals the tiles differently but sums each row in the same
    order in one warp: the outputs are bitwise those of the default grid."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    outs = []
    for cap in ("", "1"):
        env = dict(os.environ, DS4_GPU_MV_PER_SM=cap) if cap else {k: v for k, v in os.environ.items()
                                                                    if k != "DS4_GPU_MV_PER_SM"}
        out = tmp_path / f"y{cap or 'default'}.npy"
        done = subprocess.run([sys.executable, "-c", _PER_SM_SCRIPT, tests, str(out)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        outs.append(np.load(out))
    assert np.array_equal(outs[0], outs[1])
