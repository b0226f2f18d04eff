"""Sessions: decode == prefill == chunked prefill, sync reuse, DSV4 payload round trip and refusal,
KV memory, and loading a real GGUF written by the project's writer. Official numerics on."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from ds4.engine.config import preset
from ds4.engine.forward import KVState, forward_chunk
from ds4.engine.model import Model
from ds4.engine.session import HEADER, MAGIC, Session, SessionError, kv_bytes_per_token
from ds4.gguf_tools import constants as C
from forward_oracle_util import oracle_config, random_tensors, write_model_gguf

N_TOK = 300  # past the window, past top-k × 4 = 32 and past 128 (ratio-128 rows)


def close(a, b, tol=1e-5) -> bool:
    a, b = np.atleast_2d(a), np.atleast_2d(b)
    return float((np.abs(a - b).max(axis=1) / np.abs(b).max(axis=1)).max()) <= tol


@pytest.fixture(scope="module")
def model():
    cfg = oracle_config()
    return Model.from_tensors(cfg, random_tensors(cfg, seed=1))


@pytest.fixture(scope="module")
def tokens(model):
    return np.random.default_rng(2).integers(0, model.config.vocab_size, N_TOK).tolist()


@pytest.fixture(scope="module")
def decoded(model, tokens):
    """Logits after every token, decoding one token at a time."""
    s = Session(model, ctx=512)
    return np.stack([s.decode(t).copy() for t in tokens])


def test_official_numerics_are_on_by_default(model):
    assert model.config.fp8_kv and model.config.indexer_qat


def test_full_prefill_equals_token_by_token_decode(model, tokens, decoded):
    """Bit-identical, FP8/FP4 roundings included: the numba path is batch-invariant."""
    s = Session(model, ctx=512)
    assert np.array_equal(s.prefill(tokens, all_logits=True), decoded)


@pytest.mark.parametrize("chunk", [3, 61, 130])
def test_chunked_prefill_equals_decode(model, tokens, decoded, chunk):
    s = Session(model, ctx=512, prefill_chunk=chunk)
    out = s.prefill(tokens, all_logits=True)
    assert out.shape == (N_TOK, model.config.vocab_size)
    assert np.array_equal(out, decoded)
    assert np.array_equal(s.logits, decoded[-1])


def test_reference_impl_equals_numba_impl(model, tokens):
    """The numpy reference and the numba path agree to float32 rounding (roundings off: with them on,
    BLAS vs ordered sums can flip an FP8 code and the difference is then legitimately larger)."""
    plain = model.with_numerics(fp8_kv=False, indexer_qat=False)
    ref = forward_chunk(plain, KVState(plain.config, 512), tokens[:200], all_logits=True, impl="ref")
    fast = forward_chunk(plain, KVState(plain.config, 512), tokens[:200], all_logits=True)
    assert close(fast, ref)


def test_sync_extends_reuses_and_rebuilds(model, tokens, decoded):
    s = Session(model, ctx=512, prefill_chunk=64)
    assert np.array_equal(s.sync(tokens[:150]), decoded[149])
    state_before = s.state
    assert np.array_equal(s.sync(tokens[:152]), decoded[151])  # short extension: decoded in place
    assert s.state is state_before and s.pos == 152
    assert np.array_equal(s.sync(tokens[:260]), decoded[259])  # long extension: chunked prefill from 152
    same = s.sync(tokens[:260])
    assert same is s.logits and s.pos == 260
    other = tokens[:100] + [(tokens[100] + 1) % model.config.vocab_size] + tokens[101:120]
    fresh = Session(model, ctx=512).sync(other)
    assert np.array_equal(s.sync(other), fresh)  # diverging prompt: rebuilt
    assert s.tokens == other
    with pytest.raises(SessionError, match="exceeds context"):
        s.sync(list(range(512)))
    with pytest.raises(SessionError, match="exceeds context"):
        s.sync([])


def test_snapshot_restore_continues_bit_identically(model, tokens):
    a = Session(model, ctx=512, prefill_chunk=128)
    a.prefill(tokens[:203])
    blob = a.snapshot()
    b = Session(model, ctx=512, prefill_chunk=128)
    b.restore(blob)
    assert b.tokens == a.tokens and np.array_equal(b.logits, a.logits)
    assert b.snapshot() == blob
    for t in tokens[203:240]:
        assert np.array_equal(a.decode(t), b.decode(t))
    a.prefill(tokens[240:])
    b.prefill(tokens[240:])
    assert np.array_equal(a.logits, b.logits)


def test_payload_layout_follows_runtime_spec(model, tokens):
    cfg = model.config
    s = Session(model, ctx=512, prefill_chunk=128)
    s.prefill(tokens[:203])
    blob = s.snapshot()
    hdr = HEADER.unpack_from(blob, 0)
    assert blob[:4] == b"DSV4" and hdr[0] == MAGIC and hdr[1] == 1
    assert hdr[2:] == (512, 128, 128, 128, 512 // 4 + 2, 203, cfg.n_layer, cfg.head_dim, cfg.indexer_dim,
                       cfg.vocab_size, 128)
    size = HEADER.size + 4 * (203 + cfg.vocab_size + 2 * cfg.n_layer)
    for i in range(cfg.n_layer):
        r = cfg.ratio(i)
        size += 4 * 128 * cfg.head_dim
        if r:
            size += 4 * (203 // r) * cfg.head_dim + 2 * 4 * (2 * r if r == 4 else r) * cfg.compressor_width(i)
        if r == 4:
            size += 4 * (203 // 4) * cfg.indexer_dim + 2 * 4 * 8 * 2 * cfg.indexer_dim
    assert len(blob) == size
    off = HEADER.size
    assert list(np.frombuffer(blob, "<u4", 203, off)) == tokens[:203]
    off += 4 * 203
    assert np.array_equal(np.frombuffer(blob, "<f4", cfg.vocab_size, off), s.logits)
    off += 4 * cfg.vocab_size
    n_comp = np.frombuffer(blob, "<u4", cfg.n_layer, off)
    assert list(n_comp) == [203 // r if r else 0 for r in cfg.compress_ratios[:cfg.n_layer]]
    off += 8 * cfg.n_layer
    # layer 0's raw rows in logical order: the oldest live position (75) first
    raw0 = np.frombuffer(blob, "<f4", 128 * cfg.head_dim, off).reshape(128, cfg.head_dim)
    assert np.array_equal(raw0[0], s.state.layers[0].raw[75 % 128])
    assert np.array_equal(raw0[-1], s.state.layers[0].raw[202 % 128])


def test_restore_refuses_bad_payloads(model, tokens):
    s = Session(model, ctx=512, prefill_chunk=128)
    s.prefill(tokens[:40])
    blob = s.snapshot()
    t = Session(model, ctx=512, prefill_chunk=128)
    cases = {
        "magic": b"XXXX" + blob[4:],
        "truncated": blob[:-7],
        "trailing": blob + b"\0\0\0\0",
        "version": blob[:4] + struct.pack("<I", 2) + blob[8:],
    }
    for what, bad in cases.items():
        with pytest.raises(SessionError):
            t.restore(bad)
        assert t.pos == 0 and t.logits is None, what
    with pytest.raises(SessionError, match="truncated"):
        t.restore(blob[:30])
    with pytest.raises(SessionError, match="prefill chunk"):
        Session(model, ctx=512, prefill_chunk=64).restore(blob)
    with pytest.raises(SessionError, match="ctx"):
        Session(model, ctx=256, prefill_chunk=128).restore(Session(model, ctx=1024, prefill_chunk=128).snapshot())
    cfg2 = dataclasses.replace(model.config, n_layer=4, compress_ratios=model.config.compress_ratios[:4],
                               swiglu_clamp=model.config.swiglu_clamp[:4])
    other = Model.from_tensors(cfg2, random_tensors(cfg2, seed=3))
    with pytest.raises(SessionError, match="model shape"):
        Session(other, ctx=512, prefill_chunk=128).restore(blob)
    t.restore(blob)  # the good one still loads after the failures
    assert t.tokens == tokens[:40]


def test_kv_bytes_match_spec_formula(model):
    assert kv_bytes_per_token(preset("flash")) == 13760  # model-spec §4.5
    assert kv_bytes_per_token(preset("pro")) == 19696
    small, big = Session(model, ctx=1024), Session(model, ctx=2048)
    assert big.kv_bytes() - small.kv_bytes() == 1024 * small.kv_bytes_per_token()


def test_model_loads_gguf_written_by_project_writer(tmp_path, tokens):
    cfg = oracle_config()
    tensors = random_tensors(cfg, seed=4)
    half = {n: C.QuantType.F16 for n in tensors if n.endswith(("attn_q_b.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight"))}
    path = write_model_gguf(tmp_path / "m.gguf", cfg, tensors, half)
    loaded = Model.load(path)
    assert loaded.config.fp8_kv and loaded.config == cfg
    expect = {n: (a.astype(np.float16).astype(np.float32) if n in half else a) for n, a in tensors.items()}
    ref = Session(Model.from_tensors(cfg, expect), ctx=256).prefill(tokens[:150], all_logits=True)
    got = Session(loaded, ctx=256).prefill(tokens[:150], all_logits=True)
    assert np.array_equal(got, ref)
    off = Model.load(path, fp8_kv=False, indexer_qat=False)
    assert not off.config.fp8_kv and not off.config.indexer_qat


def test_fused_q8_0_matches_dequantized_and_stays_batch_invariant(tmp_path, tokens):
    cfg = oracle_config()
    tensors = random_tensors(cfg, seed=6)
    q8 = {n: C.QuantType.Q8_0 for n in tensors
          if n.endswith(("attn_q_b.weight", "attn_output_a.weight", "ffn_down_shexp.weight", "ffn_gate_exps.weight",
                         "ffn_up_exps.weight", "ffn_down_exps.weight"))}
    path = write_model_gguf(tmp_path / "q8.gguf", cfg, tensors, q8)
    fused = Model.load(path, fp8_kv=False, indexer_qat=False, fused_quant=True)
    plain = Model.load(path, fp8_kv=False, indexer_qat=False, fused_quant=False)
    assert all(fused.quantized(n) == C.QuantType.Q8_0 for n in q8) and plain.quantized(next(iter(q8))) is None
    a = Session(fused, ctx=128).prefill(tokens[:40], all_logits=True)
    b = Session(plain, ctx=128).prefill(tokens[:40], all_logits=True)
    assert close(a, b)
    s = Session(fused, ctx=128)
    assert np.array_equal(np.stack([s.decode(t).copy() for t in tokens[:40]]), a)
