"""Random DeepSeek V4 checkpoints in the official Hugging Face layout (and in transformers' layout).

`synth_checkpoint(cfg, out_dir, seed)` writes config.json, safetensors shards and
model.safetensors.index.json with the official names and storage (model-spec §2.4): FP8 e4m3 +
ue8m0 128×128 block scales for the attention projections, indexer query and shared experts; FP4
e2m1 + ue8m0 per-32 scales for routed experts; BF16 for embedding, head, router, compressor and
indexer projections; F32 for norms, HC, ape, sinks and router bias; I64 for `tid2eid`.

Values are deterministic functions of (seed, tensor name, row block), so any tensor can be made
without the others and the writer streams: it holds one row block (or one expert) at a time,
which lets the flash/pro presets be written on a small machine (slowly).

Scales are chosen so activations stay O(1) through every layer: linear weights have std
1/sqrt(fan_in) (output projections half that), norms are 1 ± 0.1, HC mixes are small with
non-zero bases, attention sinks N(0, 1), router bias N(0, 0.3), `tid2eid` a random choice of
distinct experts per token, and the head gives logits with a spread of about 2.

Shape note: FP8 scale grids use ceil(dim/128) blocks, so dims that are not multiples of 128 (the
tiny preset's 64-wide hidden size) get one partial block; the official checkpoints never need it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np

from ds4.engine.config import Config
from ds4.gguf_tools.constants import OUTPUT, OUTPUT_HC_BASE, OUTPUT_HC_FN, OUTPUT_HC_SCALE, TOKEN_EMBD, LayerTensor as T
from ds4.gguf_tools.hf import (
    FP4_BLOCK, FP8_BLOCK, SafetensorsWriter, config_to_hf, official_name, official_storage, quant_fp4, quant_fp8,
    scale_name, slot_suffix,
)
from ds4.gguf_tools.layout import Kind, TensorSlot, tensor_layout

CHUNK_ROWS = 8192  # rows generated at once; a multiple of the FP8 block so scale rows never straddle
SHARD_BYTES = {"tiny": 12 << 20, "small": 256 << 20}
DEFAULT_SHARD_BYTES = 4 << 30

_NORMS = {T.ATTN_NORM, T.FFN_NORM, T.ATTN_Q_A_NORM, T.ATTN_KV_A_NORM, T.COMP_NORM, T.IDX_COMP_NORM}
_HALF_GAIN = {T.ATTN_OUTPUT_B, T.FFN_DOWN_SHEXP, T.FFN_DOWN_EXPS}


def _rng(seed: int, name: str, block: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), block])


def slot_values(cfg: Config, slot: TensorSlot, seed: int, rows: slice | None = None,
                expert: int | None = None) -> np.ndarray:
    """float32 values (int64 for tid2eid) of one tensor, one row block (CHUNK_ROWS-aligned) or one expert."""
    name = official_name(slot, expert) if slot.kind == Kind.EXPERTS else official_name(slot)
    shape = slot.shape[1:] if slot.kind == Kind.EXPERTS else slot.shape
    suffix = slot_suffix(slot)
    if slot.kind == Kind.INDEX:
        V, k = shape
        out = np.empty((V, k), dtype=np.int64)
        for b, r0 in enumerate(range(0, V, CHUNK_ROWS)):
            n = min(CHUNK_ROWS, V - r0)
            keys = _rng(seed, name, b).random((n, cfg.n_expert))
            out[r0:r0 + n] = np.argsort(keys, axis=1)[:, :k]  # k distinct experts per token
        return out
    if len(shape) == 1 or slot.name in (OUTPUT_HC_FN,) or suffix in (T.HC_ATTN_FN, T.HC_FFN_FN, T.COMP_APE,
                                                                      T.IDX_COMP_APE):
        rng = _rng(seed, name, 0)
        if slot.name == OUTPUT_HC_SCALE or suffix in (T.HC_ATTN_SCALE, T.HC_FFN_SCALE):
            return rng.uniform(0.5, 1.5, shape).astype(np.float32)
        if slot.name == OUTPUT_HC_BASE or suffix in (T.HC_ATTN_BASE, T.HC_FFN_BASE):
            return rng.normal(0.0, 0.5, shape).astype(np.float32)
        if slot.name == OUTPUT_HC_FN or suffix in (T.HC_ATTN_FN, T.HC_FFN_FN):
            return rng.normal(0.0, 1.0 / math.sqrt(shape[1]), shape).astype(np.float32)
        if suffix in (T.COMP_APE, T.IDX_COMP_APE):
            return rng.normal(0.0, 0.5, shape).astype(np.float32)
        if suffix == T.ATTN_SINKS:
            return rng.normal(0.0, 1.0, shape).astype(np.float32)
        if suffix == T.EXP_PROBS_B:
            return rng.normal(0.0, 0.3, shape).astype(np.float32)
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)  # norm weights
    # 2-D matrix [out, in], by row blocks
    n_out, n_in = shape
    rows = rows or slice(0, n_out)
    if slot.name == TOKEN_EMBD:
        std = 1.0
    elif slot.name == OUTPUT:
        std = 2.0 / math.sqrt(n_in)
    else:
        std = (0.5 if suffix in _HALF_GAIN else 1.0) / math.sqrt(n_in)
    parts = []
    for r0 in range(rows.start, rows.stop, CHUNK_ROWS):
        assert r0 % CHUNK_ROWS == 0, "row blocks must start on CHUNK_ROWS"
        n = min(CHUNK_ROWS, n_out - r0, rows.stop - r0)
        parts.append(_rng(seed, name, (expert or 0) * 1_000_003 + r0 // CHUNK_ROWS).normal(0.0, std, (n, n_in)))
    return np.concatenate(parts).astype(np.float32) if len(parts) > 1 else parts[0].astype(np.float32)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bits, in place on one uint32 copy (values are finite)."""
    bits = np.array(x, dtype=np.float32).view(np.uint32)
    lsb = (bits >> 16) & 1
    lsb += 0x7FFF
    bits += lsb
    del lsb
    bits >>= 16
    return bits.astype(np.uint16)


def official_entries(cfg: Config) -> list[tuple[str, str, tuple[int, ...], TensorSlot, int | None]]:
    """(name, safetensors dtype, shape, slot, expert) for every tensor of the official checkpoint."""
    out = []
    for slot in tensor_layout(cfg):
        storage = official_storage(slot)
        if storage == "fp4":
            n_exp, n_out, n_in = slot.shape
            for x in range(n_exp):
                w = official_name(slot, x)
                out.append((w, "I8", (n_out, n_in // 2), slot, x))
                out.append((scale_name(w), "F8_E8M0", (n_out, n_in // FP4_BLOCK), slot, x))
            continue
        name = official_name(slot)
        if storage == "fp8":
            n_out, n_in = slot.shape
            out.append((name, "F8_E4M3", slot.shape, slot, None))
            out.append((scale_name(name), "F8_E8M0", (math.ceil(n_out / FP8_BLOCK), math.ceil(n_in / FP8_BLOCK)),
                        slot, None))
        else:
            dtype = {"bf16": "BF16", "f32": "F32", "i64": "I64"}[storage]
            out.append((name, dtype, slot.shape, slot, None))
    return out


class _Producer:
    """Makes the bytes of each official tensor in order; FP8/FP4 scales come from the weight pass."""

    def __init__(self, cfg: Config, seed: int):
        self.cfg, self.seed = cfg, seed
        self.pending_scale: dict[str, list[np.ndarray]] = {}

    def chunks(self, name: str, dtype: str, shape: tuple[int, ...], slot: TensorSlot,
               expert: int | None) -> Iterator[np.ndarray]:
        if name in self.pending_scale:
            yield from self.pending_scale.pop(name)
            return
        storage = official_storage(slot)
        if storage == "fp4":
            codes, scale = quant_fp4(slot_values(self.cfg, slot, self.seed, expert=expert))
            self.pending_scale[scale_name(name)] = [scale]
            yield codes
            return
        if storage == "i64":
            yield slot_values(self.cfg, slot, self.seed).astype("<i8")
            return
        if len(shape) == 1 or storage == "f32":
            yield slot_values(self.cfg, slot, self.seed)
            return
        scales = []
        for r0 in range(0, shape[0], CHUNK_ROWS):
            block = slot_values(self.cfg, slot, self.seed, rows=slice(r0, min(shape[0], r0 + CHUNK_ROWS)))
            if storage == "fp8":
                codes, scale = quant_fp8(block)
                scales.append(scale)
                yield codes
            else:
                yield _bf16_bits(block)
        if storage == "fp8":
            self.pending_scale[scale_name(name)] = scales


def synth_checkpoint(cfg: Config, out_dir: str | os.PathLike, seed: int = 0, *, shard_bytes: int | None = None,
                     progress: bool = False) -> Path:
    """Write a random official-layout checkpoint for `cfg` to `out_dir` (replaced atomically)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").exists():
        raise FileExistsError(f"{out} is a non-empty directory that is not a checkpoint; refusing to replace it")
    shard_bytes = shard_bytes or SHARD_BYTES.get(cfg.name.removeprefix("ds4-"), DEFAULT_SHARD_BYTES)
    entries = official_entries(cfg)
    from ds4.gguf_tools.hf import ST_DTYPES

    def nbytes(e: tuple) -> int:
        return math.prod(e[2]) * ST_DTYPES[e[1]].itemsize

    shards: list[list[tuple]] = [[]]
    size = 0
    for e in entries:
        # keep a weight and its scale in one shard
        if shards[-1] and size + nbytes(e) > shard_bytes and not e[0].endswith(".scale"):
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes(e)

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        producer = _Producer(cfg, seed)
        weight_map, total = {}, 0
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(nbytes(e) for e in entries), unit="B", unit_scale=True, desc="synth", leave=False)
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            w = SafetensorsWriter(tmp / fname, [(n, d, s) for n, d, s, _, _ in shard])
            try:
                for e in shard:
                    w.write(e[0], producer.chunks(*e))
                    weight_map[e[0]] = fname
                    total += nbytes(e)
                    if bar is not None:
                        bar.update(nbytes(e))
            finally:
                w.close()
        if bar is not None:
            bar.close()
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        hf = config_to_hf(cfg)
        hf["_synthetic"] = {"seed": seed, "generator": "ds4-quantize synth", "name": cfg.name}
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_transformers_checkpoint(cfg: Config, out_dir: str | os.PathLike, seed: int = 0,
                                  official_dir: str | os.PathLike | None = None):
    """A `DeepseekV4ForCausalLM.save_pretrained` checkpoint (float32) holding the synth weights.

    The weights are exactly those of `synth_checkpoint(cfg, ..., seed)` after FP8/FP4
    dequantization, so the engine (reading our GGUF) and transformers see the same model. They are
    loaded through transformers' own official-name mapping (a check on ours), then saved with
    `save_pretrained`. Returns the loaded transformers model (float32, eval mode). Tiny/small only:
    the whole model is materialised in memory.
    """
    import tempfile

    import torch
    from safetensors.numpy import save_file
    from transformers import DeepseekV4ForCausalLM

    from ds4.gguf_tools.hf import HFCheckpoint, config_to_transformers

    with tempfile.TemporaryDirectory(prefix="ds4-tf-") as work:
        work = Path(work)
        src = Path(official_dir) if official_dir else synth_checkpoint(cfg, work / "official", seed)
        ckpt = HFCheckpoint(src)
        tensors = {}
        for slot in tensor_layout(cfg):
            arr = ckpt.slot_array(slot)
            if slot.kind == Kind.EXPERTS:
                for x in range(arr.shape[0]):
                    tensors[official_name(slot, x)] = np.ascontiguousarray(arr[x])
            elif slot.kind == Kind.INDEX:
                tensors[official_name(slot)] = arr.astype(np.int64)
            else:
                tensors[official_name(slot)] = np.ascontiguousarray(arr, dtype=np.float32)
        plain = work / "plain"
        plain.mkdir()
        save_file(tensors, str(plain / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        tcfg = config_to_transformers(cfg)
        tcfg.save_pretrained(plain)
        model, info = DeepseekV4ForCausalLM.from_pretrained(plain, dtype=torch.float32, output_loading_info=True)
        problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if problems:
            raise RuntimeError(f"transformers did not take the synthetic weights cleanly: {problems}")
        model.eval()
        model.save_pretrained(out_dir)
    return model
