"""Importance-matrix files: the legacy .dat byte layout of tooling-spec §3.2 and the GGUF imatrix
format as the `gguf` package reads it; round trips, the partial mark, refusals, and the CLI."""

from __future__ import annotations

import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest

from ds4.imatrix import format as F

N_EXPERT, D, FFN = 8, 16, 12


def _sample(partial: bool = False, seed: int = 0) -> F.Imatrix:
    rng = np.random.default_rng(seed)
    im = F.Imatrix(datasets=["calib/prompts.txt"], chunks=6, chunk_size=2048, tokens=321, partial=partial)
    for layer in range(2):
        counts = rng.integers(0, 5, N_EXPERT).astype(np.float32)
        counts[3] = 0  # one expert never routed
        gu = (rng.random((N_EXPERT, D)) * counts[:, None]).astype(np.float32)
        down = (rng.random((N_EXPERT, FFN)) * counts[:, None]).astype(np.float32)
        im.entries[f"blk.{layer}.ffn_gate_exps.weight"] = F.ImatrixEntry(gu, counts)
        im.entries[f"blk.{layer}.ffn_up_exps.weight"] = F.ImatrixEntry(gu.copy(), counts)
        im.entries[f"blk.{layer}.ffn_down_exps.weight"] = F.ImatrixEntry(down, counts)
    return im


def _parse_dat_by_spec(raw: bytes):
    """An independent parser of the §3.2 layout: n_entries, entries, then the chunks/dataset trailer."""
    pos = 0

    def i32():
        nonlocal pos
        (v,) = struct.unpack_from("<i", raw, pos)
        pos += 4
        return v

    entries = []
    for _ in range(i32()):
        n = i32()
        name = raw[pos:pos + n].decode()
        pos += n
        ncall, nval = i32(), i32()
        vals = np.frombuffer(raw, "<f4", nval, pos)
        pos += 4 * nval
        entries.append((name, ncall, vals))
    chunks, ds_len = i32(), i32()
    dataset = raw[pos:pos + ds_len].decode()
    assert pos + ds_len == len(raw), "bytes after the trailer"
    return entries, chunks, dataset


def test_dat_layout_is_the_spec_layout(tmp_path):
    im = _sample()
    path = tmp_path / "im.dat"
    F.write_dat(path, im)
    entries, chunks, dataset = _parse_dat_by_spec(path.read_bytes())
    assert [e[0] for e in entries] == list(im.entries)  # gate, up, down per layer, in order
    assert chunks == 6 and dataset == "calib/prompts.txt"
    for name, ncall, vals in entries:
        entry = im.entries[name]
        assert ncall == 1
        assert vals.size == entry.n_mat * entry.ncols  # expert-major packing
        blocks = vals.reshape(entry.n_mat, entry.ncols)
        for e in range(entry.n_mat):
            if entry.counts[e] == 0:
                assert np.all(blocks[e] == 1.0), "never-routed experts are written as 1.0"
            else:
                np.testing.assert_allclose(blocks[e], entry.sum2[e] / entry.counts[e], rtol=1e-6)
    gate, up = entries[0][2], entries[1][2]
    assert np.array_equal(gate, up)


def test_dat_round_trip_and_per_expert_lookup(tmp_path):
    im = _sample()
    path = tmp_path / "im.dat"
    F.write_dat(path, im)
    back = F.load(path)
    assert list(back.entries) == list(im.entries)
    assert back.chunks == im.chunks and back.datasets == im.datasets and not back.partial
    for name, entry in im.entries.items():
        want = entry.importance()
        for e in range(N_EXPERT):
            np.testing.assert_array_equal(back.vector_for(name, entry.ncols, e), want[e])
    # Writing what was read gives the same bytes.
    F.write_dat(tmp_path / "again.dat", back)
    assert (tmp_path / "again.dat").read_bytes() == path.read_bytes()


def test_dat_reader_divides_by_ncall(tmp_path):
    vals = np.array([2.0, 4.0, 6.0, 8.0], "<f4")
    raw = struct.pack("<ii", 1, 3) + b"abc" + struct.pack("<ii", 2, 4) + vals.tobytes()
    (tmp_path / "x.dat").write_bytes(raw)  # no trailer: optional
    back = F.read_dat(tmp_path / "x.dat")
    np.testing.assert_array_equal(back.importance("abc").reshape(-1), vals / 2)
    assert back.datasets == [] and back.chunks == 0


def test_gguf_round_trip_keeps_sums_and_counts(tmp_path):
    im = _sample()
    path = tmp_path / "im.gguf"
    F.write_gguf(path, im)
    back = F.load(path)
    assert list(back.entries) == list(im.entries)
    for name, entry in im.entries.items():
        np.testing.assert_array_equal(back.entries[name].sum2, entry.sum2)
        np.testing.assert_array_equal(back.entries[name].counts, entry.counts)
    assert (back.datasets, back.chunks, back.chunk_size, back.tokens) == (["calib/prompts.txt"], 6, 2048, 321)


def test_gguf_is_readable_by_the_gguf_package(tmp_path):
    im = _sample()
    path = tmp_path / "im.gguf"
    F.write_gguf(path, im)
    r = gguf.GGUFReader(path)
    assert r.fields["general.type"].contents() == "imatrix"
    assert "general.architecture" not in r.fields  # as llama.cpp writes imatrix GGUFs
    assert r.fields[gguf.Keys.IMatrix.DATASETS].contents() == ["calib/prompts.txt"]
    assert r.fields[gguf.Keys.IMatrix.CHUNK_COUNT].contents() == 6
    assert r.fields[gguf.Keys.IMatrix.CHUNK_SIZE].contents() == 2048
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 2 * len(im.entries)
    for name, entry in im.entries.items():
        s, c = tensors[name + ".in_sum2"], tensors[name + ".counts"]
        assert s.tensor_type == gguf.GGMLQuantizationType.F32 and c.tensor_type == gguf.GGMLQuantizationType.F32
        assert list(s.shape) == [entry.ncols, entry.n_mat]  # ne order
        assert list(c.shape) == [1, entry.n_mat]
        np.testing.assert_array_equal(np.asarray(s.data).reshape(entry.n_mat, entry.ncols), entry.sum2)
        np.testing.assert_array_equal(np.asarray(c.data).reshape(-1), entry.counts)


@pytest.mark.parametrize("suffix", [".dat", ".gguf"])
def test_partial_mark_survives(tmp_path, suffix):
    path = tmp_path / f"p{suffix}"
    F.save(path, _sample(partial=True))
    back = F.load(path)
    assert back.partial and back.datasets == ["calib/prompts.txt"]


def test_same_importance_through_both_formats(tmp_path):
    im = _sample(seed=3)
    F.save(tmp_path / "a.dat", im)
    F.save(tmp_path / "a.gguf", im)
    a, b = F.load(tmp_path / "a.dat"), F.load(tmp_path / "a.gguf")
    for name, entry in im.entries.items():
        for e in range(entry.n_mat):
            np.testing.assert_allclose(a.vector_for(name, entry.ncols, e), b.vector_for(name, entry.ncols, e),
                                       rtol=1e-6)


def test_refuses_truncated_and_foreign_files(tmp_path):
    path = tmp_path / "im.dat"
    F.write_dat(path, _sample())
    raw = path.read_bytes()
    (tmp_path / "cut.dat").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(F.ImatrixError, match="truncated"):
        F.load(tmp_path / "cut.dat")
    (tmp_path / "junk.dat").write_bytes(b"\xff\xff\xff\xffhello")
    with pytest.raises(F.ImatrixError):
        F.load(tmp_path / "junk.dat")
    w = gguf.GGUFWriter(tmp_path / "model.gguf", arch="llama")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(F.ImatrixError, match="imatrix"):
        F.load(tmp_path / "model.gguf")
    bad = np.frombuffer(raw, np.uint8).copy()
    # Poison the first value of the first entry with a NaN.
    name_len = struct.unpack_from("<i", raw, 4)[0]
    struct.pack_into("<f", bad, 4 + 4 + name_len + 8, float("nan"))
    (tmp_path / "nan.dat").write_bytes(bad.tobytes())
    with pytest.raises(F.ImatrixError, match="non-finite"):
        F.load(tmp_path / "nan.dat")


def test_writer_leaves_no_temp_files(tmp_path):
    F.save(tmp_path / "a.gguf", _sample())
    F.save(tmp_path / "a.dat", _sample())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.dat", "a.gguf"]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ds4.imatrix.cli", *map(str, args)], capture_output=True, text=True)


def test_cli_convert_and_stats(tmp_path):
    F.save(tmp_path / "a.gguf", _sample())
    r = _cli("convert", tmp_path / "a.gguf", tmp_path / "b.dat")
    assert r.returncode == 0, r.stderr
    assert F.load(tmp_path / "b.dat").entries.keys() == F.load(tmp_path / "a.gguf").entries.keys()
    r = _cli("stats", tmp_path / "a.gguf", "--heatmap", tmp_path / "h.png")
    assert r.returncode == 0, r.stderr
    assert "321 tokens" in r.stdout
    # Layer rows report how many experts were never routed (expert 3 in each layer, maybe more).
    counts = np.stack([e.counts for n, e in _sample().entries.items() if "gate" in n])
    for layer, row in enumerate(counts):
        assert any(line.split()[:1] == [str(layer)] and int(line.split()[2]) == int((row == 0).sum())
                   for line in r.stdout.splitlines())
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_user_errors_exit_2_without_traceback(tmp_path):
    (tmp_path / "junk.dat").write_bytes(b"\x01\x00\x00\x00\x05\x00")
    for args in (("stats", tmp_path / "missing.dat"), ("stats", tmp_path / "junk.dat"),
                 ("convert", tmp_path / "junk.dat", tmp_path / "o.gguf")):
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    r = _cli("collect", "-o", tmp_path / "x.dat", "--max-prompts", "-3")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = _cli("collect", "-o", tmp_path / "no" / "such" / "x.dat")  # refused before any work
    assert r.returncode == 2 and "not writable" in r.stderr
    r = _cli("--help")
    assert r.returncode == 0 and "collect" in r.stdout and "build-dataset" in r.stdout


def test_quantizer_lookup_passes():
    """§1.7: NAME.expert.E, then NAME.expert_E, then the bare NAME (shared or sliced); regular tensors exact."""
    im = F.Imatrix()
    im.entries["w.expert.1"] = F.ImatrixEntry(np.full((1, 4), 2.0), np.ones(1))
    im.entries["w.expert_2"] = F.ImatrixEntry(np.full((1, 4), 3.0), np.ones(1))
    im.entries["w"] = F.ImatrixEntry(np.arange(12, dtype=np.float32).reshape(3, 4), np.ones(3))
    im.entries["shared"] = F.ImatrixEntry(np.full((1, 4), 5.0), np.ones(1))
    im.entries["dense"] = F.ImatrixEntry(np.full((1, 6), 7.0), np.array([2.0]))
    assert np.all(im.lookup(["w"], 4, 1) == 2.0)
    assert np.all(im.lookup(["w"], 4, 2) == 3.0)
    np.testing.assert_array_equal(im.lookup(["w"], 4, 0), [0, 1, 2, 3])
    assert np.all(im.lookup(["nope", "shared"], 4, 9) == 5.0)
    assert np.all(im.lookup(["dense"], 6) == 3.5)
    assert im.lookup(["nope"], 6) is None and im.lookup(["nope"], 4, 0) is None
    with pytest.raises(F.ImatrixError):
        im.lookup(["dense"], 5)
    with pytest.raises(F.ImatrixError):
        im.lookup(["w"], 5, 0)
