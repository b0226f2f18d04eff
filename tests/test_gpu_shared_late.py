"""DS4_GPU_SHARED_LATE (session.SHARED_LATE): with the `ffn` branch, the shared expert is launched on the side stream
after the routed gate/up (moe's gateup_done event) instead of beside the router. Only the order of independent launches
changes, so the decode logits (eager and graph-replayed, `small` with the q2 mix) must be the same bits. Skipped without
a CUDA device and the built extension."""

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

    path = tmp_path_factory.mktemp("shared-late") / "small.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(path), "--mix", "q2", "--quiet")
    return Model.load(path)


@pytest.mark.parametrize("graphs", [True, False])
def test_shared_expert_after_the_routed_gate_up_keeps_the_logits(small_model, monkeypatch, graphs):
    from ds4.engine.gpu import session
    from ds4.engine.gpu.session import Session

    toks = np.random.default_rng(4).integers(2, small_model.config.vocab_size, 40).tolist()
    runs, W = [], None
    for late in (False, True):
        monkeypatch.setattr(session, "SHARED_LATE", late)
        s = Session(small_model, ctx=256, graphs=graphs, weights=W)
        assert "ffn" in s._branches, "the switch needs the ffn side branch (DS4_GPU_BRANCH)"
        W = s.W
        s.sync(toks[:28])
        runs.append(np.stack([s.decode(t) for t in toks[28:]]))
    assert np.isfinite(runs[0]).all()
    assert np.array_equal(runs[0].view(np.uint32), runs[1].view(np.uint32))

