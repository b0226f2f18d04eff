"""GGUF writer → reader round trips, and the reader's one-line errors (in process and via the CLI)."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
from conftest import quantize_cli
from gguf.constants import GGUFValueType as V

from ds4.engine.config import preset
from ds4.gguf_tools.constants import Key, QuantType
from ds4.gguf_tools.layout import Kind, tensor_layout
from ds4.gguf_tools.reader import GGUFError, open_gguf, open_model
from ds4.gguf_tools.writer import TensorPlan, Typed, ds4_metadata, encode, write_gguf

CFG = dataclasses.replace(preset("tiny"), vocab_size=300)  # tiny shapes, a short vocabulary: small files
TOKENS = [f"<t{i}>" for i in range(CFG.vocab_size)]


def _type_for(kind: Kind) -> QuantType:
    return {Kind.VECTOR: QuantType.F32, Kind.INDEX: QuantType.I32}.get(kind, QuantType.F16)


def write_model(path, *, drop=(), replace=None, extra=(), meta_changes=None, arch="deepseek4", seed=0):
    """A random DS4 GGUF for CFG; returns {name: values written}."""
    rng = np.random.default_rng(seed)
    replace = replace or {}
    plans, values = [], {}
    for s in tensor_layout(CFG):
        if s.name in drop:
            continue
        qtype, ne = replace.get(s.name, (_type_for(s.kind), s.ne))
        plans.append(TensorPlan(s.name, qtype, tuple(ne)))
    plans += [TensorPlan(n, QuantType.F32, (4,)) for n in extra]
    for p in plans:
        if p.qtype == QuantType.I32:
            values[p.name] = rng.integers(0, CFG.n_expert, p.shape).astype(np.int32)
        else:
            values[p.name] = rng.standard_normal(p.shape).astype(np.float32)
    meta = ds4_metadata(CFG, TOKENS, ["<t1> <t2>", "<t3> <t4>"])
    meta.update(meta_changes or {})
    write_gguf(path, meta, plans, lambda p: encode(p.qtype, values[p.name]), arch=arch)
    return values


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "good.gguf"
    return path, write_model(path)


def test_roundtrip_values_config_and_typed_metadata(good):
    path, values = good
    f = open_model(path)
    assert f.config == CFG
    assert f.tokens == TOKENS and f.merges == ["<t1> <t2>", "<t3> <t4>"]
    for name, v in values.items():
        a = f.array(name)
        assert a.shape == v.shape, name
        if f.tensors[name].qtype == QuantType.F16:
            np.testing.assert_array_equal(a, v.astype(np.float16))
        else:
            np.testing.assert_array_equal(a, v)
    types = f.metadata_types
    assert types[Key.BLOCK_COUNT.value] == (V.UINT32, None)
    assert types[Key.CONTEXT_LENGTH.value] == (V.UINT64, None)
    assert types[Key.ROPE_ORIG_CTX.value] == (V.UINT64, None)
    assert types[Key.RMS_EPS.value] == (V.FLOAT32, None)
    assert types[Key.EXPERT_WEIGHTS_NORM.value] == (V.BOOL, None)
    assert types[Key.COMPRESS_RATIOS.value] == (V.ARRAY, V.INT32)
    assert types[Key.SWIGLU_CLAMP.value] == (V.ARRAY, V.FLOAT32)
    assert types[Key.TOKENS.value] == (V.ARRAY, V.STRING)
    assert f.metadata[Key.ARCHITECTURE.value] == "deepseek4"
    assert f.metadata[Key.COMPRESS_RATIOS.value] == [0, 0, 4, 128, 4, 128]


def test_views_are_zero_copy_and_read_only(good):
    path, _ = good
    f = open_model(path)
    name = "blk.3.ffn_up_exps.weight"
    t = f.tensors[name]
    a, raw = f.array(name), f.raw(name)
    assert a.shape == (CFG.n_expert, CFG.expert_ffn, CFG.n_embd) == t.shape
    assert raw.shape == (CFG.n_expert, CFG.expert_ffn, CFG.n_embd * 2)
    assert not a.flags.writeable and not a.flags.owndata
    assert t.offset % 32 == 0 and t.nbytes == a.nbytes
    with open(path, "rb") as fh:
        fh.seek(t.offset)
        assert fh.read(16) == raw.reshape(-1)[:16].tobytes()


def test_u32_compress_ratios_and_f64_clamps_are_accepted(tmp_path):
    path = tmp_path / "typed.gguf"
    write_model(path, meta_changes={
        Key.COMPRESS_RATIOS.value: Typed(list(CFG.compress_ratios), V.ARRAY, V.UINT32),
        Key.SWIGLU_CLAMP.value: Typed(list(CFG.swiglu_clamp), V.ARRAY, V.FLOAT64),
        Key.ROPE_ORIG_CTX.value: Typed(CFG.rope_orig_ctx, V.UINT32),
    })
    assert open_model(path).config == CFG


def test_quantized_tensor_roundtrip(tmp_path):
    pytest.importorskip("ds4.gguf_tools.quants.q8_0")
    from ds4.gguf_tools import quants

    path = tmp_path / "q8.gguf"
    name = "blk.2.attn_q_b.weight"
    values = write_model(path, replace={name: (QuantType.Q8_0, (CFG.q_lora_rank, CFG.n_head * CFG.head_dim))})
    f = open_model(path)
    assert f.tensors[name].qtype == QuantType.Q8_0
    expect = quants.dequantize(QuantType.Q8_0, quants.quantize(QuantType.Q8_0, values[name]), CFG.q_lora_rank)
    np.testing.assert_array_equal(f.array(name), expect)
    assert np.abs(f.array(name) - values[name]).max() < 0.02 * np.abs(values[name]).max()


def test_interrupted_write_leaves_nothing(tmp_path):
    path = tmp_path / "never.gguf"

    def produce(p):
        if p.name.startswith("blk.2."):
            raise RuntimeError("boom")
        return np.zeros(p.shape, np.float16 if p.qtype == QuantType.F16 else np.float32)

    plans = [TensorPlan(s.name, QuantType.F32 if s.kind == Kind.VECTOR else QuantType.F16, s.ne)
             for s in tensor_layout(CFG) if s.kind != Kind.INDEX]
    with pytest.raises(RuntimeError, match="boom"):
        write_gguf(path, ds4_metadata(CFG, TOKENS, ["a b"]), plans, produce)
    assert list(tmp_path.iterdir()) == []


# ---- errors ---------------------------------------------------------------------------------------

def _patched(src, dst, offset, data):
    b = bytearray(src.read_bytes())
    b[offset:offset + len(data)] = data
    dst.write_bytes(bytes(b))
    return dst


def _bad_files(tmp_path, good_path):
    raw = good_path.read_bytes()
    cases = {}
    p = tmp_path / "truncated.gguf"
    p.write_bytes(raw[: len(raw) * 2 // 3])
    cases["truncated"] = (p, "truncated file")
    cases["magic"] = (_patched(good_path, tmp_path / "magic.gguf", 0, b"GGML"), "not a GGUF file")
    cases["version"] = (_patched(good_path, tmp_path / "v2.gguf", 4, struct.pack("<I", 2)), "version 2, expected 3")
    cases["absurd_count"] = (_patched(good_path, tmp_path / "count.gguf", 8, struct.pack("<Q", 1 << 60)),
                             "absurd header")
    # the first key's string length: enormous
    cases["absurd_string"] = (_patched(good_path, tmp_path / "strlen.gguf", 24, struct.pack("<Q", 1 << 62)),
                              "truncated file")
    p = tmp_path / "llama.gguf"
    write_model(p, arch="llama")
    cases["arch"] = (p, "architecture is 'llama', expected 'deepseek4'")
    p = tmp_path / "missing.gguf"
    write_model(p, drop=("blk.4.indexer.proj.weight",))
    cases["missing"] = (p, "tensor 'blk.4.indexer.proj.weight' is missing")
    p = tmp_path / "shape.gguf"
    write_model(p, replace={"blk.1.attn_sinks.weight": (QuantType.F32, (5,))})
    cases["shape"] = (p, "tensor 'blk.1.attn_sinks.weight' has shape [5], expected [4]")
    p = tmp_path / "dtype.gguf"
    write_model(p, replace={"blk.0.ffn_gate_tid2eid.weight": (QuantType.F32, (2, 300))})
    cases["dtype"] = (p, "tensor 'blk.0.ffn_gate_tid2eid.weight' has type F32, expected I32")
    p = tmp_path / "extra.gguf"
    write_model(p, extra=("blk.9.attn_sinks.weight",))
    cases["extra"] = (p, "unexpected tensor 'blk.9.attn_sinks.weight'")
    p = tmp_path / "meta.gguf"
    meta = ds4_metadata(CFG, TOKENS, ["a b"])
    del meta[Key.HEAD_COUNT.value]
    write_gguf(p, meta, [], lambda p: None)
    cases["metadata"] = (p, "'deepseek4.attention.head_count' is missing")
    return cases


def test_errors_in_process(tmp_path, good):
    for case, (path, message) in _bad_files(tmp_path, good[0]).items():
        with pytest.raises(GGUFError) as e:
            open_model(path)
        text = str(e.value)
        assert message in text, (case, text)
        assert "\n" not in text and str(path) in text, case


def test_errors_from_cli_exit_2_one_line(tmp_path, good):
    for case, (path, message) in _bad_files(tmp_path, good[0]).items():
        r = quantize_cli("info", str(path), check=False)
        assert r.returncode == 2, (case, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr, (case, r.stderr)
    r = quantize_cli("info", str(tmp_path / "nope.gguf"), check=False)
    assert r.returncode == 2 and "no such file" in r.stderr
    ok = quantize_cli("info", str(good[0]))
    assert "6 layers, hidden 64" in ok.stdout


def test_open_gguf_reads_foreign_architectures(tmp_path):
    path = tmp_path / "other.gguf"
    write_gguf(path, {"general.name": "x", "other.count": 3},
               [TensorPlan("a", QuantType.F32, (3, 2))], lambda p: np.arange(6, dtype=np.float32), arch="other")
    f = open_gguf(path)
    assert f.architecture == "other" and f.metadata["other.count"] == 3
    np.testing.assert_array_equal(f.array("a"), np.arange(6, dtype=np.float32).reshape(2, 3))
