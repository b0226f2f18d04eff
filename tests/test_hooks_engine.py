"""The hooks seam: what tools observe is what the forward computes, and edits take effect."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine.forward import head
from ds4.engine import kernels
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
    return Model.from_tensors(cfg, random_tensors(cfg, seed=5))


@pytest.fixture(scope="module")
def tokens(model):
    return np.random.default_rng(6).integers(0, model.config.vocab_size, 150).tolist()


class Recorder(Hooks):
    def __init__(self):
        self.calls, self.routed, self.sub, self.res, self.begins = [], {}, {}, {}, []

    def begin(self, pos0, tokens):
        self.begins.append((pos0, list(tokens)))

    def routed_inputs(self, layer, x, expert_ids, weights, down_inputs):
        self.calls.append(("routed", layer))
        self.routed[layer] = (x.copy(), expert_ids.copy(), weights.copy(), down_inputs.copy())

    def sublayer_output(self, layer, kind, y):
        self.calls.append((kind, layer))
        self.sub[(layer, kind)] = y.copy()
        return None

    def residual(self, layer, X):
        self.calls.append(("residual", layer))
        self.res[layer] = X.copy()


def test_observing_hooks_change_nothing_and_see_the_forward(model, tokens):
    cfg = model.config
    plain = Session(model, ctx=256).prefill(tokens, all_logits=True)
    rec = Recorder()
    s = Session(model, ctx=256, hooks=rec, prefill_chunk=100)
    assert np.array_equal(s.prefill(tokens, all_logits=True), plain)
    assert [b[0] for b in rec.begins] == [0, 100]
    per_layer = [("attn", 0), ("routed", 0), ("ffn", 0), ("residual", 0)]
    assert rec.calls[:4] == per_layer and len(rec.calls) == 2 * 4 * cfg.n_layer

    # the last chunk (tokens 100..149) as the tools see it
    li = cfg.n_layer - 1
    x, ids, w, mid = rec.routed[li]
    T, k, F = 50, cfg.n_expert_used, cfg.expert_ffn
    assert x.shape == (T, cfg.n_embd) and ids.shape == (T, k) and w.shape == (T, k) and mid.shape == (T, k, F)
    np.testing.assert_allclose(w.sum(1), cfg.routed_scale, rtol=1e-5)
    # down_inputs really are each slot's route-weighted SwiGLU, and with the shared expert on x they
    # rebuild the FFN output the sublayer hook saw
    W1, W3, W2 = (model.w(C.blk(li, n)) for n in (L.FFN_GATE_EXPS, L.FFN_UP_EXPS, L.FFN_DOWN_EXPS))
    lim = cfg.swiglu_clamp[li]
    e = ids[7, 1]
    expect = silu(np.minimum(x[7] @ W1[e].T, lim)) * np.clip(x[7] @ W3[e].T, -lim, lim) * w[7, 1]
    np.testing.assert_allclose(mid[7, 1], expect, rtol=1e-4, atol=1e-5)
    routed = np.stack([sum(W2[ids[t, j]] @ mid[t, j] for j in range(k)) for t in range(T)])
    g = x @ model.w(C.blk(li, L.FFN_GATE_SHEXP)).T
    u = x @ model.w(C.blk(li, L.FFN_UP_SHEXP)).T
    shared = (silu(np.minimum(g, lim)) * np.clip(u, -lim, lim)) @ model.w(C.blk(li, L.FFN_DOWN_SHEXP)).T
    np.testing.assert_allclose(routed + shared, rec.sub[(li, "ffn")], rtol=1e-4, atol=1e-4)
    # hash layers route by token id
    np.testing.assert_array_equal(rec.routed[0][1], model.ids(C.blk(0, L.FFN_GATE_TID2EID))[tokens[100:]])
    # the last residual state gives the logits through the head
    np.testing.assert_array_equal(head(model, kernels, rec.res[li]), plain[100:])


class ZeroFFN(Hooks):
    def __init__(self, layer):
        self.layer = layer

    def sublayer_output(self, layer, kind, y):
        return np.zeros_like(y) if (layer, kind) == (self.layer, "ffn") else None


class Project(Hooks):
    """Directional steering as tools apply it: y ← y − s·v(v·y)."""

    def __init__(self, v, scale, kind):
        self.v, self.scale, self.kind = v / np.linalg.norm(v), scale, kind

    def sublayer_output(self, layer, kind, y):
        if kind != self.kind:
            return None
        return (y - self.scale * (y * self.v).sum(axis=1, keepdims=True) * self.v).astype(np.float32)


def test_sublayer_edits_take_effect_in_prefill_and_decode(model, tokens):
    base = Session(model, ctx=256).prefill(tokens[:40], all_logits=True)
    edited = Session(model, ctx=256, hooks=ZeroFFN(3)).prefill(tokens[:40], all_logits=True)
    assert np.abs(edited - base).max() > 1e-3
    # an edit applied while decoding token by token equals the same edit in one prefill
    v = np.random.default_rng(7).standard_normal(model.config.n_embd).astype(np.float32)
    hooks = Project(v, 1.0, "attn")
    s = Session(model, ctx=256, hooks=hooks)
    dec = np.stack([s.decode(t).copy() for t in tokens[:40]])
    pre = Session(model, ctx=256, hooks=hooks).prefill(tokens[:40], all_logits=True)
    assert np.array_equal(dec, pre)
    assert np.abs(pre - base).max() > 1e-3
    # the projected-out direction is gone from what later hooks in the chain see
    rec = Recorder()
    Session(model, ctx=256, hooks=HookList(hooks, rec)).prefill(tokens[:10])
    assert np.abs(rec.sub[(2, "attn")] @ hooks.v).max() < 1e-4


def test_hooklist_chains_edits_in_order(model, tokens):
    v = np.random.default_rng(8).standard_normal(model.config.n_embd).astype(np.float32)
    one = Session(model, ctx=64, hooks=HookList(Project(v, 0.5, "ffn"), Project(v, 0.5, "ffn"))).prefill(tokens[:20])
    two = Session(model, ctx=64, hooks=Project(v, 0.75, "ffn")).prefill(tokens[:20])  # (1−.5)² = 1−.75
    np.testing.assert_allclose(one, two, rtol=1e-4, atol=1e-4)
    assert not Hooks().wants_routed_inputs() and Recorder().wants_routed_inputs()
