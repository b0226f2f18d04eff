"""Split GGUFs (llama.cpp gguf-split layout) written by `ds4-quantize synth --split-max-size` and read
from their first part, on the `small` preset."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGUFValueType

from ds4.gguf_tools.constants import DEFAULT_ALIGNMENT, Key, QuantType
from ds4.gguf_tools.reader import GGUFError, GGUFFile, open_model, split_path, split_prefix
from ds4.gguf_tools.synth_gguf import split_outputs, split_plans
from ds4.gguf_tools.writer import TensorPlan

from conftest import quantize_cli

LIMIT = 50_000_000  # 50M


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("split")
    quantize_cli("synth", "--preset", "small", "--gguf", str(d / "one.gguf"), "--mix", "q2", "--quiet")
    res = quantize_cli("synth", "--preset", "small", "--gguf", str(d / "parts.gguf"), "--mix", "q2",
                       "--split-max-size", "50M", "--quiet")
    parts = sorted(d.glob("parts-*.gguf"))
    assert "first of" in res.stderr and str(parts[0]) in res.stderr
    return d / "one.gguf", parts


def test_part_names_and_split_keys_follow_gguf_split(files):
    one, parts = files
    n = len(parts)
    assert n > 2
    assert [p.name for p in parts] == [f"parts-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    assert not [p for p in parts[0].parent.iterdir() if p.name.startswith(".")]  # no temp leftovers
    single = GGUFFile(one)
    total = 0
    for i, path in enumerate(parts):
        f = GGUFFile(path, _part=True)
        assert f.metadata[Key.SPLIT_NO.value] == i and f.metadata[Key.SPLIT_COUNT.value] == n
        assert f.metadata[Key.SPLIT_TENSORS_COUNT.value] == len(single.tensors)
        assert f.metadata_types[Key.SPLIT_NO.value][0] == GGUFValueType.UINT16
        assert f.metadata_types[Key.SPLIT_COUNT.value][0] == GGUFValueType.UINT16
        assert f.metadata_types[Key.SPLIT_TENSORS_COUNT.value][0] == GGUFValueType.INT32
        if i == 0:
            assert set(single.metadata) <= set(f.metadata)
        else:  # later parts: the split keys only (plus the architecture the gguf package always writes)
            assert set(f.metadata) == {Key.SPLIT_NO.value, Key.SPLIT_COUNT.value, Key.SPLIT_TENSORS_COUNT.value,
                                       Key.ARCHITECTURE.value}
        padded = sum(-(-t.nbytes // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT for t in f.tensors.values())
        assert len(f.tensors) >= 1 and (padded <= LIMIT or len(f.tensors) == 1)
        total += len(f.tensors)
    assert total == len(single.tensors)


def test_the_first_part_opens_the_whole_model(files):
    one, parts = files
    a, b = open_model(one), open_model(parts[0])
    assert list(a.tensors) == list(b.tensors) and a.config == b.config
    assert {t.part for t in b.tensors.values()} == set(range(len(parts)))
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert (t.qtype, t.ne, t.nbytes) == (u.qtype, u.ne, u.nbytes)
        assert np.array_equal(a.raw(name), b.raw(name)), name
        assert b.mapping(name) is b.parts[u.part]._mm


def test_sharded_loading_and_the_engine_read_split_files(files):
    torch = pytest.importorskip("torch")
    from ds4.engine.dist.comm import Combiner
    from ds4.engine.dist.shard import ShardedWeights, is_routed
    from ds4.engine.gpu.session import Session as TorchSession
    from ds4.engine.model import Model

    one, parts = files
    ma, mb = Model.load(one), Model.load(parts[0])
    wa = ShardedWeights(ma, torch.device("cpu"), 1, 2, Combiner(None, "allreduce", 1))
    wb = ShardedWeights(mb, torch.device("cpu"), 1, 2, Combiner(None, "allreduce", 1))
    for name in (n for n in ma.file.tensors if is_routed(n)):
        assert torch.equal(wa.mat(name), wb.mat(name))
    prompt = list(range(100, 108))
    la = TorchSession(ma, ctx=32, device="cpu").sync(prompt)
    lb = TorchSession(mb, ctx=32, device="cpu").sync(prompt)
    assert np.isfinite(la).all() and np.array_equal(la, lb)


def test_later_parts_and_missing_parts_are_clear_errors(files, tmp_path):
    _, parts = files
    with pytest.raises(GGUFError, match=f"part 2 of {len(parts)} .*open the first part \\({parts[0].name}\\)"):
        open_model(parts[1])
    for p in parts:
        (tmp_path / p.name).symlink_to(p)
    (tmp_path / parts[-1].name).unlink()
    with pytest.raises(GGUFError, match=f"split part {parts[-1].name} .* is missing"):
        open_model(tmp_path / parts[0].name)
    res = quantize_cli("info", str(parts[2]), check=False)
    assert res.returncode == 2 and "open the first part" in res.stderr


def test_cli_refuses_bad_sizes_and_existing_parts(files):
    _, parts = files
    out = str(parts[0].parent / "parts.gguf")
    for bad in ("50K", "0M", "xG", "G"):
        res = quantize_cli("synth", "--preset", "small", "--gguf", out + ".x", "--split-max-size", bad, check=False)
        assert res.returncode == 2 and "--split-max-size" in res.stderr and "Traceback" not in res.stderr
    res = quantize_cli("synth", "--preset", "small", "--gguf", out, "--split-max-size", "50M", check=False)
    assert res.returncode == 2 and "exists" in res.stderr


def test_split_rule_and_names():
    mk = lambda i, n: TensorPlan(f"t{i}", QuantType.F32, (n // 4,))  # noqa: E731  n bytes
    plans = [mk(0, 32), mk(1, 32), mk(2, 100), mk(3, 8), mk(4, 24)]  # padded: 32 32 128 32 32
    groups = split_plans(plans, 96)
    assert [[p.name for p in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert split_plans(plans, 10 ** 9) == [plans]
    assert split_outputs("/x/m.gguf", 3)[2].name == "m-00003-of-00003.gguf"
    assert split_path("/x/m", 0, 12).name == "m-00001-of-00012.gguf"
    assert split_prefix("/x/m-00002-of-00012.gguf") == "/x/m" and split_prefix("/x/m.gguf") is None


def test_parallel_parts_are_byte_identical(files, tmp_path):
    _, parts = files
    res = quantize_cli("synth", "--preset", "small", "--gguf", str(tmp_path / "parts.gguf"), "--mix", "q2",
                       "--split-max-size", "50M", "--jobs", "2", "--quiet")
    assert res.returncode == 0
    got = sorted(tmp_path.glob("parts-*.gguf"))
    assert [p.name for p in got] == [p.name for p in parts]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(got, parts))



def test_parallel_single_file_is_byte_identical(files, tmp_path):
    """--jobs without --split-max-size: worker processes write the tensors of one file at their offsets (the data
    region sized first, its padding zero): the serial file's bytes; no temporary file is left behind."""
    one, _ = files
    out = tmp_path / "par.gguf"
    res = quantize_cli("synth", "--preset", "small", "--gguf", str(out), "--mix", "q2", "--jobs", "3", "--quiet")
    assert res.returncode == 0
    assert out.read_bytes() == one.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["par.gguf"]
    res = quantize_cli("synth", "--preset", "small", "--gguf", str(tmp_path / "x.gguf"), "--jobs", "0", check=False)
    assert res.returncode == 2 and "--jobs" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_parallel_write_failure_leaves_no_file(tmp_path):
    """A worker's error reaches the caller and the target is never created (the temporary file is removed)."""
    import functools

    from ds4.engine.config import preset
    from ds4.gguf_tools.synth_gguf import _synth_plans, _write_synth_tensors
    from ds4.gguf_tools.writer import write_gguf

    cfg = preset("tiny")
    # one bad tensor beside a real one of the tiny model: only the bad one's worker fails (two unknown names made the
    # reported error whichever worker failed first)
    real = next(iter(_synth_plans(cfg, None, "f16").values()))
    plans = [TensorPlan("not.a.ds4.tensor", QuantType.F32, (64,)), real]
    writer = functools.partial(_write_synth_tensors, cfg, None, "f16", 0)
    with pytest.raises(KeyError, match="not.a.ds4.tensor"):
        write_gguf(tmp_path / "bad.gguf", {}, plans, lambda p: np.zeros(64, np.float32), jobs=2, tensor_writer=writer)
    assert list(tmp_path.iterdir()) == []
