"""DS4_GPU_ATTN_CLUSTER in the session: decode's attention as one launch of thread block clusters (where the keys make
at most 16 chunks) gives the two launches' logits bit for bit, eager and graph-replayed (ext.set_attn_cluster is read
when a launch is made or captured). The kernel-level test is test_gpu_fused.py::test_decode_attention_clusters_same_bits.
Skipped without a CUDA device and the built extension."""

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

    path = tmp_path_factory.mktemp("attn-cluster") / "small.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(path), "--mix", "q2", "--quiet")
    return Model.load(path)


@pytest.mark.parametrize("graphs", [True, False])
def test_session_logits_bitwise(small_model, graphs):
    from ds4.engine.gpu.session import Session

    ext = gpu.load()
    toks = np.random.default_rng(7).integers(2, small_model.config.vocab_size, 46).tolist()
    runs, W = [], None
    try:
        for mode in (0, 1):
            ext.set_attn_cluster(mode)
            s = Session(small_model, ctx=256, graphs=graphs, weights=W)
            W = s.W
            s.sync(toks[:30])
            runs.append(np.stack([s.decode(t) for t in toks[30:]]))
    finally:
        ext.set_attn_cluster(-1)
    assert np.isfinite(runs[0]).all()
    assert np.array_equal(runs[0].view(np.uint32), runs[1].view(np.uint32))
