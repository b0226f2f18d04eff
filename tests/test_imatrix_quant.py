"""The imatrix pays off: on the `small` preset, IQ2_XXS quantization of routed experts weighted by the
collected imatrix has a lower activation-weighted error on held-out activations than ds4's default
importance (column energy of W). Also the quant-error command on `tiny` (Q8_0 blocks fit its widths)."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine.session import Session
from ds4.gguf_tools.constants import QuantType
from ds4.imatrix import collect as C
from ds4.imatrix.evaluate import LayerInputRecorder, compare_quantization, weighted_error


def _held_out(model, prompts, layer, max_tokens):
    rec = LayerInputRecorder(layer)
    used = 0
    for p in prompts:
        ids = model.tokenizer.encode_chat(p.text)[: max_tokens - used]
        if not ids:
            break
        Session(model, ctx=max(len(ids), 2), hooks=rec).prefill(ids)
        used += len(ids)
    return rec


def test_weighted_error_definition():
    rng = np.random.default_rng(0)
    W = rng.standard_normal((4, 8)).astype(np.float32)
    X = rng.standard_normal((5, 8)).astype(np.float32)
    assert weighted_error(W, W, X) == 0.0
    assert weighted_error(W, np.zeros_like(W), X) == pytest.approx(1.0)
    assert weighted_error(W, 0.5 * W, X) == pytest.approx(0.25)


def test_quant_error_pipeline_on_tiny(tiny_gguf, data_dir):
    from ds4.engine.model import Model

    model = Model.load(tiny_gguf)
    prompts = C.load_prompts(data_dir / "imatrix" / "rendered_prompts.txt.gz")
    r = C.collect(model, prompts[:2], max_tokens=200, progress=False)
    im = r.accumulator.to_imatrix()
    rec = _held_out(model, prompts[2:], 3, 200)
    rows = compare_quantization(model, im, rec, "gate", QuantType.Q8_0)
    assert rows and all(0 < x.err_default < 1e-3 and 0 < x.err_imatrix < 1e-3 for x in rows)
    assert sum(x.rows for x in rows) <= 200 * model.config.n_expert_used


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gate", "down"])
def test_imatrix_lowers_iq2_xxs_error_on_small(small_gguf, data_dir, kind):
    from ds4.engine.model import Model

    model = Model.load(small_gguf)
    prompts = C.load_prompts(data_dir / "imatrix" / "prompts.jsonl.gz")
    r = C.collect(model, prompts[:3], max_tokens=2048, progress=False)
    im = r.accumulator.to_imatrix()
    rec = _held_out(model, prompts[5:], 3, 1024)
    rows = compare_quantization(model, im, rec, kind, QuantType.IQ2_XXS, max_experts=12)
    n = sum(x.rows for x in rows)
    default = sum(x.err_default * x.rows for x in rows) / n
    weighted = sum(x.err_imatrix * x.rows for x in rows) / n
    print(f"{kind}: default {default:.5f} imatrix {weighted:.5f} ({100 * (weighted / default - 1):+.2f}%)")
    assert weighted < default
