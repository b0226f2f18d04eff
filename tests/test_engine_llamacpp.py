"""llama.cpp (through llama-cpp-python) as a second oracle: an all-F32 GGUF made by our converter,
rewritten for llama.cpp's loader, gives the logits our engine gives with the roundings off."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine.llamacpp_gguf import write_llamacpp_gguf
from ds4.engine.model import Model
from ds4.engine.session import Session
from ds4.gguf_tools.reader import open_gguf

llama_cpp = pytest.importorskip("llama_cpp")

GGML_TYPE_F32 = 0


@pytest.fixture(scope="module")
def f32_models(tmp_path_factory):
    from conftest import quantize_cli

    d = tmp_path_factory.mktemp("llamacpp")
    quantize_cli("synth", "--preset", "tiny", "--seed", "4", "--quiet", str(d / "hf"))
    quantize_cli("convert", str(d / "hf"), str(d / "ours.gguf"), "--type", "f32", "--quiet")
    write_llamacpp_gguf(d / "ours.gguf", d / "llama.gguf")
    return d / "ours.gguf", d / "llama.gguf"


def test_rewrite_keeps_tensors_and_edits_metadata(f32_models):
    ours, llama = (open_gguf(p) for p in f32_models)
    assert list(llama.tensors) == list(ours.tensors)
    for name in ("token_embd.weight", "blk.2.attn_compressor_kv.weight", "blk.0.ffn_gate_tid2eid.weight"):
        assert np.array_equal(np.asarray(llama.raw(name)), np.asarray(ours.raw(name)))
    assert llama.metadata["deepseek4.expert_gating_func"] == 4
    assert llama.metadata["deepseek4.rope.scaling.type"] == "yarn"
    assert llama.metadata["deepseek4.context_length"] == ours.metadata["deepseek4.context_length"]
    assert all(t[0].name not in ("UINT64", "INT64") for t in llama.metadata_types.values())
    # our own reader still loads the rewritten file to the same config
    assert Model.load(f32_models[1]).config == Model.load(f32_models[0]).config


def test_logits_match_llamacpp(f32_models):
    """300 tokens: past the 128-token window, past top-k×4 (indexer selects) and past 128 (ratio-128
    rows); every position's logits."""
    n = 300
    tokens = np.random.default_rng(5).integers(2, 120000, n).tolist()
    ll = llama_cpp.Llama(str(f32_models[1]), n_ctx=512, n_batch=512, logits_all=True, verbose=False,
                         type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, n_threads=2)
    ll.eval(tokens)
    ref = np.array(ll.scores[:n], dtype=np.float32)
    model = Model.load(f32_models[0], fp8_kv=False, indexer_qat=False)
    ours = Session(model, ctx=512, prefill_chunk=128).prefill(tokens, all_logits=True)
    rel = np.abs(ours - ref).max(axis=1) / np.abs(ref).max(axis=1)
    assert rel.max() <= 1e-5, (rel.argmax(), rel.max())
    # the official roundings are what separates the default engine from llama.cpp
    sim = Session(Model.load(f32_models[0]), ctx=512).prefill(tokens, all_logits=True)
    assert (np.abs(sim - ref).max(axis=1) / np.abs(ref).max(axis=1)).max() > 1e-3
