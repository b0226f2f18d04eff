"""Write GGUF v3 files through the `gguf` package, streaming one tensor at a time.

The plan (names, types, shapes) and the metadata go into the header first; then `produce(plan)`
is called for each tensor in order and its bytes are appended, so peak memory is about the
largest single tensor. The file is written under a temporary name in the target directory and
renamed into place only when complete: an interrupted run never leaves a half-written GGUF.

Metadata values are typed the way ds4 and llama.cpp expect them (`METADATA_TYPES`): u32 for
counts, u64 for context lengths, f32 for real numbers, a bool for `expert_weights_norm`, an i32
array for `compress_ratios` and an f32 array for `swiglu_clamp_exp`. Any value can be forced to a
type by wrapping it in `Typed`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType, GGUFValueType

from ds4.engine.config import Config
from ds4.gguf_tools.constants import ARCH, DEFAULT_ALIGNMENT, Key, QuantType, tensor_bytes

V = GGUFValueType

METADATA_TYPES: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {
    Key.NAME: (V.STRING, None),
    Key.ALIGNMENT: (V.UINT32, None),
    Key.BLOCK_COUNT: (V.UINT32, None),
    Key.CONTEXT_LENGTH: (V.UINT64, None),
    Key.EMBEDDING_LENGTH: (V.UINT32, None),
    Key.VOCAB_SIZE: (V.UINT32, None),
    Key.HEAD_COUNT: (V.UINT32, None),
    Key.HEAD_COUNT_KV: (V.UINT32, None),
    Key.KEY_LENGTH: (V.UINT32, None),
    Key.VALUE_LENGTH: (V.UINT32, None),
    Key.Q_LORA_RANK: (V.UINT32, None),
    Key.OUTPUT_LORA_RANK: (V.UINT32, None),
    Key.OUTPUT_GROUP_COUNT: (V.UINT32, None),
    Key.SLIDING_WINDOW: (V.UINT32, None),
    Key.RMS_EPS: (V.FLOAT32, None),
    Key.COMPRESS_RATIOS: (V.ARRAY, V.INT32),
    Key.COMPRESS_ROPE_FREQ_BASE: (V.FLOAT32, None),
    Key.INDEXER_HEAD_COUNT: (V.UINT32, None),
    Key.INDEXER_KEY_LENGTH: (V.UINT32, None),
    Key.INDEXER_TOP_K: (V.UINT32, None),
    Key.ROPE_DIMENSION_COUNT: (V.UINT32, None),
    Key.ROPE_FREQ_BASE: (V.FLOAT32, None),
    Key.ROPE_SCALING_FACTOR: (V.FLOAT32, None),
    Key.ROPE_ORIG_CTX: (V.UINT64, None),
    Key.ROPE_YARN_BETA_FAST: (V.FLOAT32, None),
    Key.ROPE_YARN_BETA_SLOW: (V.FLOAT32, None),
    Key.EXPERT_COUNT: (V.UINT32, None),
    Key.EXPERT_USED_COUNT: (V.UINT32, None),
    Key.EXPERT_SHARED_COUNT: (V.UINT32, None),
    Key.EXPERT_FFN_LENGTH: (V.UINT32, None),
    Key.EXPERT_GROUP_COUNT: (V.UINT32, None),
    Key.EXPERT_GROUP_USED_COUNT: (V.UINT32, None),
    Key.EXPERT_WEIGHTS_SCALE: (V.FLOAT32, None),
    Key.EXPERT_WEIGHTS_NORM: (V.BOOL, None),
    Key.HASH_LAYER_COUNT: (V.UINT32, None),
    Key.HC_COUNT: (V.UINT32, None),
    Key.HC_EPS: (V.FLOAT32, None),
    Key.HC_SINKHORN_ITERS: (V.UINT32, None),
    Key.SWIGLU_CLAMP: (V.ARRAY, V.FLOAT32),
    Key.TOKENS: (V.ARRAY, V.STRING),
    Key.MERGES: (V.ARRAY, V.STRING),
    Key.TOKENIZER_MODEL: (V.STRING, None),
    Key.TOKENIZER_PRE: (V.STRING, None),
    Key.BOS_ID: (V.UINT32, None),
    Key.EOS_ID: (V.UINT32, None),
}
METADATA_TYPES = {getattr(k, "value", k): v for k, v in METADATA_TYPES.items()}

TOKENIZER_MODEL = "gpt2"
TOKENIZER_PRE = "joyai-llm"  # what the published DS4 GGUFs declare (model-spec §2.3); ds4 ignores it


@dataclass(frozen=True)
class Typed:
    """A metadata value with an explicit GGUF type (and element type for arrays)."""

    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: name, storage type and GGUF shape (ne, fastest dimension first)."""

    name: str
    qtype: QuantType
    ne: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.qtype, self.ne)


def _infer_type(key: str, value: Any) -> Typed:
    if isinstance(value, Typed):
        return value
    if key in METADATA_TYPES:
        vtype, sub = METADATA_TYPES[key]
        return Typed(value, vtype, sub)
    if isinstance(value, bool):
        return Typed(value, V.BOOL)
    if isinstance(value, (int, np.integer)):
        return Typed(int(value), V.UINT32 if 0 <= value < 2**32 else V.INT64)
    if isinstance(value, (float, np.floating)):
        return Typed(float(value), V.FLOAT32)
    if isinstance(value, str):
        return Typed(value, V.STRING)
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, str) for v in value):
            return Typed(list(value), V.ARRAY, V.STRING)
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
            return Typed(list(value), V.ARRAY, V.INT32)
        if all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in value):
            return Typed([float(v) for v in value], V.ARRAY, V.FLOAT32)
    raise TypeError(f"cannot infer a GGUF type for metadata key '{key}' (value {value!r:.60})")


def _coerce(t: Typed) -> Any:
    """Python value in the form GGUFWriter packs for that type."""
    if t.vtype == V.ARRAY:
        if t.sub_type in (V.FLOAT32, V.FLOAT64):
            return [float(x) for x in t.value]
        if t.sub_type == V.STRING:
            return [str(x) for x in t.value]
        if t.sub_type == V.BOOL:
            return [bool(x) for x in t.value]
        return [int(x) for x in t.value]
    if t.vtype in (V.FLOAT32, V.FLOAT64):
        return float(t.value)
    if t.vtype == V.BOOL:
        return bool(t.value)
    if t.vtype == V.STRING:
        return str(t.value)
    return int(t.value)


def ds4_metadata(cfg: Config, tokens: Sequence[str], merges: Sequence[str], *, name: str | None = None,
                 bos_id: int = 0, eos_id: int = 1) -> dict[str, Any]:
    """All metadata of a DS4 main-model GGUF (model-spec §2.2-2.3), ready for `write_gguf`."""
    meta: dict[str, Any] = {Key.NAME.value: name or cfg.name}
    meta.update({getattr(k, "value", k): v for k, v in cfg.to_metadata().items()})
    meta[Key.EXPERT_GROUP_COUNT.value] = 0
    meta[Key.EXPERT_GROUP_USED_COUNT.value] = 0
    meta[Key.TOKENIZER_MODEL.value] = TOKENIZER_MODEL
    meta[Key.TOKENIZER_PRE.value] = TOKENIZER_PRE
    meta[Key.BOS_ID.value] = bos_id
    meta[Key.EOS_ID.value] = eos_id
    meta[Key.TOKENS.value] = list(tokens)
    meta[Key.MERGES.value] = list(merges)
    return meta


_NUMPY_FOR = {QuantType.F32: np.float32, QuantType.F16: np.float16, QuantType.I32: np.int32}


def encode(qtype: QuantType, x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """Values (any float/int array, last axis = ne0) to the bytes stored for `qtype`.

    F32/F16 round to nearest even (numpy), I32 must fit, quant types go through
    `ds4.gguf_tools.quants.quantize` row by row.
    """
    qtype = QuantType(qtype)
    if qtype in _NUMPY_FOR:
        if qtype == QuantType.I32:
            xi = np.asarray(x)
            if xi.size and (xi.min() < -2**31 or xi.max() >= 2**31):
                raise ValueError("value does not fit int32")
            return np.ascontiguousarray(xi, dtype="<i4")
        return np.ascontiguousarray(x, dtype=np.dtype(_NUMPY_FOR[qtype]).newbyteorder("<"))
    if qtype == QuantType.BF16:
        bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(np.asarray(x, dtype=np.float32))
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
        return rounded
    from ds4.gguf_tools import quants

    x = np.asarray(x, dtype=np.float32)
    ncols = x.shape[-1]
    return np.ascontiguousarray(quants.quantize(qtype, x.reshape(-1, ncols), importance=importance), dtype=np.uint8)


def _tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it onto `path` on success, delete it on failure."""
    path = Path(path)
    tmp = _tmp_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def write_gguf(path: str | os.PathLike, metadata: Mapping[str, Any], plans: Sequence[TensorPlan],
               produce: Callable[[TensorPlan], np.ndarray], *, arch: str = ARCH,
               alignment: int = DEFAULT_ALIGNMENT, progress: bool = False, jobs: int = 1,
               tensor_writer: Callable[[Path, list[tuple[str, int]]], None] | None = None) -> Path:
    """Write a GGUF v3 file: header and metadata, tensor directory, then `produce(plan)` per tensor.

    `produce` returns the stored bytes of one tensor: an array of exactly `plan.nbytes` bytes
    (float32/float16/int32 values, or uint8 blocks for quant types), or an iterable of such arrays
    written back to back (whole rows each), so a converter can stream a tensor expert by expert.

    With jobs > 1 and a picklable `tensor_writer(path, [(name, byte offset)])` (which writes those
    tensors' bytes at those offsets of the file, e.g. with `write_tensor_at`), the data region is
    sized up front and groups of tensors are written by that many worker processes at once: the
    same bytes (padding is the zeros of the sized file).
    """
    path = Path(path)
    names = [p.name for p in plans]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in the plan")
    with atomic_output(path) as tmp:
        w = GGUFWriter(tmp, arch)
        try:
            fout = _write_head(w, metadata, plans, alignment)
            bar = None
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=sum(p.nbytes for p in plans), unit="B", unit_scale=True,
                           desc=f"writing {path.name}", leave=False)
            if jobs > 1 and tensor_writer is not None:
                _write_data_parallel(fout, tmp, plans, tensor_writer, jobs, alignment, bar)
            else:
                for p in plans:
                    written = _write_tensor(fout, p, produce(p), bar)
                    w.write_padding(fout, written)
            if bar is not None:
                bar.close()
            fout.flush()
        finally:
            w.close()
    return path


def _write_head(w: GGUFWriter, metadata: Mapping[str, Any], plans: Sequence[TensorPlan], alignment: int):
    """Header, metadata and tensor directory, padded so the data region starts aligned; the open file."""
    if alignment != DEFAULT_ALIGNMENT:
        w.add_custom_alignment(alignment)
    for key, value in metadata.items():
        key = getattr(key, "value", key)
        if key == Key.ARCHITECTURE.value:
            continue  # GGUFWriter writes general.architecture from `arch`
        t = _infer_type(key, value)
        if t.vtype == V.ARRAY and len(t.value) == 0:
            continue  # gguf-py cannot write an empty array; an absent key reads the same
        w.add_key_value(key, _coerce(t), t.vtype, sub_type=t.sub_type)
    for p in plans:
        # numpy-order shape; a non-uint8 dtype keeps GGUFWriter from reinterpreting it as bytes
        w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes,
                          raw_dtype=GGMLQuantizationType(int(p.qtype)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    w.write_padding(fout, fout.tell())  # data region starts aligned
    return fout


def _write_tensor(fout, p: TensorPlan, produced, bar=None) -> int:
    """One tensor's bytes from `produced` (an array or an iterable of arrays) at fout's position; checks the size."""
    chunks = [produced] if isinstance(produced, np.ndarray) else produced
    written = 0
    for chunk in chunks:
        chunk = np.ascontiguousarray(chunk)
        if written + chunk.nbytes > p.nbytes:
            raise ValueError(f"tensor '{p.name}': produced more than the {p.nbytes} bytes "
                             f"{p.qtype.name} {list(p.ne)} needs")
        chunk.tofile(fout)
        written += chunk.nbytes
        if bar is not None:
            bar.update(chunk.nbytes)
        del chunk
    if written != p.nbytes:
        raise ValueError(f"tensor '{p.name}': produced {written} bytes, "
                         f"{p.qtype.name} {list(p.ne)} needs {p.nbytes}")
    return written


def write_tensor_at(path: Path, offset: int, p: TensorPlan, produced) -> None:
    """A worker's part of a parallel write_gguf: one tensor's bytes at `offset` of the sized file."""
    with open(path, "r+b") as f:
        f.seek(offset)
        _write_tensor(f, p, produced)


def _write_data_parallel(fout, tmp: Path, plans: Sequence[TensorPlan], tensor_writer, jobs: int, alignment: int,
                         bar) -> None:
    """Size the data region (its padding stays zero), then groups of ~1/(4 jobs) of the bytes per worker task."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    data_start = fout.tell()
    offsets, off = [], data_start
    for p in plans:
        offsets.append(off)
        off += -(-p.nbytes // alignment) * alignment
    fout.truncate(off)
    fout.flush()
    target = max(1, sum(p.nbytes for p in plans) // (4 * jobs))
    groups, size = [[]], 0
    for p, o in zip(plans, offsets):
        if groups[-1] and size + p.nbytes > target:
            groups.append([])
            size = 0
        groups[-1].append((p.name, o))
        size += p.nbytes
    nbytes = {p.name: p.nbytes for p in plans}
    with ProcessPoolExecutor(min(jobs, len(groups)), mp_context=mp.get_context("spawn")) as ex:
        futs = {ex.submit(tensor_writer, tmp, g): sum(nbytes[n] for n, _ in g) for g in groups}
        for f in as_completed(futs):
            f.result()
            if bar is not None:
                bar.update(futs[f])


def write_tensors(path: str | os.PathLike, metadata: Mapping[str, Any],
                  tensors: Mapping[str, tuple[QuantType, np.ndarray]] | Iterable[tuple[str, QuantType, np.ndarray]],
                  **kw: Any) -> Path:
    """Convenience for small files: `tensors` maps name -> (type, values in numpy shape).

    Values are encoded with `encode` (so quant types need the quants kernels).
    """
    items = list(tensors.items()) if isinstance(tensors, Mapping) else [(n, (q, a)) for n, q, a in tensors]
    plans, values = [], {}
    for name, (qtype, arr) in items:
        arr = np.asarray(arr)
        plans.append(TensorPlan(name, QuantType(qtype), tuple(reversed(arr.shape))))
        values[name] = arr
    return write_gguf(path, metadata, plans, lambda p: encode(p.qtype, values[p.name]), **kw)
