"""DS4_GPU_ROUTER_XQ in the session: the routed experts' quantized x written by the router's cluster kernel instead of
a quantize_x launch on the `ffn` branch gives the same logits bit for bit, eager and graph-replayed (the planes are
quantize_x's bits: test_gpu_router_one.py::test_cluster_writes_the_quantize_x_planes). Skipped without a CUDA device
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

    path = tmp_path_factory.mktemp("router-xq") / "small.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(path), "--mix", "q2", "--quiet")
    return Model.load(path)


@pytest.mark.parametrize("graphs", [True, False])
def test_session_logits_bitwise(small_model, monkeypatch, graphs):
    from ds4.engine.gpu import fused
    from ds4.engine.gpu.session import Session

    toks = np.random.default_rng(8).integers(2, small_model.config.vocab_size, 46).tolist()
    runs, W = [], None
    for on in (False, True):
        monkeypatch.setattr(fused, "ROUTER_XQ", on)
        s = Session(small_model, ctx=256, graphs=graphs, weights=W)
        W = s.W
        s.sync(toks[:30])
        runs.append(np.stack([s.decode(t) for t in toks[30:]]))
    assert np.isfinite(runs[0]).all()
    assert np.array_equal(runs[0].view(np.uint32), runs[1].view(np.uint32))
