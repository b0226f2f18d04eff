"""Shared helpers for the forward-pass oracle tests: a random transformers DeepseekV4 model and the
explicit name map from its state dict to our GGUF tensor names.

The map is written here (test-local) so the oracle does not depend on the converter under test;
`test_forward_oracle.py` also checks it covers every tensor both sides have.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ds4.engine.config import Config, preset
from ds4.gguf_tools import constants as C

L = C.LayerTensor

GLOBAL_MAP = {
    "model.embed_tokens.weight": C.TOKEN_EMBD,
    "lm_head.weight": C.OUTPUT,
    "model.norm.weight": C.OUTPUT_NORM,
    "model.hc_head.hc_fn": C.OUTPUT_HC_FN,
    "model.hc_head.hc_base": C.OUTPUT_HC_BASE,
    "model.hc_head.hc_scale": C.OUTPUT_HC_SCALE,
}
LAYER_MAP = {
    "attn_hc.fn": L.HC_ATTN_FN, "attn_hc.base": L.HC_ATTN_BASE, "attn_hc.scale": L.HC_ATTN_SCALE,
    "ffn_hc.fn": L.HC_FFN_FN, "ffn_hc.base": L.HC_FFN_BASE, "ffn_hc.scale": L.HC_FFN_SCALE,
    "input_layernorm.weight": L.ATTN_NORM, "post_attention_layernorm.weight": L.FFN_NORM,
    "self_attn.q_a_proj.weight": L.ATTN_Q_A, "self_attn.q_a_norm.weight": L.ATTN_Q_A_NORM,
    "self_attn.q_b_proj.weight": L.ATTN_Q_B, "self_attn.kv_proj.weight": L.ATTN_KV,
    "self_attn.kv_norm.weight": L.ATTN_KV_A_NORM, "self_attn.sinks": L.ATTN_SINKS,
    "self_attn.o_a_proj.weight": L.ATTN_OUTPUT_A, "self_attn.o_b_proj.weight": L.ATTN_OUTPUT_B,
    "self_attn.compressor.kv_proj.weight": L.COMP_KV, "self_attn.compressor.gate_proj.weight": L.COMP_GATE,
    "self_attn.compressor.position_bias": L.COMP_APE, "self_attn.compressor.kv_norm.weight": L.COMP_NORM,
    "self_attn.compressor.indexer.kv_proj.weight": L.IDX_COMP_KV,
    "self_attn.compressor.indexer.gate_proj.weight": L.IDX_COMP_GATE,
    "self_attn.compressor.indexer.position_bias": L.IDX_COMP_APE,
    "self_attn.compressor.indexer.kv_norm.weight": L.IDX_COMP_NORM,
    "self_attn.compressor.indexer.q_b_proj.weight": L.IDX_Q_B,
    "self_attn.compressor.indexer.scorer.weights_proj.weight": L.IDX_PROJ,
    "mlp.gate.weight": L.FFN_GATE_INP, "mlp.gate.e_score_correction_bias": L.EXP_PROBS_B,
    "mlp.gate.tid2eid": L.FFN_GATE_TID2EID,
    "mlp.experts.down_proj": L.FFN_DOWN_EXPS,
    "mlp.shared_experts.gate_proj.weight": L.FFN_GATE_SHEXP, "mlp.shared_experts.up_proj.weight": L.FFN_UP_SHEXP,
    "mlp.shared_experts.down_proj.weight": L.FFN_DOWN_SHEXP,
}
# Split on conversion: gate_up_proj [E, 2F, D] holds gate rows first, then up rows.
GATE_UP = "mlp.experts.gate_up_proj"


def oracle_config(**overrides) -> Config:
    """The tiny preset with a small vocabulary (fast oracle runs) unless overridden."""
    base = dataclasses.replace(preset("tiny"), vocab_size=512)
    return dataclasses.replace(base, **overrides)


def hf_config(cfg: Config):
    from transformers import DeepseekV4Config

    names = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    hc = DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, moe_intermediate_size=cfg.expert_ffn,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=1,
        head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank, num_experts_per_tok=cfg.n_expert_used,
        n_routed_experts=cfg.n_expert, n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True,
        routed_scaling_factor=cfg.routed_scale, max_position_embeddings=cfg.context_length,
        rope_theta=cfg.rope_base, compress_rope_theta=cfg.compress_rope_base,
        layer_types=[names[r] for r in cfg.compress_ratios[:cfg.n_layer]],
        mlp_layer_types=["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(cfg.n_layer)],
        hc_mult=cfg.n_hc, hc_sinkhorn_iters=cfg.sinkhorn_iters, hc_eps=cfg.hc_eps,
        swiglu_limit=cfg.swiglu_clamp[0], sliding_window=cfg.sliding_window, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.indexer_heads, index_head_dim=cfg.indexer_dim,
        index_topk=cfg.indexer_top_k, rms_norm_eps=cfg.rms_eps, partial_rotary_factor=cfg.rope_dim / cfg.head_dim,
        rope_parameters={"rope_type": "yarn", "factor": cfg.rope_scaling_factor,
                         "original_max_position_embeddings": cfg.rope_orig_ctx,
                         "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow},
        tie_word_embeddings=False,
    )
    hc._attn_implementation = "eager"
    hc._experts_implementation = "eager"
    return hc


def random_hf_model(cfg: Config, seed: int = 0):
    """A transformers DeepseekV4ForCausalLM (fp32, eager) with every parameter randomised at a scale
    that keeps activations O(1), so all paths (sinks, biases, ape, hash tables) matter."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(cfg)).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            leaf = name.rsplit(".", 1)[-1]
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                v = torch.stack([torch.randperm(cfg.n_expert, generator=g)[:cfg.n_expert_used]
                                 for _ in range(p.shape[0])])
                p.copy_(v.to(p.dtype))
            elif "norm" in name and leaf == "weight":
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif leaf in ("sinks", "position_bias", "base", "hc_base"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif leaf in ("scale", "hc_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif leaf == "e_score_correction_bias":
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif leaf in ("fn", "hc_fn"):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            else:
                raise AssertionError(f"unhandled parameter {name}")
    return model


def hf_to_gguf_tensors(model, cfg: Config) -> dict[str, np.ndarray]:
    """Our GGUF-named tensors (numpy shape = reversed ne) from a transformers state dict."""
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    out: dict[str, np.ndarray] = {}
    for hf_name, ours in GLOBAL_MAP.items():
        out[ours] = sd.pop(hf_name).float().numpy()
    F = cfg.expert_ffn
    for i in range(cfg.n_layer):
        pre = f"model.layers.{i}."
        for hf_suffix, suffix in LAYER_MAP.items():
            if pre + hf_suffix in sd:
                t = sd.pop(pre + hf_suffix)
                out[C.blk(i, suffix)] = t.numpy().astype(np.int32) if suffix == L.FFN_GATE_TID2EID else t.float().numpy()
        gu = sd.pop(pre + GATE_UP).float().numpy()
        out[C.blk(i, L.FFN_GATE_EXPS)] = np.ascontiguousarray(gu[:, :F])
        out[C.blk(i, L.FFN_UP_EXPS)] = np.ascontiguousarray(gu[:, F:])
        if cfg.is_hash_layer(i):
            sd.pop(pre + "mlp.gate.e_score_correction_bias", None)
    leftover = [k for k in sd if "inv_freq" not in k]
    if leftover:
        raise AssertionError(f"state-dict tensors without a GGUF name: {leftover}")
    return out


def hf_logits(model, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(tokens)]), use_cache=False)
    return out.logits[0].float().numpy()


def random_tensors(cfg: Config, seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF-named random weights for `cfg` at scales that keep activations O(1) (no transformers)."""
    from ds4.engine.model import expected_shapes

    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    shapes = dict(expected_shapes(cfg))
    for i in range(cfg.n_hash_layers, cfg.n_layer):
        shapes[C.blk(i, L.EXP_PROBS_B)] = (cfg.n_expert,)
    for name, shape in shapes.items():
        if name.endswith(L.FFN_GATE_TID2EID.value):
            out[name] = np.stack([rng.permutation(cfg.n_expert)[:cfg.n_expert_used] for _ in range(shape[0])]).astype(np.int32)
        elif "norm" in name:
            out[name] = (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith(("sinks.weight", "ape.weight", "base.weight", "hc_base.weight")):
            out[name] = rng.standard_normal(shape).astype(np.float32)
        elif name.endswith("scale.weight"):
            out[name] = (0.5 + rng.random(shape)).astype(np.float32)
        elif name.endswith("exp_probs_b.bias"):
            out[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name == C.TOKEN_EMBD:
            out[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return out


def write_model_gguf(path, cfg: Config, tensors: dict[str, np.ndarray], qtypes: dict[str, int] | None = None):
    """A DS4 GGUF through the project's writer (F32 tensors unless `qtypes` names another type)."""
    from ds4.gguf_tools.writer import ds4_metadata, write_tensors

    qtypes = qtypes or {}
    tokens = [f"<t{i}>" for i in range(cfg.vocab_size)]
    meta = ds4_metadata(cfg, tokens, ["<t0> <t1>"])
    items = {}
    for name, arr in tensors.items():
        q = C.QuantType.I32 if arr.dtype.kind == "i" else C.QuantType(qtypes.get(name, C.QuantType.F32))
        items[name] = (q, arr)
    return write_tensors(path, meta, items)
