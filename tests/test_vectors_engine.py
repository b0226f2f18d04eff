"""ds4-vectors against the engine: capture from the tiny model, the same model passes, a model with
one perturbed tensor fails exactly at the step where its greedy path leaves the capture."""

import json
import subprocess
import sys

import numpy as np
import pytest

from ds4.engine.tokenizer import bytes_to_bytelevel
from ds4.test_vectors.formats import load_vector_dir, read_vec
from ds4_tool_util import perturb_rows

CASES = ["short_italian_fact", "short_code_completion"]


def vectors_cli(*args):
    return subprocess.run([sys.executable, "-m", "ds4.test_vectors.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def captured(tiny_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("vectors") / "captured"
    only = [a for c in CASES for a in ("--only", c)]
    r = vectors_cli("-m", tiny_gguf, "--capture", out, "--steps", 4, *only)
    assert r.returncode == 0, r.stderr
    return out


def test_capture_has_the_official_schema(captured):
    vs = load_vector_dir(captured)  # same reader as the official set
    assert [c.id for c in vs.cases] == CASES
    assert vs.manifest.source == "ds4-local" and vs.manifest.top_logprobs == 20
    vec = {c.id: c for c in read_vec(captured / "official.vec")}
    for c in vs.cases:
        assert len(c.steps) == 4 and c.ctx == vec[c.id].ctx
        for st, vst in zip(c.steps, vec[c.id].steps):
            assert len(st.top) == 20 and st.top[0].token == st.selected  # greedy = best of the top-20
            assert [t.logprob for t in st.top] == sorted((t.logprob for t in st.top), reverse=True)
            assert vst.selected == st.selected and len(vst.top) == 20


def test_same_model_passes(tiny_gguf, captured, tmp_path):
    r = vectors_cli("-m", tiny_gguf, "--vectors", captured, "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert all(c["ok"] for c in rep["cases"]) and len(rep["cases"]) == len(CASES)
    assert "2/2 cases passed" in r.stdout


def test_perturbed_tensor_fails_at_divergence_step(tiny_gguf, captured, tmp_path):
    from ds4.engine.model import Model
    tok = Model.load(tiny_gguf).tokenizer
    vs = load_vector_dir(captured)
    # Pick a case and step k >= 1 whose selected token is not among the top-20 of any earlier step:
    # flipping that token's output row changes the greedy choice at step k and leaves steps < k
    # within tolerance, so the divergence step is known before running the check.
    target = None
    for c in vs.cases:
        for k in range(len(c.steps) - 1, 0, -1):
            sel = c.steps[k].selected
            if all(sel not in {t.token for t in c.steps[j].top} for j in range(k)):
                target = (c.id, k, tok.token_to_id[bytes_to_bytelevel(sel)])
                break
        if target:
            break
    assert target is not None
    case_id, k, token_id = target
    bad = perturb_rows(tiny_gguf, tmp_path / "perturbed.gguf", "output.weight", [token_id], -1.0)
    r = vectors_cli("-m", bad, "--vectors", captured, "--only", case_id, "--json", tmp_path / "r.json")
    assert r.returncode == 1, r.stdout + r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())["cases"][0]
    assert rep["first_failure"] == k
    assert [s["ok"] for s in rep["steps"]][:k] == [True] * k
    assert any("greedy token" in p for p in rep["steps"][k]["problems"])
    assert "FAIL" in r.stdout


def test_official_vectors_reject_a_random_model(tiny_gguf, tmp_path):
    # The random tiny model cannot answer "2048 divided by 128"; the official check must say so.
    r = vectors_cli("-m", tiny_gguf, "--only", "short_reasoning_plain", "--json", tmp_path / "r.json")
    assert r.returncode == 1
    rep = json.loads((tmp_path / "r.json").read_text())["cases"][0]
    assert rep["steps"][0]["expected_hex"] == b"16".hex() and not rep["ok"]
    assert np.isfinite(rep["prompt_tokens"]) and rep["prompt_tokens"] == 18  # the API's usage.prompt_tokens


def test_cli_errors(tiny_gguf, tmp_path):
    r = vectors_cli("-m", tmp_path / "nope.gguf")
    assert r.returncode == 2 and "no such model file" in r.stderr and "Traceback" not in r.stderr
    r = vectors_cli("-m", tiny_gguf, "--only", "no_such_case")
    assert r.returncode == 2 and "unknown case id" in r.stderr
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    r = vectors_cli("-m", tmp_path / "junk.gguf")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
