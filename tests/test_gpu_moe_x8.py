"""The routed experts' 8-bit activations (DS4_GPU_MOE_X8, ext.set_moe_x8): x and h quantized per 32 columns with the hi
plane only (x = s hi, s = amax / 127), as ds4 quantizes its expert activations (model-spec §3.9). Decode's gate/up and
down kernels and prefill's mmq skip the lo plane. Each is held to a float64 reference on the 8-bit activation, where
the K-quants' min terms take the exact 16-column sums (as the kernels do); prefill and decode are compared in the session,
and the `small` session is held near the CPU engine (8 bits cost ~1e-2 there, so the switch is off by default)."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

from test_gpu_kernels import dequant, random_blocks, rel_err
from test_gpu_mmq import small_reference  # noqa: F401  (the module-scoped fixture: small and the CPU engine's logits)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]


def x8(x: np.ndarray) -> np.ndarray:
    import torch

    from ds4.engine.gpu import ops

    return ops.quantize_hilo(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), hi_only=True).numpy() \
        .astype(np.float64)


def split_mins(qtype: Q, raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale part, min part) of the dequantized rows: the min part is the dequantization with every code zeroed."""
    if qtype not in (Q.Q2_K, Q.Q4_K):
        return dequant(qtype, raw, cols), np.zeros((raw.shape[0], cols))
    if qtype == Q.Q2_K:
        from ds4.gguf_tools.quants.q2_k import BLOCK_BYTES, BLOCK_DTYPE
    else:
        from ds4.gguf_tools.quants.q4_k import BLOCK_BYTES, BLOCK_DTYPE
    zeroed = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, BLOCK_BYTES).copy()
    blocks = zeroed.view(BLOCK_DTYPE)
    blocks["qs"] = 0
    mins = dequant(qtype, zeroed.reshape(raw.shape), cols)
    return dequant(qtype, raw, cols) - mins, mins


def product_x8(qtype: Q, raw: np.ndarray, cols: int, x: np.ndarray) -> np.ndarray:
    """rows . x as the 8-bit kernels form it: codes times the 8-bit x, minus the min terms on the exact x."""
    scale, mins = split_mins(qtype, raw, cols)
    return x8(x) @ scale.T + x.astype(np.float64) @ mins.T


def moe_x8_reference(raws, qg: Q, qd: Q, x: np.ndarray, ids, wts, clamp: float) -> tuple[np.ndarray, np.ndarray]:
    """(h [T k, n_ff], y [T, n_embd]) with x and h on 8 bits; h's quantization takes the float64 h."""
    gate_raw, up_raw, down_raw = raws
    T, k = ids.shape
    n_ff, n_embd = gate_raw.shape[1], x.shape[1]
    h = np.zeros((T * k, n_ff))
    y = np.zeros((T, n_embd))
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            g = np.minimum(product_x8(qg, gate_raw[e], n_embd, x[t:t + 1])[0], clamp)
            u = np.clip(product_x8(qg, up_raw[e], n_embd, x[t:t + 1])[0], -clamp, clamp)
            h[t * k + j] = g / (1.0 + np.exp(-g)) * u * wts[t, j]
            y[t] += product_x8(qd, down_raw[e], n_ff, h[t * k + j:t * k + j + 1])[0]
    return h, y


@pytest.fixture
def ext_x8():
    ext = gpu.load()
    ext.set_moe_x8(1)
    try:
        yield ext
    finally:
        ext.set_moe_x8(-1)


@pytest.mark.parametrize("qg,qd,n_embd,n_ff", [(Q.IQ2_XXS, Q.Q2_K, 4096, 2048), (Q.Q4_K, Q.Q4_K, 2048, 1024),
                                              (Q.Q8_0, Q.IQ2_XXS, 1024, 512)])
def test_x8_decode_moe_matches_the_8bit_reference(ext_x8, qg, qd, n_embd, n_ff):
    """gate/up's h within 1e-5 of the reference; y within 1e-3 (a value of h within float32 rounding of a rounding
    boundary may quantize one step apart, ~5e-4 in y), while the 16-bit path is ~1e-2 away from that reference, which
    says the 8-bit path ran."""
    ext = ext_x8
    n_expert, k = 8, 6
    rng = np.random.default_rng(int(qg) * 7 + int(qd))
    raws = [random_blocks(qg, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1) for _ in range(2)]
    raws.append(random_blocks(qd, n_expert * n_embd, n_ff, rng).reshape(n_expert, n_embd, -1))
    gate = gpu.upload(f"blk.1.ffn_gate_exps.x8{qg.name}", qg, (n_embd, n_ff, n_expert), raws[0])
    up = gpu.upload(f"blk.1.ffn_up_exps.x8{qg.name}", qg, (n_embd, n_ff, n_expert), raws[1])
    down = gpu.upload(f"blk.1.ffn_down_exps.x8{qd.name}", qd, (n_ff, n_embd, n_expert), raws[2])
    for T in (1, 3):
        x = (rng.standard_normal((T, n_embd)) * 2.0).astype(np.float32)
        ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)]).astype(np.int32)
        wts = rng.uniform(0.1, 0.5, (T, k)).astype(np.float32)
        h_ref, y_ref = moe_x8_reference(raws, qg, qd, x, ids, wts, 10.0)
        args = (ext.Array.from_numpy(x), ext.Array.from_numpy(ids), ext.Array.from_numpy(wts))
        h = ext.Array.empty([T * k, n_ff])
        ext.moe_gateup(gate, up, *args, h, 10.0)
        y = ext.Array.empty([T, n_embd])
        y.fill(float("nan"))
        ext.moe(gate, up, down, *args, y, 10.0)
        ext.synchronize()
        assert rel_err(h.numpy(), h_ref) <= 1e-5, f"h T={T}: {rel_err(h.numpy(), h_ref):.2e}"
        assert rel_err(y.numpy(), y_ref) <= 1e-3, f"y T={T}: {rel_err(y.numpy(), y_ref):.2e}"
        ext.set_moe_x8(0)
        y16 = ext.Array.empty([T, n_embd])
        ext.moe(gate, up, down, *args, y16, 10.0)
        ext.synchronize()
        ext.set_moe_x8(1)
        assert rel_err(y16.numpy(), y_ref) > 3 * rel_err(y.numpy(), y_ref)


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.Q2_K, Q.Q4_K, Q.Q8_0])
def test_x8_mmq_experts_match_the_8bit_reference(ext_x8, qtype):
    import torch

    from ds4.engine.gpu.moe_gemm import expert_tiles

    ext = ext_x8
    rng = np.random.default_rng(17 + int(qtype))
    n_embd, n_ff, n_expert = 512, 200, 10
    raw = random_blocks(qtype, n_ff * n_expert, n_embd, rng)
    w = gpu.upload(f"blk.0.ffn_gate_exps.x8mmq{qtype.name}", qtype, (n_embd, n_ff, n_expert), raw)
    counts = [3, 0, 150, 1, 64, 65, 1, 20, 128, 129]
    x = (rng.standard_normal((sum(counts), n_embd)) * 3.0).astype(np.float32)
    tiles = torch.tensor(expert_tiles(counts, ext.mmq_tile_rows()), dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()  # torch's copy runs on its stream; the extension's own stream does not wait for it
    y = ext.Array.empty([sum(counts), n_ff])
    y.fill(float("nan"))
    assert ext.mmq_experts(w, ext.Array.from_numpy(x), tiles.data_ptr(), tiles.shape[0], y)
    raw3 = raw.reshape(n_expert, n_ff, -1)
    expert = np.repeat(np.arange(n_expert), counts)
    ref = np.concatenate([product_x8(qtype, raw3[e], n_embd, x[expert == e]) for e in range(n_expert)
                          if (expert == e).any()])
    err = rel_err(y.numpy(), ref)
    assert err <= 1e-5, f"{qtype.name}: rel err {err:.2e}"


def test_x8_session_against_the_cpu_engine(small_reference):
    """`small` (IQ2_XXS / Q2_K experts), 600 tokens in chunks of 256 with mmq on the routed experts, then 8 decode
    steps. The 8-bit activations cost precision: on the H200 (v19) the logits landed 7.6e-3 from the CPU engine (which
    keeps float activations; the 16-bit path: 3e-5), and decode 5.9e-3 from a prefill of the same tokens, since a
    value within float rounding of a rounding boundary of its 8-bit grid moves a whole step (s = amax / 127) where the
    16-bit grid moves s / 254. That is why the switch is off by default. Held here: within 3e-2 of the CPU engine, and
    the 8-bit path further from it than the 16-bit one, so a kernel that ignores the switch or breaks fails."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    from ds4.engine.gpu.session import Session as GpuSession

    ext = gpu.load()
    m, toks, want = small_reference
    extra = np.random.default_rng(9).integers(2, m.config.vocab_size, 8).tolist()
    errs = {}
    for mode in (1, 0):
        ext.set_moe_x8(mode)
        try:
            g = GpuSession(m, ctx=1024, prefill_chunk=256)
            got = g.sync(toks)
            for t in extra:
                dec = g.decode(t)
            pre = GpuSession(m, ctx=1024, prefill_chunk=256).sync(toks + extra)
        finally:
            ext.set_moe_x8(-1)
        errs[mode] = (float(np.linalg.norm(got - want) / np.linalg.norm(want)),
                      float(np.linalg.norm(dec - pre) / np.linalg.norm(pre)))
    print(f"\nsmall against the CPU engine / decode against prefill: 8-bit {errs[1][0]:.2e} / {errs[1][1]:.2e}, "
          f"16-bit {errs[0][0]:.2e} / {errs[0][1]:.2e}")
    assert errs[1][0] <= 3e-2 and errs[1][1] <= 3e-2
    assert errs[0][0] <= 1e-3 and errs[0][1] <= 1e-3
    assert errs[1][0] > 3 * errs[0][0]
