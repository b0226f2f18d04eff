"""ds4-quality against the engine: KLD of a model with itself is 0, quantized copies order as
expected (q8_0 < q4_K < q2_K), saved base logits give the direct result, and scoring a model on
its own greedy continuations is a perfect match."""

import json
import subprocess
import sys

import numpy as np
import pytest

from ds4 import paths
from ds4.gguf_tools.constants import QuantType
from ds4_tool_util import perturb_rows, quantize_copy, tiny_wide_ffn_config, write_random_model

TEXT = paths.data_dir() / "speed-bench" / "promessi_sposi.txt"
VOCAB_TENSORS = ("token_embd.weight", "output.weight")


def quality_cli(*args):
    return subprocess.run([sys.executable, "-m", "ds4.quality.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny_q8(tiny_gguf, tmp_path_factory):
    return quantize_copy(tiny_gguf, tmp_path_factory.mktemp("q") / "tiny-q8_0.gguf", QuantType.Q8_0, keep=VOCAB_TENSORS)


@pytest.mark.slow  # ~80-110 s on 2 cores: three quantized copies of a wide model, scored in turn
def test_kld_ordering_f16_q8_q4_q2(tmp_path_factory):
    from ds4.engine.model import Model
    from ds4.quality.kld import KldAccumulator
    from ds4.quality.run import chunk_logprobs, text_chunks

    d = tmp_path_factory.mktemp("wide")
    base_path = write_random_model(d / "f16.gguf", tiny_wide_ffn_config(), seed=3)
    base = Model.load(base_path)
    chunks = text_chunks(base.tokenizer, TEXT.read_text(encoding="utf-8")[:20000], 48, 2)
    s0 = 24
    base_lp = [chunk_logprobs(base, c, s0) for c in chunks]
    means = {}
    for name, qt in (("q8_0", QuantType.Q8_0), ("q4_K", QuantType.Q4_K), ("q2_K", QuantType.Q2_K)):
        m = Model.load(quantize_copy(base_path, d / f"{name}.gguf", qt, keep=VOCAB_TENSORS))
        acc = KldAccumulator()
        for c, lp in zip(chunks, base_lp):
            acc.add(lp, chunk_logprobs(m, c, s0), c[s0 + 1:], test_is_logits=False)
        means[name] = acc.result().summary()["kld_mean"]
    assert 0 < means["q8_0"] < means["q4_K"] < means["q2_K"], means


def test_kld_cli_self_zero_saved_logits_and_compare(tiny_gguf, tiny_q8, tmp_path):
    common = ["--ctx", 48, "--chunks", 2, "--text", TEXT]
    r = quality_cli("kld", tiny_gguf, tiny_gguf, *common, "--json", tmp_path / "self.json", "--label", "f16")
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "self.json").read_text())["stats"]
    assert s["kld_mean"] == 0 and s["kld_max"] == 0 and s["same_top"] == 1.0 and s["ppl_ratio"] == 1.0
    assert "Same top p:  100.000 ± 0.000 %" in r.stdout and "Mean    KLD:   0.000000" in r.stdout

    r = quality_cli("kld", tiny_gguf, tiny_q8, *common, "--json", tmp_path / "q8.json", "--hist", tmp_path / "h.png")
    assert r.returncode == 0, r.stderr
    direct = json.loads((tmp_path / "q8.json").read_text())["stats"]
    assert direct["kld_mean"] > 0 and direct["tokens"] == 2 * (48 - 1 - 24)
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"

    r = quality_cli("kld", tiny_gguf, *common, "--save-logits", tmp_path / "base.kld")
    assert r.returncode == 0, r.stderr
    r = quality_cli("kld", "--base-logits", tmp_path / "base.kld", tiny_q8, "--json", tmp_path / "q8s.json")
    assert r.returncode == 0, r.stderr
    saved = json.loads((tmp_path / "q8s.json").read_text())["stats"]
    assert saved["kld_mean"] == pytest.approx(direct["kld_mean"], rel=0.02, abs=1e-4)  # f16 storage only
    assert saved["same_top"] == pytest.approx(direct["same_top"], abs=0.05)

    r = quality_cli("compare", tmp_path / "self.json", tmp_path / "q8.json", "--csv", tmp_path / "t.csv",
                    "--md", tmp_path / "t.md", "--chart", tmp_path / "t.png")
    assert r.returncode == 0, r.stderr
    lines = (tmp_path / "t.csv").read_text().splitlines()
    assert lines[0].startswith("model,mean KLD") and lines[1].startswith("f16,0.000000") and len(lines) == 3
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG" and "| f16 |" in (tmp_path / "t.md").read_text()

    r = quality_cli("kld", "--base-logits", tmp_path / "h.png", tiny_q8)
    assert r.returncode == 2 and "not a ds4 saved-logits file" in r.stderr


def test_score_own_continuations_and_diff(tiny_gguf, tmp_path):
    import json as _json

    from ds4.engine.model import Model
    from ds4.quality.metrics import read_scores
    data = tmp_path / "cont"
    r = quality_cli("collect", "-m", tiny_gguf, "--out", data, "--count", 3, "--max-tokens", 6)
    assert r.returncode == 0, r.stderr
    assert (data / "manifest.tsv").read_text().splitlines()[0] == "# id\tprompt_file\tcontinuation_file\tresponse_file"
    r = quality_cli("score", "-m", tiny_gguf, "--manifest", data / "manifest.tsv", "-o", tmp_path / "self.tsv")
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("summary cases=3 tokens=")
    scores = read_scores(tmp_path / "self.tsv")
    tok = Model.load(tiny_gguf).tokenizer
    checked = 0
    for s in scores:
        gen = _json.loads((data / "responses" / f"{s.id}.json").read_text())["tokens"]
        text = (data / "continuations" / f"{s.id}.txt").read_text()
        if tok.encode(text) == gen:  # the continuation re-tokenizes to what was generated
            assert s.first_match == 1 and s.greedy_lcp == s.target_tokens == len(gen)
            checked += 1
    assert checked >= 1
    # a model with its head flipped for the first continuation token no longer matches it
    first = _json.loads((data / "responses" / "case_000.json").read_text())["tokens"][0]
    bad = perturb_rows(tiny_gguf, tmp_path / "bad.gguf", "output.weight", [first], -1.0)
    r = quality_cli("score", "-m", bad, "--manifest", data / "manifest.tsv", "-o", tmp_path / "bad.tsv")
    assert r.returncode == 0, r.stderr
    bad_scores = {s.id: s for s in read_scores(tmp_path / "bad.tsv")}
    assert bad_scores["case_000"].first_match == 0 and bad_scores["case_000"].nll > scores[0].nll
    r = quality_cli("diff", tmp_path / "self.tsv", tmp_path / "bad.tsv")
    assert r.returncode == 0 and "cases\t3" in r.stdout and "old best cases:" in r.stdout
    assert np.isfinite(float(r.stdout.split("relative_nll_change\t")[1].split("%")[0]))


def test_collect_from_openai_compatible_server_matches_local_greedy(tiny_gguf, tmp_path):
    """`collect --base-url` against a real ds4-server on loopback (greedy, thinking disabled) gives
    the continuations the local engine gives."""
    import re
    import signal
    srv = subprocess.Popen([sys.executable, "-m", "ds4.engine.server", "-m", str(tiny_gguf), "--port", "0",
                            "--host", "127.0.0.1", "--ctx", "512", "--backend", "cpu", "--quiet"],
                           stderr=subprocess.PIPE, text=True)
    try:
        line = srv.stderr.readline()
        m = re.search(r"listening on (http://\S+/v1)", line)
        assert m, line
        r = quality_cli("collect", "--base-url", m.group(1), "--api-model", "ds4", "--out", tmp_path / "api",
                        "--count", 2, "--max-tokens", 5)
        assert r.returncode == 0, r.stderr
    finally:
        srv.send_signal(signal.SIGTERM)
        srv.wait(timeout=30)
    r = quality_cli("collect", "-m", tiny_gguf, "--out", tmp_path / "local", "--count", 2, "--max-tokens", 5)
    assert r.returncode == 0, r.stderr
    for cid in ("case_000", "case_001"):
        api = (tmp_path / "api" / "continuations" / f"{cid}.txt").read_text()
        local = (tmp_path / "local" / "continuations" / f"{cid}.txt").read_text()
        assert api == local and api
        resp = json.loads((tmp_path / "api" / "responses" / f"{cid}.json").read_text())
        assert resp["choices"][0]["message"]["content"] == api
    # nothing listening: retries, then a one-line error
    r = quality_cli("collect", "--base-url", "http://127.0.0.1:9/v1", "--out", tmp_path / "x", "--count", 1,
                    "--attempts", 2)
    assert r.returncode == 2 and "failed 2 times" in r.stderr and "Traceback" not in r.stderr
