"""q_a's RMS norm folded into q_b's streaming matvec (x_op MV_X_RMS, DS4_GPU_NORM_FOLD=1): the kernel normalizes
x while it stages it, with rms_norm_kernel's arithmetic emulated operation for operation, so its products are
BITWISE those of the extension's rms_norm op followed by the plain matvec. Shapes the fold does not take go
through that same pair of launches inside ext.matvec (it then returns False). The session test decodes the
small q2 model with the switch on and off (one subprocess each: the switch is read once per process) and
expects the same logits, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

from test_gpu_kernels import TOL, dequant, random_blocks, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason())),
              pytest.mark.usefixtures("ext_on_torch_stream")]

torch = pytest.importorskip("torch")
EPS = 1e-6
NAN = float("nan")


def _arr(t: torch.Tensor):
    return gpu.load().Array.view(t.data_ptr(), list(t.shape), False)


def _inputs(cols: int, seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, cols] of uneven magnitudes across x blocks and a norm weight around 1 with both signs."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    x[:, : cols // 8] *= 20.0
    w = (1.0 + 0.5 * rng.standard_normal(cols)).astype(np.float32)
    return torch.from_numpy(x * np.float32(scale)).cuda(), torch.from_numpy(w).cuda()


def folded(w, x: torch.Tensor, nw: torch.Tensor, eps: float = EPS) -> tuple[bool, np.ndarray]:
    """ext.matvec with the norm: (whether the streaming kernel applied it, y)."""
    y = torch.full((1, w.nrows), NAN, device="cuda")
    took = gpu.load().matvec(w, _arr(x), _arr(y), 1, nw.data_ptr(), eps)
    torch.cuda.synchronize()
    return took, y.cpu().numpy()[0]


def rms_norm_op(x: torch.Tensor, nw: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """The extension's rms_norm op (the launch that the fold removes from decode)."""
    xn = torch.full_like(x, NAN)
    gpu.load().rms_norm(x.data_ptr(), nw.data_ptr(), xn.data_ptr(), x.shape[0], x.shape[1], eps)
    return xn


def unfused(w, x: torch.Tensor, nw: torch.Tensor, eps: float = EPS) -> tuple[np.ndarray, np.ndarray]:
    """(rms_norm(x) * nw, W . that): two launches, as decode runs them without the fold."""
    xn = rms_norm_op(x, nw, eps)
    y = torch.full((1, w.nrows), NAN, device="cuda")
    assert gpu.load().matvec(w, _arr(xn), _arr(y)) is False  # no norm: nothing folded
    torch.cuda.synchronize()
    return xn.cpu().numpy()[0], y.cpu().numpy()[0]


def upload(name: str, qtype: Q, cols: int, rows: int, seed: int):
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    return gpu.upload(name, qtype, (cols, rows), raw), raw


def plan(qtype: Q, cols: int, rows: int, sms: int) -> tuple[int, int, int]:
    """(R, C, threads) of mv_plan (mv_stream.cuh) for one matrix, batch 1, one group."""
    nchunks = -(-cols // (256 if qtype == Q.F16 else 512))
    C = 2 if nchunks <= 2 else (4 if nchunks <= 4 else 8)
    R = 8 // C
    while R > 1 and -(-rows // R) < sms * 16:
        R //= 2
    return R, C, 256 if -(-rows // R) >= sms * 8 else 128


# (type, cols, rows, scale of x): Flash's q_b (Q8_0 32768 x 1024) and indexer q_b (F16 8192 x 1024), the same with
# few rows (4-warp CTAs), widths whose emulated rms_norm threads sum 2 and 4 float4s (n / 4 > 512, > 1536), the
# small model's q_b (256 wide), an odd width, and x so small that eps weighs in the norm
FOLD_SHAPES = [
    (Q.Q8_0, 1024, 32768, 1.0),
    (Q.Q8_0, 1024, 1000, 1.0),
    (Q.F16, 1024, 8192, 1.0),
    (Q.F16, 1024, 512, 1.0),
    (Q.Q8_0, 4096, 2048, 1.0),
    (Q.F16, 8192, 256, 1.0),
    (Q.Q8_0, 256, 4096, 1.0),
    (Q.F16, 520, 40, 1.0),
    (Q.Q8_0, 1024, 3000, 1e-4),
    (Q.F16, 1024, 700, 1e-4),
]


def test_shapes_cover_both_cta_sizes() -> None:
    """The fold shapes run 4-warp and 8-warp CTAs (the emulated 512-thread reduction loops 4 or 2 times per warp)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    threads = {plan(qt, cols, rows, sms)[2] for qt, cols, rows, _ in FOLD_SHAPES}
    assert threads == {128, 256}, f"{sms} SMs: plans of {threads} threads only"


@pytest.mark.parametrize("qtype,cols,rows,scale", FOLD_SHAPES)
def test_fold_gives_the_bits_of_rms_norm_then_matvec(qtype: Q, cols: int, rows: int, scale: float) -> None:
    w, raw = upload(f"fold.{qtype.name}.{cols}.{rows}.{scale}", qtype, cols, rows, cols + rows)
    x, nw = _inputs(cols, rows, scale)
    took, y = folded(w, x, nw)
    xn, want = unfused(w, x, nw)
    assert took, "the streaming kernel declined the fold"
    assert np.array_equal(y, want), f"max |diff| {np.nanmax(np.abs(y - want)):.3e}"
    # the pair it is held to is a real RMS norm and product
    xd = x.cpu().numpy()[0].astype(np.float64)
    ref_xn = xd / np.sqrt(np.mean(xd * xd) + EPS) * nw.cpu().numpy().astype(np.float64)
    assert rel_err(xn.astype(np.float64), ref_xn) <= 1e-5
    if rows * cols <= 4 << 20:  # the float64 dequantized product of the big ones costs seconds on the host
        assert rel_err(y.astype(np.float64), dequant(qtype, raw, cols) @ ref_xn) <= TOL


@pytest.mark.parametrize("qtype,cols,rows", [
    (Q.Q8_0, 12288, 64),  # the streaming kernel takes W, not the norm (over 16 x 512 values: the scalar path)
    (Q.F16, 8200, 48),    # F16 wider than the streaming kernel: the general kernel
    (Q.Q8_0, 16640, 32),  # Q8_0 wider than the streaming kernel: the general kernel
])
def test_declined_shapes_run_the_norm_launch_first(qtype: Q, cols: int, rows: int) -> None:
    w, _ = upload(f"fold.decline.{qtype.name}.{cols}", qtype, cols, rows, cols)
    x, nw = _inputs(cols, cols)
    took, y = folded(w, x, nw)
    _, want = unfused(w, x, nw)
    assert not took
    assert np.array_equal(y, want)


def test_several_matrices_in_one_launch() -> None:
    """matvec_multi with norm_w: every segment reads the normalized x (the bits of the plain launch on it)."""
    ext = gpu.load()
    mats = [upload(f"fold.multi.{i}", Q.Q8_0, 1024, r, 50 + i)[0] for i, r in enumerate((4096, 512, 33))]
    x, nw = _inputs(1024, 7)
    xn = rms_norm_op(x, nw)
    got = [torch.full((1, w.nrows), NAN, device="cuda") for w in mats]
    want = [torch.full((1, w.nrows), NAN, device="cuda") for w in mats]
    assert ext.matvec_multi(mats, x.data_ptr(), [y.data_ptr() for y in got], False, 0.0, nw.data_ptr(), EPS)
    assert ext.matvec_multi(mats, xn.data_ptr(), [y.data_ptr() for y in want])
    torch.cuda.synchronize()
    for g, h in zip(got, want):
        assert np.array_equal(g.cpu().numpy(), h.cpu().numpy())
    with pytest.raises(ValueError):
        ext.matvec_multi(mats, x.data_ptr(), [y.data_ptr() for y in got], True, 10.0, nw.data_ptr(), EPS)
    ys = torch.full((1, 2 * mats[0].nrows), NAN, device="cuda")
    with pytest.raises(ValueError):  # the norm takes one vector
        ext.matvec(mats[0], _arr(torch.cat([x, x])), _arr(ys.view(2, -1)), 1, nw.data_ptr(), EPS)


def test_weights_mm_with_norm() -> None:
    """Weights.mm(name, x, norm=(w, eps)) == Weights.mm(name, rms_norm op(x)): one token folded (counted), two
    tokens through the norm launch."""
    from ds4.engine.gpu.weights import Weights

    mats = {"q_b": upload("fold.weights.q_b", Q.Q8_0, 1024, 4096, 3)[0],
            "idx_q_b": upload("fold.weights.idx", Q.F16, 1024, 2048, 4)[0]}

    class Resident(Weights):  # the uploaded matrices, without a model file
        def mat(self, name):
            return mats[name]

    W = Resident(None, torch.device("cuda"))
    x1, nw = _inputs(1024, 11)
    x2 = torch.cat([x1, _inputs(1024, 12)[0]])
    for name in mats:
        for x in (x1, x2):
            got = W.mm(name, x, norm=(nw, EPS))
            want = W.mm(name, rms_norm_op(x, nw))
            torch.cuda.synchronize()
            assert np.array_equal(got.cpu().numpy(), want.cpu().numpy()), (name, x.shape[0])
    assert W.folded_norms == 2  # one per matrix: the one-token products


_SESSION_SCRIPT = r"""
import sys, numpy as np
from ds4.engine.model import Model
from ds4.engine.gpu.session import Session
m = Model.load(sys.argv[1])
toks = np.random.default_rng(8).integers(2, m.config.vocab_size, 40).tolist()
s = Session(m, ctx=1024, prefill_chunk=256)
s.sync(toks[:24])
logits = np.stack([s.decode(t) for t in toks[24:]])
np.savez(sys.argv[2], logits=logits, folded=s.W.folded_norms)
"""


def _decode(gguf: Path, out: Path, fold: bool) -> dict:
    env = dict(os.environ, DS4_GPU_NORM_FOLD="1" if fold else "0")
    done = subprocess.run([sys.executable, "-c", _SESSION_SCRIPT, str(gguf), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(out))


def test_session_decode_logits_bitwise_equal(tmp_path) -> None:
    """The small q2 model (Q8_0 q_b, F16 indexer q_b; ctx 1024, so the ratio-4 layers run the indexer): decode with
    the fold gives the logits of decode without it, and the fold did take q_b's launches."""
    from conftest import quantize_cli

    gguf = tmp_path / "small.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(gguf), "--mix", "q2", "--quiet")
    on, off = _decode(gguf, tmp_path / "on.npz", True), _decode(gguf, tmp_path / "off.npz", False)
    from ds4.engine.config import preset

    cfg = preset("small")
    indexer_layers = sum(1 for i in range(cfg.n_layer) if cfg.ratio(i) == 4)
    assert int(off["folded"]) == 0
    assert int(on["folded"]) >= cfg.n_layer + indexer_layers, int(on["folded"])  # q_b + indexer q_b, one capture
    assert np.isfinite(on["logits"]).all()
    assert np.array_equal(on["logits"], off["logits"]), \
        f"max |diff| {np.max(np.abs(on['logits'] - off['logits'])):.3e}"
