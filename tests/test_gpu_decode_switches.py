"""Decode switches that claim the default's bits, in the session (eager and graph-replayed, `small` with the q2 mix):
- DS4_GPU_ATTN_CLUSTER (ext.set_attn_cluster): the attention's partials and combine in one launch of clusters;
- DS4_GPU_ROUTER_XQ (fused.ROUTER_XQ): the routed experts' quantized x written by the router's cluster kernel;
- DS4_GPU_COMP_MERGE (session.COMP_MERGE): the compressors' products in the q_a/kv launch.
Each is read when a launch is made or captured, so one process runs both settings. The kernel-level tests:
test_gpu_fused.py -k clusters_same_bits, test_gpu_router_one.py -k quantize_x_planes. Skipped without a CUDA device
and the built extension."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from ds4.engine import gpu  # noqa: E402

HAVE_GPU = torch.cuda.is_available() and gpu.available()
pytestmark = pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA device and the built extension")


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from conftest import quantize_cli
    from ds4.engine.model import Model

    path = tmp_path_factory.mktemp("decode-switches") / "small.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(path), "--mix", "q2", "--quiet")
    return Model.load(path)


def set_switch(name: str, on: bool, monkeypatch) -> None:
    from ds4.engine.gpu import fused, session

    if name == "attn_cluster":
        gpu.load().set_attn_cluster(1 if on else 0)
    elif name == "router_xq":
        monkeypatch.setattr(fused, "ROUTER_XQ", on)
    else:
        monkeypatch.setattr(session, "COMP_MERGE", on)


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("name", ["attn_cluster", "router_xq", "comp_merge"])
def test_switch_keeps_the_logits_bitwise(small_model, monkeypatch, name, graphs):
    from ds4.engine.gpu.session import Session

    toks = np.random.default_rng(9).integers(2, small_model.config.vocab_size, 46).tolist()
    runs, W = [], None
    try:
        for on in (False, True):
            set_switch(name, on, monkeypatch)
            s = Session(small_model, ctx=256, graphs=graphs, weights=W)
            W = s.W
            s.sync(toks[:30])
            runs.append(np.stack([s.decode(t) for t in toks[30:]]))
    finally:
        gpu.load().set_attn_cluster(-1)
    assert np.isfinite(runs[0]).all()
    assert np.array_equal(runs[0].view(np.uint32), runs[1].view(np.uint32))
