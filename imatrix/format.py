"""Importance-matrix files: one reader and one writer per format (tooling-spec §1.7, §3.2).

Two on-disk formats hold the same thing, per tensor and per matrix (expert) of that tensor, the sum of
squared input activations and how many input rows contributed:

* the legacy llama.cpp `.dat`, laid out as ds4 writes it (tooling-spec §3.2):

      i32 n_entries
      n_entries × { i32 name_len, name bytes (no NUL), i32 ncall, i32 nval, nval × f32 }
      i32 chunks, i32 dataset_len, dataset bytes          (optional trailer)

  ds4 writes ncall = 1 and, per expert, the *mean* squared activation (sum2 / count), or 1.0 for an
  expert that was never routed, packed expert-major: nval = n_expert × ncols. Loaders divide by ncall.
  The per-expert counts are not stored, so a `.dat` read back carries importance, not counts.

* the GGUF imatrix format of llama.cpp: `general.type = "imatrix"`, `imatrix.datasets` (string array),
  `imatrix.chunk_count`, `imatrix.chunk_size` (u32), and per tensor NAME two f32 tensors
  `NAME.in_sum2` (ne = [ncols, n_mat]) and `NAME.counts` (ne = [1, n_mat]), raw sums and counts.

This is a leaf module (numpy + gguf only): the quantizer imports it without pulling in the engine.
"""

from __future__ import annotations

import enum
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ds4.atomic import atomic_write

# GGUF imatrix keys and tensor suffixes (llama.cpp names).
GENERAL_TYPE = "general.type"
GENERAL_ARCHITECTURE = "general.architecture"
IMATRIX_TYPE = "imatrix"
KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
SUFFIX_SUM2 = ".in_sum2"
SUFFIX_COUNTS = ".counts"
# ds4 additions (ignored by other readers): an interrupted collection, and the tokens it saw.
KEY_PARTIAL = "ds4.imatrix.partial"
KEY_TOKENS = "ds4.imatrix.tokens"

# The legacy format has no flag field; an interrupted run is marked in the dataset string.
PARTIAL_MARK = " [partial]"
MAX_NAME_BYTES = 4096
GGUF_MAGIC = b"GGUF"


class ImatrixFormat(str, enum.Enum):
    DAT = "dat"
    GGUF = "gguf"


class ImatrixError(ValueError):
    """A file that is not a valid importance matrix (truncated, foreign, inconsistent)."""


@dataclass
class ImatrixEntry:
    """Statistics of one weight tensor: `sum2[m, i]` = Σ x_i² over the rows routed to matrix m."""

    sum2: np.ndarray  # float32 [n_mat, ncols]
    counts: np.ndarray  # float32 [n_mat]

    def __post_init__(self) -> None:
        self.sum2 = np.ascontiguousarray(self.sum2, dtype=np.float32)
        if self.sum2.ndim == 1:
            self.sum2 = self.sum2.reshape(1, -1)
        self.counts = np.ascontiguousarray(self.counts, dtype=np.float32).reshape(-1)
        if self.sum2.ndim != 2 or self.counts.shape[0] != self.sum2.shape[0]:
            raise ImatrixError(f"sum2 {self.sum2.shape} and counts {self.counts.shape} disagree")

    @property
    def n_mat(self) -> int:
        return self.sum2.shape[0]

    @property
    def ncols(self) -> int:
        return self.sum2.shape[1]

    def importance(self) -> np.ndarray:
        """Mean squared activation per matrix, [n_mat, ncols]; 1.0 for a matrix that saw no rows."""
        out = np.ones_like(self.sum2)
        seen = self.counts > 0
        out[seen] = self.sum2[seen] / self.counts[seen, None]
        return out


@dataclass
class Imatrix:
    """Everything an imatrix file holds. `entries` keeps insertion order (= file order)."""

    entries: dict[str, ImatrixEntry] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunks: int = 0
    chunk_size: int = 0
    tokens: int = 0
    partial: bool = False

    def importance(self, name: str) -> np.ndarray:
        return self.entries[name].importance()

    def vector_for(self, name: str, ncols: int, expert: int | None = None) -> np.ndarray | None:
        """The importance row for `name` (expert `expert` of a routed tensor), or None when absent.

        An entry of `ncols` values is shared by every expert; one of `n × ncols` values is sliced
        for expert E (tooling-spec §1.7, pass 2). Any other size is an error.
        """
        entry = self.entries.get(name)
        if entry is None:
            return None
        flat = entry.importance().reshape(-1)
        if flat.size == ncols:
            return flat
        if expert is not None and flat.size % ncols == 0 and expert < flat.size // ncols:
            return flat[expert * ncols:(expert + 1) * ncols]
        raise ImatrixError(f"imatrix entry '{name}' has {flat.size} values: neither {ncols} nor one block of "
                           f"{ncols} per expert")

    def lookup(self, names: list[str], ncols: int, expert: int | None = None) -> np.ndarray | None:
        """ds4's quantizer lookup (tooling-spec §1.7) over candidate names (GGUF name, HF name).

        Regular tensors: exact name with exactly `ncols` values. Expert E of a routed tensor: three
        passes over the candidates, `NAME.expert.E`, then `NAME.expert_E`, then the bare `NAME`
        (shared row, or sliced per expert). None when nothing matches.
        """
        if expert is None:
            for n in names:
                entry = self.entries.get(n)
                if entry is not None:
                    if entry.n_mat * entry.ncols != ncols:
                        raise ImatrixError(f"imatrix entry '{n}' has {entry.n_mat * entry.ncols} values, "
                                           f"the tensor has {ncols} columns")
                    return entry.importance().reshape(-1)
            return None
        for pattern in ("{}.expert.{}", "{}.expert_{}"):
            for n in names:
                key = pattern.format(n, expert)
                if key in self.entries:
                    return self.vector_for(key, ncols)
        for n in names:
            row = self.vector_for(n, ncols, expert)
            if row is not None:
                return row
        return None


# ---- legacy .dat ------------------------------------------------------------------------------------

def dat_bytes(im: Imatrix) -> bytes:
    """The `.dat` image of `im` exactly as ds4 lays it out (ncall = 1, means, 1.0 for unseen)."""
    parts = [struct.pack("<i", len(im.entries))]
    for name, entry in im.entries.items():
        raw = name.encode("utf-8")
        if not 1 <= len(raw) <= MAX_NAME_BYTES:
            raise ImatrixError(f"imatrix entry name must be 1..{MAX_NAME_BYTES} bytes: {name!r}")
        values = entry.importance().reshape(-1).astype("<f4")
        parts += [struct.pack("<i", len(raw)), raw, struct.pack("<ii", 1, values.size), values.tobytes()]
    dataset = (im.datasets[0] if im.datasets else "") + (PARTIAL_MARK if im.partial else "")
    raw = dataset.encode("utf-8")
    parts += [struct.pack("<ii", im.chunks, len(raw)), raw]
    return b"".join(parts)


def write_dat(path: str | os.PathLike, im: Imatrix) -> None:
    data = dat_bytes(im)
    atomic_write(path, lambda p: p.write_bytes(data))


def read_dat(path: str | os.PathLike) -> Imatrix:
    """Read a legacy `.dat`. Values are divided by ncall (ncall > 0); counts are set to 1 per entry.

    The importance of a read-back entry is exactly the file's values (a single matrix of nval columns:
    the per-expert split is the consumer's, by `vector_for`).
    """
    buf = Path(path).read_bytes()
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if pos + n > len(buf):
            raise ImatrixError(f"{path}: truncated imatrix .dat (reading {what} at byte {pos})")
        out = buf[pos:pos + n]
        pos += n
        return out

    def i32(what: str) -> int:
        return struct.unpack("<i", take(4, what))[0]

    if buf[:4] == GGUF_MAGIC:
        raise ImatrixError(f"{path}: this is a GGUF file, not a legacy .dat imatrix")
    n_entries = i32("entry count")
    if not 0 < n_entries < 1 << 20:
        raise ImatrixError(f"{path}: not an imatrix .dat (entry count {n_entries})")
    im = Imatrix()
    for k in range(n_entries):
        name_len = i32("name length")
        if not 1 <= name_len <= MAX_NAME_BYTES:
            raise ImatrixError(f"{path}: entry {k}: bad name length {name_len}")
        try:
            name = take(name_len, "name").decode("utf-8")
        except UnicodeDecodeError as e:
            raise ImatrixError(f"{path}: entry {k}: name is not UTF-8") from e
        ncall, nval = i32("ncall"), i32("nval")
        if nval <= 0:
            raise ImatrixError(f"{path}: entry '{name}': bad value count {nval}")
        values = np.frombuffer(take(4 * nval, f"values of '{name}'"), dtype="<f4").astype(np.float32)
        if not np.all(np.isfinite(values)):
            raise ImatrixError(f"{path}: entry '{name}' holds non-finite values")
        if ncall > 0:
            values = values / np.float32(ncall)
        im.entries[name] = ImatrixEntry(values.reshape(1, -1), np.ones(1, np.float32))
    if pos + 8 <= len(buf):
        im.chunks = i32("chunks")
        ds_len = i32("dataset length")
        if ds_len < 0:
            raise ImatrixError(f"{path}: bad dataset name length {ds_len}")
        dataset = take(ds_len, "dataset name").decode("utf-8", errors="replace")
        if dataset.endswith(PARTIAL_MARK):
            im.partial, dataset = True, dataset[: -len(PARTIAL_MARK)]
        im.datasets = [dataset] if dataset else []
    return im


# ---- GGUF imatrix -----------------------------------------------------------------------------------

def write_gguf(path: str | os.PathLike, im: Imatrix) -> None:
    import gguf

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(tmp, arch=IMATRIX_TYPE)
        # llama.cpp's imatrix GGUF carries general.type but no general.architecture.
        w.kv_data[0].pop(GENERAL_ARCHITECTURE, None)
        w.add_type(IMATRIX_TYPE)
        w.add_array(KEY_DATASETS, list(im.datasets) or [""])
        w.add_uint32(KEY_CHUNK_COUNT, int(im.chunks))
        w.add_uint32(KEY_CHUNK_SIZE, int(im.chunk_size))
        w.add_bool(KEY_PARTIAL, bool(im.partial))
        w.add_uint64(KEY_TOKENS, int(im.tokens))
        for name, entry in im.entries.items():
            w.add_tensor(name + SUFFIX_SUM2, entry.sum2)
            w.add_tensor(name + SUFFIX_COUNTS, entry.counts.reshape(-1, 1))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    atomic_write(path, write)


def _field_value(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def read_gguf(path: str | os.PathLike) -> Imatrix:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/struct errors on foreign files
        raise ImatrixError(f"{path}: not a readable GGUF file ({e})") from e
    kind = _field_value(reader, GENERAL_TYPE)
    if kind != IMATRIX_TYPE:
        raise ImatrixError(f"{path}: GGUF general.type is {kind!r}, not 'imatrix'")
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name.endswith(SUFFIX_SUM2):
            sums[t.name[: -len(SUFFIX_SUM2)]] = np.array(t.data, dtype=np.float32).reshape(-1, int(t.shape[0]))
        elif t.name.endswith(SUFFIX_COUNTS):
            counts[t.name[: -len(SUFFIX_COUNTS)]] = np.array(t.data, dtype=np.float32).reshape(-1)
    im = Imatrix(
        datasets=[d for d in (_field_value(reader, KEY_DATASETS) or []) if d],
        chunks=int(_field_value(reader, KEY_CHUNK_COUNT) or 0),
        chunk_size=int(_field_value(reader, KEY_CHUNK_SIZE) or 0),
        tokens=int(_field_value(reader, KEY_TOKENS) or 0),
        partial=bool(_field_value(reader, KEY_PARTIAL) or False),
    )
    for name, s in sums.items():
        if name not in counts:
            raise ImatrixError(f"{path}: '{name}{SUFFIX_SUM2}' has no matching '{SUFFIX_COUNTS}' tensor")
        if not np.all(np.isfinite(s)):
            raise ImatrixError(f"{path}: '{name}' holds non-finite values")
        im.entries[name] = ImatrixEntry(s, counts[name])
    return im


# ---- either ----------------------------------------------------------------------------------------

def detect_format(path: str | os.PathLike) -> ImatrixFormat:
    with open(path, "rb") as f:
        head = f.read(4)
    return ImatrixFormat.GGUF if head == GGUF_MAGIC else ImatrixFormat.DAT


def format_for_name(path: str | os.PathLike) -> ImatrixFormat:
    """Output format chosen by file name: `.gguf` → GGUF, anything else → legacy `.dat`."""
    return ImatrixFormat.GGUF if str(path).lower().endswith(".gguf") else ImatrixFormat.DAT


def load(path: str | os.PathLike) -> Imatrix:
    """Read either format (detected by magic)."""
    if not Path(path).is_file():
        raise ImatrixError(f"{path}: no such file")
    return read_gguf(path) if detect_format(path) is ImatrixFormat.GGUF else read_dat(path)


def save(path: str | os.PathLike, im: Imatrix, fmt: ImatrixFormat | str | None = None) -> None:
    fmt = ImatrixFormat(fmt) if fmt else format_for_name(path)
    (write_gguf if fmt is ImatrixFormat.GGUF else write_dat)(path, im)
