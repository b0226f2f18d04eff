"""Which type each GGUF tensor gets (tooling-spec §1.5, §1.8).

The template is the published DS4 layout (model-spec §2.4): Q8_0 attention projections, shared
experts and head; F16 embedding, router, HC mixes, compressors and indexer; F32 vectors; I32
`tid2eid`; routed experts by mix (q2: IQ2_XXS gate/up + Q2_K down, q4: Q4_K). `--type` sets the
base: `q8_0` is the published layout with Q8_0 experts, `f16` turns every quantized non-expert
tensor and the experts into F16, `f32` keeps everything float32 (for close comparisons with an
oracle). Family flags and `--tensor-type` overrides then apply in ds4's decision order:

1. `--tensor-type PFX=T` (exact name or prefix, first match wins), any tensor;
2. routed experts: the per-part flag, else `--experts`, else the template (whose mix is `--mix`,
   or q4 for the last `--q4-last-layers N` layers: the published q2-q4 product, §1.8);
3. 1-D tensors and I32 keep the template type;
4. `token_embd` → `--embedding`; `output.*` → `--output`; `*_shexp.*` → `--shared`;
   attention projections → `--attention-proj`; other attention/indexer/compressor tensors →
   `--attention`; everything else → `--dense`; a family without a flag keeps the template type.

Two matching quirks of ds4 are fixed on purpose: `.attn_q_b.weight` no longer captures the
indexer's `indexer.attn_q_b` (as later ds4 versions do), and `attn_` no longer captures the
hyper-connection tensors `hc_attn_*` (they fall under `--dense`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ds4.engine.config import Config
from ds4.gguf_tools.constants import BLOCK, OUTPUT, TOKEN_EMBD, LayerTensor as T, QuantType
from ds4.gguf_tools.layout import Kind, TensorSlot, tensor_layout
from ds4.gguf_tools.writer import TensorPlan

Q = QuantType
PRODUCIBLE = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS)
TYPE_NAMES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q80": Q.Q8_0, "q2k": Q.Q2_K, "q4k": Q.Q4_K,
              "iq2xxs": Q.IQ2_XXS}
BASES = ("f16", "q8_0", "f32")
MIXES = {  # routed (gate, up, down)
    "q2": (Q.IQ2_XXS, Q.IQ2_XXS, Q.Q2_K),
    "q4": (Q.Q4_K, Q.Q4_K, Q.Q4_K),
}
ATTN_PROJ = (T.ATTN_Q_A, T.ATTN_Q_B, T.ATTN_KV, T.ATTN_OUTPUT_A, T.ATTN_OUTPUT_B)


class PlanError(ValueError):
    """A type plan that cannot be written (one-line message)."""


def parse_type(text: str) -> QuantType | None:
    """A type name, case-insensitive with '-'/'_' ignored; 'copy'/'template' → None (keep template)."""
    key = text.lower().replace("-", "").replace("_", "")
    if key in ("copy", "template"):
        return None
    if key not in TYPE_NAMES:
        raise PlanError(f"unknown type '{text}' (choose f32, f16, bf16, q8_0, q2_k, q4_k, iq2_xxs or copy)")
    return TYPE_NAMES[key]


@dataclass
class Policy:
    base: str = "f16"
    mix: str | None = None
    experts: QuantType | None = None
    routed_gate: QuantType | None = None
    routed_up: QuantType | None = None
    routed_down: QuantType | None = None
    attention_proj: QuantType | None = None
    attention: QuantType | None = None
    shared: QuantType | None = None
    embedding: QuantType | None = None
    output: QuantType | None = None
    dense: QuantType | None = None
    tensor_types: list[tuple[str, QuantType]] = field(default_factory=list)
    q4_last_layers: int = 0  # the q2-q4 mix: routed experts of the last N layers take the q4 mix


def layer_mix(p: Policy, layer: int | None, n_layer: int) -> str | None:
    """The routed-expert mix of one layer: `--mix`, except q4 for the last `q4_last_layers` layers."""
    if layer is not None and p.q4_last_layers and layer >= n_layer - p.q4_last_layers:
        return "q4"
    return p.mix


def _suffix(slot: TensorSlot) -> T | None:
    return T(slot.name.split(".", 2)[2]) if slot.layer is not None else None


def published_type(slot: TensorSlot, mix: str | None = None) -> QuantType:
    """The type of this tensor in the published DS4 GGUFs (experts: by mix, Q8_0 without one)."""
    sfx = _suffix(slot)
    if slot.kind == Kind.INDEX:
        return Q.I32
    if slot.kind == Kind.VECTOR:
        return Q.F32
    if slot.kind == Kind.EXPERTS:
        if mix is None:
            return Q.Q8_0
        gate, up, down = MIXES[mix]
        return {T.FFN_GATE_EXPS: gate, T.FFN_UP_EXPS: up, T.FFN_DOWN_EXPS: down}[sfx]
    if slot.name == OUTPUT or sfx in ATTN_PROJ or sfx in (T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP, T.FFN_DOWN_SHEXP):
        return Q.Q8_0
    return Q.F16


def template_type(slot: TensorSlot, base: str, mix: str | None) -> QuantType:
    t = published_type(slot, mix)
    if t in (Q.I32,) or slot.kind == Kind.VECTOR:
        return t
    if base == "f32":
        return t if (slot.kind == Kind.EXPERTS and mix) else Q.F32
    if base == "f16":
        return t if (slot.kind == Kind.EXPERTS and mix) else Q.F16
    return t  # q8_0: the published layout, Q8_0 experts unless a mix says otherwise


def _family(slot: TensorSlot, p: Policy) -> QuantType | None:
    name, sfx = slot.name, _suffix(slot)
    if name == TOKEN_EMBD:
        return p.embedding
    if name.startswith("output."):
        return p.output
    if "_shexp." in name:
        return p.shared
    if sfx in ATTN_PROJ:
        return p.attention_proj
    if sfx is not None and not name.split(".", 2)[2].startswith("hc_") and (
            ".attn" in name or "attn_" in name or ".indexer" in name or "indexer_" in name):
        return p.attention
    return p.dense


def choose_type(slot: TensorSlot, p: Policy, n_layer: int = 0) -> QuantType:
    for prefix, t in p.tensor_types:
        if slot.name == prefix or slot.name.startswith(prefix):
            return t
    tmpl = template_type(slot, p.base, layer_mix(p, slot.layer, n_layer) if slot.kind == Kind.EXPERTS else p.mix)
    if slot.kind == Kind.EXPERTS:
        part = {T.FFN_GATE_EXPS: p.routed_gate, T.FFN_UP_EXPS: p.routed_up, T.FFN_DOWN_EXPS: p.routed_down}[_suffix(slot)]
        # QuantType.F32 is 0, so test for None rather than truth
        return next(t for t in (part, p.experts, tmpl) if t is not None)
    if slot.kind in (Kind.VECTOR, Kind.INDEX):
        return tmpl
    fam = _family(slot, p)
    return tmpl if fam is None else fam


def plan(cfg: Config, p: Policy, present: set[str] | None = None) -> list[TensorPlan]:
    """TensorPlans for every tensor of `cfg` (optional tensors only if in `present`)."""
    if p.base not in BASES:
        raise PlanError(f"unknown --type '{p.base}' (choose {', '.join(BASES)})")
    if p.mix is not None and p.mix not in MIXES:
        raise PlanError(f"unknown --mix '{p.mix}' (choose {', '.join(MIXES)})")
    if p.q4_last_layers:
        if p.mix != "q2":
            raise PlanError("--q4-last-layers makes the q2-q4 mix: it goes with --mix q2")
        if not 0 < p.q4_last_layers <= cfg.n_layer:
            raise PlanError(f"--q4-last-layers {p.q4_last_layers}: this model has {cfg.n_layer} layers")
    out = []
    by_layer: dict[int, dict[T, QuantType]] = {}
    for slot in tensor_layout(cfg):
        if slot.optional and present is not None and slot.name not in present:
            continue
        t = choose_type(slot, p, cfg.n_layer)
        if slot.kind == Kind.INDEX and t != Q.I32:
            raise PlanError(f"tensor '{slot.name}' holds expert ids and must stay I32, not {t.name}")
        if slot.kind == Kind.VECTOR and t != Q.F32:
            raise PlanError(f"tensor '{slot.name}' is a vector and must be F32, not {t.name}")
        if t not in PRODUCIBLE and t != Q.I32:
            raise PlanError(f"tensor '{slot.name}': cannot produce type {t.name}")
        block = BLOCK[t].elements
        if slot.ne[0] % block:
            raise PlanError(f"tensor '{slot.name}': {t.name} needs rows of a multiple of {block} values, "
                            f"this tensor's rows have {slot.ne[0]}")
        if slot.kind == Kind.EXPERTS:
            by_layer.setdefault(slot.layer, {})[_suffix(slot)] = t
        out.append(TensorPlan(slot.name, t, slot.ne))
    for layer, types in by_layer.items():
        if types[T.FFN_GATE_EXPS] != types[T.FFN_UP_EXPS]:
            raise PlanError(f"layer {layer}: routed gate ({types[T.FFN_GATE_EXPS].name}) and up "
                            f"({types[T.FFN_UP_EXPS].name}) experts must share a type")
    return out


# ---- published file names (tooling-spec §1.8) ----------------------------------------------------

_MIX_TAGS = {
    "q2": "IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8",
    "q4": "Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out",
}
_PRESET_STEMS = {"flash": "DeepSeek-V4-Flash", "pro": "DeepSeek-V4-Pro"}


def model_stem(cfg: Config, fallback: str) -> str:
    """'DeepSeek-V4-Flash' / '-Pro' when `cfg` has that preset's shape, else `fallback`."""
    from ds4.engine.config import preset

    for key, stem in _PRESET_STEMS.items():
        ref = preset(key)
        if (cfg.n_layer, cfg.n_embd, cfg.n_expert, cfg.expert_ffn, cfg.vocab_size) == \
                (ref.n_layer, ref.n_embd, ref.n_expert, ref.expert_ffn, ref.vocab_size):
            return stem
    return fallback


def published_filename(stem: str, p: Policy, n_layer: int, imatrix: bool = False) -> str:
    """The file name the published DS4 GGUFs give this product (§1.8), e.g.
    `DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix.gguf`.

    q2, q4 and q2-q4 (`--q4-last-layers`) on the published base (`--type q8_0`) get the published
    names; any other policy is named after its base and mix, and `-custom` marks family or
    per-tensor flags the name cannot describe.
    """
    custom = any(v is not None for v in (p.experts, p.routed_gate, p.routed_up, p.routed_down, p.attention_proj,
                                         p.attention, p.shared, p.embedding, p.output, p.dense)) or bool(p.tensor_types)
    if p.base == "q8_0" and p.mix in _MIX_TAGS:
        if p.q4_last_layers:
            first = n_layer - p.q4_last_layers
            tag = (f"Layers{first:02d}-{n_layer - 1:02d}Q4KExperts-OtherExpertLayersIQ2XXSGateUp-Q2KDown-"
                   "AProjQ8-SExpQ8-OutQ8")
        else:
            tag = _MIX_TAGS[p.mix]
        tag += "-chat-v2"
    else:
        tag = p.base.upper().replace("_", "") + (f"-{p.mix.upper()}Experts" if p.mix else "")
    return f"{stem}-{tag}{'-custom' if custom else ''}{'-imatrix' if imatrix else ''}.gguf"
