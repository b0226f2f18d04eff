"""Vector formats (manifest, official JSON, official.vec) and the §5.3 comparison rules."""

import json
import subprocess
import sys

import numpy as np
import pytest

from ds4 import paths
from ds4.test_vectors import formats as F
from ds4.test_vectors.compare import (API_EOS_BYTES, EOS_BYTES, canonical_token, check_step, local_top,
                                      log_softmax, top_k_ids)

VEC_DIR = paths.data_dir() / "test-vectors"
EXPECTED_STEPS = {"short_italian_fact": 4, "short_code_completion": 4, "short_reasoning_plain": 1,
                  "long_memory_archive": 4, "long_code_audit": 4}


def test_official_vec_reads_and_round_trips_byte_for_byte():
    cases = F.read_vec(VEC_DIR / "official.vec")
    assert {c.id: len(c.steps) for c in cases} == EXPECTED_STEPS  # tooling-spec §5.2 step counts
    for c in cases:
        for st in c.steps:
            # every official step keeps exactly the chosen token, logprob 0 (§5.2)
            assert [(t.token, t.logprob) for t in st.top] == [(st.selected, 0.0)]
    assert F.format_vec(cases) == (VEC_DIR / "official.vec").read_text(encoding="utf-8")


def test_official_json_agrees_with_vec_and_manifest():
    vs = F.load_vector_dir(VEC_DIR)
    assert [c.id for c in vs.cases] == list(EXPECTED_STEPS)
    vec = {c.id: c for c in F.read_vec(VEC_DIR / "official.vec")}
    for c in vs.cases:
        assert c.ctx == vec[c.id].ctx
        assert len(c.prompt) == next(p.prompt_chars for p in vs.manifest.prompts if p.id == c.id)
        # the .vec filter applied to the JSON gives the .vec content
        c.prompt_file = vec[c.id].prompt_file
    assert F.format_vec(vs.cases) == (VEC_DIR / "official.vec").read_text(encoding="utf-8")


def test_manifest_and_official_json_round_trip(tmp_path):
    m = F.read_manifest(VEC_DIR / "manifest.json")
    F.write_manifest(tmp_path / "manifest.json", m)
    assert json.loads((tmp_path / "manifest.json").read_text()) == json.loads((VEC_DIR / "manifest.json").read_text())
    for p in m.prompts:
        data = F.read_official(VEC_DIR / p.official_file)
        F.write_official(tmp_path / "x.json", data)
        assert F.read_official(tmp_path / "x.json") == data


def test_vec_reader_rejects_truncated_and_malformed(tmp_path):
    text = (VEC_DIR / "official.vec").read_text()
    bad = tmp_path / "bad.vec"
    bad.write_text(text[: text.rindex("end")])
    with pytest.raises(F.VectorFormatError, match="no 'end'"):
        F.read_vec(bad)
    bad.write_text(text.replace("step 0 416461 1", "step 0 41646z 1"))
    with pytest.raises(F.VectorFormatError, match="bad hex"):
        F.read_vec(bad)
    bad.write_text(text.replace("case short_reasoning_plain 4096 1", "case short_reasoning_plain 4096 2"))
    with pytest.raises(F.VectorFormatError, match="declares 2 steps"):
        F.read_vec(bad)
    bad.write_text('{"schema": "something-else"}')
    with pytest.raises(F.VectorFormatError, match="schema"):
        F.read_official(bad)
    bad.write_text('{"schema": ')
    with pytest.raises(F.VectorFormatError, match="malformed JSON"):
        F.read_manifest(bad)


def test_api_eos_spelling_maps_to_eos():
    # the API's doubled-bar spelling appears in the official captures (as an alternative)
    raw = (VEC_DIR / "official" / "short_reasoning_plain.official.json").read_text(encoding="utf-8")
    assert API_EOS_BYTES.decode() in raw
    assert canonical_token(API_EOS_BYTES) == EOS_BYTES
    step = F.VectorStep(index=0, selected=API_EOS_BYTES, top=[F.TopEntry(API_EOS_BYTES, -0.5)])
    ok = check_step(step, EOS_BYTES, [F.TopEntry(EOS_BYTES, -0.7), F.TopEntry(b"x", -1.0)])
    assert ok.ok, ok.problems


def test_check_step_rules():
    step = F.VectorStep(index=2, selected=b" the", top=[F.TopEntry(b" the", -0.1), F.TopEntry(b" a", -2.0)])
    local = [F.TopEntry(b" the", -0.2), F.TopEntry(b" a", -5.9)]
    assert check_step(step, b" the", local).ok  # |Δ| = 3.9 ≤ 4
    r = check_step(step, b" the", [F.TopEntry(b" the", -0.2), F.TopEntry(b" a", -6.1)])
    assert not r.ok and "logprob" in r.problems[0]  # |Δ| = 4.1 > 4
    r = check_step(step, b" a", local)
    assert not r.ok and "greedy token" in r.problems[0]
    r = check_step(step, b" the", [F.TopEntry(b" the", -0.2)])
    assert not r.ok and "not in local top" in r.problems[0]


def test_local_top_and_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=300).astype(np.float32)
    logits[7] = logits[11] = logits.max() + 1  # a tie: the lower id first
    lp = log_softmax(logits)
    assert abs(np.exp(lp).sum() - 1) < 1e-12
    # hand check on a small array: log-softmax of [0, ln 3] is [ln 1/4, ln 3/4]
    np.testing.assert_allclose(log_softmax(np.array([0.0, np.log(3.0)])), np.log([0.25, 0.75]))
    ids = top_k_ids(logits, 20)
    assert list(ids[:2]) == [7, 11]
    assert list(ids) == list(np.argsort(-logits.astype(np.float64), kind="stable")[:20])
    top = local_top(logits, lambda i: bytes([i % 256]), 5)
    assert [t.logprob for t in top] == pytest.approx([lp[i] for i in ids[:5]])


def test_cli_bad_vector_dir_is_one_line_error(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    r = subprocess.run([sys.executable, "-m", "ds4.test_vectors.cli", "--vectors", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "malformed JSON" in r.stderr and "Traceback" not in r.stderr


def test_vector_prompts_render_to_the_api_prompt_token_counts():
    # The capture's usage.prompt_tokens is an oracle for the rendering (BOS, <｜User｜>, prompt,
    # <｜Assistant｜>, </think>; no system prompt): ours must give the same count for all five.
    from ds4.engine.tokenizer import Tokenizer
    from ds4.test_vectors.runtime import render_nothink
    tok = Tokenizer.from_tokenizer_json()
    vs = F.load_vector_dir(VEC_DIR)
    for c in vs.cases:
        usage = F.read_official(VEC_DIR / "official" / f"{c.id}.official.json")["usage"]
        ids = render_nothink(tok, c.prompt)
        assert len(ids) == usage["prompt_tokens"], c.id
        assert ids[0] == tok.bos_id and ids[-2:] == [tok.assistant_id, tok.think_close_id]
