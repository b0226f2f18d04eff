"""The `ds4` command (runtime-spec §4), run as a real subprocess on the tiny GGUF."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from ds4.engine.chat import DEFAULT_SYSTEM, ThinkMode, encode_chat_prompt
from ds4.engine.tokenizer import default_tokenizer_json

RENDERED = "<｜begin▁of▁sentence｜>You are a helpful assistant<｜User｜>What is 2+2?<｜Assistant｜><think>"


def ds4(*args, stdin=None, env=None, timeout=240):
    cmd = [sys.executable, "-m", "ds4.engine.cli", *map(str, args)]
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=full_env, timeout=timeout)


def assert_user_error(proc, needle=""):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert needle in lines[0]


# ---- --dump-tokens (§4.4) --------------------------------------------------------------------


def test_dump_tokens_format_and_ids(tiny_gguf):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(default_tokenizer_json()))
    proc = ds4("--dump-tokens", "-m", tiny_gguf, "-p", RENDERED)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    ids = json.loads(lines[0])
    # rendered text from the seven specials and ASCII: HF gives the same ids (§1.7)
    assert ids == hf.encode(RENDERED, add_special_tokens=False).ids
    assert ids == [0, 3476, 477, 260, 11502, 22896, 128803, 3085, 344, 223, 20, 13, 20, 33, 128804, 128821]
    assert len(lines) == 1 + len(ids)
    vocab = {v: k for k, v in hf.get_vocab().items()}
    for line, i in zip(lines[1:], ids):
        assert line == "%6d  %s" % (i, vocab[i])
    assert lines[2] == "  3476  You" and lines[3] == "   477  Ġare" and lines[7] == "128803  <｜User｜>"


def test_dump_tokens_prompt_file_and_default_model(tiny_gguf, tmp_path):
    text = "Quel ramo del lago di Como,\n\tche volge a mezzogiorno <think>2+2</think>"
    f = tmp_path / "prompt.txt"
    f.write_text(text, encoding="utf-8")
    a = ds4("--dump-tokens", "-m", tiny_gguf, "--prompt-file", f)
    b = ds4("--dump-tokens", "-p", text, env={"DS4_MODEL": str(tiny_gguf)})  # no -m: the default model
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout
    ids = json.loads(a.stdout.splitlines()[0])
    assert 128821 in ids and 128822 in ids  # specials recognised in the raw text


def test_dump_tokens_without_text_is_an_error(tiny_gguf):
    assert_user_error(ds4("--dump-tokens", "-m", tiny_gguf), "--dump-tokens needs")


# ---- user mistakes: one line, exit 2 ----------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--temp", "500", "-p", "x"], "--temp"),
        (["--temp", "abc", "-p", "x"], "--temp"),
        (["--top-p", "1.5", "-p", "x"], "--top-p"),
        (["--min-p", "-0.1", "-p", "x"], "--min-p"),
        (["--seed", "0", "-p", "x"], "--seed"),
        (["--logprobs-top-k", "500", "-p", "x"], "--logprobs-top-k"),
        (["--ctx", "0", "-p", "x"], "--ctx"),
        (["--no-such-flag"], "unrecognized"),
        (["-p", "x", "--prompt-file", "y"], "not allowed"),
        (["--think", "--nothink", "-p", "x"], "not allowed"),
    ],
)
def test_bad_flags(args, needle):
    assert_user_error(ds4(*args), needle)


def test_bad_model_files(tmp_path, tiny_gguf):
    assert_user_error(ds4("-m", tmp_path / "missing.gguf", "-p", "x"), "not found")
    assert_user_error(ds4("--dump-tokens", "-m", tmp_path / "missing.gguf", "-p", "x"), "not found")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + bytes(100))
    assert_user_error(ds4("-m", junk, "-p", "x"), "magic")
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:5000])
    assert_user_error(ds4("-m", truncated, "-p", "x"))
    assert_user_error(ds4("--dump-tokens", "-m", truncated, "-p", "x"))
    assert_user_error(ds4("-m", tiny_gguf, "--prompt-file", tmp_path / "nope.txt"), "--prompt-file")


def test_help():
    proc = ds4("--help")
    assert proc.returncode == 0
    for flag in ["--dump-tokens", "--dump-logprobs", "--prompt-file", "--nothink", "--think-max", "--min-p", "--raw",
                 "--no-rounding-sim", "--backend", "-sys"]:
        assert flag in proc.stdout


# ---- generation through the engine -------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_reference(tiny_gguf):
    """The engine's own greedy continuation (in process), the oracle for the CLI runs."""
    from ds4.engine.model import Model
    from ds4.engine.session import Session

    model = Model.load(tiny_gguf)
    tok = model.tokenizer
    ids = encode_chat_prompt(tok, DEFAULT_SYSTEM, "Hi there", ThinkMode.NONE)
    session = Session(model, ctx=256)
    logits = session.sync(ids)
    out, all_logits = [], []
    for _ in range(6):
        all_logits.append(np.asarray(logits, dtype=np.float64))
        t = int(np.argmax(logits))
        if t == tok.eos_id:
            break
        out.append(t)
        logits = session.decode(t)
    return tok, ids, out, all_logits


def test_greedy_one_shot_is_deterministic_and_matches_engine(tiny_gguf, greedy_reference):
    tok, _, expected, _ = greedy_reference
    args = ("-m", tiny_gguf, "-p", "Hi there", "--temp", "0", "-n", len(expected), "--nothink", "--ctx", 256)
    a = ds4(*args)
    b = ds4(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout
    assert a.stdout == tok.decode(expected).decode("utf-8", "replace") + "\n"
    assert "prefill:" in a.stderr and "generation:" in a.stderr


@pytest.mark.slow
def test_seeded_sampling(tiny_gguf):
    args = ("-m", tiny_gguf, "-p", "Hi", "-n", 6, "--nothink", "--ctx", 128, "--temp", "1.5", "--min-p", "0")
    a = ds4(*args, "--seed", 7)
    b = ds4(*args, "--seed", 7)
    c = ds4(*args, "--seed", 8)
    assert a.returncode == b.returncode == c.returncode == 0
    assert a.stdout == b.stdout
    assert a.stdout != c.stdout


def test_dump_logprobs(tiny_gguf, greedy_reference, tmp_path):
    tok, ids, expected, all_logits = greedy_reference
    out = tmp_path / "lp.json"
    proc = ds4("-m", tiny_gguf, "-p", "Hi there", "--nothink", "--ctx", 256, "-n", 3, "--temp", "0.9",
               "--dump-logprobs", out, "--logprobs-top-k", 5)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert list(doc) == ["source", "prompt_tokens", "ctx", "top_k", "steps"]
    assert doc["source"] == "ds4" and doc["prompt_tokens"] == len(ids) and doc["ctx"] == 256 and doc["top_k"] == 5
    n_steps = min(3, len(expected) + 1)
    assert [s["step"] for s in doc["steps"]] == list(range(n_steps))
    for k, step in enumerate(doc["steps"]):
        logits = all_logits[k]
        assert list(step) == ["step", "selected", "top_logprobs"]
        sel = step["selected"]
        assert sel["id"] == int(np.argmax(logits))  # greedy regardless of --temp
        assert bytes(sel["bytes"]) == tok.decode_token(sel["id"])
        tops = step["top_logprobs"]
        assert len(tops) == 5 and tops[0]["token"]["id"] == sel["id"]
        assert [t["token"]["id"] for t in tops] == list(np.argsort(-logits, kind="stable")[:5])
        lse = logits.max() + math.log(np.exp(logits - logits.max()).sum())
        for t in tops:
            assert set(t) == {"token", "logit", "logprob"}
            assert t["logit"] == pytest.approx(logits[t["token"]["id"]], rel=1e-6)
            assert t["logprob"] == pytest.approx(logits[t["token"]["id"]] - lse, abs=1e-5)


@pytest.mark.slow
def test_dump_logprobs_default_prompt_is_think_high(tiny_gguf, tok, tmp_path):
    out = tmp_path / "lp.json"
    proc = ds4("-m", tiny_gguf, "-p", "2+2?", "-n", 1, "--dump-logprobs", out, "--ctx", 128)
    assert proc.returncode == 0, proc.stderr
    ids = encode_chat_prompt(tok, DEFAULT_SYSTEM, "2+2?", ThinkMode.HIGH)
    assert json.loads(out.read_text())["prompt_tokens"] == len(ids)
    # --raw: BOS + the text's tokens; a pre-rendered prompt: its chat tokenization
    proc = ds4("-m", tiny_gguf, "-p", "2+2?", "-n", 1, "--dump-logprobs", out, "--ctx", 128, "--raw")
    assert json.loads(out.read_text())["prompt_tokens"] == 1 + len(tok.encode("2+2?"))
    proc = ds4("-m", tiny_gguf, "-p", RENDERED, "-n", 1, "--dump-logprobs", out, "--ctx", 128)
    assert proc.returncode == 0 and json.loads(out.read_text())["prompt_tokens"] == 16


@pytest.mark.slow
def test_dump_logits(tiny_gguf, greedy_reference, tmp_path):
    tok, ids, _, all_logits = greedy_reference
    out = tmp_path / "logits.json"
    proc = ds4("-m", tiny_gguf, "-p", "Hi there", "--nothink", "--ctx", 256, "--dump-logits", out)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    doc = json.loads(text)
    assert doc["source"] == "ds4" and doc["vocab"] == 129280 and doc["prompt_tokens"] == len(ids)
    assert len(doc["logits"]) == 129280
    np.testing.assert_allclose(doc["logits"], all_logits[0], rtol=1e-6, atol=1e-6)
    assert doc["argmax_token"]["id"] == int(np.argmax(all_logits[0]))
    assert text.count("\n") >= 129280 // 8


def test_prompt_longer_than_context(tiny_gguf):
    assert_user_error(ds4("-m", tiny_gguf, "-p", "word " * 200, "--ctx", 64), "context")


def test_repl(tiny_gguf, tmp_path):
    f = tmp_path / "msg.txt"
    f.write_text("Second message from a file", encoding="utf-8")
    script = f"/help\nHello\n/nothink\n/read {f}\n/read {tmp_path / 'nope'}\n/bogus\n/think-max\n/ctx 96\nBye\n/quit\n"
    proc = ds4("-m", tiny_gguf, "-n", 3, "--temp", "0", "--ctx", 128, stdin=script, env={"HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "/think-max" in proc.stdout and "/read FILE" in proc.stdout  # the help text
    assert proc.stderr.count("prefill:") == 3  # three turns generated
    assert "unknown command /bogus" in proc.stderr
    assert "cannot read" in proc.stderr
    assert "Think-Max needs" in proc.stderr
    assert "context 96" in proc.stderr


def test_repl_end_of_input(tiny_gguf):
    proc = ds4("-m", tiny_gguf, stdin="")
    assert proc.returncode == 0


def test_think_max_needs_context(tiny_gguf, tmp_path):
    out = tmp_path / "lp.json"
    proc = ds4("-m", tiny_gguf, "--think-max", "-p", "What is 2+2?", "-n", 1, "--dump-logprobs", out)
    assert proc.returncode == 0, proc.stderr
    assert "--think-max needs --ctx >= 393216" in proc.stderr
    assert json.loads(out.read_text())["prompt_tokens"] == 16  # HIGH: the §1.8 prompt without the prefix


@pytest.mark.slow
def test_think_max_prompt(tiny_gguf, tmp_path):
    out = tmp_path / "lp.json"
    proc = ds4("-m", tiny_gguf, "--think-max", "--ctx", 393216, "-p", "What is 2+2?", "-n", 1, "--dump-logprobs", out)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["prompt_tokens"] == 95  # §1.8: the full MAX prompt


@pytest.mark.slow
def test_inspect(tiny_gguf):
    proc = ds4("-m", tiny_gguf, "--inspect")
    assert proc.returncode == 0, proc.stderr
    assert "n_layer" in proc.stdout and "vocab_size       129280" in proc.stdout and "tensors" in proc.stdout
