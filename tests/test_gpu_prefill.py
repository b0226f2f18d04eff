"""The prefill GEMM path of the CUDA engine (engine/gpu/dequant.cu, weights.Weights._gemm/_moe_gemm) against
the numpy dequantize-then-matmul reference, on fresh random GGUF blocks. Skipped without a CUDA device.

The dequantized f16 rows must equal the reference values rounded to f16 (one rounding step), and
their hi + lo split the values to ~22 bits; the products (hi/lo f16 operands, f32 accumulation) must
agree with the float64 reference to 1e-5 (the single-pass DS4_GPU_PREFILL_GEMM=f16 mode: 1e-3).
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine import gpu
from ds4.gguf_tools.constants import QuantType as Q

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason=str(gpu.unavailable_reason()))]
torch = pytest.importorskip("torch")

from ds4.engine.gpu.weights import EXACT_GEMM  # noqa: E402
from test_gpu_kernels import TOL, dequant, moe_reference, random_blocks, rel_err  # noqa: E402


@pytest.fixture(autouse=True)
def _own_stream():
    yield
    gpu.load().reset_stream()  # Weights points the extension at torch's stream; later tests capture on its own


def _weights():
    from ds4.engine.gpu.weights import Weights

    return Weights(None, torch.device("cuda"))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q2_K, Q.IQ2_XXS, Q.F16])
def test_dequant_rows_equal_the_reference_in_f16(qtype: Q) -> None:
    rows, cols = 96, 1024
    rng = np.random.default_rng(int(qtype) + 40)
    raw = random_blocks(qtype, rows, cols, rng)
    w = gpu.upload(f"dq.{qtype.name}", qtype, (cols, rows), raw)
    ref = dequant(qtype, raw, cols)
    ext = gpu.load()
    out = torch.full((rows, cols), float("nan"), dtype=torch.float16, device="cuda")
    ext.dequant(w, out.data_ptr())
    torch.cuda.synchronize()
    got = out.double().cpu().numpy()
    # one f16 rounding of the exact value (half an ulp, 2^-11 relative), or the subnormal step near 0
    assert np.all(np.abs(got - ref) <= 2.0 ** -11 * np.abs(ref) + 6e-8), qtype.name
    # a row range into a wider buffer: other rows and the padding columns stay untouched
    wide = torch.full((rows, cols + 64), -7.0, dtype=torch.float16, device="cuda")
    ext.dequant(w, wide.data_ptr(), row0=10, nrows=20, ld=cols + 64)
    torch.cuda.synchronize()
    part = wide.double().cpu().numpy()
    np.testing.assert_array_equal(part[:20, :cols], got[10:30])
    assert (part[:, cols:] == -7.0).all() and (part[20:] == -7.0).all()
    with pytest.raises(ValueError, match="rows out of range"):
        ext.dequant(w, wide.data_ptr(), row0=90, nrows=20)
    if qtype == Q.F16:
        return
    # hi + lo parts of the value times 2^10: the exact GEMMs' operand, ~22 significant bits
    lo = torch.full((rows, cols), float("nan"), dtype=torch.float16, device="cuda")
    ext.dequant(w, out.data_ptr(), lo.data_ptr(), 1024.0)
    torch.cuda.synchronize()
    both = (out.double() + lo.double()).cpu().numpy() / 1024.0
    assert np.all(np.abs(both - ref) <= 2.0 ** -20 * np.abs(ref) + 1e-10), qtype.name


@pytest.mark.parametrize("qtype,groups", [(Q.Q8_0, 1), (Q.Q8_0, 8), (Q.F16, 1), (Q.Q2_K, 1)])
def test_gemm_matches_the_reference(qtype: Q, groups: int) -> None:
    rows, cols, T = 512, 1024, 40
    rng = np.random.default_rng(int(qtype) * 10 + groups)
    raw = random_blocks(qtype, rows, cols, rng)
    w = gpu.upload(f"gemm.{qtype.name}.{groups}", qtype, (cols, rows), raw)
    x = rng.standard_normal((T, groups * cols)).astype(np.float32)
    x[:, :64] *= 300.0  # magnitudes far outside f16's comfortable range get scaled per row
    wd = dequant(qtype, raw, cols)
    per = rows // groups
    ref = np.concatenate([x[:, g * cols:(g + 1) * cols].astype(np.float64) @ wd[g * per:(g + 1) * per].T
                          for g in range(groups)], axis=1)
    got = _weights()._gemm(w, torch.from_numpy(x).cuda(), groups).cpu().numpy()
    err = rel_err(got.astype(np.float64), ref)
    assert err <= (1e-5 if EXACT_GEMM else TOL), f"{qtype.name} groups={groups}: rel err {err:.2e}"


def test_mm_split_per_group_matches_the_gemm() -> None:
    """The grouped product from a producer's split with one scale per row and group (the fused attention's output)
    equals the product of the float32 rows to float32 rounding, and keeps a tiny group's own precision."""
    from ds4.engine.gpu.weights import EXACT_GEMM, to_half

    rows, cols, groups, T = 512, 1024, 8, 40
    rng = np.random.default_rng(81)
    raw = random_blocks(Q.Q8_0, rows, cols, rng)
    W = _weights()
    W._mats["o_a"] = gpu.upload("gemm.split.o_a", Q.Q8_0, (cols, rows), raw)
    x = torch.from_numpy(rng.standard_normal((T, groups * cols)).astype(np.float32)).cuda()
    x[:, 3 * cols:4 * cols] *= 1e-4  # a small group beside large ones
    hi, lo, s = to_half(x.view(T, groups, cols), EXACT_GEMM)
    got = W.mm_split("o_a", (hi.reshape(T, -1), None if lo is None else lo.reshape(T, -1), s.reshape(T, groups)),
                     groups)
    wd = dequant(Q.Q8_0, raw, cols)
    per = rows // groups
    xn = x.cpu().numpy().astype(np.float64)
    ref = np.concatenate([xn[:, g * cols:(g + 1) * cols] @ wd[g * per:(g + 1) * per].T for g in range(groups)], 1)
    g3 = slice(3 * per, 4 * per)
    assert rel_err(got.cpu().numpy().astype(np.float64), ref) <= (1e-5 if EXACT_GEMM else TOL)
    assert rel_err(got[:, g3].cpu().numpy().astype(np.float64), ref[:, g3]) <= (1e-5 if EXACT_GEMM else TOL)
    with pytest.raises(ValueError, match="mm_split"):
        W.mm_split("o_a", (hi.reshape(T, -1), lo, s.reshape(T, groups)[:, :4]), groups)


@pytest.mark.parametrize("fp8", [False, True])
def test_mm_split_then_in_one_split_launch_gives_the_same_bits(monkeypatch, fp8: bool) -> None:
    """mm_split_then with DS4_GPU_SPLIT_GROUPS (split_groups: the grouped product's rescale and the next product's
    split in one launch, the float8 operand in place of lo where the second product takes it) against the two-step
    form, bit for bit; and the kernel's own planes against to_half / pack_x of the rescaled rows."""
    from ds4.engine.gpu import fp8_split
    from ds4.engine.gpu import weights as Wm

    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 GEMMs need compute capability 8.9")
    monkeypatch.setattr(Wm, "FP8_GEMM", fp8)
    monkeypatch.setattr(Wm, "FP8_MIN", 0)
    rows_a, cols_a, groups, T = 1024, 512, 4, 48  # o_a-like: 4 groups of 512 -> 256; o_b-like: 1024 -> 384
    rng = np.random.default_rng(83 + fp8)
    W = _weights()
    raw_a, raw_b = random_blocks(Q.Q8_0, rows_a, cols_a, rng), random_blocks(Q.Q8_0, 384, rows_a, rng)
    W._mats["a"] = gpu.upload(f"split_then.a.{fp8}", Q.Q8_0, (cols_a, rows_a), raw_a)
    W._mats["b"] = gpu.upload(f"split_then.b.{fp8}", Q.Q8_0, (rows_a, 384), raw_b)
    x = torch.from_numpy(rng.standard_normal((T, groups * cols_a)).astype(np.float32)).cuda()
    hi, lo, s = Wm.to_half(x.view(T, groups, cols_a), True)
    split = (hi.reshape(T, -1), lo.reshape(T, -1), s.reshape(T, groups))
    monkeypatch.setattr(Wm, "SPLIT_GROUPS", False)
    want = W.mm_split_then("a", split, groups, "b")
    monkeypatch.setattr(Wm, "SPLIT_GROUPS", True)
    got = W.mm_split_then("a", split, groups, "b")
    assert torch.equal(got, want)
    # the kernel's planes
    y, r = W._mm_split_groups("a", split, groups)
    G, _, n = y.shape
    rows = (y.transpose(0, 1) * r[:, :, None]).reshape(T, G * n)
    want_hi, want_lo, want_s = Wm.to_half(rows, True)
    ext = gpu.load()
    xh = torch.empty_like(want_hi)
    xl = torch.empty_like(want_hi)
    a8 = torch.empty((T, 2 * G * n), dtype=fp8_split.E4M3, device="cuda")
    s2 = torch.empty_like(want_s)
    W._sync_stream()
    ext.split_groups(y.contiguous().data_ptr(), r.contiguous().data_ptr(), G, T, n, xh.data_ptr(), xl.data_ptr(), 0,
                     s2.data_ptr())
    torch.cuda.synchronize()
    assert torch.equal(xh, want_hi) and torch.equal(xl, want_lo) and torch.equal(s2, want_s)
    ext.split_groups(y.contiguous().data_ptr(), r.contiguous().data_ptr(), G, T, n, xh.data_ptr(), 0, a8.data_ptr(),
                     s2.data_ptr())
    torch.cuda.synchronize()
    assert torch.equal(a8.view(torch.uint8), fp8_split.pack_x(want_hi, want_lo).view(torch.uint8))
    with pytest.raises(ValueError, match="split_groups"):
        ext.split_groups(y.data_ptr(), r.data_ptr(), G, T, n, xh.data_ptr(), xl.data_ptr(), a8.data_ptr(), s2.data_ptr())


N_EXPERT = 16


def _moe_case(mix: str, seed: int, n_choice: int = N_EXPERT):
    """Random experts on the device, a chunk of 40 tokens routed among the first n_choice of them (one expert
    much busier than the rest: past the padded batch's cap), the float64 reference: (moe args, ref, ids)."""
    qg, qd = (Q.IQ2_XXS, Q.Q2_K) if mix == "q2" else (Q.Q4_K, Q.Q4_K)
    n_embd, n_ff, n_expert, k, T = 1024, 512, N_EXPERT, 6, 40
    rng = np.random.default_rng(seed)
    gate_raw = random_blocks(qg, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1)
    up_raw = random_blocks(qg, n_expert * n_ff, n_embd, rng).reshape(n_expert, n_ff, -1)
    down_raw = random_blocks(qd, n_expert * n_embd, n_ff, rng).reshape(n_expert, n_embd, -1)
    gate = gpu.upload("blk.1.ffn_gate_exps.weight", qg, (n_embd, n_ff, n_expert), gate_raw)
    up = gpu.upload("blk.1.ffn_up_exps.weight", qg, (n_embd, n_ff, n_expert), up_raw)
    down = gpu.upload("blk.1.ffn_down_exps.weight", qd, (n_ff, n_embd, n_expert), down_raw)
    x = rng.standard_normal((T, n_embd)).astype(np.float32) * 2.0
    ids = np.stack([rng.choice(n_choice, k, replace=False) for _ in range(T)]).astype(np.int32)
    ids[:30, 0] = 3
    wts = rng.uniform(0.1, 0.5, (T, k)).astype(np.float32)
    ref = moe_reference(gate_raw, up_raw, down_raw, qg, qd, x.astype(np.float64), ids, wts, 10.0)
    dev = torch.device("cuda")
    args = (gate, up, down, torch.from_numpy(x).to(dev), torch.from_numpy(ids).long().to(dev),
            torch.from_numpy(wts).to(dev), 10.0)
    return args, ref, ids


@pytest.mark.parametrize("mix,cap_factor", [("q2", 2.0), ("q4", 2.0), ("q2", 1.0), ("q2", 0.25)])
def test_moe_gemm_matches_the_reference(mix: str, cap_factor: float, monkeypatch) -> None:
    """cap_factor (DS4_GPU_MOE_CAP): smaller ones send more of each expert's rows to the overflow GEMMs."""
    from ds4.engine.gpu import weights as gw

    monkeypatch.setattr(gw, "MOE_CAP_FACTOR", cap_factor)
    args, ref, _ = _moe_case(mix, 50 if mix == "q2" else 51)
    got = _weights()._moe_gemm(*args)
    err = rel_err(got.cpu().numpy().astype(np.float64), ref)
    assert err <= (1e-5 if EXACT_GEMM else TOL), f"moe gemm {mix} cap x{cap_factor}: rel err {err:.2e}"


@pytest.mark.parametrize("mix,spread,small,round_to", [("q2", 1.25, 64, 1), ("q4", 1.25, 64, 1), ("q2", 1.0, 0, 1),
                                                       ("q2", 100.0, 0, 1), ("q2", 1.25, 64, 16)])
def test_bucketed_moe_gemm_matches_the_reference(mix: str, spread: float, small: int, round_to: int,
                                                 monkeypatch) -> None:
    """The bucketed routed experts (moe_gemm.routed_experts): spread 1 and no small bucket give one bucket per
    distinct count (plain GEMMs for single experts), 100 puts every expert into one batched GEMM; one expert is
    much busier than the rest and one gets no token (it is neither dequantized nor multiplied); round_to 16: caps
    rounded up (DS4_GPU_MOE_ROUND), more zero rows."""
    from ds4.engine.gpu import moe_gemm

    args, ref, ids = _moe_case(mix, 52 if mix == "q2" else 53, n_choice=N_EXPERT - 1)
    counts = np.bincount(ids.reshape(-1), minlength=N_EXPERT).tolist()
    used, buckets, rows = moe_gemm.plan_buckets(counts, spread, small, round_to)
    assert N_EXPERT - 1 not in used and sorted(used) == [e for e in range(N_EXPERT) if counts[e]]
    assert rows == sum(b.slots * b.cap for b in buckets) >= sum(counts)
    if spread == 100.0:
        assert len(buckets) == 1
    elif spread == 1.0 and round_to == 1:
        assert len(buckets) == len(set(counts) - {0})
    monkeypatch.setattr(moe_gemm, "SPREAD", spread)
    monkeypatch.setattr(moe_gemm, "SMALL_ROWS", small)
    monkeypatch.setattr(moe_gemm, "ROUND", round_to)
    got = moe_gemm.routed_experts(_weights(), *args)
    err = rel_err(got.cpu().numpy().astype(np.float64), ref)
    assert err <= (1e-5 if EXACT_GEMM else TOL), f"bucketed moe gemm {mix} spread {spread}: rel err {err:.2e}"


def test_dequant_block_map_permutes_whole_experts() -> None:
    """dequant with a block map writes expert block_map[b] as output block b, bit for bit the plain rows."""
    rng = np.random.default_rng(54)
    n_in, n_out, n_expert = 512, 64, 6
    raw = random_blocks(Q.IQ2_XXS, n_expert * n_out, n_in, rng).reshape(n_expert, n_out, -1)
    w = gpu.upload("blk.1.ffn_gate_exps.weight", Q.IQ2_XXS, (n_in, n_out, n_expert), raw)
    W = _weights()
    plain = torch.empty((n_expert * n_out, n_in), dtype=torch.float16, device="cuda")
    plain_lo = torch.empty_like(plain)
    W.ext.dequant(w, plain.data_ptr(), plain_lo.data_ptr(), 1024.0)
    order = [4, 1, 5]
    block_map = torch.tensor(order, dtype=torch.int32, device="cuda")
    hi = torch.empty((len(order) * n_out, n_in), dtype=torch.float16, device="cuda")
    lo = torch.empty_like(hi)
    W.ext.dequant(w, hi.data_ptr(), lo.data_ptr(), 1024.0, 0, len(order) * n_out, -1, block_map.data_ptr(), n_out)
    want = plain.view(n_expert, n_out, n_in)[order].reshape(-1, n_in)
    want_lo = plain_lo.view(n_expert, n_out, n_in)[order].reshape(-1, n_in)
    assert torch.equal(hi, want) and torch.equal(lo, want_lo)
    with pytest.raises(ValueError, match="whole blocks"):
        W.ext.dequant(w, hi.data_ptr(), lo.data_ptr(), 1024.0, 0, n_out + 1, -1, block_map.data_ptr(), n_out)


# float4 rows held in registers (n <= 8192), the scalar form (n % 4 != 0), float4 rows read twice (n > 8192)
@pytest.mark.parametrize("n", [1000, 1001, 4096, 8192, 8196])
def test_split_half_is_the_scaled_hi_lo_of_each_row(n) -> None:
    from ds4.engine.gpu.weights import to_half

    rng = np.random.default_rng(60)
    x = rng.standard_normal((37, n)).astype(np.float32) * np.logspace(-3, 4, 37, dtype=np.float32)[:, None]
    x[5] = 0.0  # an all-zero row keeps a positive scale
    xt = torch.from_numpy(x).cuda()
    hi, lo, s = _weights().to_half(xt)
    want_hi, want_lo, want_s = to_half(xt, True)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(s.cpu().numpy(), want_s.cpu().numpy())
    np.testing.assert_array_equal(hi.cpu().numpy(), want_hi.cpu().numpy())
    if lo is not None:
        np.testing.assert_array_equal(lo.cpu().numpy(), want_lo.cpu().numpy())
        back = (hi.double() + lo.double()) * s.double()
        assert float(((back - xt.double()).abs() / xt.double().abs().amax(1, keepdim=True).clamp_min(1e-30)).max()) < 2e-7


def test_split_memo_reuses_only_the_same_unchanged_rows() -> None:
    """to_half's memo: the same tensor at the same version is split once; an in-place change, another tensor with
    equal values, or more tensors than the memo holds each get a fresh split, equal to an uncached one."""
    from ds4.engine.gpu.weights import SPLIT_MEMO

    if SPLIT_MEMO < 2:
        pytest.skip("DS4_GPU_SPLIT_MEMO is off")
    W = _weights()
    x = torch.randn(64, 1024, device="cuda")
    first = W.to_half(x)
    assert W.to_half(x)[0] is first[0] and W.split_hits == 1
    y = x.clone()
    assert W.to_half(y)[0] is not first[0]  # equal values, other memory
    x.mul_(2.0)  # in place: a new version
    again = W.to_half(x)
    assert again[0] is not first[0] and torch.equal(again[2], first[2] * 2.0)
    for _ in range(SPLIT_MEMO):
        W.to_half(torch.randn(8, 1024, device="cuda"))
    assert W.to_half(x)[0] is not again[0]  # pushed out
    wide = torch.randn(4, 16384, device="cuda")  # wider than the memo takes
    assert W.to_half(wide)[0] is not W.to_half(wide)[0]
    assert W.split_hits == 1
    kept = W.to_half(x)  # x was split again by the pushed-out check: a hit
    assert W.split_hits == 2
    W.clear_splits()  # the session's call after each prefill chunk
    assert W._splits == [] and W.to_half(x)[0] is not kept[0]


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("rows_per_token,T", [(64, 40), (4, 10)])  # the warp kernel (2560 rows), the block kernel (40)
def test_norm_rope_in_scale_is_the_multiply_first(rows_per_token: int, T: int, norm: bool) -> None:
    """norm_rope's in_scale (a GEMM's deferred per-row rescale) gives the bits of multiplying the rows first."""
    from ds4.engine.gpu.fused import Fused

    K = Fused(gpu.load(), torch.device("cuda"))
    d = 512
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T * rows_per_token, d, generator=g).cuda()
    s = (torch.rand(T, 1, generator=g) * 100 + 1e-3).cuda()
    pos = torch.arange(7, 7 + T, device="cuda")
    freq = (10000.0 ** (-torch.arange(32, dtype=torch.float32) / 32)).cuda()
    kw = dict(norm=norm, eps=1e-6, freq=freq, rope_dim=64)
    scaled = (x.view(T, rows_per_token * d) * s).view(-1, d)
    want = K.norm_rope(scaled, d, rows_per_token, pos, **kw)
    got = K.norm_rope(x, d, rows_per_token, pos, in_scale=s, **kw)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="in_scale"):
        K.norm_rope(x, d, rows_per_token, pos, in_scale=s[:-1], **kw)


def _session_switch_case(monkeypatch, tmp_path, switch: str, seed: int, module=None):
    """A session-level A/B of a same-bits switch (a flag of `module`, default ds4.engine.gpu.session) on `small` (q2
    mix, 300 random tokens in chunks of 128: the hi/lo GEMM path): (every position's logits with the switch off, the
    tokens, a session with it on that has not run yet)."""
    from conftest import quantize_cli

    from ds4.engine.gpu import session as gpu_session
    from ds4.engine.model import Model

    module = gpu_session if module is None else module
    quantize_cli("synth", "--preset", "small", "--gguf", str(tmp_path / "small.gguf"), "--mix", "q2", "--quiet")
    m = Model.load(tmp_path / "small.gguf")
    toks = np.random.default_rng(seed).integers(2, m.config.vocab_size, 300).tolist()
    monkeypatch.setattr(module, switch, False)
    want = gpu_session.Session(m, ctx=512, prefill_chunk=128).prefill(toks, all_logits=True)
    monkeypatch.setattr(module, switch, True)
    return want, toks, gpu_session.Session(m, ctx=512, prefill_chunk=128)


def test_folded_swiglu_rescales_in_the_session(monkeypatch, tmp_path) -> None:
    """DS4_GPU_FOLD_SWIGLU: the shared expert's gate and up rescales applied by the SwiGLU launch give every position's
    logits bit for bit, and the products did reach it unscaled."""
    from ds4.engine.gpu import ops as gpu_ops
    from ds4.engine.gpu import weights as Wm

    want, toks, ses = _session_switch_case(monkeypatch, tmp_path, "FOLD_SWIGLU", 29, module=Wm)
    unscaled = []
    real = ses.K.swiglu

    def spy(g, u, limit):
        unscaled.append(sum(isinstance(y, gpu_ops.Unscaled) for y in (g, u)))
        return real(g, u, limit)

    monkeypatch.setattr(ses.K, "swiglu", spy)
    got = ses.prefill(toks, all_logits=True)
    assert sum(unscaled) > 0, "no gate or up product reached the SwiGLU unscaled"
    assert np.array_equal(got, want)


def test_folded_post_rescale_in_the_session(monkeypatch, tmp_path) -> None:
    """DS4_GPU_FOLD_POST: o_b's and the shared expert's per-row rescales applied by the mHC post give every position's
    logits bit for bit, and the products did reach the post unscaled."""
    from ds4.engine.gpu import ops as gpu_ops

    want, toks, ses = _session_switch_case(monkeypatch, tmp_path, "FOLD_POST", 23)
    unscaled = []
    real = ses.K.hc_post

    def spy(X, y1, y2, *rest):
        unscaled.append(sum(isinstance(y, gpu_ops.Unscaled) for y in (y1, y2)))
        return real(X, y1, y2, *rest)

    monkeypatch.setattr(ses.K, "hc_post", spy)
    got = ses.prefill(toks, all_logits=True)
    assert sum(unscaled) > 0, "no product reached the mHC post unscaled"
    assert np.array_equal(got, want)


def test_folded_rescale_in_the_session(monkeypatch, tmp_path) -> None:
    """DS4_GPU_FOLD_RESCALE: the q_b product's per-row rescale applied by norm_rope gives every position's logits
    bit for bit."""
    want, toks, ses = _session_switch_case(monkeypatch, tmp_path, "FOLD_RESCALE", 17)
    deferred = []
    real = ses.W.mm_unscaled
    monkeypatch.setattr(ses.W, "mm_unscaled", lambda *a: (lambda zr: deferred.append(zr[1] is not None) or zr)(real(*a)))
    got = ses.prefill(toks, all_logits=True)
    assert deferred and all(deferred), "the q_b products did not defer their rescale"
    assert np.array_equal(got, want)


def test_session_reserves_the_prefill_working_set(monkeypatch, tmp_path) -> None:
    """Session._reserve_prefill (DS4_GPU_PREFILL_RESERVE): a size in MiB grows torch's cache by that much at
    construction (freed, so cached: the first long prompt finds it), 0 leaves the cache alone."""
    from conftest import quantize_cli

    from ds4.engine.gpu import session as gpu_session
    from ds4.engine.model import Model

    quantize_cli("synth", "--preset", "tiny", "--gguf", str(tmp_path / "tiny.gguf"), "--type", "f16", "--mix", "none",
                 "--quiet")
    m = Model.load(tmp_path / "tiny.gguf")
    grown = {}
    for setting in ("0", "320"):
        monkeypatch.setattr(gpu_session, "PREFILL_RESERVE", setting)
        torch.cuda.empty_cache()
        before, held = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        ses = gpu_session.Session(m, ctx=256, prefill_chunk=128)
        grown[setting] = torch.cuda.memory_reserved() - before
        assert torch.cuda.memory_allocated() - held < 64 * 2**20  # the block itself is freed
        del ses
    assert grown["320"] >= 320 * 2**20 > grown["0"] + 256 * 2**20
