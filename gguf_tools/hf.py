"""Hugging Face DeepSeek V4 checkpoints: reading, FP8/FP4 dequantization, name mapping, configs.

Two on-disk layouts are accepted (tooling-spec §1.4):

* **official** (as DeepSeek publishes V4): names like `layers.3.attn.wq_a.weight`; FP8 e4m3 weights
  with a ue8m0 scale per 128×128 block in `<name>.scale`; routed experts as FP4 e2m1 packed two
  per int8 byte (low nibble first) with a ue8m0 scale per 32 inputs; BF16/F32 for the rest.
* **transformers** (written by `DeepseekV4ForCausalLM.save_pretrained`): a `model.` prefix,
  some module names (`embed_tokens`, `hc_head.hc_fn`, `attn.norm` for the KV norm, ...) and
  bf16/fp32 values. Module-style names (`self_attn.q_a_proj`, fused `mlp.experts.gate_up_proj`)
  are understood too. Everything is mapped to the official names first (`canonical_name`).

Tensors are read from the shards through `numpy.memmap`, one tensor (or one row block, or one
expert) at a time, so converting never holds the model in memory.

Dequantization follows tooling-spec §1.4: e8m0 byte e → 2^(e−127) (e = 0 → 2^−127); e4m3fn with
the NaN code read as 0; FP4 table ±{0, .5, 1, 1.5, 2, 3, 4, 6}. Scale grids whose weight dims are
not a multiple of 128 (the tiny preset) are taken as ceil(dim/128) blocks, the last one partial.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ds4.engine.config import Config, ConfigError
from ds4.gguf_tools.constants import (
    OUTPUT, OUTPUT_HC_BASE, OUTPUT_HC_FN, OUTPUT_HC_SCALE, OUTPUT_NORM, TOKEN_EMBD, LayerTensor as T,
)
from ds4.gguf_tools.layout import Kind, TensorSlot

FP8_BLOCK = 128
FP4_BLOCK = 32


class HFError(Exception):
    """A checkpoint directory that cannot be read; one-line message."""


# ---------------------------------------------------------------------------------------------
# Element decoders (tables built from the bit layouts, tooling-spec §1.4)
# ---------------------------------------------------------------------------------------------

def _e8m0_table() -> np.ndarray:
    bits = np.arange(256, dtype=np.uint32) << 23
    bits[0] = 0x00400000  # 2^-127 exactly (a subnormal): the reference's special case
    return bits.view(np.float32)


def _e4m3fn_table() -> np.ndarray:
    out = np.zeros(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp, man = (code >> 3) & 0xF, code & 0x7
        if code & 0x7F == 0x7F:
            v = 0.0  # the NaN code decodes to 0 (no NaN ever enters the converter)
        elif exp == 0:
            v = man * 2.0 ** -9  # subnormal: (m/8) * 2^-6
        else:
            v = (1.0 + man / 8.0) * 2.0 ** (exp - 7)
        out[code] = sign * v
    return out


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0 = _e8m0_table()
E4M3FN = _e4m3fn_table()
E2M1 = np.array(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=np.float32)  # bit 3 = sign


def e8m0_to_f32(codes: np.ndarray) -> np.ndarray:
    return E8M0[np.asarray(codes, dtype=np.uint8)]


def e4m3fn_to_f32(codes: np.ndarray) -> np.ndarray:
    return E4M3FN[np.asarray(codes, dtype=np.uint8)]


def _expand_blocks(scale: np.ndarray, rows: int, cols: int, brows: int, bcols: int) -> np.ndarray:
    """Broadcast a per-block scale grid to [rows, cols]; the last block of each axis may be partial."""
    return np.repeat(np.repeat(scale, brows, axis=0)[:rows], bcols, axis=1)[:, :cols]


def dequant_fp8(weight: np.ndarray, scale: np.ndarray, row0: int = 0) -> np.ndarray:
    """FP8 e4m3 codes [r, cols] (rows row0..row0+r of the matrix) times their 128×128 block scales."""
    w = np.asarray(weight).view(np.uint8)
    rows, cols = w.shape
    need = (math.ceil((row0 + rows) / FP8_BLOCK), math.ceil(cols / FP8_BLOCK))
    if scale.shape[0] < need[0] or scale.shape[1] != need[1]:
        raise HFError(f"FP8 scale grid {list(scale.shape)} does not cover a [{row0 + rows}, {cols}] weight")
    b0 = row0 // FP8_BLOCK
    b1 = math.ceil((row0 + rows) / FP8_BLOCK)
    s = e8m0_to_f32(np.asarray(scale[b0:b1]).view(np.uint8))
    full = _expand_blocks(s, (b1 - b0) * FP8_BLOCK, cols, FP8_BLOCK, FP8_BLOCK)
    off = row0 - b0 * FP8_BLOCK
    return e4m3fn_to_f32(w) * full[off: off + rows]


def dequant_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """FP4 e2m1 packed [rows, cols/2] (low nibble = even column) times ue8m0 scales [rows, cols/32]."""
    p = np.asarray(packed).view(np.uint8)
    rows, half = p.shape
    cols = 2 * half
    if scale.shape != (rows, cols // FP4_BLOCK):
        raise HFError(f"FP4 scale shape {list(scale.shape)}, expected {[rows, cols // FP4_BLOCK]}")
    vals = np.empty((rows, cols), dtype=np.float32)
    vals[:, 0::2] = E2M1[p & 0x0F]
    vals[:, 1::2] = E2M1[p >> 4]
    s = e8m0_to_f32(np.asarray(scale).view(np.uint8))
    return (vals.reshape(rows, cols // FP4_BLOCK, FP4_BLOCK) * s[:, :, None]).reshape(rows, cols)


# Encoders (used by the synthetic checkpoint writer). Power-of-two scales as the reference uses.

def _pow2_exponent(amax: np.ndarray, top: float) -> np.ndarray:
    amax = np.maximum(amax, np.float32(2.0 ** -126))
    return np.clip(np.ceil(np.log2(amax / top)), -127, 127).astype(np.int32)


def quant_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [rows, cols] -> (e4m3fn codes uint8 [rows, cols], ue8m0 scales uint8 [ceil/128, ceil/128])."""
    import ml_dtypes

    w = np.asarray(w, dtype=np.float32)
    rows, cols = w.shape
    br, bc = math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)
    padded = np.zeros((br * FP8_BLOCK, bc * FP8_BLOCK), dtype=np.float32)
    padded[:rows, :cols] = np.abs(w)
    amax = padded.reshape(br, FP8_BLOCK, bc, FP8_BLOCK).max(axis=(1, 3))
    exp = _pow2_exponent(amax, 448.0)
    scale = np.ldexp(np.float32(1.0), _expand_blocks(exp, rows, cols, FP8_BLOCK, FP8_BLOCK)).astype(np.float32)
    codes = (w / scale).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return codes, (exp + 127).astype(np.uint8)


def quant_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [rows, cols] -> (packed int8 [rows, cols/2], ue8m0 scales uint8 [rows, cols/32])."""
    import ml_dtypes

    w = np.asarray(w, dtype=np.float32)
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // FP4_BLOCK, FP4_BLOCK)
    exp = _pow2_exponent(np.abs(blocks).max(axis=2), 6.0)
    q = (blocks / np.ldexp(np.float32(1.0), exp)[:, :, None]).astype(ml_dtypes.float4_e2m1fn)
    codes = q.view(np.uint8).reshape(rows, cols) & 0x0F
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed.view(np.int8), (exp + 127).astype(np.uint8)


# ---------------------------------------------------------------------------------------------
# Official names per GGUF tensor (model-spec §2.4 right column)
# ---------------------------------------------------------------------------------------------

GLOBAL_NAMES = {
    TOKEN_EMBD: "embed.weight",
    OUTPUT: "head.weight",
    OUTPUT_NORM: "norm.weight",
    OUTPUT_HC_FN: "hc_head_fn",
    OUTPUT_HC_BASE: "hc_head_base",
    OUTPUT_HC_SCALE: "hc_head_scale",
}

LAYER_NAMES = {
    T.HC_ATTN_FN: "hc_attn_fn", T.HC_ATTN_SCALE: "hc_attn_scale", T.HC_ATTN_BASE: "hc_attn_base",
    T.ATTN_NORM: "attn_norm.weight",
    T.ATTN_Q_A: "attn.wq_a.weight", T.ATTN_Q_A_NORM: "attn.q_norm.weight", T.ATTN_Q_B: "attn.wq_b.weight",
    T.ATTN_KV: "attn.wkv.weight", T.ATTN_KV_A_NORM: "attn.kv_norm.weight", T.ATTN_SINKS: "attn.attn_sink",
    T.ATTN_OUTPUT_A: "attn.wo_a.weight", T.ATTN_OUTPUT_B: "attn.wo_b.weight",
    T.COMP_APE: "attn.compressor.ape", T.COMP_KV: "attn.compressor.wkv.weight",
    T.COMP_GATE: "attn.compressor.wgate.weight", T.COMP_NORM: "attn.compressor.norm.weight",
    T.IDX_Q_B: "attn.indexer.wq_b.weight", T.IDX_PROJ: "attn.indexer.weights_proj.weight",
    T.IDX_COMP_APE: "attn.indexer.compressor.ape", T.IDX_COMP_KV: "attn.indexer.compressor.wkv.weight",
    T.IDX_COMP_GATE: "attn.indexer.compressor.wgate.weight", T.IDX_COMP_NORM: "attn.indexer.compressor.norm.weight",
    T.HC_FFN_FN: "hc_ffn_fn", T.HC_FFN_SCALE: "hc_ffn_scale", T.HC_FFN_BASE: "hc_ffn_base",
    T.FFN_NORM: "ffn_norm.weight", T.FFN_GATE_INP: "ffn.gate.weight", T.EXP_PROBS_B: "ffn.gate.bias",
    T.FFN_GATE_TID2EID: "ffn.gate.tid2eid",
    T.FFN_GATE_SHEXP: "ffn.shared_experts.w1.weight", T.FFN_UP_SHEXP: "ffn.shared_experts.w3.weight",
    T.FFN_DOWN_SHEXP: "ffn.shared_experts.w2.weight",
}
EXPERT_PART = {T.FFN_GATE_EXPS: "w1", T.FFN_UP_EXPS: "w3", T.FFN_DOWN_EXPS: "w2"}

# Stored in FP8 in the official checkpoint (everything else 2-D is BF16; vectors and HC are F32).
FP8_SUFFIXES = (T.ATTN_Q_A, T.ATTN_Q_B, T.ATTN_KV, T.ATTN_OUTPUT_A, T.ATTN_OUTPUT_B, T.IDX_Q_B,
                T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP, T.FFN_DOWN_SHEXP)
F32_SUFFIXES = (T.HC_ATTN_FN, T.HC_FFN_FN, T.COMP_APE, T.IDX_COMP_APE)


def slot_suffix(slot: TensorSlot) -> T | None:
    if slot.layer is None:
        return None
    return T(slot.name.split(".", 2)[2])


def official_name(slot: TensorSlot, expert: int | None = None) -> str:
    """The official checkpoint name of a GGUF tensor (of one expert for routed expert tensors)."""
    if slot.layer is None:
        return GLOBAL_NAMES[slot.name]
    suffix = slot_suffix(slot)
    if suffix in EXPERT_PART:
        if expert is None:
            raise ValueError(f"{slot.name} is stored per expert; pass the expert index")
        return f"layers.{slot.layer}.ffn.experts.{expert}.{EXPERT_PART[suffix]}.weight"
    return f"layers.{slot.layer}.{LAYER_NAMES[suffix]}"


def official_storage(slot: TensorSlot) -> str:
    """How the official checkpoint stores this tensor: fp8, fp4, bf16, f32 or i64."""
    suffix = slot_suffix(slot)
    if slot.kind == Kind.EXPERTS:
        return "fp4"
    if slot.kind == Kind.INDEX:
        return "i64"
    if slot.kind == Kind.VECTOR or suffix in F32_SUFFIXES or slot.name in (OUTPUT_HC_FN,):
        return "f32"
    if suffix in FP8_SUFFIXES:
        return "fp8"
    return "bf16"


def scale_name(weight_name: str) -> str:
    return weight_name[: -len(".weight")] + ".scale" if weight_name.endswith(".weight") else weight_name + ".scale"


# transformers names -> official names. Applied in order to a name without its `model.` prefix.
_TF_RULES: list[tuple[re.Pattern[str], str]] = [(re.compile(a), b) for a, b in [
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.position_bias$", ".ape"),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.norm\.weight$", ".attn.kv_norm.weight"),  # save_pretrained's spelling of the KV norm
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
]]
_FUSED_EXPERTS = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(gate_up_proj|down_proj)$")


def canonical_name(name: str) -> str:
    """Map a transformers-format tensor name to the official one (official names pass unchanged)."""
    n = name[len("model."):] if name.startswith("model.") else name
    for pattern, repl in _TF_RULES:
        n = pattern.sub(repl, n)
    return n


# ---------------------------------------------------------------------------------------------
# safetensors: our own header parser and a streaming writer
# ---------------------------------------------------------------------------------------------

ST_DTYPES = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"), "F8_E4M3": np.dtype("u1"), "F8_E8M0": np.dtype("u1"),
}


@dataclass(frozen=True)
class STEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    offset: int  # absolute
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, STEntry]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HFError(f"{path}: truncated safetensors file")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, 100 << 20):
                raise HFError(f"{path}: safetensors header length {n} exceeds the file")
            header = json.loads(f.read(n))
    except OSError as e:
        raise HFError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HFError(f"{path}: malformed safetensors header") from None
    out = {}
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise HFError(f"{path}: malformed entry for tensor '{name}'") from None
        if dtype not in ST_DTYPES:
            raise HFError(f"{path}: tensor '{name}' has unsupported dtype {dtype}")
        if e - b != math.prod(shape) * ST_DTYPES[dtype].itemsize or base + e > size:
            raise HFError(f"{path}: tensor '{name}' data out of range (truncated shard?)")
        out[name] = STEntry(name, dtype, shape, path, base + b, e - b)
    return out


def st_array(entry: STEntry) -> np.ndarray:
    """Zero-copy memmap view of a safetensors tensor in its stored dtype (BF16 as uint16 bits)."""
    if entry.nbytes == 0:
        return np.zeros(entry.shape, dtype=ST_DTYPES[entry.dtype])
    return np.memmap(entry.path, dtype=ST_DTYPES[entry.dtype], mode="r", offset=entry.offset, shape=entry.shape)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_f32(entry: STEntry, arr: np.ndarray) -> np.ndarray:
    """Unscaled elementwise conversion of stored values to float32."""
    if entry.dtype == "BF16":
        return bf16_to_f32(arr)
    if entry.dtype == "F8_E4M3":
        return e4m3fn_to_f32(arr)
    if entry.dtype in ("F32", "F16", "F64"):
        return np.asarray(arr, dtype=np.float32)
    raise HFError(f"{entry.path}: tensor '{entry.name}' has dtype {entry.dtype}, expected a float type")


class SafetensorsWriter:
    """Write one shard: declare every tensor first (the header needs offsets), then stream the data."""

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...]]]):
        self.path = Path(path)
        self.entries = entries
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        self.sizes = {}
        for name, dtype, shape in entries:
            nbytes = math.prod(shape) * ST_DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
            self.sizes[name] = nbytes
            off += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.f = open(self.path, "wb")
        self.f.write(len(blob).to_bytes(8, "little"))
        self.f.write(blob)
        self.next = 0

    def write(self, name: str, data: np.ndarray | Iterator[np.ndarray]) -> None:
        """Append one tensor's bytes: an array, or an iterable of arrays written back to back."""
        expect = self.entries[self.next][0]
        if name != expect:
            raise ValueError(f"tensors must be written in header order: got {name}, expected {expect}")
        written = 0
        for chunk in ([data] if isinstance(data, np.ndarray) else data):
            chunk = np.ascontiguousarray(chunk)
            chunk.tofile(self.f)
            written += chunk.nbytes
        if written != self.sizes[name]:
            raise ValueError(f"tensor {name}: {written} bytes, header says {self.sizes[name]}")
        self.next += 1

    def close(self) -> None:
        self.f.close()
        if self.next != len(self.entries):
            raise ValueError(f"{self.path}: {len(self.entries) - self.next} tensors were never written")


# ---------------------------------------------------------------------------------------------
# Checkpoint reader
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Fused:
    entry: STEntry
    expert: int
    rows: slice


class HFCheckpoint:
    """A checkpoint directory: config, format, and per-GGUF-tensor float32 values on demand."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise HFError(f"{self.dir}: not a directory (expected a Hugging Face checkpoint)")
        cfg_path = self.dir / "config.json"
        try:
            self.hf_config = json.loads(cfg_path.read_text())
        except FileNotFoundError:
            raise HFError(f"{cfg_path}: missing (not a Hugging Face checkpoint)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HFError(f"{cfg_path}: malformed JSON ({e})") from None
        if not isinstance(self.hf_config, dict):
            raise HFError(f"{cfg_path}: expected a JSON object")
        mt = self.hf_config.get("model_type")
        if mt not in (None, "deepseek_v4"):
            raise HFError(f"{cfg_path}: model_type is '{mt}', expected 'deepseek_v4'")
        try:
            self.config = config_from_hf(self.hf_config)
        except ConfigError as e:
            raise HFError(f"{cfg_path}: {e}") from None
        self.entries: dict[str, STEntry] = {}
        for shard in self._shards():
            self.entries.update(read_safetensors_header(shard))
        raw_names = list(self.entries)
        self.format = "transformers" if any(n.startswith(("model.", "lm_head.")) for n in raw_names) else "official"
        self.by_name: dict[str, STEntry] = {}
        self.fused: dict[str, _Fused] = {}
        F = self.config.expert_ffn
        for n, e in self.entries.items():
            canon = canonical_name(n)
            m = _FUSED_EXPERTS.match(canon)
            if m:
                layer, which = m.group(1), m.group(2)
                for x in range(e.shape[0]):
                    if which == "gate_up_proj":  # [E, 2F, D]: gate rows first, then up
                        self.fused[f"layers.{layer}.ffn.experts.{x}.w1.weight"] = _Fused(e, x, slice(0, F))
                        self.fused[f"layers.{layer}.ffn.experts.{x}.w3.weight"] = _Fused(e, x, slice(F, 2 * F))
                    else:
                        self.fused[f"layers.{layer}.ffn.experts.{x}.w2.weight"] = _Fused(e, x, slice(None))
                continue
            self.by_name[canon] = e

    def _shards(self) -> list[Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
                raise HFError(f"{index}: malformed index (expected a 'weight_map' object)") from None
            shards = sorted(set(weight_map.values()))
            for s in shards:
                if not (self.dir / s).is_file():
                    raise HFError(f"{index}: shard '{s}' is missing")
            return [self.dir / s for s in shards]
        shards = sorted(self.dir.glob("*.safetensors"))
        if not shards:
            raise HFError(f"{self.dir}: no safetensors files")
        return shards

    # ---- lookups ---------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.by_name or name in self.fused

    def _entry(self, name: str, slot: TensorSlot) -> STEntry:
        e = self.by_name.get(name)
        if e is None:
            raise HFError(f"{self.dir}: tensor '{name}' (for {slot.name}) is missing from the checkpoint")
        return e

    def _scale(self, name: str) -> STEntry | None:
        for cand in (scale_name(name), name + "_scale_inv", name[: -len(".weight")] + ".weight_scale_inv"):
            if cand in self.by_name:
                return self.by_name[cand]
        return None

    def has_tensor(self, slot: TensorSlot) -> bool:
        if slot.kind == Kind.EXPERTS:
            return self.has(official_name(slot, 0))
        return self.has(official_name(slot))

    # ---- values ----------------------------------------------------------------------------------
    def matrix_rows(self, name: str, slot: TensorSlot, ncols: int, nrows: int,
                    row0: int, row1: int) -> np.ndarray:
        """Rows row0..row1 of a 2-D tensor (one expert matrix, or a whole weight) as float32."""
        fused = self.fused.get(name)
        if fused is not None:
            arr = st_array(fused.entry)[fused.expert][fused.rows]
            if arr.shape != (nrows, ncols):
                raise HFError(f"{self.dir}: '{fused.entry.name}' gives expert shape {list(arr.shape)} "
                              f"for {slot.name}, expected {[nrows, ncols]}")
            return to_f32(fused.entry, arr[row0:row1])
        e = self._entry(name, slot)
        arr = st_array(e)
        scale = self._scale(name) if e.dtype in ("F8_E4M3", "I8", "U8") else None
        if e.dtype in ("I8", "U8"):  # FP4 packed two per byte
            if scale is None:
                raise HFError(f"{self.dir}: '{name}' is packed FP4 but has no scale tensor")
            if e.shape != (nrows, ncols // 2):
                raise HFError(f"{self.dir}: '{name}' has shape {list(e.shape)}, expected {[nrows, ncols // 2]} "
                              f"(FP4 for {slot.name})")
            return dequant_fp4(arr[row0:row1], st_array(scale)[row0:row1])
        if e.shape != (nrows, ncols):
            raise HFError(f"{self.dir}: '{name}' has shape {list(e.shape)}, expected {[nrows, ncols]} for {slot.name}")
        if e.dtype == "F8_E4M3" and scale is not None:
            return dequant_fp8(arr[row0:row1], st_array(scale), row0)
        return to_f32(e, arr[row0:row1])

    def iter_slot(self, slot: TensorSlot, max_bytes: int = 16 << 20) -> Iterator[np.ndarray]:
        """The tensor's values in GGUF row order, in row blocks of at most ~max_bytes of float32.

        Routed experts come expert by expert (each [F, D] or [D, F]); a block never spans two
        experts, so per-expert importance vectors can be computed from one block.
        """
        if slot.kind == Kind.INDEX:
            yield self.index_array(slot)
            return
        if slot.kind == Kind.VECTOR:
            name = official_name(slot)
            e = self._entry(name, slot)
            want = slot.shape
            arr = to_f32(e, st_array(e))
            if arr.size != math.prod(want):
                raise HFError(f"{self.dir}: '{name}' has shape {list(e.shape)}, expected {list(want)} for {slot.name}")
            yield arr.reshape(want)
            return
        ncols = slot.ne[0]
        nrows = slot.ne[1]
        step = max(1, max_bytes // (4 * ncols))
        if slot.kind == Kind.EXPERTS:
            for x in range(slot.ne[2]):
                name = official_name(slot, x)
                if not self.has(name):
                    raise HFError(f"{self.dir}: tensor '{name}' (expert {x} of {slot.name}) is missing")
                yield self.matrix_rows(name, slot, ncols, nrows, 0, nrows)
            return
        name = official_name(slot)
        if slot.name in (OUTPUT_HC_FN,) or slot_suffix(slot) in (T.COMP_APE, T.IDX_COMP_APE):
            step = nrows  # small tensors: one block
        for r0 in range(0, nrows, step):
            yield self.matrix_rows(name, slot, ncols, nrows, r0, min(nrows, r0 + step))

    def index_array(self, slot: TensorSlot) -> np.ndarray:
        name = official_name(slot)
        e = self._entry(name, slot)
        if e.dtype not in ("I64", "I32", "I16", "I8", "U8"):
            raise HFError(f"{self.dir}: '{name}' has dtype {e.dtype}, expected integers")
        if e.shape != slot.shape:
            raise HFError(f"{self.dir}: '{name}' has shape {list(e.shape)}, expected {list(slot.shape)}")
        arr = np.asarray(st_array(e))
        if arr.size and (arr.min() < 0 or arr.max() >= self.config.n_expert):
            raise HFError(f"{self.dir}: '{name}' holds expert ids outside 0..{self.config.n_expert - 1}")
        return arr.astype(np.int32)

    def slot_array(self, slot: TensorSlot) -> np.ndarray:
        """The whole tensor as float32 (int32 for tid2eid) in numpy shape (reversed ne)."""
        parts = list(self.iter_slot(slot))
        if slot.kind == Kind.EXPERTS:
            return np.stack(parts)
        return np.concatenate(parts, axis=0).reshape(slot.shape) if len(parts) > 1 else parts[0].reshape(slot.shape)


# ---------------------------------------------------------------------------------------------
# config.json <-> Config
# ---------------------------------------------------------------------------------------------

_LAYER_TYPE_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def config_from_hf(d: dict[str, Any], name: str | None = None) -> Config:
    """A Config from an official or transformers `config.json` dict."""
    if "text_config" in d and isinstance(d["text_config"], dict):
        d = {**d, **d["text_config"]}

    def get(key: str, default: Any = ...) -> Any:
        if key in d and d[key] is not None:
            return d[key]
        if default is ...:
            raise ConfigError(f"config.json key '{key}' is missing")
        return default

    try:
        n = int(get("num_hidden_layers"))
        head_dim = int(get("head_dim"))
        if "compress_ratios" in d:
            ratios = tuple(int(r) for r in d["compress_ratios"][:n])
        elif "layer_types" in d:
            rates = {**{"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                     **(d.get("compress_rates") or {})}
            ratios = tuple(0 if t == "sliding_attention" else int(rates[t]) for t in d["layer_types"][:n])
        else:
            raise ConfigError("config.json has neither 'compress_ratios' nor 'layer_types'")
        if "num_hash_layers" in d:
            n_hash = int(d["num_hash_layers"])
        elif "mlp_layer_types" in d:
            kinds = list(d["mlp_layer_types"])
            n_hash = sum(1 for k in kinds if k == "hash_moe")
            if kinds[:n_hash] != ["hash_moe"] * n_hash:
                raise ConfigError("hash-routed layers must come first in 'mlp_layer_types'")
        else:
            n_hash = 3
        if "qk_rope_head_dim" in d:
            rope_dim = int(d["qk_rope_head_dim"])
        else:
            rope_dim = int(round(head_dim * float(get("partial_rotary_factor"))))
        rp = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else None
        if rp and isinstance(rp.get("compress"), dict):
            yarn = rp["compress"]
            rope_base = float(rp.get("main", {}).get("rope_theta", get("rope_theta", 10000.0)))
            compress_base = float(yarn.get("rope_theta", get("compress_rope_theta", 160000.0)))
        else:
            yarn = d.get("rope_scaling") or rp or {}
            rope_base = float(get("rope_theta", 10000.0))
            compress_base = float(get("compress_rope_theta", 160000.0))
        scoring = d.get("scoring_func", "sqrtsoftplus")
        if scoring != "sqrtsoftplus":
            raise ConfigError(f"scoring_func is '{scoring}', DeepSeek V4 uses 'sqrtsoftplus'")
        clamp = get("swiglu_limit", 10.0)
        clamps = tuple(float(c) for c in clamp[:n]) if isinstance(clamp, list) else (float(clamp),) * n
        return Config(
            n_layer=n,
            n_embd=int(get("hidden_size")),
            vocab_size=int(get("vocab_size")),
            n_head=int(get("num_attention_heads")),
            n_head_kv=int(get("num_key_value_heads", 1)),
            head_dim=head_dim,
            rope_dim=rope_dim,
            q_lora_rank=int(get("q_lora_rank")),
            o_lora_rank=int(get("o_lora_rank")),
            o_groups=int(get("o_groups")),
            n_expert=int(get("n_routed_experts")),
            n_expert_used=int(get("num_experts_per_tok")),
            expert_ffn=int(get("moe_intermediate_size")),
            n_expert_shared=int(get("n_shared_experts", 1)),
            n_hash_layers=n_hash,
            sliding_window=int(get("sliding_window")),
            indexer_heads=int(get("index_n_heads")),
            indexer_dim=int(get("index_head_dim")),
            indexer_top_k=int(get("index_topk")),
            n_hc=int(get("hc_mult")),
            sinkhorn_iters=int(get("hc_sinkhorn_iters")),
            compress_ratios=ratios,
            swiglu_clamp=clamps,
            rope_base=rope_base,
            compress_rope_base=compress_base,
            rope_scaling_factor=float(yarn.get("factor", 16.0)),
            rope_orig_ctx=int(yarn.get("original_max_position_embeddings", 65536)),
            yarn_beta_fast=float(yarn.get("beta_fast", 32.0)),
            yarn_beta_slow=float(yarn.get("beta_slow", 1.0)),
            routed_scale=float(get("routed_scaling_factor")),
            rms_eps=float(get("rms_norm_eps", 1e-6)),
            hc_eps=float(get("hc_eps", 1e-6)),
            expert_weights_norm=bool(get("norm_topk_prob", True)),
            context_length=int(get("max_position_embeddings", 1048576)),
            name=name or str(d.get("_name_or_path") or d.get("name") or "deepseek4"),
        )
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"malformed DeepSeek V4 config.json ({type(e).__name__}: {e})") from None


def config_to_hf(cfg: Config) -> dict[str, Any]:
    """config.json as DeepSeek publishes it for V4 (official key names, FP8 + FP4 quantization)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "moe_intermediate_size": cfg.expert_ffn,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_head_kv,
        "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.rope_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "o_lora_rank": cfg.o_lora_rank,
        "o_groups": cfg.o_groups,
        "n_routed_experts": cfg.n_expert,
        "n_shared_experts": cfg.n_expert_shared,
        "num_experts_per_tok": cfg.n_expert_used,
        "num_hash_layers": cfg.n_hash_layers,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": cfg.expert_weights_norm,
        "routed_scaling_factor": cfg.routed_scale,
        "swiglu_limit": cfg.swiglu_clamp[0],
        "hidden_act": "silu",
        "sliding_window": cfg.sliding_window,
        "compress_ratios": list(cfg.compress_ratios[: cfg.n_layer]) + [0],  # trailing entry: the MTP layer
        "compress_rope_theta": cfg.compress_rope_base,
        "index_n_heads": cfg.indexer_heads,
        "index_head_dim": cfg.indexer_dim,
        "index_topk": cfg.indexer_top_k,
        "hc_mult": cfg.n_hc,
        "hc_sinkhorn_iters": cfg.sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": {
            "type": "yarn",
            "factor": cfg.rope_scaling_factor,
            "original_max_position_embeddings": cfg.rope_orig_ctx,
            "beta_fast": cfg.yarn_beta_fast,
            "beta_slow": cfg.yarn_beta_slow,
        },
        "max_position_embeddings": cfg.context_length,
        "num_nextn_predict_layers": 0,  # synthetic checkpoints carry no MTP block
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "expert_dtype": "fp4",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        },
    }


def config_to_transformers(cfg: Config):
    """The transformers `DeepseekV4Config` for a Config (the oracle for the engine tests).

    Compressed layers get YaRN through `rope_parameters` (transformers keeps them under the
    'compress' rope type and forces attention_factor 1.0, i.e. no mscale, as model-spec §3.1 says);
    dense layers keep plain RoPE at `rope_theta`.
    """
    from transformers import DeepseekV4Config

    if len(set(cfg.swiglu_clamp[: cfg.n_layer])) != 1:
        raise ConfigError("transformers supports one swiglu limit for all layers")
    return DeepseekV4Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.n_embd,
        moe_intermediate_size=cfg.expert_ffn,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head_kv,
        head_dim=cfg.head_dim,
        qk_rope_head_dim=cfg.rope_dim,
        q_lora_rank=cfg.q_lora_rank,
        o_lora_rank=cfg.o_lora_rank,
        o_groups=cfg.o_groups,
        n_routed_experts=cfg.n_expert,
        n_shared_experts=cfg.n_expert_shared,
        num_experts_per_tok=cfg.n_expert_used,
        num_hash_layers=cfg.n_hash_layers,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=cfg.expert_weights_norm,
        routed_scaling_factor=cfg.routed_scale,
        swiglu_limit=cfg.swiglu_clamp[0],
        sliding_window=cfg.sliding_window,
        compress_ratios=list(cfg.compress_ratios[: cfg.n_layer]),
        compress_rope_theta=cfg.compress_rope_base,
        index_n_heads=cfg.indexer_heads,
        index_head_dim=cfg.indexer_dim,
        index_topk=cfg.indexer_top_k,
        hc_mult=cfg.n_hc,
        hc_sinkhorn_iters=cfg.sinkhorn_iters,
        hc_eps=cfg.hc_eps,
        rms_norm_eps=cfg.rms_eps,
        rope_theta=cfg.rope_base,
        rope_parameters={
            "rope_type": "yarn",
            "factor": cfg.rope_scaling_factor,
            "original_max_position_embeddings": cfg.rope_orig_ctx,
            "beta_fast": cfg.yarn_beta_fast,
            "beta_slow": cfg.yarn_beta_slow,
        },
        max_position_embeddings=cfg.context_length,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
