"""Read GGUF v3 files: mmap, zero-copy numpy views, and DS4 validation (model-spec §2).

`open_gguf(path)` parses any GGUF v3 file (MTP, imatrix, foreign models) without checking what it
holds. `open_model(path)` additionally requires a DeepSeek V4 main model: architecture
`deepseek4`, a valid `Config` from the metadata, and every tensor present with the name, shape and
type that config implies (`layout.tensor_layout`).

Every problem with a file raises `GGUFError` with a one-line message naming the file (and the
tensor or key) and what was expected. Command-line tools print that line and exit with code 2.

Split files (llama.cpp gguf-split: `NAME-00001-of-0000N.gguf`, keys `split.no`, `split.count`,
`split.tensors.count`) are opened from their first part: the other parts are found by name, each
is mapped, and their tensors join the first part's, so `tensors`, `raw`, `array` and `mapping` see
one model. Opening a later part directly is an error naming the first.

The parser is our own (not `gguf.GGUFReader`) so that hostile or broken headers are checked before
anything is allocated: each count and length is bounded by the bytes that remain in the file.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ds4.engine.config import Config, ConfigError
from ds4.gguf_tools.constants import ARCH, DEFAULT_ALIGNMENT, GGUF_VERSION, Key, QuantType
from ds4.gguf_tools.layout import ALLOWED_TYPES, Kind, TensorSlot, tensor_layout

GGUF_MAGIC = b"GGUF"
MAX_DIMS = 4
MAX_ELEMENTS = 1 << 48  # far above any real tensor; rejects absurd shapes before any arithmetic overflows

# Scalar value types: struct format and size.
_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}
_NUMPY = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.FLOAT64: "<f8",
    GGUFValueType.BOOL: "?",
}


class GGUFError(Exception):
    """A GGUF file that cannot be used; the message is one line naming the file and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: QuantType | int  # QuantType for the types ds4 knows; the raw ggml code otherwise
    ne: tuple[int, ...]  # GGUF order, fastest dimension first
    offset: int  # absolute byte offset of the tensor data in the file (its part, for a split file)
    nbytes: int
    part: int = 0  # index of the split part holding the data (0 for a single file)

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy shape of the logical tensor: reversed ne."""
        return tuple(reversed(self.ne))

    @property
    def type_name(self) -> str:
        try:
            return QuantType(self.qtype).name
        except ValueError:
            try:
                return GGMLQuantizationType(self.qtype).name
            except ValueError:
                return str(int(self.qtype))


def _f32_to_float(v: float) -> float:
    """The shortest decimal that rounds to this float32 (1e-6 stays 1e-6, not 9.99999997e-07)."""
    return float(np.format_float_positional(np.float32(v), unique=True, trim="-")) if np.isfinite(v) else float(v)


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated file: {what} needs {n} bytes at offset {self.pos}, "
                            f"file has {self.size} bytes")

    def scalar(self, vtype: GGUFValueType, what: str) -> Any:
        fmt = _SCALAR[vtype]
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT64, what)

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos: self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            raise self.fail(f"metadata key '{key}' has unknown value type {vtype}") from None
        if vtype == GGUFValueType.STRING:
            return self.string(f"metadata key '{key}'")
        if vtype == GGUFValueType.FLOAT32:
            return _f32_to_float(self.scalar(vtype, f"metadata key '{key}'"))
        if vtype != GGUFValueType.ARRAY:
            return self.scalar(vtype, f"metadata key '{key}'")
        if depth > 4:
            raise self.fail(f"metadata key '{key}' nests arrays too deeply")
        sub = self.u32(f"array type of '{key}'")
        count = self.u64(f"array length of '{key}'")
        try:
            sub = GGUFValueType(sub)
        except ValueError:
            raise self.fail(f"metadata key '{key}' is an array of unknown type {sub}") from None
        if sub in _NUMPY:
            dt = np.dtype(_NUMPY[sub])
            self.need(count * dt.itemsize, f"array '{key}' of {count} {sub.name}")
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
            self.pos += count * dt.itemsize
            if sub == GGUFValueType.FLOAT32:
                return [_f32_to_float(v) for v in arr]
            return arr.tolist()
        # strings and nested arrays take at least 8 bytes each
        self.need(count * 8, f"array '{key}' of {count} {sub.name}")
        if sub == GGUFValueType.STRING:
            return [self.string(f"element of '{key}'") for _ in range(count)]
        return [self.value(sub, key, depth + 1) for _ in range(count)]


SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_path(prefix: str | os.PathLike, index: int, count: int) -> Path:
    """The file of part `index` (0-based) of `count`: PREFIX-00001-of-0000N.gguf, as llama.cpp names them."""
    return Path(f"{os.fspath(prefix)}-{index + 1:05d}-of-{count:05d}.gguf")


def split_prefix(path: str | os.PathLike) -> str | None:
    """PREFIX of a split part's file name, or None when the name is not NAME-0000i-of-0000N.gguf."""
    m = SPLIT_NAME.match(os.fspath(path))
    return m.group("prefix") if m else None


def _type_sizes(code: int) -> tuple[int, int] | None:
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(code)]
    except (ValueError, KeyError):
        return None


class GGUFFile:
    """A parsed GGUF file. Tensor data stay in the page cache; views are read-only and zero-copy."""

    def __init__(self, path: str | os.PathLike, *, _part: bool = False):
        self.path = Path(path)
        try:
            fd = open(self.path, "rb")
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise GGUFError(f"{self.path}: is a directory, expected a GGUF file") from None
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open ({e.strerror})") from None
        with fd:
            size = os.fstat(fd.fileno()).st_size
            if size < 24:
                raise GGUFError(f"{self.path}: truncated file: {size} bytes, a GGUF header needs 24")
            self._mm = mmap.mmap(fd.fileno(), 0, access=mmap.ACCESS_READ)
        self.file_size = size
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()
        self.parts: list[GGUFFile] = [self]
        if not _part:
            self._open_parts()

    # ---- parsing ---------------------------------------------------------------------------------
    def _parse(self) -> None:
        c = _Cursor(self._mm, self.path)
        magic = bytes(self._mm[:4])
        if magic != GGUF_MAGIC:
            raise c.fail(f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
        c.pos = 4
        self.version = c.u32("version")
        if self.version != GGUF_VERSION:
            raise c.fail(f"GGUF version {self.version}, expected {GGUF_VERSION}")
        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata count")
        # Every metadata record takes >= 13 bytes and every tensor record >= 28: bound the counts.
        if n_kv * 13 > self.file_size or n_tensors * 28 > self.file_size:
            raise c.fail(f"absurd header: {n_tensors} tensors and {n_kv} metadata keys "
                         f"cannot fit in {self.file_size} bytes")
        for _ in range(n_kv):
            key = c.string("metadata key")
            vtype = c.u32(f"type of metadata key '{key}'")
            start = c.pos
            value = c.value(vtype, key)  # validates vtype and the array's element type
            sub = GGUFValueType(struct.unpack_from("<I", self._mm, start)[0]) \
                if vtype == GGUFValueType.ARRAY else None
            if key in self.metadata:
                raise c.fail(f"metadata key '{key}' appears twice")
            self.metadata[key] = value
            self.metadata_types[key] = (GGUFValueType(vtype), sub)

        self.alignment = DEFAULT_ALIGNMENT
        if Key.ALIGNMENT.value in self.metadata:
            a = self.metadata[Key.ALIGNMENT.value]
            if not isinstance(a, int) or isinstance(a, bool) or a <= 0 or a & (a - 1) or a > 1 << 20:
                raise c.fail(f"general.alignment is {a!r}, expected a power of two")
            self.alignment = a

        infos = []
        for _ in range(n_tensors):
            name = c.string("tensor name")
            n_dims = c.u32(f"dimension count of tensor '{name}'")
            if not 1 <= n_dims <= MAX_DIMS:
                raise c.fail(f"tensor '{name}' has {n_dims} dimensions, expected 1 to {MAX_DIMS}")
            ne = tuple(c.u64(f"shape of tensor '{name}'") for _ in range(n_dims))
            if any(d == 0 for d in ne) or math.prod(ne) > MAX_ELEMENTS:
                raise c.fail(f"tensor '{name}' has absurd shape {list(ne)}")
            code = c.u32(f"type of tensor '{name}'")
            offset = c.u64(f"offset of tensor '{name}'")
            sizes = _type_sizes(code)
            if sizes is None:
                raise c.fail(f"tensor '{name}' has unknown ggml type {code}")
            block, block_bytes = sizes
            if ne[0] % block:
                raise c.fail(f"tensor '{name}' row of {ne[0]} is not a multiple of the "
                             f"{GGMLQuantizationType(code).name} block ({block})")
            nbytes = math.prod(ne) // block * block_bytes
            if name in self.tensors or any(i[0] == name for i in infos):
                raise c.fail(f"tensor '{name}' appears twice")
            infos.append((name, code, ne, offset, nbytes))

        self.data_offset = -(-c.pos // self.alignment) * self.alignment
        for name, code, ne, offset, nbytes in infos:
            if offset % self.alignment:
                raise c.fail(f"tensor '{name}' offset {offset} is not aligned to {self.alignment}")
            start = self.data_offset + offset
            if start + nbytes > self.file_size:
                raise c.fail(f"truncated file: tensor '{name}' needs bytes up to {start + nbytes}, "
                             f"file has {self.file_size}")
            qtype: QuantType | int
            try:
                qtype = QuantType(code)
            except ValueError:
                qtype = code
            self.tensors[name] = TensorInfo(name, qtype, ne, start, nbytes)

    def _open_parts(self) -> None:
        """Join the tensors of the other parts of a split file (this must be its first part)."""
        key_no, key_count, key_total = Key.SPLIT_NO.value, Key.SPLIT_COUNT.value, Key.SPLIT_TENSORS_COUNT.value
        if key_count not in self.metadata:
            return
        count, no = self.metadata[key_count], self.metadata.get(key_no, 0)
        if not isinstance(count, int) or not isinstance(no, int) or count < 1 or not 0 <= no < count:
            raise GGUFError(f"{self.path}: malformed split keys ({key_no}={no!r}, {key_count}={count!r})")
        prefix = split_prefix(self.path)
        if no != 0:
            first = split_path(prefix, 0, count).name if prefix else "its part 00001"
            raise GGUFError(f"{self.path}: part {no + 1} of {count} of a split GGUF; open the first part ({first})")
        if count > 1 and prefix is None:
            raise GGUFError(f"{self.path}: first of {count} split parts, but the name does not follow "
                            "NAME-00001-of-NNNNN.gguf, so the other parts cannot be found")
        for i in range(1, count):
            p = split_path(prefix, i, count)
            if not p.is_file():
                raise GGUFError(f"{self.path}: split part {p.name} ({i + 1} of {count}) is missing")
            part = GGUFFile(p, _part=True)
            if part.metadata.get(key_no) != i or part.metadata.get(key_count) != count:
                raise GGUFError(f"{p}: split keys say part {part.metadata.get(key_no)!r} of "
                                f"{part.metadata.get(key_count)!r}, expected {i} of {count}")
            for name, t in part.tensors.items():
                if name in self.tensors:
                    raise GGUFError(f"{p}: tensor '{name}' appears in two split parts")
                self.tensors[name] = replace(t, part=i)
            self.parts.append(part)
        total = self.metadata.get(key_total)
        if total is not None and total != len(self.tensors):
            raise GGUFError(f"{self.path}: {key_total} is {total}, the {count} parts hold {len(self.tensors)} tensors")

    # ---- access ----------------------------------------------------------------------------------
    def mapping(self, name: str) -> mmap.mmap:
        """The read-only mapping of the file (split part) holding tensor `name`; its `offset` is into it."""
        return self.parts[self.info(name).part]._mm

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: tensor '{name}' is missing") from None

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes, zero-copy, shaped (rows..., row_bytes) with rows = reversed ne[1:]."""
        t = self.info(name)
        flat = np.frombuffer(self.mapping(name), dtype=np.uint8, count=t.nbytes, offset=t.offset)
        rows = tuple(reversed(t.ne[1:]))
        return flat.reshape(rows + (t.nbytes // max(1, math.prod(rows)),))

    def array(self, name: str) -> np.ndarray:
        """The tensor as numbers, numpy shape = reversed ne.

        F32, F16 and I32 are zero-copy views of the file; BF16 and quant types are decoded to a new
        float32 array (quant types through `ds4.gguf_tools.quants.dequantize`).
        """
        t = self.info(name)
        mm = self.mapping(name)
        direct = {QuantType.F32: np.float32, QuantType.F16: np.float16, QuantType.I32: np.int32}
        if t.qtype in direct:
            dt = np.dtype(direct[t.qtype]).newbyteorder("<")
            return np.frombuffer(mm, dtype=dt, count=math.prod(t.ne), offset=t.offset).reshape(t.shape)
        if t.qtype == QuantType.BF16:
            bits = np.frombuffer(mm, dtype="<u2", count=math.prod(t.ne), offset=t.offset)
            return (bits.astype(np.uint32) << 16).view(np.float32).reshape(t.shape)
        if t.qtype in (QuantType.Q8_0, QuantType.Q2_K, QuantType.Q4_K, QuantType.IQ2_XXS):
            from ds4.gguf_tools import quants

            raw = self.raw(name).reshape(-1, self.raw(name).shape[-1])
            return np.asarray(quants.dequantize(QuantType(t.qtype), raw, t.ne[0]), dtype=np.float32).reshape(t.shape)
        raise GGUFError(f"{self.path}: tensor '{name}' has type {t.type_name}, which ds4 cannot decode")

    @property
    def tokens(self) -> list[str]:
        return list(self.metadata.get(Key.TOKENS.value, []))

    @property
    def merges(self) -> list[str]:
        return list(self.metadata.get(Key.MERGES.value, []))

    @property
    def architecture(self) -> str | None:
        return self.metadata.get(Key.ARCHITECTURE.value)

    def close(self) -> None:
        """Release the mapping(s). Views handed out earlier must not be used afterwards."""
        for part in getattr(self, "parts", [self]):
            try:
                part._mm.close()
            except BufferError:
                pass  # numpy views still alive: the mapping goes when they do

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, {len(self.tensors)} tensors)"


class DS4File(GGUFFile):
    """A validated DeepSeek V4 main-model GGUF: `.config` describes every tensor in it."""

    config: Config

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        arch = self.architecture
        if arch != ARCH:
            raise GGUFError(f"{self.path}: architecture is '{arch}', expected '{ARCH}' (not a DeepSeek V4 model)")
        try:
            self.config = Config.from_metadata(self.metadata)
        except ConfigError as e:
            raise GGUFError(f"{self.path}: {e}") from None
        except (TypeError, ValueError) as e:
            raise GGUFError(f"{self.path}: malformed DeepSeek V4 metadata ({e})") from None
        validate_tensors(self.path, self.config, self.tensors)
        n_tok = len(self.metadata.get(Key.TOKENS.value, ()))
        if n_tok != self.config.vocab_size:
            raise GGUFError(f"{self.path}: '{Key.TOKENS.value}' has {n_tok} tokens, expected "
                            f"{self.config.vocab_size} (vocab_size)")
        if Key.MERGES.value not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key '{Key.MERGES.value}' is missing")


def _check_type(path: Path, slot: TensorSlot, t: TensorInfo) -> None:
    allowed = ALLOWED_TYPES[slot.kind]
    if t.qtype not in allowed:
        names = "/".join(q.name for q in allowed)
        raise GGUFError(f"{path}: tensor '{slot.name}' has type {t.type_name}, expected {names}")


def validate_tensors(path: Path, cfg: Config, tensors: dict[str, TensorInfo]) -> None:
    """Check that `tensors` are exactly the DS4 tensors for `cfg` (names, shapes, types)."""
    layout = tensor_layout(cfg)
    expected = {s.name for s in layout}
    for slot in layout:
        t = tensors.get(slot.name)
        if t is None:
            if slot.optional:
                continue
            raise GGUFError(f"{path}: tensor '{slot.name}' is missing (expected shape {list(slot.ne)})")
        if t.ne != slot.ne:
            raise GGUFError(f"{path}: tensor '{slot.name}' has shape {list(t.ne)}, expected {list(slot.ne)}")
        _check_type(path, slot, t)
    for layer in range(cfg.n_layer):
        gate = tensors[f"blk.{layer}.ffn_gate_exps.weight"]
        up = tensors[f"blk.{layer}.ffn_up_exps.weight"]
        if gate.qtype != up.qtype:
            raise GGUFError(f"{path}: layer {layer} routed gate ({gate.type_name}) and up ({up.type_name}) "
                            "experts must share a type")
    extra = sorted(set(tensors) - expected)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise GGUFError(f"{path}: unexpected tensor '{extra[0]}'{more} for this configuration")


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse any GGUF v3 file without checking what model it holds."""
    return GGUFFile(path)


def open_model(path: str | os.PathLike) -> DS4File:
    """Open and fully validate a DeepSeek V4 main-model GGUF."""
    return DS4File(path)
