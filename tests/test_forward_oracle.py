"""engine.forward against transformers' DeepseekV4ForCausalLM (fp32, eager experts).

Both run the same random weights: the transformers model is randomised, its state dict is mapped
to our GGUF names through the explicit map in `forward_oracle_util`, and our config switches the
official FP8/FP4 simulations off (transformers lacks them, model-spec §7). The sequences run past
the sliding window (128), past top-k × 4 (the indexer selects) and past 128 (ratio-128 rows).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ds4.engine.forward import KVState, forward_chunk
from ds4.engine.model import Model, expected_shapes
from ds4.engine.session import Session
from forward_oracle_util import GATE_UP, GLOBAL_MAP, LAYER_MAP, hf_logits, hf_to_gguf_tensors, oracle_config, random_hf_model

TOL = 1e-4


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours − ref| over each position's max |ref|, worst position."""
    ours, ref = np.atleast_2d(ours), np.atleast_2d(ref)
    return float((np.abs(ours - ref).max(axis=1) / np.abs(ref).max(axis=1)).max())


@pytest.fixture(scope="module")
def oracle():
    cfg = oracle_config()
    hf = random_hf_model(cfg, seed=0)
    tensors = hf_to_gguf_tensors(hf, cfg)
    model = Model.from_tensors(cfg.with_numerics(fp8_kv=False, indexer_qat=False), tensors)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 300)
    return cfg, hf, tensors, model, tokens, hf_logits(hf, tokens)


def test_name_map_covers_every_tensor(oracle):
    cfg, hf, tensors, *_ = oracle
    assert set(tensors) == set(expected_shapes(cfg)) | {f"blk.{i}.exp_probs_b.bias" for i in range(cfg.n_hash_layers, cfg.n_layer)}
    for name, shape in expected_shapes(cfg).items():
        assert tensors[name].shape == shape, name
    mapped = set(GLOBAL_MAP) | {f"model.layers.{i}.{s}" for i in range(cfg.n_layer) for s in list(LAYER_MAP) + [GATE_UP]}
    hf_names = {k for k in hf.state_dict() if "inv_freq" not in k}
    assert hf_names <= mapped


def test_all_positions_match_transformers(oracle):
    cfg, hf, tensors, model, tokens, ref = oracle
    state = KVState(model.config, ctx=512)
    ours = forward_chunk(model, state, tokens, all_logits=True)
    err = rel_err(ours, ref)
    assert err <= TOL, f"max relative logit error {err:.3g}"
    assert np.array_equal(ours.argmax(1), ref.argmax(1))


def test_chunked_session_matches_transformers(oracle):
    cfg, hf, tensors, model, tokens, ref = oracle
    s = Session(model, ctx=512, prefill_chunk=97)
    s.prefill(tokens[:250])
    for t in tokens[250:]:
        s.decode(t)
    assert rel_err(s.logits, ref[-1]) <= TOL


def test_oracle_is_sensitive_to_indexer_and_roundings(oracle):
    """The comparison can fail: selecting all compressed rows, or the official roundings, move the
    logits well past the tolerance on this sequence."""
    cfg, hf, tensors, model, tokens, ref = oracle
    no_topk = Model.from_tensors(dataclasses.replace(model.config, indexer_top_k=10_000), tensors)
    assert rel_err(forward_chunk(no_topk, KVState(no_topk.config, 512), tokens, all_logits=True), ref) > 100 * TOL
    official = model.with_numerics(fp8_kv=True, indexer_qat=True)
    assert rel_err(forward_chunk(official, KVState(official.config, 512), tokens, all_logits=True), ref) > 10 * TOL


# Seeds are chosen so no indexer/router top-k has a near-tie (a gap below float32 noise): at such a
# tie a different summation order legitimately picks another row (seed 1 at 600 tokens has a gap of
# 2.6e-7 at position 552 — the numpy reference agrees with transformers there, the numba path not).
@pytest.mark.slow
@pytest.mark.parametrize("overrides,seed,n_tokens", [
    (dict(), 4, 600),
    (dict(n_hash_layers=1, indexer_top_k=16, o_groups=4, n_expert_used=3, routed_scale=2.5), 2, 520),
    (dict(n_layer=4, compress_ratios=(128, 128, 4, 128), swiglu_clamp=(10.0,) * 4, n_hash_layers=2,
          indexer_heads=32), 3, 400),
])
def test_oracle_sweep(overrides, seed, n_tokens):
    cfg = oracle_config(**overrides)
    hf = random_hf_model(cfg, seed=seed)
    model = Model.from_tensors(cfg.with_numerics(fp8_kv=False, indexer_qat=False), hf_to_gguf_tensors(hf, cfg))
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, n_tokens)
    ref = hf_logits(hf, tokens)
    ours = forward_chunk(model, KVState(model.config, ctx=1024), tokens, all_logits=True)
    assert rel_err(ours, ref) <= TOL


def test_converted_gguf_matches_transformers_checkpoint(tmp_path):
    """End to end through the project's tools: a random official-layout checkpoint, converted by
    `ds4-quantize convert` to a GGUF, read by Model.load, against transformers loading the same
    weights through its own official-name mapping (gguf_tools.synth.write_transformers_checkpoint)."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from ds4.engine.config import preset
    from ds4.gguf_tools.synth import synth_checkpoint, write_transformers_checkpoint

    cfg = preset("tiny")
    synth_checkpoint(cfg, tmp_path / "official", seed=3)
    hf = write_transformers_checkpoint(cfg, tmp_path / "tf", seed=3, official_dir=tmp_path / "official")
    exe = Path(sys.executable).with_name("ds4-quantize")
    gguf = tmp_path / "m.gguf"
    subprocess.run([str(exe), "convert", str(tmp_path / "official"), str(gguf), "--type", "f32", "--quiet"], check=True)
    model = Model.load(gguf, fp8_kv=False, indexer_qat=False)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, 260)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([tokens.tolist()]), use_cache=False).logits[0].float().numpy()
    ours = forward_chunk(model, KVState(model.config, ctx=512), tokens, all_logits=True)
    assert rel_err(ours, ref) <= TOL
