"""DS4_GPU_L2_HINT: weights asked of L2 by kernels already on decode's chain (the q_a/kv bulk-copy matvec, the router's
cluster kernel, the attention's partial blocks) before they wait for their predecessor. A prefetch moves no value:
every point at every fraction must leave the session's logits bitwise the same, eager and graph-replayed; a hint no
carrier takes is cleared. Skipped without a CUDA device and the built extension."""

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

    path = tmp_path_factory.mktemp("l2-hint") / "small.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(path), "--mix", "q2", "--quiet")
    return Model.load(path)


@pytest.mark.parametrize("graphs", [True, False])
def test_hints_keep_the_bits(small_model, graphs):
    from ds4.engine.gpu.session import Session

    toks = np.random.default_rng(6).integers(2, small_model.config.vocab_size, 46).tolist()
    runs, W = [], None
    for hints in ({}, {"qb": 1.0, "sh": 1.0, "oa": 1.0}, {"qb": 0.5, "sh": 0.3, "oa": 0.5}):
        s = Session(small_model, ctx=256, graphs=graphs, weights=W)
        s.l2_hints = hints
        W = s.W
        s.sync(toks[:30])
        runs.append(np.stack([s.decode(t) for t in toks[30:]]))
    assert np.isfinite(runs[0]).all()
    for r in runs[1:]:
        assert np.array_equal(r.view(np.uint32), runs[0].view(np.uint32))


def test_a_hint_reaches_one_launch_only():
    """Set, then cleared with an empty list: the next bulk-copy matvec runs (and gives its result) without it."""
    from test_gpu_kernels import random_blocks

    from ds4.gguf_tools.constants import QuantType as Q

    ext = gpu.load()
    rng = np.random.default_rng(12)
    w = gpu.upload("l2_hint.w", Q.Q8_0, (1024, 512), random_blocks(Q.Q8_0, 512, 1024, rng))
    x = torch.from_numpy(rng.standard_normal((1, 1024)).astype(np.float32)).cuda()
    outs = []
    for hint in (False, True, False):
        if hint:
            ext.l2_hint([w], 1.0, 1)
        y = torch.full((1, 512), float("nan"), device="cuda")
        ext.matvec(w, ext.Array.view(x.data_ptr(), [1, 1024]), ext.Array.view(y.data_ptr(), [1, 512]))
        ext.l2_hint([])
        torch.cuda.synchronize()
        outs.append(y.cpu().numpy())
    assert np.isfinite(outs[0]).all()
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
