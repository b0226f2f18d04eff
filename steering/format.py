"""Steering-direction files: one reader and one writer per format (tooling-spec §8.2, model-spec §6).

* raw `.f32`: little-endian float32 [n_layer][n_embd], layer-major, no header. For Flash that is
  43 × 4096 × 4 = 704,512 bytes; the size is checked against the model when loading.
* JSON sidecar (same stem, `.json`): `{"format": "ds4-directional-steering-v1", "shape": [L, D],
  "component", "thinking", "pair_normalize", "orthogonalize_control_mean", "good_file", "bad_file",
  "model", "note"}`, indent 2.
* llama.cpp control-vector GGUF: `general.architecture = "controlvector"`, `controlvector.model_hint`,
  `controlvector.layer_count`, one f32 tensor `direction.N` of n_embd values per layer, N counted
  from 1 (llama.cpp's layer numbering: direction.N edits the output of block N-1 in ours). llama.cpp
  *adds* control vectors to the residual; ds4 *projects* with them. The file carries the unit
  directions; the scale and the way it is applied belong to the runtime.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ds4.atomic import atomic_write, write_bytes_atomic

FORMAT_NAME = "ds4-directional-steering-v1"
NOTE = "runtime positive scale suppresses this direction; negative scale amplifies it"
COMPONENTS = ("ffn_out", "attn_out")

CV_ARCH = "controlvector"
CV_MODEL_HINT = "controlvector.model_hint"
CV_LAYER_COUNT = "controlvector.layer_count"
CV_TENSOR = "direction.{}"
CV_COMPONENT = "ds4.steering.component"  # ds4 addition; other readers ignore it
GGUF_MAGIC = b"GGUF"


class SteeringFileError(ValueError):
    """A direction file that does not fit the model or is not a direction file at all."""


@dataclass
class DirectionSet:
    """Unit directions per layer, [n_layer, n_embd] float32, plus the sidecar metadata."""

    vectors: np.ndarray
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.vectors = np.ascontiguousarray(self.vectors, dtype=np.float32)
        if self.vectors.ndim != 2:
            raise SteeringFileError(f"directions must be [layers, hidden], got shape {self.vectors.shape}")

    @property
    def n_layer(self) -> int:
        return self.vectors.shape[0]

    @property
    def n_embd(self) -> int:
        return self.vectors.shape[1]

    @property
    def component(self) -> str:
        return self.meta.get("component", "ffn_out")


def sidecar_path(f32_path: str | os.PathLike) -> Path:
    return Path(f32_path).with_suffix(".json")


def sidecar_meta(shape: tuple[int, int], *, component: str = "ffn_out", thinking: bool = False,
                 pair_normalize: bool = False, orthogonalize: bool = True, good_file: str = "",
                 bad_file: str = "", model: str = "") -> dict:
    if component not in COMPONENTS:
        raise SteeringFileError(f"component must be one of {COMPONENTS}, got {component!r}")
    return {
        "format": FORMAT_NAME,
        "shape": [int(shape[0]), int(shape[1])],
        "component": component,
        "thinking": bool(thinking),
        "pair_normalize": bool(pair_normalize),
        "orthogonalize_control_mean": bool(orthogonalize),
        "good_file": str(good_file),
        "bad_file": str(bad_file),
        "model": str(model),
        "note": NOTE,
    }


# ---- raw f32 + JSON sidecar ------------------------------------------------------------------------

def write_f32(path: str | os.PathLike, ds: DirectionSet, *, sidecar: bool = True) -> None:
    path = Path(path)
    write_bytes_atomic(path, ds.vectors.astype("<f4").tobytes())
    if sidecar:
        meta = dict(ds.meta) or sidecar_meta(ds.vectors.shape)
        meta["shape"] = [ds.n_layer, ds.n_embd]
        write_bytes_atomic(sidecar_path(path), (json.dumps(meta, indent=2) + "\n").encode())


def read_sidecar(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SteeringFileError(f"{path}: malformed JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise SteeringFileError(f"{path}: not a {FORMAT_NAME} sidecar")
    shape = meta.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(x, int) and x > 0 for x in shape)):
        raise SteeringFileError(f"{path}: sidecar 'shape' must be [layers, hidden]")
    return meta


def read_f32(path: str | os.PathLike, n_layer: int | None = None, n_embd: int | None = None) -> DirectionSet:
    """Read a raw direction file. The shape comes from (n_layer, n_embd) when given (the size must
    then match exactly, as ds4 checks), else from the JSON sidecar."""
    path = Path(path)
    if not path.is_file():
        raise SteeringFileError(f"{path}: no such file")
    side = sidecar_path(path)
    meta = read_sidecar(side) if side.is_file() else {}
    if n_layer is None or n_embd is None:
        if not meta:
            raise SteeringFileError(f"{path}: no sidecar {side.name} and no model shape to check the size against")
        n_layer, n_embd = meta["shape"]
    size = path.stat().st_size
    want = n_layer * n_embd * 4
    if size != want:
        raise SteeringFileError(
            f"{path}: {size} bytes, expected {want} (= {n_layer} layers × {n_embd} hidden × 4 bytes)")
    vectors = np.fromfile(path, dtype="<f4").reshape(n_layer, n_embd)
    if not np.all(np.isfinite(vectors)):
        raise SteeringFileError(f"{path}: holds non-finite values")
    if meta and meta["shape"] != [n_layer, n_embd]:
        raise SteeringFileError(f"{side}: sidecar shape {meta['shape']} disagrees with [{n_layer}, {n_embd}]")
    return DirectionSet(vectors.astype(np.float32), meta)


# ---- llama.cpp control vector GGUF ------------------------------------------------------------------

def write_control_vector(path: str | os.PathLike, ds: DirectionSet, model_hint: str = "deepseek4") -> None:
    import gguf

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(tmp, arch=CV_ARCH)
        w.add_string(CV_MODEL_HINT, model_hint)
        w.add_int32(CV_LAYER_COUNT, ds.n_layer)
        w.add_string(CV_COMPONENT, ds.component)
        for layer in range(ds.n_layer):
            w.add_tensor(CV_TENSOR.format(layer + 1), ds.vectors[layer])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    atomic_write(path, write)


def read_control_vector(path: str | os.PathLike, n_layer: int | None = None) -> DirectionSet:
    """Read `direction.N` tensors (N ≥ 1) into [n_layer, n_embd]; layers without a tensor are zero."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise SteeringFileError(f"{path}: not a readable GGUF file ({e})") from e
    arch = reader.fields.get("general.architecture")
    if arch is None or arch.contents() != CV_ARCH:
        raise SteeringFileError(f"{path}: not a control-vector GGUF (general.architecture != '{CV_ARCH}')")
    rows: dict[int, np.ndarray] = {}
    for t in reader.tensors:
        prefix, _, num = t.name.partition(".")
        if prefix != "direction" or not num.isdigit() or int(num) < 1:
            raise SteeringFileError(f"{path}: unexpected tensor '{t.name}' in a control vector")
        rows[int(num) - 1] = np.array(t.data, dtype=np.float32).reshape(-1)
    if not rows:
        raise SteeringFileError(f"{path}: control vector has no direction tensors")
    widths = {r.size for r in rows.values()}
    if len(widths) != 1:
        raise SteeringFileError(f"{path}: direction tensors have different widths {sorted(widths)}")
    count = reader.fields.get(CV_LAYER_COUNT)
    layers = n_layer or (int(count.contents()) if count is not None else max(rows) + 1)
    if max(rows) >= layers:
        raise SteeringFileError(f"{path}: direction.{max(rows) + 1} is past the model's {layers} layers")
    vectors = np.zeros((layers, widths.pop()), np.float32)
    for layer, row in rows.items():
        vectors[layer] = row
    comp = reader.fields.get(CV_COMPONENT)
    meta = sidecar_meta(vectors.shape, component=comp.contents() if comp is not None else "ffn_out")
    return DirectionSet(vectors, meta)


# ---- either ----------------------------------------------------------------------------------------

def load_directions(path: str | os.PathLike, n_layer: int | None = None, n_embd: int | None = None) -> DirectionSet:
    """Load a raw `.f32` (size-checked) or a control-vector GGUF (detected by magic)."""
    path = Path(path)
    if not path.is_file():
        raise SteeringFileError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    ds = read_control_vector(path, n_layer) if magic == GGUF_MAGIC else read_f32(path, n_layer, n_embd)
    if n_embd is not None and ds.n_embd != n_embd:
        raise SteeringFileError(f"{path}: directions are {ds.n_embd} wide, the model's hidden size is {n_embd}")
    return ds
