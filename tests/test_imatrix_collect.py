"""Importance collection through the engine hooks on the `tiny` model: sums equal a direct numpy
recomputation of the routed inputs, counts equal the router's selections, never-routed experts are
1.0 in the .dat, the numba kernels equal their references, calibration text parses and renders."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from ds4 import paths
from ds4.engine.hooks import HookList, Hooks
from ds4.gguf_tools.constants import LayerTensor as L, blk
from ds4.imatrix import collect as C
from ds4.imatrix import format as F


# ---- kernels -------------------------------------------------------------------------------------

def test_numba_kernels_equal_reference():
    rng = np.random.default_rng(0)
    E, T, k, D, Fw = 7, 33, 3, 24, 10
    x = rng.standard_normal((T, D)).astype(np.float32)
    mid = rng.standard_normal((T, k, Fw)).astype(np.float32)
    ids = rng.integers(-1, E + 1, (T, k))  # includes out-of-range ids, which are ignored
    s_ref, c_ref = np.zeros((E, D), np.float32), np.zeros(E, np.int64)
    s_fast, c_fast = np.zeros((E, D), np.float32), np.zeros(E, np.int64)
    C.accumulate_token_rows_ref(s_ref, c_ref, x, ids)
    C.accumulate_token_rows(s_fast, c_fast, x, ids)
    np.testing.assert_array_equal(c_fast, c_ref)
    np.testing.assert_allclose(s_fast, s_ref, rtol=1e-6)
    d_ref, d_fast = np.zeros((E, Fw), np.float32), np.zeros((E, Fw), np.float32)
    C.accumulate_slot_rows_ref(d_ref, mid, ids)
    C.accumulate_slot_rows(d_fast, mid, ids)
    np.testing.assert_allclose(d_fast, d_ref, rtol=1e-6)
    valid = (ids >= 0) & (ids < E)
    assert c_ref.sum() == valid.sum()


# ---- collection on tiny --------------------------------------------------------------------------

class FfnInputRecorder(Hooks):
    """Keeps what the engine reports: the FFN inputs and selections per layer (copies)."""

    def __init__(self):
        self.calls = []

    def routed_inputs(self, layer, x, expert_ids, weights, down_inputs):
        self.calls.append((layer, x.copy(), expert_ids.copy(), weights.copy()))


def _softplus(z):
    return np.logaddexp(0.0, z)


def _recompute(model, layer, x, ids, weights):
    """Routed down inputs from the weights and model-spec §3.7, independently of the engine."""
    cfg = model.config
    W1 = model.w(blk(layer, L.FFN_GATE_EXPS)).astype(np.float64)
    W3 = model.w(blk(layer, L.FFN_UP_EXPS)).astype(np.float64)
    lim = cfg.swiglu_clamp[layer]
    T, k = ids.shape
    mid = np.zeros((T, k, cfg.expert_ffn))
    xd = x.astype(np.float64)
    for t in range(T):
        for s in range(k):
            e = ids[t, s]
            g = np.minimum(W1[e] @ xd[t], lim)
            u = np.clip(W3[e] @ xd[t], -lim, lim)
            mid[t, s] = g / (1 + np.exp(-g)) * u * weights[t, s]
    return mid


def _expected_ids(model, layer, x, tokens):
    cfg = model.config
    if cfg.is_hash_layer(layer):
        return model.ids(blk(layer, L.FFN_GATE_TID2EID))[tokens]
    s = np.sqrt(_softplus(x.astype(np.float64) @ model.w(blk(layer, L.FFN_GATE_INP)).T.astype(np.float64)))
    bias = blk(layer, L.EXP_PROBS_B)
    if model.has(bias):
        s = s + model.w(bias)
    return np.argsort(-s, axis=1, kind="stable")[:, : cfg.n_expert_used]


def test_collected_sums_and_counts_equal_recomputation(tiny_model, tiny_tokens):
    model = tiny_model
    cfg = model.config
    tokens = tiny_tokens[:40]
    acc = C.RoutedAccumulator(cfg)
    rec = FfnInputRecorder()
    C.prefill_fresh(model, tokens, HookList(rec, C.ImatrixHooks(acc)), chunk=16)
    assert {c[0] for c in rec.calls} == set(range(cfg.n_layer))
    gu = np.zeros((cfg.n_layer, cfg.n_expert, cfg.n_embd))
    down = np.zeros((cfg.n_layer, cfg.n_expert, cfg.expert_ffn))
    counts = np.zeros((cfg.n_layer, cfg.n_expert), np.int64)
    pos = {layer: 0 for layer in range(cfg.n_layer)}
    for layer, x, ids, w in rec.calls:
        T = x.shape[0]
        chunk_tokens = np.asarray(tokens[pos[layer]:pos[layer] + T])
        pos[layer] += T
        # counts equal the router's selections (hash table / biased top-k of sqrt-softplus scores)
        np.testing.assert_array_equal(np.sort(ids, axis=1), np.sort(_expected_ids(model, layer, x, chunk_tokens), axis=1))
        mid = _recompute(model, layer, x, ids, w)
        for t in range(T):
            for s in range(ids.shape[1]):
                e = ids[t, s]
                gu[layer, e] += x[t].astype(np.float64) ** 2
                down[layer, e] += mid[t, s] ** 2
                counts[layer, e] += 1
    assert all(p == len(tokens) for p in pos.values())
    np.testing.assert_array_equal(acc.counts, counts)
    np.testing.assert_array_equal(acc.down_counts, counts)
    assert np.all(acc.counts.sum(axis=1) == len(tokens) * cfg.n_expert_used)
    np.testing.assert_allclose(acc.gate_up_sum2, gu, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(acc.down_sum2, down, rtol=2e-4, atol=1e-6)


def test_never_routed_experts_are_one_in_dat(tiny_model, tiny_tokens, tmp_path):
    cfg = tiny_model.config
    acc = C.RoutedAccumulator(cfg)
    C.prefill_fresh(tiny_model, tiny_tokens[:1], C.ImatrixHooks(acc))  # one token: k experts per layer
    assert np.all((acc.counts > 0).sum(axis=1) <= cfg.n_expert_used)
    F.save(tmp_path / "one.dat", acc.to_imatrix("text"))
    back = F.load(tmp_path / "one.dat")
    for layer in range(cfg.n_layer):
        for suffix, width, sums in ((L.FFN_GATE_EXPS, cfg.n_embd, acc.gate_up_sum2),
                                    (L.FFN_DOWN_EXPS, cfg.expert_ffn, acc.down_sum2)):
            for e in range(cfg.n_expert):
                row = back.vector_for(blk(layer, suffix), width, e)
                n = acc.counts[layer, e]
                if n == 0:
                    assert np.all(row == 1.0)
                else:
                    np.testing.assert_allclose(row, sums[layer, e] / n, rtol=1e-6)


def test_collect_loop_budget_and_prompt_independence(tiny_model):
    """--max-tokens truncates; every prompt starts from a fresh state (same text → same sums)."""
    text = "Hello there, general Kenobi. " * 3
    prompts = [C.Prompt("a", text), C.Prompt("b", text)]
    r = C.collect(tiny_model, prompts, progress=False)
    n = len(tiny_model.tokenizer.encode_chat(text))
    assert (r.prompts, r.tokens, r.interrupted) == (2, 2 * n, False)
    one = C.collect(tiny_model, prompts[:1], progress=False)
    np.testing.assert_allclose(r.accumulator.gate_up_sum2, 2 * one.accumulator.gate_up_sum2, rtol=1e-5)
    np.testing.assert_array_equal(r.accumulator.counts, 2 * one.accumulator.counts)
    capped = C.collect(tiny_model, prompts, max_tokens=n + 3, progress=False)
    assert capped.tokens == n + 3 and capped.prompts == 2
    assert np.all(capped.accumulator.counts.sum(axis=1) == (n + 3) * tiny_model.config.n_expert_used)


def test_all_tensors_adds_shared_expert_entries(tiny_model, tiny_tokens):
    acc = C.RoutedAccumulator(tiny_model.config, all_tensors=True)
    C.prefill_fresh(tiny_model, tiny_tokens[:9], C.ImatrixHooks(acc))
    im = acc.to_imatrix()
    name = blk(0, L.FFN_GATE_SHEXP)
    assert name in im.entries and im.entries[name].counts[0] == 9
    # the shared expert's gate input is the same x every routed expert sees: Σx² over tokens
    np.testing.assert_allclose(im.entries[name].sum2[0] * tiny_model.config.n_expert_used,
                               acc.gate_up_sum2[0].sum(axis=0), rtol=1e-5)


# ---- calibration text ----------------------------------------------------------------------------

def test_marker_text_round_trips_the_shipped_rendered_file():
    from ds4.imatrix.dataset import rendered_file_text

    text = gzip.open(paths.data_dir() / "imatrix" / "rendered_prompts.txt.gz", "rt", encoding="utf-8").read()
    prompts = C.split_rendered(text)
    manifest = json.loads((paths.data_dir() / "imatrix" / "manifest.json").read_text())
    assert len(prompts) == manifest["record_count"]
    assert rendered_file_text(prompts) == text
    assert C.split_rendered("  just one prompt \n")[0].text == "just one prompt"


def test_build_dataset_rerenders_records_like_the_shipped_ones():
    """Records without a tools block re-render through the engine's chat renderer to exactly the
    recorded text (records with tools lack the tool list, so they cannot)."""
    from ds4.imatrix.dataset import render_record

    checked = 0
    for i, rec in enumerate(C.iter_jsonl(paths.data_dir() / "imatrix" / "prompts.jsonl.gz")):
        if "## Tools" in rec["rendered"]:
            continue
        (p,) = render_record(rec, index=i, rerender=True)
        assert p.text == rec["rendered"], rec["id"]
        assert p.mode == rec["mode"]
        checked += 1
        if checked == 300:
            break
    assert checked == 300


def test_build_dataset_cli(tmp_path):
    import subprocess
    import sys

    recs = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]},
            {"mode": "think", "category": "x", "messages": [{"role": "user", "content": "2+2?"},
                                                            {"role": "assistant", "content": "4", "reasoning": "add"}]}]
    src = tmp_path / "recs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "out.txt"
    r = subprocess.run([sys.executable, "-m", "ds4.imatrix.cli", "build-dataset", str(src), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    prompts = C.split_rendered(out.read_text())
    assert [p.mode for p in prompts] == ["nothink", "think", "think"]
    assert prompts[0].text.endswith("<｜User｜>Why is the sky blue?<｜Assistant｜></think>")
    assert prompts[1].text.endswith("<｜Assistant｜><think>")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    r = subprocess.run([sys.executable, "-m", "ds4.imatrix.cli", "build-dataset", str(tmp_path / "bad.jsonl"),
                        "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and "malformed JSON" in r.stderr and "Traceback" not in r.stderr


# ---- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_tokens(tiny_model):
    from ds4_tool_util import SAMPLE_TEXT

    return tiny_model.tokenizer.encode(SAMPLE_TEXT)
