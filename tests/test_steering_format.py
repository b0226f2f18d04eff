"""Steering files: raw f32 + JSON sidecar (tooling-spec §8.2) and llama.cpp control-vector GGUF
round trips, size checks, and the info/convert CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest

from ds4.steering import format as SF

L, D = 6, 64


def _dirs(seed=0):
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((L, D)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return SF.DirectionSet(v, SF.sidecar_meta((L, D), component="attn_out", thinking=True, good_file="g.txt",
                                              bad_file="b.txt", model="m.gguf"))


def test_f32_layout_and_sidecar(tmp_path):
    ds = _dirs()
    path = tmp_path / "dir.f32"
    SF.write_f32(path, ds)
    raw = path.read_bytes()
    assert len(raw) == L * D * 4  # no header
    np.testing.assert_array_equal(np.frombuffer(raw, "<f4").reshape(L, D), ds.vectors)  # layer-major
    meta = json.loads((tmp_path / "dir.json").read_text())
    assert meta["format"] == "ds4-directional-steering-v1" and meta["shape"] == [L, D]
    assert meta["component"] == "attn_out" and meta["thinking"] is True
    assert set(meta) >= {"pair_normalize", "orthogonalize_control_mean", "good_file", "bad_file", "model", "note"}
    assert (tmp_path / "dir.json").read_text().startswith('{\n  "format"')  # indent 2
    back = SF.read_f32(path)  # shape from the sidecar
    np.testing.assert_array_equal(back.vectors, ds.vectors)
    assert back.meta == meta
    np.testing.assert_array_equal(SF.load_directions(path, L, D).vectors, ds.vectors)


def test_f32_size_is_checked(tmp_path):
    path = tmp_path / "dir.f32"
    SF.write_f32(path, _dirs(), sidecar=False)
    with pytest.raises(SF.SteeringFileError, match=f"expected {(L + 1) * D * 4}"):
        SF.load_directions(path, L + 1, D)
    with pytest.raises(SF.SteeringFileError, match="no sidecar"):
        SF.read_f32(path)
    (tmp_path / "dir.json").write_text("{oops")
    with pytest.raises(SF.SteeringFileError, match="malformed JSON"):
        SF.read_f32(path)
    path.write_bytes(np.full(L * D, np.nan, "<f4").tobytes())
    with pytest.raises(SF.SteeringFileError, match="non-finite|malformed"):
        SF.load_directions(path, L, D)


def test_control_vector_gguf_round_trip(tmp_path):
    ds = _dirs(1)
    path = tmp_path / "cv.gguf"
    SF.write_control_vector(path, ds)
    r = gguf.GGUFReader(path)
    assert r.fields["general.architecture"].contents() == "controlvector"
    assert r.fields["controlvector.model_hint"].contents() == "deepseek4"
    assert r.fields["controlvector.layer_count"].contents() == L
    names = [t.name for t in r.tensors]
    assert names == [f"direction.{i + 1}" for i in range(L)]  # counted from 1
    for t in r.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32 and list(t.shape) == [D]
    back = SF.load_directions(path, L, D)
    np.testing.assert_array_equal(back.vectors, ds.vectors)
    assert back.component == "attn_out"
    with pytest.raises(SF.SteeringFileError, match="past the model"):
        SF.load_directions(path, L - 1, D)
    with pytest.raises(SF.SteeringFileError, match="hidden size"):
        SF.load_directions(path, L, D * 2)


def test_control_vector_with_missing_layers_reads_zero_rows(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "sparse.gguf", arch="controlvector")
    w.add_string("controlvector.model_hint", "llama")
    w.add_int32("controlvector.layer_count", 4)
    w.add_tensor("direction.2", np.ones(8, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    ds = SF.read_control_vector(tmp_path / "sparse.gguf")
    assert ds.vectors.shape == (4, 8)
    assert np.all(ds.vectors[1] == 1) and np.all(ds.vectors[[0, 2, 3]] == 0)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ds4.steering.cli", *map(str, args)], capture_output=True, text=True)


def test_cli_convert_and_info(tmp_path):
    SF.write_f32(tmp_path / "a.f32", _dirs(2))
    r = _cli("convert", tmp_path / "a.f32", tmp_path / "a.gguf")
    assert r.returncode == 0, r.stderr
    r = _cli("convert", tmp_path / "a.gguf", tmp_path / "b.f32")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "b.f32").read_bytes() == (tmp_path / "a.f32").read_bytes()
    r = _cli("info", tmp_path / "a.gguf")
    assert r.returncode == 0 and f"{L} layers × {D} hidden" in r.stdout and "attn_out" in r.stdout
    for args in (("info", tmp_path / "nope.f32"), ("convert", tmp_path / "nope.f32", tmp_path / "x.gguf")):
        r = _cli(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    r = _cli("build", "-o", tmp_path / "no" / "dir.f32")  # refused before loading anything
    assert r.returncode == 2 and "not writable" in r.stderr
    r = _cli("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in ("build", "sweep", "info", "convert"))
