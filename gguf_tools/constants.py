"""Every on-disk name of the DS4 GGUF layout in one place (model-spec §2).

Metadata keys, tensor name patterns and the quant types ds4 uses, with their block sizes.
Nothing else in the project spells these strings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

ARCH = "deepseek4"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32


class Key(str, enum.Enum):
    """Metadata keys (model-spec §2.2)."""

    ARCHITECTURE = "general.architecture"
    NAME = "general.name"
    ALIGNMENT = "general.alignment"
    BLOCK_COUNT = f"{ARCH}.block_count"
    CONTEXT_LENGTH = f"{ARCH}.context_length"
    EMBEDDING_LENGTH = f"{ARCH}.embedding_length"
    VOCAB_SIZE = f"{ARCH}.vocab_size"
    HEAD_COUNT = f"{ARCH}.attention.head_count"
    HEAD_COUNT_KV = f"{ARCH}.attention.head_count_kv"
    KEY_LENGTH = f"{ARCH}.attention.key_length"
    VALUE_LENGTH = f"{ARCH}.attention.value_length"
    Q_LORA_RANK = f"{ARCH}.attention.q_lora_rank"
    OUTPUT_LORA_RANK = f"{ARCH}.attention.output_lora_rank"
    OUTPUT_GROUP_COUNT = f"{ARCH}.attention.output_group_count"
    SLIDING_WINDOW = f"{ARCH}.attention.sliding_window"
    RMS_EPS = f"{ARCH}.attention.layer_norm_rms_epsilon"
    COMPRESS_RATIOS = f"{ARCH}.attention.compress_ratios"
    COMPRESS_ROPE_FREQ_BASE = f"{ARCH}.attention.compress_rope_freq_base"
    INDEXER_HEAD_COUNT = f"{ARCH}.attention.indexer.head_count"
    INDEXER_KEY_LENGTH = f"{ARCH}.attention.indexer.key_length"
    INDEXER_TOP_K = f"{ARCH}.attention.indexer.top_k"
    ROPE_DIMENSION_COUNT = f"{ARCH}.rope.dimension_count"
    ROPE_FREQ_BASE = f"{ARCH}.rope.freq_base"
    ROPE_SCALING_FACTOR = f"{ARCH}.rope.scaling.factor"
    ROPE_ORIG_CTX = f"{ARCH}.rope.scaling.original_context_length"
    ROPE_YARN_BETA_FAST = f"{ARCH}.rope.scaling.yarn_beta_fast"
    ROPE_YARN_BETA_SLOW = f"{ARCH}.rope.scaling.yarn_beta_slow"
    EXPERT_COUNT = f"{ARCH}.expert_count"
    EXPERT_USED_COUNT = f"{ARCH}.expert_used_count"
    EXPERT_SHARED_COUNT = f"{ARCH}.expert_shared_count"
    EXPERT_FFN_LENGTH = f"{ARCH}.expert_feed_forward_length"
    EXPERT_GROUP_COUNT = f"{ARCH}.expert_group_count"
    EXPERT_GROUP_USED_COUNT = f"{ARCH}.expert_group_used_count"
    EXPERT_WEIGHTS_SCALE = f"{ARCH}.expert_weights_scale"
    EXPERT_WEIGHTS_NORM = f"{ARCH}.expert_weights_norm"
    HASH_LAYER_COUNT = f"{ARCH}.hash_layer_count"
    HC_COUNT = f"{ARCH}.hyper_connection.count"
    HC_EPS = f"{ARCH}.hyper_connection.epsilon"
    HC_SINKHORN_ITERS = f"{ARCH}.hyper_connection.sinkhorn_iterations"
    SWIGLU_CLAMP = f"{ARCH}.swiglu_clamp_exp"
    TOKENS = "tokenizer.ggml.tokens"
    MERGES = "tokenizer.ggml.merges"
    TOKENIZER_MODEL = "tokenizer.ggml.model"
    TOKENIZER_PRE = "tokenizer.ggml.pre"
    BOS_ID = "tokenizer.ggml.bos_token_id"
    EOS_ID = "tokenizer.ggml.eos_token_id"
    # split GGUFs (llama.cpp gguf-split): every part carries these; only part 0 the rest
    SPLIT_NO = "split.no"  # u16, 0-based
    SPLIT_COUNT = "split.count"  # u16
    SPLIT_TENSORS_COUNT = "split.tensors.count"  # i32, tensors in all parts together


class QuantType(enum.IntEnum):
    """GGML tensor types ds4 reads (model-spec §2.1); values are the on-disk codes."""

    F32 = 0
    F16 = 1
    Q8_0 = 8
    Q2_K = 10
    Q4_K = 12
    IQ2_XXS = 16
    I32 = 26
    BF16 = 30  # read-only input type


@dataclass(frozen=True)
class BlockInfo:
    elements: int  # weights per block
    nbytes: int  # bytes per block


BLOCK = {
    QuantType.F32: BlockInfo(1, 4),
    QuantType.F16: BlockInfo(1, 2),
    QuantType.BF16: BlockInfo(1, 2),
    QuantType.I32: BlockInfo(1, 4),
    QuantType.Q8_0: BlockInfo(32, 34),
    QuantType.Q2_K: BlockInfo(256, 84),
    QuantType.Q4_K: BlockInfo(256, 144),
    QuantType.IQ2_XXS: BlockInfo(256, 66),
}

ROUTED_TYPES = (QuantType.IQ2_XXS, QuantType.Q2_K, QuantType.Q4_K, QuantType.Q8_0, QuantType.F16, QuantType.F32)


def row_bytes(qtype: QuantType, ncols: int) -> int:
    """Bytes of one row of `ncols` values; ncols must be a whole number of blocks."""
    info = BLOCK[QuantType(qtype)]
    if ncols % info.elements:
        raise ValueError(f"{QuantType(qtype).name} needs rows of a multiple of {info.elements}, got {ncols}")
    return ncols // info.elements * info.nbytes


def tensor_bytes(qtype: QuantType, ne: tuple[int, ...]) -> int:
    n_rows = 1
    for d in ne[1:]:
        n_rows *= d
    return row_bytes(qtype, ne[0]) * n_rows


# Tensor names (model-spec §2.4). Global tensors:
TOKEN_EMBD = "token_embd.weight"
OUTPUT = "output.weight"
OUTPUT_NORM = "output_norm.weight"
OUTPUT_HC_FN = "output_hc_fn.weight"
OUTPUT_HC_BASE = "output_hc_base.weight"
OUTPUT_HC_SCALE = "output_hc_scale.weight"


class LayerTensor(str, enum.Enum):
    """Per-layer tensor suffixes; the full name is `blk.{i}.{suffix}` (see `blk`)."""

    HC_ATTN_FN = "hc_attn_fn.weight"
    HC_ATTN_SCALE = "hc_attn_scale.weight"
    HC_ATTN_BASE = "hc_attn_base.weight"
    ATTN_NORM = "attn_norm.weight"
    ATTN_Q_A = "attn_q_a.weight"
    ATTN_Q_A_NORM = "attn_q_a_norm.weight"
    ATTN_Q_B = "attn_q_b.weight"
    ATTN_KV = "attn_kv.weight"
    ATTN_KV_A_NORM = "attn_kv_a_norm.weight"
    ATTN_SINKS = "attn_sinks.weight"
    ATTN_OUTPUT_A = "attn_output_a.weight"
    ATTN_OUTPUT_B = "attn_output_b.weight"
    COMP_APE = "attn_compressor_ape.weight"
    COMP_KV = "attn_compressor_kv.weight"
    COMP_GATE = "attn_compressor_gate.weight"
    COMP_NORM = "attn_compressor_norm.weight"
    IDX_Q_B = "indexer.attn_q_b.weight"
    IDX_PROJ = "indexer.proj.weight"
    IDX_COMP_APE = "indexer_compressor_ape.weight"
    IDX_COMP_KV = "indexer_compressor_kv.weight"
    IDX_COMP_GATE = "indexer_compressor_gate.weight"
    IDX_COMP_NORM = "indexer_compressor_norm.weight"
    HC_FFN_FN = "hc_ffn_fn.weight"
    HC_FFN_SCALE = "hc_ffn_scale.weight"
    HC_FFN_BASE = "hc_ffn_base.weight"
    FFN_NORM = "ffn_norm.weight"
    FFN_GATE_INP = "ffn_gate_inp.weight"
    EXP_PROBS_B = "exp_probs_b.bias"
    FFN_GATE_TID2EID = "ffn_gate_tid2eid.weight"
    FFN_GATE_SHEXP = "ffn_gate_shexp.weight"
    FFN_UP_SHEXP = "ffn_up_shexp.weight"
    FFN_DOWN_SHEXP = "ffn_down_shexp.weight"
    FFN_GATE_EXPS = "ffn_gate_exps.weight"
    FFN_UP_EXPS = "ffn_up_exps.weight"
    FFN_DOWN_EXPS = "ffn_down_exps.weight"


def blk(layer: int, suffix: LayerTensor | str) -> str:
    s = suffix.value if isinstance(suffix, LayerTensor) else suffix
    return f"blk.{layer}.{s}"


# MTP GGUF (model-spec §2.5): `mtp.0.{suffix}`; block suffixes reuse LayerTensor values.
MTP_PREFIX = "mtp.0."


class MtpTensor(str, enum.Enum):
    HC_HEAD_BASE = "hc_head_base"
    HC_HEAD_FN = "hc_head_fn"
    HC_HEAD_SCALE = "hc_head_scale"
    E_PROJ = "e_proj"
    H_PROJ = "h_proj"
    ENORM = "enorm"
    HNORM = "hnorm"
    NORM = "norm"


# Special tokens, found by string in the token table (runtime-spec §1.1).
BOS_TEXT = "<｜begin▁of▁sentence｜>"
EOS_TEXT = "<｜end▁of▁sentence｜>"
USER_TEXT = "<｜User｜>"
ASSISTANT_TEXT = "<｜Assistant｜>"
THINK_OPEN_TEXT = "<think>"
THINK_CLOSE_TEXT = "</think>"
DSML_TEXT = "｜DSML｜"
SPECIAL_TEXTS = (BOS_TEXT, EOS_TEXT, USER_TEXT, ASSISTANT_TEXT, THINK_OPEN_TEXT, THINK_CLOSE_TEXT, DSML_TEXT)
