"""The one seam between the engine and the tools: observe or edit the forward pass.

Tools never patch `ds4.engine.forward`. They subclass `Hooks`, override what they need, and pass
the instance to `Session(model, hooks=...)` (or assign `session.hooks`). Every method is called
once per layer per forward call, with all T tokens of the call (T = 1 in decode, the chunk length
in prefill), in token order. Arrays are float32 numpy views owned by the engine: copy what you
keep beyond the call, and do not modify arrays in place (return an edited copy instead where a
method allows an edit).

Call order inside `forward_chunk(tokens at positions pos0..pos0+T-1)`:

    begin(pos0, tokens)
    for layer in 0..n_layer-1:
        y = attention(...);  y = sublayer_output(layer, "attn", y) or y;   HC post
        x = RMSNorm(v; ffn_norm)
        routed experts;      routed_inputs(layer, x, expert_ids, weights, down_inputs)
        (before every 2-D layer projection: linear_input(layer, name, x), only when wanted)
        y = routed + shared; y = sublayer_output(layer, "ffn", y) or y;    HC post
        residual(layer, X)

Hook points (model-spec §3.3-3.7, §6; tooling-spec §3.1):

* `routed_inputs(layer, x, expert_ids, weights, down_inputs)` — the MoE's inputs, what an
  importance matrix accumulates. `x` [T, D] is the RMS-normalised FFN input (the input of the
  router and of every routed expert's gate/up projection); `expert_ids` [T, k] int64 (for hash
  layers the tid2eid row of the token, else the biased top-k); `weights` [T, k] the routing
  weights applied (unbiased sqrt-softplus scores normalised and scaled); `down_inputs`
  [T, k, F] the input of each slot's down projection, i.e. the route-weighted SwiGLU
  `w · silu(min(g, clamp)) · clip(u, ±clamp)`. ds4's imatrix accumulates, per (token, slot) with
  expert e: gate/up `sum2[e] += x²`, down `sum2[e] += down_inputs²`, and a count per expert.
  Computing `down_inputs` costs memory, so the engine fills it only when a subclass overrides
  this method (see `wants_routed_inputs`).
* `sublayer_output(layer, kind, y)` — `kind` is "attn" (output of the grouped output projection)
  or "ffn" (routed sum + shared expert); `y` [T, D] is the sublayer output *before* HC post.
  Return None to leave it, or a new [T, D] array to replace it (directional steering:
  `y - scale · v (v · y)`).
  The engine is batch-invariant (decode, prefill and any chunking give the same bits); an edit
  keeps that only if it is computed row by row, e.g. `(y * v).sum(-1, keepdims=True)` rather than
  `y @ v` (BLAS blocks by batch size, and the FP8 KV rounding turns last-bit differences into
  visible ones).
* `residual(layer, X)` — the hyper-connection state [T, n_hc, D] after the layer (observe only).
* `linear_input(layer, name, x)` — the input rows of a layer's 2-D projection whose GGUF tensor is
  `name` (e.g. "blk.3.attn_q_a.weight", "blk.3.attn_output_b.weight", "blk.3.ffn_down_shexp.weight"),
  called right before the product, in forward order, observe only: x is [T, in] (the HC mixers,
  attention q/kv/output, compressors, indexer, router, shared expert); for the grouped
  "attn_output_a" it is [T·G, in/G], group g of token t in row t·G + g. Routed experts are not
  reported here (see `routed_inputs`). The engine makes these calls only when
  `wants_linear_inputs()` is True (default False), so hooks that do not ask cost nothing.
* `begin(pos0, tokens)` — start of a forward call: first absolute position and the token ids [T].
"""

from __future__ import annotations

import numpy as np


class Hooks:
    """No-op base class; override the methods you need."""

    def begin(self, pos0: int, tokens: np.ndarray) -> None:
        pass

    def routed_inputs(self, layer: int, x: np.ndarray, expert_ids: np.ndarray, weights: np.ndarray,
                      down_inputs: np.ndarray) -> None:
        pass

    def sublayer_output(self, layer: int, kind: str, y: np.ndarray) -> np.ndarray | None:
        return None

    def residual(self, layer: int, X: np.ndarray) -> None:
        pass

    def linear_input(self, layer: int, name: str, x: np.ndarray) -> None:
        pass

    def wants_routed_inputs(self) -> bool:
        """True when a subclass overrides `routed_inputs` (the engine then gathers down_inputs)."""
        return type(self).routed_inputs is not Hooks.routed_inputs

    def wants_linear_inputs(self) -> bool:
        """Override to return True to receive `linear_input` calls (off by default: one call per
        projection per layer is not free)."""
        return False


class HookList(Hooks):
    """Several hooks at once, called in order; sublayer edits chain (each sees the previous edit)."""

    def __init__(self, *hooks: Hooks):
        self.hooks = [h for h in hooks if h is not None]

    def begin(self, pos0, tokens):
        for h in self.hooks:
            h.begin(pos0, tokens)

    def routed_inputs(self, layer, x, expert_ids, weights, down_inputs):
        for h in self.hooks:
            if h.wants_routed_inputs():
                h.routed_inputs(layer, x, expert_ids, weights, down_inputs)

    def sublayer_output(self, layer, kind, y):
        edited = None
        for h in self.hooks:
            out = h.sublayer_output(layer, kind, y if edited is None else edited)
            if out is not None:
                edited = out
        return edited

    def residual(self, layer, X):
        for h in self.hooks:
            h.residual(layer, X)

    def linear_input(self, layer, name, x):
        for h in self.hooks:
            if h.wants_linear_inputs():
                h.linear_input(layer, name, x)

    def wants_routed_inputs(self) -> bool:
        return any(h.wants_routed_inputs() for h in self.hooks)

    def wants_linear_inputs(self) -> bool:
        return any(h.wants_linear_inputs() for h in self.hooks)
