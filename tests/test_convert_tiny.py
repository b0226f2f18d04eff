"""Synthetic checkpoints and `ds4-quantize convert` on the tiny preset (model-spec §2.4, tooling-spec §1)."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
from conftest import quantize_cli

from ds4.engine.config import preset
from ds4.gguf_tools.constants import Key, QuantType
from ds4.gguf_tools.hf import (
    HFCheckpoint, bf16_to_f32, dequant_fp4, dequant_fp8, official_name, read_safetensors_header, st_array,
)
from ds4.gguf_tools.layout import Kind, layout_by_name, tensor_layout
from ds4.gguf_tools.plan import Policy, plan, published_type
from ds4.gguf_tools.quantize import tokenizer_tables
from ds4.gguf_tools.reader import open_model
from ds4.gguf_tools.synth import synth_checkpoint

CFG = preset("tiny")


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    return synth_checkpoint(CFG, tmp_path_factory.mktemp("hf") / "tiny-hf", seed=0)


@pytest.fixture(scope="module")
def converted(official, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    quantize_cli("convert", str(official), str(out), "--type", "f16", "--quiet")
    return out


def _digest(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_synth_is_deterministic(official, tmp_path):
    again = synth_checkpoint(CFG, tmp_path / "again", seed=0)
    other = synth_checkpoint(CFG, tmp_path / "other", seed=1)
    assert _digest(again) == _digest(official)
    a, b = _digest(official), _digest(other)
    assert all(a[n] != b[n] for n in a if n.endswith(".safetensors"))


def test_synth_official_layout_and_storage(official):
    hf = json.loads((official / "config.json").read_text())
    assert hf["model_type"] == "deepseek_v4" and hf["architectures"] == ["DeepseekV4ForCausalLM"]
    assert hf["compress_ratios"] == [0, 0, 4, 128, 4, 128, 0]
    assert hf["quantization_config"]["weight_block_size"] == [128, 128] and hf["expert_dtype"] == "fp4"
    assert hf["rope_scaling"]["type"] == "yarn" and hf["num_hash_layers"] == 3
    index = json.loads((official / "model.safetensors.index.json").read_text())
    entries = {}
    for shard in set(index["weight_map"].values()):
        entries.update(read_safetensors_header(official / shard))
    assert set(entries) == set(index["weight_map"]) and len(set(index["weight_map"].values())) > 1
    D, Rq = CFG.n_embd, CFG.q_lora_rank
    assert (entries["layers.0.attn.wq_a.weight"].dtype, entries["layers.0.attn.wq_a.weight"].shape) == ("F8_E4M3", (Rq, D))
    # 64-wide hidden: one partial 128-block (ceil division)
    assert (entries["layers.0.attn.wq_a.scale"].dtype, entries["layers.0.attn.wq_a.scale"].shape) == ("F8_E8M0", (1, 1))
    assert entries["layers.2.attn.wq_b.scale"].shape == (math.ceil(CFG.n_head * CFG.head_dim / 128), 1)
    e = entries["layers.3.ffn.experts.7.w2.weight"]
    assert (e.dtype, e.shape) == ("I8", (D, CFG.expert_ffn // 2))
    assert entries["layers.3.ffn.experts.7.w2.scale"].shape == (D, CFG.expert_ffn // 32)
    for name, dtype in [("embed.weight", "BF16"), ("head.weight", "BF16"), ("layers.1.hc_attn_fn", "F32"),
                        ("layers.2.attn.compressor.wkv.weight", "BF16"), ("layers.2.attn.compressor.ape", "F32"),
                        ("layers.2.attn.indexer.wq_b.weight", "F8_E4M3"), ("layers.0.ffn.gate.tid2eid", "I64"),
                        ("layers.4.ffn.gate.bias", "F32"), ("layers.3.attn.attn_sink", "F32")]:
        assert entries[name].dtype == dtype, name
    assert entries["layers.2.attn.compressor.ape"].shape == (4, 2 * CFG.head_dim)
    assert entries["layers.3.attn.compressor.ape"].shape == (128, CFG.head_dim)
    assert "layers.0.ffn.gate.bias" not in entries and "layers.3.ffn.gate.tid2eid" not in entries
    assert "layers.3.attn.indexer.wq_b.weight" not in entries and "layers.0.attn.compressor.wkv.weight" not in entries

    # non-trivial routing tables, sinks and biases
    tid = np.asarray(st_array(entries["layers.1.ffn.gate.tid2eid"]))
    assert tid.shape == (CFG.vocab_size, CFG.n_expert_used)
    assert np.all(tid[:, 0] != tid[:, 1]) and set(np.unique(tid)) == set(range(CFG.n_expert))
    assert not np.array_equal(tid, np.asarray(st_array(entries["layers.0.ffn.gate.tid2eid"])))
    assert np.asarray(st_array(entries["layers.3.attn.attn_sink"])).std() > 0.3
    assert np.asarray(st_array(entries["layers.5.ffn.gate.bias"])).std() > 0.1


def test_convert_names_shapes_types_metadata(converted):
    f = open_model(converted)  # validates every tensor against model-spec §2.4 for the config
    assert f.config == CFG
    layout = tensor_layout(CFG)
    assert list(f.tensors) == [s.name for s in layout]  # file order: globals, then layer by layer
    for s in layout:
        want = {Kind.VECTOR: QuantType.F32, Kind.INDEX: QuantType.I32}.get(s.kind, QuantType.F16)
        assert (f.tensors[s.name].ne, f.tensors[s.name].qtype) == (s.ne, want), s.name
    tokens, merges = tokenizer_tables()
    assert len(tokens) == 129280 and f.tokens == tokens and f.merges == merges
    assert f.tokens[0] == "<｜begin▁of▁sentence｜>" and f.tokens[1] == "<｜end▁of▁sentence｜>"
    assert f.metadata[Key.TOKENIZER_MODEL.value] == "gpt2"
    assert f.metadata[Key.NAME.value] == "ds4-tiny"


def test_convert_values_follow_the_checkpoint(official, converted):
    f = open_model(converted)
    entries = HFCheckpoint(official).by_name
    embed = bf16_to_f32(st_array(entries["embed.weight"]))
    np.testing.assert_array_equal(f.array("token_embd.weight"), embed.astype(np.float16))
    w = dequant_fp8(st_array(entries["layers.2.attn.wq_b.weight"]), st_array(entries["layers.2.attn.wq_b.scale"]))
    np.testing.assert_array_equal(f.array("blk.2.attn_q_b.weight"), w.astype(np.float16))
    e5 = dequant_fp4(st_array(entries["layers.4.ffn.experts.5.w3.weight"]),
                     st_array(entries["layers.4.ffn.experts.5.w3.scale"]))
    np.testing.assert_array_equal(f.array("blk.4.ffn_up_exps.weight")[5], e5.astype(np.float16))
    np.testing.assert_array_equal(f.array("blk.2.ffn_gate_tid2eid.weight"),
                                  np.asarray(st_array(entries["layers.2.ffn.gate.tid2eid"])).astype(np.int32))
    np.testing.assert_array_equal(f.array("blk.3.attn_compressor_ape.weight"),
                                  np.asarray(st_array(entries["layers.3.attn.compressor.ape"])).astype(np.float16))


def test_q8_0_plan_is_the_published_layout(official):
    plans = {p.name: p.qtype for p in plan(CFG, Policy(base="q8_0"))}
    layout = layout_by_name(CFG)
    for name, qtype in plans.items():
        want = published_type(layout[name])  # Q8_0 experts when no mix is given
        assert qtype == want, name
    assert plans["blk.2.attn_q_a.weight"] == QuantType.Q8_0 and plans["output.weight"] == QuantType.Q8_0
    assert plans["token_embd.weight"] == QuantType.F16 and plans["blk.2.indexer.attn_q_b.weight"] == QuantType.F16
    assert plans["blk.0.hc_attn_fn.weight"] == QuantType.F16 and plans["blk.3.ffn_down_exps.weight"] == QuantType.Q8_0
    # family flags and prefix overrides (tooling-spec §1.5 order); hc_attn is not "attention" here
    p = Policy(base="q8_0", attention=QuantType.F32, dense=QuantType.F32, shared=QuantType.F16,
               tensor_types=[("blk.3.", QuantType.F32)])
    got = {t.name: t.qtype for t in plan(CFG, p)}
    assert got["blk.2.attn_compressor_kv.weight"] == QuantType.F32
    assert got["blk.2.indexer.attn_q_b.weight"] == QuantType.F32  # not captured by --attention-proj
    assert got["blk.2.attn_q_b.weight"] == QuantType.Q8_0
    assert got["blk.0.hc_attn_fn.weight"] == QuantType.F32 and got["blk.0.ffn_up_shexp.weight"] == QuantType.F16
    assert all(t == QuantType.F32 for n, t in got.items() if n.startswith("blk.3.") and "tid2eid" not in n)


def test_convert_q8_0_against_quants(official, tmp_path):
    pytest.importorskip("ds4.gguf_tools.quants.q8_0")
    from ds4.gguf_tools import quants

    out = tmp_path / "q8.gguf"
    quantize_cli("convert", str(official), str(out), "--type", "q8_0", "--quiet")
    f = open_model(out)
    ckpt = HFCheckpoint(official)
    for name in ("blk.2.attn_q_b.weight", "blk.3.ffn_down_exps.weight", "output.weight"):
        assert f.tensors[name].qtype == QuantType.Q8_0
        src = ckpt.slot_array(layout_by_name(CFG)[name])
        want = quants.quantize(QuantType.Q8_0, src.reshape(-1, src.shape[-1]))
        np.testing.assert_array_equal(f.raw(name).reshape(want.shape), want)


# ---- transformers-format checkpoints ------------------------------------------------------------

@pytest.fixture(scope="module")
def transformers_model(official, tmp_path_factory):
    from ds4.gguf_tools.synth import write_transformers_checkpoint

    out = tmp_path_factory.mktemp("tf") / "tiny-tf"
    model = write_transformers_checkpoint(CFG, out, seed=0, official_dir=official)
    return out, model


def _assert_same_gguf(a_path, b_path):
    a, b = open_model(a_path), open_model(b_path)
    assert a.config == b.config and list(a.tensors) == list(b.tensors)
    differ = [n for n in a.tensors if not np.array_equal(a.raw(n), b.raw(n))]
    assert differ == []


def test_transformers_checkpoint_converts_to_the_same_gguf(transformers_model, converted, tmp_path):
    tf_dir, _ = transformers_model
    ckpt = HFCheckpoint(tf_dir)
    assert ckpt.format == "transformers" and ckpt.config == CFG
    out = tmp_path / "from-tf.gguf"
    quantize_cli("convert", str(tf_dir), str(out), "--type", "f16", "--quiet", "--name", "ds4-tiny")
    _assert_same_gguf(out, converted)


def test_transformers_module_names_convert_to_the_same_gguf(transformers_model, converted, tmp_path):
    """A state_dict saved as is (self_attn.*, fused experts.gate_up_proj, ...) maps the same way."""
    from safetensors.torch import save_file

    _, model = transformers_model
    d = tmp_path / "module-names"
    d.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.3.mlp.experts.gate_up_proj" in state
    save_file(state, str(d / "model.safetensors"))
    model.config.save_pretrained(d)
    out = tmp_path / "from-modules.gguf"
    quantize_cli("convert", str(d), str(out), "--quiet", "--name", "ds4-tiny")
    _assert_same_gguf(out, converted)


def test_transformers_forward_on_synth_weights_is_sane(transformers_model):
    """Activations stay O(1) through all layers and logits have a real spread (no NaN/inf)."""
    import torch

    _, model = transformers_model
    ids = torch.from_numpy(np.random.default_rng(5).integers(0, CFG.vocab_size, (1, 140)))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    logits = out.logits[0].numpy()
    assert np.isfinite(logits).all()
    assert 0.5 < logits.std(axis=-1).min() and logits.std(axis=-1).max() < 10
    for h in out.hidden_states:
        h = h.numpy()
        assert np.isfinite(h).all() and 0.1 < np.abs(h).mean() < 10


# ---- CLI mistakes --------------------------------------------------------------------------------

def test_convert_cli_errors(official, converted, tmp_path):
    bad_json = tmp_path / "bad"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    not_ckpt = tmp_path / "photos"
    not_ckpt.mkdir()
    (not_ckpt / "cat.jpg").write_bytes(b"meow")
    cases = [
        (["convert", str(tmp_path / "nothing"), str(tmp_path / "o.gguf")], "not a directory"),
        (["convert", str(bad_json), str(tmp_path / "o.gguf")], "malformed JSON"),
        (["convert", str(official), str(converted)], "exists (use --overwrite"),
        (["convert", str(official), str(tmp_path / "o.gguf"), "--mix", "q2"], "IQ2_XXS needs rows of a multiple of 256"),
        (["convert", str(official), str(tmp_path / "o.gguf"), "--experts", "q5_x"], "unknown type 'q5_x'"),
        (["synth", "--preset", "tiny", str(not_ckpt)], "not a checkpoint"),
    ]
    for args, message in cases:
        r = quantize_cli(*args, "--quiet", check=False)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and message in lines[0], (args, r.stderr)
    assert not (tmp_path / "o.gguf").exists()
