"""Decode's shared expert inside the routed gate/up launch (DS4_GPU_MOE_SHARED, engine/gpu/moe.cu GuShared).

The routed units are computed as without the shared ones (one warp per unit, the same code), so h and the routed
output are bitwise those of ext.moe_gateup and ext.moe; the shared gate and up rows (Q8_0 against the quantized x)
are held to a float64 reference; the session's logits with the switch are the default's within float rounding
(the shared gate/up then reads x at ~16 bits instead of float32). Skipped without a CUDA device and the extension.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from ds4.engine import gpu  # noqa: E402
from ds4.gguf_tools.constants import QuantType as Q  # noqa: E402

HAVE_GPU = torch.cuda.is_available() and gpu.available()
pytestmark = pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA device and the built extension")


def expert_case(n_embd: int, n_ff: int, n_sh: int, n_expert: int, k: int, seed: int):
    from test_gpu_kernels import random_blocks

    rng = np.random.default_rng(seed)
    tag = f"{n_embd}.{n_ff}.{n_sh}"
    raws = [random_blocks(Q.IQ2_XXS, n_expert * n_ff, n_embd, rng) for _ in range(2)]
    gate, up = (gpu.upload(f"moe_shared.{tag}.{i}", Q.IQ2_XXS, (n_embd, n_ff, n_expert), r) for i, r in enumerate(raws))
    down = gpu.upload(f"moe_shared.{tag}.down", Q.Q2_K, (n_ff, n_embd, n_expert),
                      random_blocks(Q.Q2_K, n_expert * n_embd, n_ff, rng))
    sh_raw = [random_blocks(Q.Q8_0, n_sh, n_embd, rng) for _ in range(2)]
    sg, su = (gpu.upload(f"moe_shared.{tag}.s{i}", Q.Q8_0, (n_embd, n_sh), r) for i, r in enumerate(sh_raw))
    x = (rng.standard_normal((1, n_embd)) * 2.0).astype(np.float32)
    ids = np.array([rng.choice(n_expert, k, replace=False)], dtype=np.int32)
    wts = rng.uniform(0.1, 0.5, (1, k)).astype(np.float32)
    return dict(gate=gate, up=up, down=down, sg=sg, su=su, sh_raw=sh_raw, x=x, ids=ids, wts=wts, n_ff=n_ff, n_sh=n_sh)


@pytest.mark.parametrize("n_embd,n_ff,n_sh,n_expert,k", [
    (4096, 2048, 2048, 16, 6),  # Flash's expert and shared-expert shapes (fewer experts stored)
    (512, 256, 256, 8, 6),      # the small preset
    (1024, 256, 1024, 8, 2),    # more shared units than routed ones: the tail of the dealing is shared
])
def test_shared_units_leave_the_routed_bits_and_match_the_reference(n_embd, n_ff, n_sh, n_expert, k):
    from test_gpu_kernels import TOL, dequant, rel_err

    ext = gpu.load()
    c = expert_case(n_embd, n_ff, n_sh, n_expert, k, seed=n_embd + n_sh)
    assert ext.moe_shared_takes(c["gate"], c["sg"], c["su"])
    xt, ids, wts = (torch.from_numpy(a).cuda() for a in (c["x"], c["ids"], c["wts"]))
    xq = torch.empty(ext.xq_bytes(1, n_embd), dtype=torch.uint8, device="cuda")
    ext.quantize_x_into(xt.data_ptr(), 1, n_embd, xq.data_ptr())
    h = torch.full((k, n_ff), float("nan"), device="cuda")
    gu = torch.full((1, 2 * n_sh), float("nan"), device="cuda")
    ext.moe_gateup_shared(c["gate"], c["up"], c["sg"], c["su"], xq.data_ptr(), ids.data_ptr(), wts.data_ptr(), k,
                          10.0, h.data_ptr(), gu.data_ptr())
    y = torch.full((1, n_embd), float("nan"), device="cuda")
    xq_h = torch.empty(ext.xq_bytes(k, n_ff), dtype=torch.uint8, device="cuda")
    ext.moe_down_h(c["down"], h.data_ptr(), ids.data_ptr(), k, xq_h.data_ptr(), y.data_ptr())
    torch.cuda.synchronize()
    # the routed half: bitwise the separate gate/up launch and the four-launch MoE
    h_ref = ext.Array.empty([k, n_ff])
    ext.moe_gateup(c["gate"], c["up"], ext.Array.from_numpy(c["x"]), ext.Array.from_numpy(c["ids"]),
                   ext.Array.from_numpy(c["wts"]), h_ref, 10.0)
    assert np.array_equal(h.cpu().numpy().view(np.uint32), h_ref.numpy().view(np.uint32))
    y_ref = gpu.moe_host(c["gate"], c["up"], c["down"], c["x"], c["ids"], c["wts"], 10.0)
    assert np.array_equal(y.cpu().numpy().view(np.uint32), y_ref.view(np.uint32))
    # the shared half: raw gate and up rows against float64
    x64 = c["x"][0].astype(np.float64)
    want = np.concatenate([dequant(Q.Q8_0, r, n_embd) @ x64 for r in c["sh_raw"]])
    assert rel_err(gu.cpu().numpy()[0], want) <= TOL


def test_declines_other_types():
    from test_gpu_kernels import random_blocks

    ext = gpu.load()
    rng = np.random.default_rng(3)
    gate = gpu.upload("moe_shared.q4", Q.Q4_K, (512, 256, 4), random_blocks(Q.Q4_K, 4 * 256, 512, rng))
    sg = gpu.upload("moe_shared.q4.s", Q.Q8_0, (512, 256), random_blocks(Q.Q8_0, 256, 512, rng))
    assert not ext.moe_shared_takes(gate, sg, sg)
    with pytest.raises(Exception, match="not taken"):
        ext.moe_gateup_shared(gate, gate, sg, sg, 0, 0, 0, 6, 10.0, 0, 0)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from conftest import quantize_cli
    from ds4.engine.model import Model

    path = tmp_path_factory.mktemp("moe-shared") / "small.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(path), "--mix", "q2", "--quiet")
    return Model.load(path)


@pytest.mark.parametrize("graphs", [True, False])
def test_session_logits(small_model, monkeypatch, graphs):
    from ds4.engine.gpu import session
    from ds4.engine.gpu.session import Session

    toks = np.random.default_rng(4).integers(2, small_model.config.vocab_size, 46).tolist()
    runs, W = [], None
    for on in (False, True):
        monkeypatch.setattr(session, "MOE_SHARED", on)
        s = Session(small_model, ctx=256, graphs=graphs, weights=W)
        W = s.W
        s.sync(toks[:30])
        runs.append(np.stack([s.decode(t) for t in toks[30:]]))
    assert np.isfinite(runs[1]).all()
    err = np.linalg.norm(runs[1] - runs[0]) / np.linalg.norm(runs[0])
    assert 0.0 < err < 1e-3, f"relative error {err:.2e} (0: the switch did not take the shared expert)"
