"""Expert parallelism across real processes (gloo on the CPU): the sharded forward on N = 2 and 4
ranks against the one-process engines on the `small` preset (F16 file written by ds4-quantize
synth --gguf; quantized experts are covered in test_dist_shard and the slow q2 run below)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4.engine.dist.comm import wire_bytes  # noqa: E402
from ds4.engine.dist.launch import TraceCall, run  # noqa: E402
from ds4.engine.gpu.session import Session as TorchSession  # noqa: E402
from ds4.engine.model import Model  # noqa: E402
from ds4.engine.session import Session as CpuSession  # noqa: E402
from ds4.engine.session import SessionError  # noqa: E402

from conftest import quantize_cli  # noqa: E402

CTX = 128
PROMPT = np.random.default_rng(7).integers(2, 129280, 20).tolist()
DECODES, GREEDY = 3, 3


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def synth(tmp_path_factory, mix: str, typ: str):
    out = tmp_path_factory.mktemp("dist") / f"small-{mix}.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(out), "--mix", mix, "--type", typ, "--quiet")
    return out


@pytest.fixture(scope="module")
def small_f16(tmp_path_factory):
    return synth(tmp_path_factory, "none", "f16")


def reference(path, numerics: bool):
    """Unsharded: the torch forward in one process, and the numpy engine, same calls as TraceCall."""
    m = Model.load(path, fp8_kv=numerics, indexer_qat=numerics)
    out = {}
    for name, s in (("torch", TorchSession(m, ctx=CTX, device="cpu")), ("numpy", CpuSession(m, ctx=CTX))):
        rows = [s.sync(PROMPT)]
        for _ in range(DECODES):
            rows.append(s.decode(int(np.argmax(rows[-1]))))
        greedy = []
        for _ in range(GREEDY):
            greedy.append(int(np.argmax(s.logits)))
            s.decode(greedy[-1])
        out[name] = dict(logits=np.stack(rows), greedy=greedy, last=s.logits, snapshot=s.snapshot())
    return out


@pytest.fixture(scope="module")
def ref_exact(small_f16):
    return reference(small_f16, numerics=False)


@pytest.mark.parametrize("world,combine", [(2, "auto"), (4, "allreduce")])
def test_sharded_forward_equals_the_unsharded_engines(small_f16, ref_exact, world, combine):
    r = run(TraceCall(PROMPT, DECODES, GREEDY), world, small_f16, ctx=CTX, fp8_kv=False, indexer_qat=False,
            combine=combine)
    assert r["consistent"]  # every rank ends with bitwise the same tokens, logits and KV state
    for name in ("torch", "numpy"):
        ref = ref_exact[name]
        for i in range(DECODES + 1):
            assert rel(r["logits"][i], ref["logits"][i]) < 1e-5, (name, i)
        assert r["greedy"] == ref["greedy"], name
        assert rel(r["greedy_logits"], ref["last"]) < 1e-5
    # payload: one [T, n_embd] float32 combine per layer per forward
    cfg = Model.load(small_f16).config
    per_token = cfg.n_layer * cfg.n_embd * 4
    assert r["prefill_comm"]["payload_bytes"] == per_token * len(PROMPT)
    assert r["comm"]["calls"] == cfg.n_layer * (1 + DECODES + GREEDY)
    assert r["comm"]["payload_bytes"] == per_token * (len(PROMPT) + DECODES + GREEDY)
    row = cfg.n_embd * 4
    want = cfg.n_layer * (wire_bytes(combine, row * len(PROMPT), world) + (DECODES + GREEDY) * wire_bytes(combine, row, world))
    assert r["comm"]["wire_bytes"] == pytest.approx(want)
    stats = r["stats"]
    assert [s["experts"] for s in stats] == [(i * 32 // world, (i + 1) * 32 // world) for i in range(world)]
    total = stats[0]["expert_bytes_read"] * world
    assert all(s["expert_bytes_read"] == total // world for s in stats)
    # the session payload is the one-process engine's (header equal, state within rounding)
    a, b = np.frombuffer(r["snapshot"], np.uint8), np.frombuffer(ref_exact["numpy"]["snapshot"], np.uint8)
    assert len(a) == len(b) and np.array_equal(a[:52], b[:52])
    assert np.allclose(a[52:].view(np.float32), b[52:].view(np.float32), rtol=1e-4, atol=1e-5, equal_nan=True)


class ErrorsThenWork:
    """A bad call raises on rank 0 and leaves every rank serving; restore and rebuild stay in step."""

    def __call__(self, s):
        out = {}
        try:
            s.sync(list(range(2, 2 + CTX)))
        except SessionError as e:
            out["error"] = str(e)
        first = s.sync(PROMPT)
        blob = s.snapshot()
        s.sync(PROMPT[:5])  # not a prefix extension: rebuild
        s.restore(blob)
        out["restored"] = np.array_equal(s.logits, first)
        out["after"] = s.decode(5)
        out["consistent"] = s.check_consistent()
        return out


def test_errors_restore_chunks_and_rebuild_stay_in_step(small_f16, ref_exact):
    r = run(ErrorsThenWork(), 2, small_f16, ctx=CTX, fp8_kv=False, indexer_qat=False, combine="allgather",
            prefill_chunk=8)  # chunked prefill: every chunk is one collective forward
    assert "exceeds context" in r["error"]
    assert r["restored"] and r["consistent"]
    m = Model.load(small_f16, fp8_kv=False, indexer_qat=False)
    s = CpuSession(m, ctx=CTX)
    s.sync(PROMPT)
    assert rel(r["after"], s.decode(5)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("combine", ["allreduce", "rs_ag"])
def test_q2_experts_with_rounding_sims_on_four_ranks(tmp_path_factory, combine):
    path = synth(tmp_path_factory, "q2", "q8_0")
    ref = reference(path, numerics=True)["torch"]
    r = run(TraceCall(PROMPT, DECODES, GREEDY), 4, path, ctx=CTX, combine=combine)
    assert r["consistent"] and r["greedy"] == ref["greedy"]
    assert max(rel(r["logits"][i], ref["logits"][i]) for i in range(DECODES + 1)) < 1e-4
