"""v16's decode latency steps (engine/gpu/NOTES.md v16), each behind a switch and each the same bits as without it:
- argmax_kernel (DS4_GPU_ARGMAX): greedy decode's argmax in one launch, torch.argmax's answer (NaN first, ties to
  the first index);
- quantize_x_into + moe(xq=) (DS4_GPU_EARLY_XQ): the routed experts' x quantized beforehand, on the side stream;
- the ratio-4 compressor pooling with each column's candidates loaded together (DS4_GPU_COMPRESS_REGS);
- the indexer's head-weight matvec launched with the compressor steps (DS4_GPU_EARLY_IDX_PROJ=1; off by default:
  slower);
- index_keys_v2_kernel (DS4_GPU_INDEX_KEYS=2): lanes over the dims and the query's RoPE/QAT folded into its staging;
  its scores sum in another order, so it is held to the v15 kernel by tolerance and to norm_rope's query bitwise, at
  Flash's indexer shape (64 heads of 128; the `small` preset's 16 heads are a shape it declines).
- matvec_tma_kernel (DS4_GPU_MV_TMA, v17; default 2: launches of at most 7 MB): the batch-1 Q8_0 products with the
  weights streamed by bulk copies (its kernel-level tests: test_gpu_matvec_tma.py).
The switches are read once per process, so the session comparison runs each setting in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from ds4.engine import gpu  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and gpu.available()),
                                                  reason="needs a CUDA device and the built extension")]

# each switch and its value other than the default
SWITCHES = {"DS4_GPU_ARGMAX": "0", "DS4_GPU_EARLY_XQ": "0", "DS4_GPU_COMPRESS_REGS": "0", "DS4_GPU_EARLY_IDX_PROJ": "1",
            "DS4_GPU_MV_TMA": "1"}
# DS4_GPU_MV_TMA's default is 2 (small launches only): flipped to 1 every Q8_0 launch takes the bulk-copy kernel


@pytest.fixture(scope="module")
def K():
    from ds4.engine.gpu.fused import Fused

    ext = gpu.load()
    yield Fused(ext, torch.device("cuda"))
    ext.reset_stream()


def _argmax(K, x: torch.Tensor) -> int:
    out = torch.full((1,), -7, dtype=torch.long, device="cuda")
    K.argmax_into(x, out)
    return int(out.item())


@pytest.mark.parametrize("n", [1, 3, 5, 1000, 4097, 129280])
def test_argmax_kernel_is_torch_argmax(K, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n + 1, generator=g).cuda()
    for v in (x[:n], x[1:]):  # 16-byte aligned, and not: the float4 walk and the scalar tail
        assert _argmax(K, v) == int(torch.argmax(v))
    if n < 3:
        return
    y = x[:n].clone()
    top = float(y.max())
    y[n // 3] = y[n - 1] = top + 1.0  # a tie: the first index wins
    assert _argmax(K, y) == int(torch.argmax(y)) == n // 3
    y[n - 2] = float("nan")
    y[n // 2] = float("nan")  # NaN counts as the largest value, the first NaN wins
    assert _argmax(K, y) == int(torch.argmax(y)) == min(n // 2, n - 2)
    z = torch.full((n,), -float("inf"), device="cuda")
    assert _argmax(K, z) == int(torch.argmax(z)) == 0


def test_argmax_kernel_in_a_graph_follows_its_input(K):
    x = torch.randn(129280, device="cuda")
    out = torch.zeros(1, dtype=torch.long, device="cuda")
    K.argmax_into(x, out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.argmax_into(x, out)
    for i in (17, 99_999, 3):
        x[i] = 1e6 + i
        graph.replay()
        torch.cuda.synchronize()
        assert int(out.item()) == int(torch.argmax(x)) == i
        x[i] = 0.0


def test_moe_with_x_quantized_beforehand_gives_the_same_bits():
    from test_gpu_kernels import random_blocks

    from ds4.gguf_tools.constants import QuantType as Q

    ext = gpu.load()
    rng = np.random.default_rng(16)
    n_expert, k, n_embd, n_ff = 8, 6, 1024, 512
    gate, up = (gpu.upload(f"xqin.{i}", Q.IQ2_XXS, (n_embd, n_ff, n_expert),
                           random_blocks(Q.IQ2_XXS, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1))
                for i in range(2))
    down = gpu.upload("xqin.down", Q.Q2_K, (n_ff, n_embd, n_expert),
                      random_blocks(Q.Q2_K, n_expert * n_embd, n_ff, rng).reshape(n_expert, n_embd, -1))
    x = (rng.standard_normal((1, n_embd)) * 2.0).astype(np.float32)
    ids = rng.choice(n_expert, (1, k), replace=False).astype(np.int32)
    wts = rng.uniform(0.1, 0.5, (1, k)).astype(np.float32)
    want = gpu.moe_host(gate, up, down, x, ids, wts)
    xt = torch.from_numpy(x).cuda()
    buf = torch.full((ext.xq_bytes(1, n_embd),), 0x55, dtype=torch.uint8, device="cuda")
    ext.reset_stream()
    ext.quantize_x_into(xt.data_ptr(), 1, n_embd, buf.data_ptr())
    y = ext.Array.empty([1, n_embd])
    # x given as zeros: the kernels must read the planes in buf, not quantize x again
    ext.moe(gate, up, down, ext.Array.from_numpy(np.zeros_like(x)), ext.Array.from_numpy(ids),
            ext.Array.from_numpy(wts), y, 10.0, buf.data_ptr())
    assert np.array_equal(y.numpy().view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="one token"):  # two tokens cannot take one token's planes
        ext.moe(gate, up, down, ext.Array.from_numpy(np.repeat(x, 2, 0)), ext.Array.from_numpy(np.repeat(ids, 2, 0)),
                ext.Array.from_numpy(np.repeat(wts, 2, 0)), ext.Array.empty([2, n_embd]), 10.0, buf.data_ptr())


def _keys_inputs(seed: int, n: int = 600, Hi: int = 64, di: int = 128):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Hi, di, generator=g).cuda()
    w = torch.randn(Hi, generator=g).cuda()
    idx = torch.randn(n, di, generator=g).cuda()
    return q, w, idx


def _keys_v2(K, q, w, idx, pos, post=None):
    Hi, di = q.shape
    keys = torch.empty(idx.shape[0], dtype=torch.float64, device="cuda")
    post = post or {}
    freq = post.get("freq")
    K._stream()
    K.ext.index_keys_v2(q.data_ptr(), w.data_ptr(), idx.data_ptr(), idx.shape[0], Hi, di, pos.data_ptr(), 4, 0.01,
                        0 if freq is None else freq.data_ptr(), int(post.get("rope_dim", 0)), bool(post.get("qat")),
                        float(1.0 / np.sqrt(di)), keys.data_ptr())
    return keys


@pytest.mark.parametrize("p", [97, 2399])
def test_index_keys_v2_matches_the_v15_kernel(K, p):
    q, w, idx = _keys_inputs(p)
    pos = torch.tensor([p], device="cuda")
    old = torch.empty(idx.shape[0], dtype=torch.float64, device="cuda")
    K._stream()
    K.ext.index_keys(q.data_ptr(), w.data_ptr(), idx.data_ptr(), idx.shape[0], 64, 128, pos.data_ptr(), 4, 0.01,
                     old.data_ptr())
    new = _keys_v2(K, q, w, idx, pos)
    vis = torch.arange(idx.shape[0], device="cuda") < (p + 1) // 4
    assert torch.equal(torch.isinf(new), ~vis) and torch.equal(torch.isinf(old), ~vis)
    ref = (w.double()[:, None] * 0.01 * torch.clamp(q.double() @ idx.double().T, min=0)).sum(0)
    assert float((new[vis] - ref[vis]).abs().max() / ref[vis].abs().max()) < 1e-6
    assert float((new[vis] - old[vis]).abs().max() / old[vis].abs().max()) < 1e-6
    k = min(64, int(vis.sum()))
    assert torch.equal(torch.sort(torch.topk(new, k).indices).values, torch.sort(torch.topk(old, k).indices).values)


@pytest.mark.parametrize("qat", [False, True])
def test_index_keys_v2_folds_the_querys_norm_rope_bitwise(K, qat):
    q, w, idx = _keys_inputs(5 + qat)
    pos = torch.tensor([1234], device="cuda")
    rd = 64
    freq = (1.0 / (10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))).float().cuda()
    post = dict(freq=freq, rope_dim=rd, qat=qat)
    staged = K.norm_rope(q, 128, 64, pos, **post)  # the launch the fold replaces
    want = _keys_v2(K, staged, w, idx, pos)
    got = _keys_v2(K, q, w, idx, pos, post)
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))


SESSION = r"""
import sys, numpy as np
from ds4.engine.model import Model
from ds4.engine.gpu.session import Session
m = Model.load(sys.argv[1])
cfg = m.config
toks = np.random.default_rng(9).integers(2, cfg.vocab_size, 40).tolist()
g = Session(m, ctx=512)
g.prefill(np.random.default_rng(8).integers(2, cfg.vocab_size, 340).tolist())  # 85 rows: the top-k selects 64
# positions 340-391: a ratio-4 row pooled every 4 tokens, a ratio-128 row at 383
logits = np.stack([g.decode(t) for t in toks])
greedy = g.greedy(12)
np.savez(sys.argv[2], logits=logits, greedy=np.array(greedy))
"""


def _session_run(tmp_path: Path, model: Path, flipped: tuple[str, ...]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    env["DS4_GPU_COMPILE"] = "0"  # the same elementwise code in every run, without torch.compile's time
    for name in flipped:
        env[name] = SWITCHES[name]
    out = tmp_path / f"session_{'_'.join(flipped) or 'default'}.npz"
    done = subprocess.run([sys.executable, "-c", SESSION, str(model), str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(out))


def test_decode_session_is_bitwise_the_same_with_each_switch_flipped(tmp_path):
    """small (q2 layout, ratio-4 layers with an indexer) through the session's graphs: under the defaults, with each
    switch flipped, and with all flipped, the logits are the same bits and greedy picks the same tokens."""
    from conftest import quantize_cli

    model = tmp_path / "small.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(model), "--mix", "q2", "--quiet")
    base = _session_run(tmp_path, model, ())
    assert np.isfinite(base["logits"]).all()
    for flipped in [(s,) for s in SWITCHES] + [tuple(SWITCHES)]:
        got = _session_run(tmp_path, model, flipped)
        assert np.array_equal(got["logits"].view(np.uint32), base["logits"].view(np.uint32)), flipped
        assert got["greedy"].tolist() == base["greedy"].tolist(), flipped
