"""Expert parallelism in one process: expert ranges, byte-range loading, and the sharded MoE whose
per-rank parts add up to the unsharded layer (N ranks simulated by N ShardedWeights)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4.engine.dist.comm import Combiner, wire_bytes  # noqa: E402
from ds4.engine.dist.shard import ShardedWeights, expert_blocks, expert_range, expert_slice_f32, is_routed  # noqa: E402
from ds4.engine.gpu.weights import Weights  # noqa: E402
from ds4.engine.model import Model  # noqa: E402
from ds4.gguf_tools import constants as C  # noqa: E402
from ds4.gguf_tools.reader import open_model  # noqa: E402

from conftest import quantize_cli  # noqa: E402

L = C.LayerTensor
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def small_q2(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "small-q2.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(out), "--mix", "q2", "--quiet")
    return out


@pytest.mark.parametrize("n_expert,world", [(32, 1), (32, 4), (256, 3), (384, 4), (8, 8), (10, 4)])
def test_expert_ranges_tile_the_experts(n_expert, world):
    ranges = [expert_range(n_expert, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n_expert
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [e1 - e0 for e0, e1 in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_expert_range_rejects_more_ranks_than_experts():
    with pytest.raises(ValueError, match="only 8 experts"):
        expert_range(8, 0, 9)
    with pytest.raises(ValueError, match="outside"):
        expert_range(8, 4, 4)


def test_routed_names():
    assert is_routed(C.blk(3, L.FFN_DOWN_EXPS)) and is_routed(C.blk(0, L.FFN_GATE_EXPS))
    assert not is_routed(C.blk(3, L.FFN_DOWN_SHEXP)) and not is_routed(C.blk(3, L.FFN_GATE_INP))


def test_expert_blocks_are_the_byte_range_of_the_slice(small_q2):
    f = open_model(small_q2)
    for t in (L.FFN_GATE_EXPS, L.FFN_DOWN_EXPS):
        name = C.blk(4, t)
        info = f.info(name)
        blk = expert_blocks(f, name, 8, 16)
        per = info.nbytes // info.ne[2]
        assert blk.shape[0] == 8 and blk.nbytes == 8 * per
        assert blk.__array_interface__["data"][0] - f.raw(name).__array_interface__["data"][0] == 8 * per
        assert np.array_equal(blk, f.raw(name)[8:16])
    with pytest.raises(ValueError, match="outside"):
        expert_blocks(f, name, 30, 33)


def test_slices_decode_like_the_whole_tensor(small_q2):
    m = Model.load(small_q2)
    for t in (L.FFN_GATE_EXPS, L.FFN_UP_EXPS, L.FFN_DOWN_EXPS):  # IQ2_XXS, IQ2_XXS, Q2_K
        name = C.blk(5, t)
        assert np.array_equal(expert_slice_f32(m, name, 24, 32), m.w(name)[24:32])


def test_a_rank_reads_nothing_outside_its_experts(small_q2, tmp_path):
    """Garbage in every other rank's expert bytes changes nothing that rank 1 of 4 loads."""
    bad = tmp_path / "other-experts-garbage.gguf"
    shutil.copy(small_q2, bad)
    f = open_model(small_q2)
    e0, e1 = expert_range(32, 1, 4)
    with open(bad, "r+b") as out:
        for info in f.tensors.values():
            if is_routed(info.name):
                per = info.nbytes // info.ne[2]
                for a, b in ((0, e0), (e1, info.ne[2])):
                    out.seek(info.offset + a * per)
                    out.write(b"\xff" * (b - a) * per)
    good_m, bad_m = Model.load(small_q2), Model.load(bad)
    assert not np.array_equal(bad_m.file.raw(C.blk(0, L.FFN_UP_EXPS)), good_m.file.raw(C.blk(0, L.FFN_UP_EXPS)))
    wg = ShardedWeights(good_m, CPU, 1, 4, Combiner(None, "allreduce", 1))
    wb = ShardedWeights(bad_m, CPU, 1, 4, Combiner(None, "allreduce", 1))
    for li in range(good_m.config.n_layer):
        for t in (L.FFN_GATE_EXPS, L.FFN_UP_EXPS, L.FFN_DOWN_EXPS):
            assert torch.equal(wg.mat(C.blk(li, t)), wb.mat(C.blk(li, t)))
    assert wb.expert_bytes_read == sum(i.nbytes for i in f.tensors.values() if is_routed(i.name)) // 4


@pytest.mark.parametrize("world", [2, 4])
def test_rank_parts_sum_to_the_unsharded_moe(small_q2, world):
    m = Model.load(small_q2)
    cfg = m.config
    rng = np.random.default_rng(0)
    T, k = 9, cfg.n_expert_used
    b = torch.from_numpy(rng.standard_normal((T, cfg.n_embd)).astype(np.float32))
    ids = torch.from_numpy(np.stack([rng.choice(cfg.n_expert, k, replace=False) for _ in range(T)]))
    wts = torch.from_numpy(rng.random((T, k)).astype(np.float32))
    li = 3
    full = Weights(m, CPU).moe(li, b, ids, wts, 10.0)  # the CUDA engine's own (gather) path
    one = ShardedWeights(m, CPU, 0, 1, Combiner(None, "allreduce", 1)).moe(li, b, ids, wts, 10.0)
    scale = float(full.norm())
    assert float((one - full).norm()) / scale < 1e-5
    for static in (False, True):  # eager per-expert groups (CPU) / masked static slots (the CUDA graph path)
        parts = [ShardedWeights(m, CPU, r, world, Combiner(None, "allreduce", 1), static_moe=static)
                 .moe(li, b, ids, wts, 10.0) for r in range(world)]
        assert all(p.abs().sum() > 0 for p in parts)
        assert float((sum(parts) - full).norm()) / scale < 1e-5, static


def test_wire_bytes_of_the_ring_algorithms():
    assert wire_bytes("allreduce", 1000, 1) == 0
    assert wire_bytes("allreduce", 1000, 4) == pytest.approx(1500)
    assert wire_bytes("rs_ag", 1000, 2) == pytest.approx(1000)
    assert wire_bytes("allgather", 1000, 4) == pytest.approx(3000)
    assert wire_bytes("auto", 1000, 4) == pytest.approx(3000)  # small payload: one all-gather
    assert wire_bytes("auto", 1 << 20, 4) == pytest.approx(1.5 * (1 << 20))  # large: all-reduce
    with pytest.raises(ValueError):
        wire_bytes("alltoall", 1, 2)


def test_graph_replays_are_counted_as_one_row_combines():
    c = Combiner(None, "auto", world=4)
    c.count_replayed(3, 2048, 8)
    assert (c.stats.calls, c.stats.payload_bytes) == (24, 24 * 2048)
    assert c.stats.wire_bytes == pytest.approx(24 * 3 * 2048)  # small rows: all-gather
    one = Combiner(None, "auto", world=1)
    one.count_replayed(3, 2048, 8)
    assert one.stats.calls == 0
