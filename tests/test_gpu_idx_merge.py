"""The indexer's small decode launches merged into the main chain's (DS4_GPU_IDX_MERGE, fused.idx_merged).

- matvec_multi now takes Q8_0 and F16 matrices of one width in one launch (matvec_pair_kernel): every output must be
  BITWISE the one-type launch of that matrix alone (the same x staging, the same per-row summation order), with and
  without the folded RMS norm, and it must be a real product (float64 reference).
- norm_rope takes a third job: the three jobs' outputs are those of three separate launches, bit for bit.
- The small q2 model (Q8_0 q_b and q_a/kv, F16 indexer q_b and proj) decodes the same logits, bit for bit, with the
  merges on and off (a subprocess each: the switch is read once), and with them on a decode step runs the pair kernel
  once per indexed layer and no separate indexer q_b matvec or query norm_rope (with qb), nor proj matvec (with
  comp).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

from test_gpu_kernels import TOL, dequant, rel_err
from test_gpu_norm_fold import EPS, NAN, _arr, _inputs as _x, upload as _upload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason())),
              pytest.mark.usefixtures("ext_on_torch_stream")]

torch = pytest.importorskip("torch")


def _alone(w, x: torch.Tensor, nw: torch.Tensor | None) -> np.ndarray:
    y = torch.full((1, w.nrows), NAN, device="cuda")
    gpu.load().matvec(w, _arr(x), _arr(y), 1, 0 if nw is None else nw.data_ptr(), EPS)
    torch.cuda.synchronize()
    return y.cpu().numpy()[0]


# (cols, [(type, rows)]): decode's two pairs at Flash width (q_b + indexer q_b; q_a + kv + indexer proj), the
# `small` preset's, and an F16 matrix listed first
PAIR_CASES = [
    (1024, [(Q.Q8_0, 32768), (Q.F16, 8192)]),
    (4096, [(Q.Q8_0, 1024), (Q.Q8_0, 512), (Q.F16, 64)]),
    (256, [(Q.Q8_0, 4096), (Q.F16, 2048)]),
    (512, [(Q.F16, 16), (Q.Q8_0, 256), (Q.Q8_0, 512)]),
]


@pytest.mark.parametrize("split", [0, 1])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("cols,mats", PAIR_CASES)
def test_mixed_types_in_one_launch_give_the_bits_of_each_alone(cols: int, mats, norm: bool, split: int) -> None:
    """split (ext.set_pair_split, DS4_GPU_PAIR_SPLIT): the CTAs' warps split between the two types instead of one phase
    after the other; the same bits either way."""
    ext = gpu.load()
    up = [_upload(f"pair.{cols}.{i}.{t.name}", t, cols, r, 7 * cols + i) for i, (t, r) in enumerate(mats)]
    ws = [w for w, _ in up]
    x, nw = _x(cols, cols)
    ys = [torch.full((1, w.nrows), NAN, device="cuda") for w in ws]
    ext.set_pair_split(split)
    try:
        took = ext.matvec_multi(ws, x.data_ptr(), [y.data_ptr() for y in ys], False, 0.0,
                                nw.data_ptr() if norm else 0, EPS)
        torch.cuda.synchronize()
    finally:
        ext.set_pair_split(-1)
    assert took, "the pair kernel declined a Q8_0 + F16 set"
    xd = x.cpu().numpy()[0].astype(np.float64)
    if norm:
        xd = xd / np.sqrt(np.mean(xd * xd) + EPS) * nw.cpu().numpy().astype(np.float64)
    for (t, rows), (w, raw), y in zip(mats, up, ys):
        got = y.cpu().numpy()[0]
        want = _alone(w, x, nw if norm else None)
        assert np.array_equal(got, want), f"{t.name} {rows}x{cols}: max |diff| {np.nanmax(np.abs(got - want)):.3e}"
        if rows * cols <= 4 << 20:
            assert rel_err(got.astype(np.float64), dequant(t, raw, cols) @ xd) <= TOL


def test_five_segments_in_one_launch() -> None:
    """A ratio-4 layer's four F16 compressor matrices and the indexer's proj (64 rows) read a in one launch: each
    product is its launch alone, bit for bit."""
    ext = gpu.load()
    up = [_upload(f"five.{i}", Q.F16, 4096, r, 90 + i) for i, r in enumerate((1024, 1024, 256, 256, 64))]
    x, _ = _x(4096, 5)
    ys = [torch.full((1, w.nrows), NAN, device="cuda") for w, _ in up]
    assert ext.matvec_multi([w for w, _ in up], x.data_ptr(), [y.data_ptr() for y in ys])
    torch.cuda.synchronize()
    for (w, _), y in zip(up, ys):
        assert np.array_equal(y.cpu().numpy()[0], _alone(w, x, None)), w.name


def test_pair_declines_other_types() -> None:
    """A K-quant beside F16 is not the pair kernel's: nothing is launched, the caller falls back."""
    ext = gpu.load()
    ws = [_upload("pair.q2k", Q.Q2_K, 1024, 256, 1)[0], _upload("pair.f16", Q.F16, 1024, 256, 2)[0]]
    x, _ = _x(1024, 3)
    ys = [torch.full((1, 256), NAN, device="cuda") for _ in ws]
    assert not ext.matvec_multi(ws, x.data_ptr(), [y.data_ptr() for y in ys])
    torch.cuda.synchronize()
    assert all(torch.isnan(y).all() for y in ys)


def test_norm_rope_three_jobs_equal_three_launches() -> None:
    """The decode query heads (norm + RoPE), the KV ring row (norm, weight, RoPE, FP8) and the indexer's query heads
    (RoPE + Hadamard/FP4 QAT) in one launch: each output is its separate launch's."""
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(5)
    H, d, Hi, di, rd, cap = 8, 512, 16, 128, 64, 32
    freq = (1.0 / (10000.0 ** (torch.arange(0, rd, 2, device="cuda", dtype=torch.float32) / rd))).contiguous()
    pos = torch.tensor([37], device="cuda")
    q = torch.randn((1, H * d), generator=g, device="cuda")
    kv = torch.randn((1, d), generator=g, device="cuda")
    qi = torch.randn((1, Hi * di), generator=g, device="cuda")
    w = 1.0 + 0.1 * torch.randn(d, generator=g, device="cuda")
    q_kw = dict(norm=True, eps=EPS, freq=freq, rope_dim=rd)
    kv_kw = dict(norm=True, w=w, eps=EPS, freq=freq, rope_dim=rd, fp8_nope=d - rd, ring_cap=cap)
    qi_kw = dict(freq=freq, rope_dim=rd, qat=True)

    ring_a = torch.full((cap, d), NAN, device="cuda")
    qi_a = torch.full((Hi, di), NAN, device="cuda")
    out_a = K.norm_rope(q, d, H, pos, **q_kw, also=[dict(x=kv, d=d, rows_per_token=1, out=ring_a, **kv_kw),
                                                    dict(x=qi, d=di, rows_per_token=Hi, out=qi_a, **qi_kw)])
    ring_b = torch.full((cap, d), NAN, device="cuda")
    out_b = K.norm_rope(q, d, H, pos, **q_kw)
    K.norm_rope(kv, d, 1, pos, out=ring_b, **kv_kw)
    qi_b = K.norm_rope(qi, di, Hi, pos, **qi_kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out_a).all() and torch.isfinite(qi_a).all() and torch.isfinite(ring_a[37 % cap]).all()
    assert torch.equal(out_a, out_b)
    assert torch.equal(qi_a, qi_b.reshape(Hi, di))
    assert torch.equal(ring_a[37 % cap], ring_b[37 % cap])
    with pytest.raises(ValueError):
        K.norm_rope(q, d, H, pos, **q_kw, also=[dict(x=kv, d=d, rows_per_token=1, out=ring_a, **kv_kw)] * 3)


_SESSION_SCRIPT = r"""
import sys, numpy as np, torch
from torch.profiler import ProfilerActivity, profile
from ds4.engine.model import Model
from ds4.engine.gpu.session import Session
m = Model.load(sys.argv[1])
toks = np.random.default_rng(8).integers(2, m.config.vocab_size, 340).tolist()
s = Session(m, ctx=1024, prefill_chunk=256)
s.sync(toks[:300])  # past 4 x 64 rows: the ratio-4 layers' top-k selects
logits = np.stack([s.decode(t) for t in toks[300:]])
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    s.decode(toks[0])
    torch.cuda.synchronize()
names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
np.savez(sys.argv[2], logits=logits, pair=sum("matvec_pair" in n for n in names),
         norm_rope=sum("norm_rope" in n for n in names), kernels=len(names))
"""


def _decode(gguf: Path, out: Path, merge: str) -> dict:
    env = dict(os.environ, DS4_GPU_IDX_MERGE=merge)
    done = subprocess.run([sys.executable, "-c", _SESSION_SCRIPT, str(gguf), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {k: v for k, v in np.load(out).items()}


@pytest.fixture(scope="module")
def small_q2(tmp_path_factory) -> Path:
    from conftest import quantize_cli

    gguf = tmp_path_factory.mktemp("idx_merge") / "small.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(gguf), "--mix", "q2", "--quiet")
    return gguf


@pytest.fixture(scope="module")
def unmerged(small_q2, tmp_path_factory) -> dict:
    return _decode(small_q2, tmp_path_factory.mktemp("idx_merge_off") / "off.npz", "0")


# (switch, pair launches and launches saved per indexed layer): qb merges q_b and the norm_rope jobs, comp (with qb the
# default) adds the indexer's proj to the compressors' launch
@pytest.mark.parametrize("merge,pairs,saved", [("qb", 1, 2), ("qb,comp", 1, 3), ("comp", 0, 1)])
def test_session_decode_logits_bitwise_equal(small_q2, unmerged, tmp_path, merge: str, pairs: int, saved: int) -> None:
    from ds4.engine.config import preset

    on, off = _decode(small_q2, tmp_path / "on.npz", merge), unmerged
    cfg = preset("small")
    indexed = sum(1 for i in range(cfg.n_layer) if cfg.ratio(i) == 4)  # ctx 1024: 256 rows > top-k 64 each
    assert np.isfinite(on["logits"]).all()
    assert np.array_equal(on["logits"], off["logits"]), \
        f"max |diff| {np.max(np.abs(on['logits'] - off['logits'])):.3e}"
    assert int(off["pair"]) == 0
    assert int(on["pair"]) == pairs * indexed, (int(on["pair"]), indexed)
    # the indexer query's own launch is gone with qb
    assert int(on["norm_rope"]) == int(off["norm_rope"]) - indexed * ("qb" in merge)
    assert int(on["kernels"]) == int(off["kernels"]) - saved * indexed
