"""`Hooks.linear_input`: the input rows of every 2-D layer projection, observe-only, off by default,
and `ds4-imatrix collect --all-tensors` collecting attention and shared-down entries through it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ds4.engine.hooks import HookList, Hooks
from ds4.engine.model import Model
from ds4.engine.numerics import silu
from ds4.engine.session import Session
from ds4.gguf_tools import constants as C
from forward_oracle_util import oracle_config, random_tensors

L = C.LayerTensor


@pytest.fixture(scope="module")
def model():
    cfg = oracle_config()
    return Model.from_tensors(cfg, random_tensors(cfg, seed=11))


@pytest.fixture(scope="module")
def tokens(model):
    return np.random.default_rng(12).integers(0, model.config.vocab_size, 150).tolist()


class LinearRecorder(Hooks):
    def __init__(self):
        self.calls: list[tuple[int, str]] = []
        self.x: dict[str, np.ndarray] = {}  # last call's input per tensor
        self.routed, self.sub = {}, {}

    def wants_linear_inputs(self):
        return True

    def linear_input(self, layer, name, x):
        self.calls.append((layer, name))
        self.x[name] = x.copy()

    def routed_inputs(self, layer, x, expert_ids, weights, down_inputs):
        self.routed[layer] = (x.copy(), expert_ids.copy(), down_inputs.copy())

    def sublayer_output(self, layer, kind, y):
        self.sub[(layer, kind)] = y.copy()


class Sink(Hooks):
    """Overrides linear_input but does not ask for it: must never be called."""

    def linear_input(self, layer, name, x):
        raise AssertionError("linear_input called without wants_linear_inputs()")


def test_off_by_default_and_observe_only(model, tokens):
    plain = Session(model, ctx=256).prefill(tokens, all_logits=True)
    assert not Hooks().wants_linear_inputs() and not HookList(Sink()).wants_linear_inputs()
    assert np.array_equal(Session(model, ctx=256, hooks=Sink()).prefill(tokens, all_logits=True), plain)
    rec = LinearRecorder()
    got = Session(model, ctx=256, hooks=HookList(Sink(), rec), prefill_chunk=100).prefill(tokens, all_logits=True)
    assert np.array_equal(got, plain)
    assert rec.calls


def test_reports_every_layer_projection_in_forward_order(model, tokens):
    cfg = model.config
    rec = LinearRecorder()
    Session(model, ctx=256, hooks=rec).prefill(tokens)  # one chunk: each projection once per layer
    layers = [li for li, _ in rec.calls]
    assert layers == sorted(layers) and set(layers) == set(range(cfg.n_layer))
    for li in range(cfg.n_layer):
        names = [n for l2, n in rec.calls if l2 == li]
        assert len(names) == len(set(names)), names
        first = [C.blk(li, s) for s in (L.HC_ATTN_FN, L.ATTN_Q_A, L.ATTN_Q_B, L.ATTN_KV)]
        assert names[:4] == first
        last = [C.blk(li, s) for s in (L.ATTN_OUTPUT_A, L.ATTN_OUTPUT_B, L.HC_FFN_FN, L.FFN_GATE_INP,
                                       L.FFN_GATE_SHEXP, L.FFN_UP_SHEXP, L.FFN_DOWN_SHEXP)]
        assert names[-7:] == last
        r = cfg.ratio(li)
        if r:
            assert C.blk(li, L.COMP_KV) in names and C.blk(li, L.COMP_GATE) in names
        if r == 4:  # 150 tokens → 37 rows > top-k: the indexer's q and weights projections run
            for s in (L.IDX_COMP_KV, L.IDX_COMP_GATE, L.IDX_Q_B, L.IDX_PROJ):
                assert C.blk(li, s) in names
        for n in names:  # every input's width is the weight's input width
            w = model.w(n)
            assert rec.x[n].ndim == 2 and rec.x[n].shape[1] == w.shape[-1], n
        assert rec.x[C.blk(li, L.ATTN_OUTPUT_A)].shape[0] == len(tokens) * cfg.o_groups
        for n in names:
            if n.endswith(("attn_q_a.weight", "attn_kv.weight", "compressor_kv.weight")):
                np.testing.assert_array_equal(rec.x[n], rec.x[C.blk(li, L.ATTN_Q_A)])


def test_inputs_rebuild_the_sublayer_outputs(model, tokens):
    """attn_output_b's input gives the attention output; the shared down input plus the routed
    experts give the FFN output; the shared gate input is the routed x."""
    cfg = model.config
    rec = LinearRecorder()
    s = Session(model, ctx=256, hooks=rec)
    s.prefill(tokens[:60])
    s.decode(tokens[60])  # the last calls are one decode step (T = 1)
    for li in range(cfg.n_layer):
        xb = rec.x[C.blk(li, L.ATTN_OUTPUT_B)]
        assert xb.shape[0] == 1
        np.testing.assert_allclose(xb @ model.w(C.blk(li, L.ATTN_OUTPUT_B)).T, rec.sub[(li, "attn")],
                                   rtol=1e-4, atol=1e-5)
        x, ids, mid = rec.routed[li]
        np.testing.assert_array_equal(rec.x[C.blk(li, L.FFN_GATE_SHEXP)], x)
        np.testing.assert_array_equal(rec.x[C.blk(li, L.FFN_GATE_INP)], x)
        W2 = model.w(C.blk(li, L.FFN_DOWN_EXPS))
        routed = sum(W2[ids[0, j]] @ mid[0, j] for j in range(cfg.n_expert_used))
        xd = rec.x[C.blk(li, L.FFN_DOWN_SHEXP)]
        lim = cfg.swiglu_clamp[li]
        g, u = x @ model.w(C.blk(li, L.FFN_GATE_SHEXP)).T, x @ model.w(C.blk(li, L.FFN_UP_SHEXP)).T
        np.testing.assert_allclose(xd, silu(np.minimum(g, lim)) * np.clip(u, -lim, lim), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(routed + xd @ model.w(C.blk(li, L.FFN_DOWN_SHEXP)).T, rec.sub[(li, "ffn")],
                                   rtol=1e-4, atol=1e-4)


def test_imatrix_collect_all_tensors_cli(tmp_path):
    import gguf

    from ds4_tool_util import write_random_tiny

    path = write_random_tiny(tmp_path / "tiny.gguf")
    cfg = Model.load(path).config
    src = tmp_path / "calib.txt"
    src.write_text("The river bends because the outer bank erodes faster than the inner one. " * 4)
    outs = {}
    for flag in ([], ["--all-tensors"]):
        out = tmp_path / f"im{len(flag)}.gguf"
        r = subprocess.run([sys.executable, "-m", "ds4.imatrix.cli", "collect", "-m", str(path), "--rendered",
                            str(src), "-o", str(out), "--max-tokens", "40", "--quiet", *flag],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        outs[bool(flag)] = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(out).tensors}
    plain, full = outs[False], outs[True]
    assert not any("attn" in n or "shexp" in n for n in plain)
    for li in range(cfg.n_layer):
        for s, width in ((L.ATTN_Q_A, cfg.n_embd), (L.ATTN_KV, cfg.n_embd), (L.ATTN_OUTPUT_B, cfg.o_groups * cfg.o_lora_rank),
                         (L.FFN_DOWN_SHEXP, cfg.expert_ffn), (L.FFN_GATE_SHEXP, cfg.n_embd)):
            name = C.blk(li, s)
            assert full[name + ".counts"].reshape(-1).tolist() == [40.0], name  # once per token, not twice
            assert full[name + ".in_sum2"].size == width and np.all(full[name + ".in_sum2"] >= 0), name
        # routed entries are the same with and without --all-tensors
        for kind in ("gate", "up", "down"):
            n = f"blk.{li}.ffn_{kind}_exps.weight.in_sum2"
            np.testing.assert_array_equal(full[n], plain[n])
