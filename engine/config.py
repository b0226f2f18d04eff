"""The model configuration: one frozen dataclass, read from GGUF metadata, validated once.

Field names follow the GGUF keys of model-spec §2.2. Nothing in the engine hard-codes Flash numbers;
every shape comes from here. Presets give the four shapes the project builds: `tiny` (tests), `small`
(CPU benchmarks), `flash` and `pro` (the real models).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ds4.gguf_tools.constants import ARCH, Key


class ConfigError(ValueError):
    """A model configuration that cannot describe a DeepSeek V4 model."""


@dataclass(frozen=True)
class Config:
    n_layer: int
    n_embd: int
    vocab_size: int
    n_head: int
    head_dim: int  # key_length == value_length (K=V shared head)
    rope_dim: int  # RoPE tail width of each head
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_expert: int
    n_expert_used: int
    expert_ffn: int
    n_expert_shared: int
    n_hash_layers: int
    sliding_window: int
    indexer_heads: int
    indexer_dim: int
    indexer_top_k: int
    n_hc: int
    sinkhorn_iters: int
    compress_ratios: tuple[int, ...]
    swiglu_clamp: tuple[float, ...]
    rope_base: float = 10000.0
    compress_rope_base: float = 160000.0
    rope_scaling_factor: float = 16.0
    rope_orig_ctx: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    routed_scale: float = 1.5
    rms_eps: float = 1e-6
    hc_eps: float = 1e-6
    expert_weights_norm: bool = True
    n_head_kv: int = 1
    context_length: int = 1048576
    name: str = field(default="deepseek4", compare=False)
    # Runtime numerics switches (not stored in the file): the official roundings are the default;
    # turn them off only to compare with an oracle that lacks them (transformers).
    fp8_kv: bool = field(default=True, compare=False)
    indexer_qat: bool = field(default=True, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def n_nope(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def hc_dim(self) -> int:
        return self.n_hc * self.n_embd

    @property
    def hc_mix(self) -> int:
        return 2 * self.n_hc + self.n_hc * self.n_hc

    @property
    def group_width(self) -> int:
        return self.n_head * self.head_dim // self.o_groups

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def compressor_width(self, layer: int) -> int:
        """Compressor output width: two overlapping halves for ratio 4, one for ratio 128."""
        r = self.ratio(layer)
        if r == 0:
            return 0
        return 2 * self.head_dim if r == 4 else self.head_dim

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    # ---- validation -----------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise ConfigError(f"invalid DeepSeek V4 config: {what}")

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and not isinstance(v, bool) and f.name != "n_hash_layers":
                need(0 < v < 2**40, f"{f.name}={v} out of range")
        need(self.n_hash_layers >= 0, "hash_layer_count < 0")
        need(len(self.compress_ratios) >= self.n_layer,
             f"compress_ratios has {len(self.compress_ratios)} entries for {self.n_layer} layers")
        need(all(r in (0, 4, 128) for r in self.compress_ratios[: self.n_layer]),
             f"compress_ratios must be 0, 4 or 128, got {sorted(set(self.compress_ratios))}")
        need(len(self.swiglu_clamp) >= self.n_layer, "swiglu_clamp_exp shorter than block_count")
        need(self.n_head_kv == 1, f"head_count_kv must be 1 (shared K=V), got {self.n_head_kv}")
        need(self.rope_dim % 2 == 0 and self.rope_dim < self.head_dim, "rope dimension must be even and < head dim")
        need(self.rope_dim < self.indexer_dim, "rope dimension must be < indexer key length")
        need(self.n_nope % 64 == 0, f"non-RoPE head dims ({self.n_nope}) must be a multiple of 64 (FP8 blocks)")
        need(self.indexer_dim & (self.indexer_dim - 1) == 0 and self.indexer_dim % 32 == 0,
             "indexer key length must be a power of two, multiple of 32 (Hadamard + FP4 blocks)")
        need((self.n_head * self.head_dim) % self.o_groups == 0, "heads × head dim must split into output groups")
        need(self.n_head % self.o_groups == 0, "head count must be a multiple of output groups")
        need(self.n_expert_used <= self.n_expert, "expert_used_count > expert_count")
        need(self.n_hash_layers <= self.n_layer, "hash_layer_count > block_count")
        need(self.n_expert_shared == 1, "exactly one shared expert is supported")
        need(self.n_hc >= 1, "hyper_connection.count must be >= 1")

    # ---- GGUF metadata --------------------------------------------------------------------------
    def to_metadata(self) -> dict[str, Any]:
        """The deepseek4.* keys as a writer emits them (typed by the writer)."""
        return {
            Key.BLOCK_COUNT: self.n_layer,
            Key.CONTEXT_LENGTH: self.context_length,
            Key.EMBEDDING_LENGTH: self.n_embd,
            Key.VOCAB_SIZE: self.vocab_size,
            Key.HEAD_COUNT: self.n_head,
            Key.HEAD_COUNT_KV: self.n_head_kv,
            Key.KEY_LENGTH: self.head_dim,
            Key.VALUE_LENGTH: self.head_dim,
            Key.ROPE_DIMENSION_COUNT: self.rope_dim,
            Key.Q_LORA_RANK: self.q_lora_rank,
            Key.OUTPUT_LORA_RANK: self.o_lora_rank,
            Key.OUTPUT_GROUP_COUNT: self.o_groups,
            Key.EXPERT_COUNT: self.n_expert,
            Key.EXPERT_USED_COUNT: self.n_expert_used,
            Key.EXPERT_FFN_LENGTH: self.expert_ffn,
            Key.EXPERT_SHARED_COUNT: self.n_expert_shared,
            Key.HASH_LAYER_COUNT: self.n_hash_layers,
            Key.SLIDING_WINDOW: self.sliding_window,
            Key.INDEXER_HEAD_COUNT: self.indexer_heads,
            Key.INDEXER_KEY_LENGTH: self.indexer_dim,
            Key.INDEXER_TOP_K: self.indexer_top_k,
            Key.HC_COUNT: self.n_hc,
            Key.HC_SINKHORN_ITERS: self.sinkhorn_iters,
            Key.COMPRESS_RATIOS: list(self.compress_ratios),
            Key.SWIGLU_CLAMP: list(self.swiglu_clamp),
            Key.ROPE_ORIG_CTX: self.rope_orig_ctx,
            Key.ROPE_FREQ_BASE: self.rope_base,
            Key.ROPE_SCALING_FACTOR: self.rope_scaling_factor,
            Key.ROPE_YARN_BETA_FAST: self.yarn_beta_fast,
            Key.ROPE_YARN_BETA_SLOW: self.yarn_beta_slow,
            Key.COMPRESS_ROPE_FREQ_BASE: self.compress_rope_base,
            Key.EXPERT_WEIGHTS_SCALE: self.routed_scale,
            Key.RMS_EPS: self.rms_eps,
            Key.HC_EPS: self.hc_eps,
            Key.EXPERT_WEIGHTS_NORM: self.expert_weights_norm,
        }

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "Config":
        """Build from a GGUF key → python value mapping. Raises ConfigError naming a missing key."""
        arch = meta.get(Key.ARCHITECTURE.value, ARCH)
        if arch != ARCH:
            raise ConfigError(f"architecture is '{arch}', expected '{ARCH}' (not a DeepSeek V4 GGUF)")

        def get(key: Key, default: Any = dataclasses.MISSING) -> Any:
            if key.value in meta:
                return meta[key.value]
            if default is dataclasses.MISSING:
                raise ConfigError(f"GGUF metadata key '{key.value}' is missing")
            return default

        group = get(Key.EXPERT_GROUP_COUNT, 0)
        if group not in (0, None):
            raise ConfigError(f"'{Key.EXPERT_GROUP_COUNT.value}' must be 0 or absent, got {group}")
        key_len, val_len = int(get(Key.KEY_LENGTH)), int(get(Key.VALUE_LENGTH))
        if key_len != val_len:
            raise ConfigError(f"key_length {key_len} != value_length {val_len} (K and V share one head)")
        return cls(
            n_layer=int(get(Key.BLOCK_COUNT)),
            n_embd=int(get(Key.EMBEDDING_LENGTH)),
            vocab_size=int(get(Key.VOCAB_SIZE)),
            n_head=int(get(Key.HEAD_COUNT)),
            n_head_kv=int(get(Key.HEAD_COUNT_KV)),
            head_dim=key_len,
            rope_dim=int(get(Key.ROPE_DIMENSION_COUNT)),
            q_lora_rank=int(get(Key.Q_LORA_RANK)),
            o_lora_rank=int(get(Key.OUTPUT_LORA_RANK)),
            o_groups=int(get(Key.OUTPUT_GROUP_COUNT)),
            n_expert=int(get(Key.EXPERT_COUNT)),
            n_expert_used=int(get(Key.EXPERT_USED_COUNT)),
            expert_ffn=int(get(Key.EXPERT_FFN_LENGTH)),
            n_expert_shared=int(get(Key.EXPERT_SHARED_COUNT)),
            n_hash_layers=int(get(Key.HASH_LAYER_COUNT)),
            sliding_window=int(get(Key.SLIDING_WINDOW)),
            indexer_heads=int(get(Key.INDEXER_HEAD_COUNT)),
            indexer_dim=int(get(Key.INDEXER_KEY_LENGTH)),
            indexer_top_k=int(get(Key.INDEXER_TOP_K)),
            n_hc=int(get(Key.HC_COUNT)),
            sinkhorn_iters=int(get(Key.HC_SINKHORN_ITERS)),
            compress_ratios=tuple(int(x) for x in get(Key.COMPRESS_RATIOS)),
            swiglu_clamp=tuple(float(x) for x in get(Key.SWIGLU_CLAMP)),
            rope_base=float(get(Key.ROPE_FREQ_BASE)),
            compress_rope_base=float(get(Key.COMPRESS_ROPE_FREQ_BASE)),
            rope_scaling_factor=float(get(Key.ROPE_SCALING_FACTOR)),
            rope_orig_ctx=int(get(Key.ROPE_ORIG_CTX)),
            yarn_beta_fast=float(get(Key.ROPE_YARN_BETA_FAST)),
            yarn_beta_slow=float(get(Key.ROPE_YARN_BETA_SLOW)),
            routed_scale=float(get(Key.EXPERT_WEIGHTS_SCALE)),
            rms_eps=float(get(Key.RMS_EPS)),
            hc_eps=float(get(Key.HC_EPS)),
            expert_weights_norm=bool(get(Key.EXPERT_WEIGHTS_NORM, True)),
            context_length=int(get(Key.CONTEXT_LENGTH, 1048576)),
            name=str(meta.get(Key.NAME.value, "deepseek4")),
        )

    def with_numerics(self, *, fp8_kv: bool | None = None, indexer_qat: bool | None = None) -> "Config":
        """A copy with the official rounding simulations switched on or off."""
        changes = {}
        if fp8_kv is not None:
            changes["fp8_kv"] = fp8_kv
        if indexer_qat is not None:
            changes["indexer_qat"] = indexer_qat
        return dataclasses.replace(self, **changes)


def _flash_ratios(n_layer: int) -> tuple[int, ...]:
    return tuple(0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(n_layer))


def _pro_ratios(n_layer: int) -> tuple[int, ...]:
    return tuple(128 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(n_layer))


def preset(name: str) -> Config:
    """The four shapes the project builds. Unknown names raise ConfigError listing the choices."""
    common = dict(vocab_size=129280, rope_dim=64, n_expert_shared=1, n_hc=4, sinkhorn_iters=20)
    if name == "tiny":
        # Hidden 64, 6 layers: window-only (0,1), ratio 4 (2,4), ratio 128 (3,5); hash MoE on 0-2,
        # top-k MoE on 3-5. 16 indexer heads so ReLU scores do not tie; top-k 8 so the indexer
        # selects once 32 tokens are in.
        n = 6
        return Config(n_layer=n, n_embd=64, n_head=4, head_dim=128, q_lora_rank=32, o_lora_rank=16,
                      o_groups=2, n_expert=8, n_expert_used=2, expert_ffn=32, n_hash_layers=3,
                      sliding_window=128, indexer_heads=16, indexer_dim=128, indexer_top_k=8,
                      compress_ratios=_flash_ratios(n), swiglu_clamp=(10.0,) * n, routed_scale=1.5,
                      name="ds4-tiny", **common)
    if name == "small":
        n = 8
        return Config(n_layer=n, n_embd=512, n_head=8, head_dim=512, q_lora_rank=256, o_lora_rank=128,
                      o_groups=2, n_expert=32, n_expert_used=6, expert_ffn=256, n_hash_layers=3,
                      sliding_window=128, indexer_heads=16, indexer_dim=128, indexer_top_k=64,
                      compress_ratios=_flash_ratios(n), swiglu_clamp=(10.0,) * n, routed_scale=1.5,
                      name="ds4-small", **common)
    if name == "flash":
        n = 43
        return Config(n_layer=n, n_embd=4096, n_head=64, head_dim=512, q_lora_rank=1024, o_lora_rank=1024,
                      o_groups=8, n_expert=256, n_expert_used=6, expert_ffn=2048, n_hash_layers=3,
                      sliding_window=128, indexer_heads=64, indexer_dim=128, indexer_top_k=512,
                      compress_ratios=_flash_ratios(n), swiglu_clamp=(10.0,) * n, routed_scale=1.5,
                      name="DeepSeek-V4-Flash", **common)
    if name == "pro":
        n = 61
        return Config(n_layer=n, n_embd=7168, n_head=128, head_dim=512, q_lora_rank=1536, o_lora_rank=1024,
                      o_groups=16, n_expert=384, n_expert_used=6, expert_ffn=3072, n_hash_layers=3,
                      sliding_window=128, indexer_heads=64, indexer_dim=128, indexer_top_k=1024,
                      compress_ratios=_pro_ratios(n), swiglu_clamp=(10.0,) * n, routed_scale=2.5,
                      name="DeepSeek-V4-Pro", **common)
    raise ConfigError(f"unknown preset '{name}' (choose tiny, small, flash or pro)")


PRESETS = ("tiny", "small", "flash", "pro")


def first_layers(cfg: Config, n_layer: int) -> Config:
    """cfg cut to its first n_layer layers (their compress ratios, clamps and hash routing kept): a Flash-shaped model
    that fits a smaller GPU, for speed work whose costs are per layer or per shape. Raises ConfigError past cfg's
    layer count."""
    if not 1 <= n_layer <= cfg.n_layer:
        raise ConfigError(f"layers must be 1..{cfg.n_layer} for this shape, got {n_layer}")
    return dataclasses.replace(cfg, n_layer=n_layer, n_hash_layers=min(cfg.n_hash_layers, n_layer),
                               compress_ratios=cfg.compress_ratios[:n_layer], swiglu_clamp=cfg.swiglu_clamp[:n_layer])


def yarn_low_high(cfg: Config) -> tuple[float, float]:
    """YaRN ramp bounds for the compressed-layer RoPE (model-spec §3.1)."""

    def corr_dim(n_rot: float) -> float:
        return cfg.rope_dim * math.log(cfg.rope_orig_ctx / (2 * math.pi * n_rot)) / (2 * math.log(cfg.compress_rope_base))

    low = max(math.floor(corr_dim(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(corr_dim(cfg.yarn_beta_slow)), cfg.rope_dim - 1)
    return float(low), float(high)
