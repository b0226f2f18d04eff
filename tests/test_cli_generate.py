"""The decode loop (engine.generate) and the CLI's streaming printer, in process on the tiny model;
plus the tokenizer benchmark entry point."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest

from ds4.engine.chat import ThinkMode, encode_chat_prompt
from ds4.engine.cli import Printer, json_token_text, logprobs_json
from ds4.engine.generate import Utf8Stream, generate, log_softmax_at, logprob_steps, top_ids
from ds4.engine.sampling import Sampler
from ds4_tool_util import greedy_oracle


@pytest.fixture()
def session(tiny_model):
    from ds4.engine.session import Session

    return Session(tiny_model, ctx=128)


class Scripted:
    """A sampler that plays back a fixed list of ids (drives the loop into EOS deterministically)."""

    def __init__(self, ids):
        self.ids = list(ids)
        self.seen = []

    def sample(self, logits):
        self.seen.append(np.asarray(logits).copy())
        return self.ids.pop(0)


def test_utf8_stream_holds_partial_sequences():
    s = Utf8Stream()
    data = "aé😀".encode()
    out = [s.push(data[i:i + 1]) for i in range(len(data))]
    assert out == ["a", "", "é", "", "", "", "😀"]
    assert s.push(b"\xff") == "\ufffd"  # invalid bytes never stall the stream
    assert s.push(b"\xe2\x82") == "" and s.flush() == "\ufffd"


def test_generate_greedy_matches_manual_loop(tiny_model, session):
    tok = tiny_model.tokenizer
    prompt = encode_chat_prompt(tok, "", "Hello", ThinkMode.NONE)
    seen = []
    gen = generate(session, prompt, 5, Sampler(temperature=0), on_token=seen.append, eos_id=tok.eos_id)
    from ds4.engine.session import Session

    manual = greedy_oracle(Session(tiny_model, ctx=128), prompt, 5, tok.eos_id)
    assert gen.tokens == manual == seen
    assert gen.prompt_tokens == len(prompt)
    assert gen.finish_reason == ("length" if len(manual) == 5 else "stop")
    # the last sampled token is not evaluated: the session holds prompt + all but the last
    assert session.tokens == prompt + manual[:-1]


def test_generate_stops_at_eos_without_evaluating_it(tiny_model, session):
    tok = tiny_model.tokenizer
    prompt = [tok.bos_id, tok.user_id] + tok.encode("x") + [tok.assistant_id, tok.think_close_id]
    sampler = Scripted([100, 200, tok.eos_id, 300])
    gen = generate(session, prompt, 10, sampler, eos_id=tok.eos_id)
    assert gen.tokens == [100, 200] and gen.finish_reason == "stop"
    assert session.tokens == prompt + [100, 200]
    assert len(sampler.seen) == 3 and sampler.ids == [300]


def test_generate_zero_budget(tiny_model, session):
    gen = generate(session, [0, 5, 6], 0, Sampler(temperature=0), eos_id=1)
    assert gen.tokens == [] and gen.finish_reason == "length"


def test_logprob_steps(tiny_model, session):
    tok = tiny_model.tokenizer
    prompt = encode_chat_prompt(tok, "", "Hi", ThinkMode.NONE)
    steps = logprob_steps(session, prompt, 3, 4, tok.eos_id)
    assert 1 <= len(steps) <= 3
    for s in steps:
        ids = [t[0] for t in s["top"]]
        assert s["selected"] == ids[0] and len(ids) == 4
        assert all(a[1] >= b[1] for a, b in zip(s["top"], s["top"][1:]))
        assert all(lp <= 0 for _, _, lp in s["top"])
    text = logprobs_json(tok, steps, len(prompt), 128, 4)
    import json

    doc = json.loads(text)
    assert doc["steps"][0]["selected"]["id"] == steps[0]["selected"]


def test_top_ids_and_log_softmax():
    logits = np.array([1.0, 3.0, 3.0, -np.inf, 2.0], dtype=np.float32)
    assert list(top_ids(logits, 4)) == [1, 2, 4, 0]  # ties: lower id first; -inf last
    lp = log_softmax_at(logits, np.array([1, 4]))
    finite = np.array([1.0, 3.0, 3.0, 2.0])
    ref = np.log(np.exp(finite) / np.exp(finite).sum())
    np.testing.assert_allclose(lp, [ref[1], ref[3]], rtol=1e-12)


def test_json_token_text():
    assert json_token_text("a\"b\n".encode()) == '"a\\"b\\n"'
    assert json_token_text("é".encode()) == '"é"'
    assert json_token_text(b"\xe2\x82") == '"\\u00e2\\u0082"'  # invalid UTF-8: bytes >= 0x80 as \u00XX


def test_printer_hides_think_tags(tiny_model):
    tok = tiny_model.tokenizer
    out = io.StringIO()
    p = Printer(tok, thinking=True, out=out, color=True)
    for t in tok.encode("reason") + [tok.think_close_id] + tok.encode("answer é"):
        p(t)
    p.finish()
    assert out.getvalue() == "\x1b[90mreason\x1b[0m\nanswer é\n"
    out = io.StringIO()
    p = Printer(tok, thinking=False, out=out, color=False)
    for t in tok.encode("plain 😀"):
        p(t)
    p.finish()
    assert out.getvalue() == "plain 😀\n"


def test_bench_tokenizer_runs(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Quel ramo del lago di Como, che volge a mezzogiorno.\n" * 200, encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "ds4.engine.bench_tokenizer", "--text", str(text), "--repeat", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stdout and "ratio ds4/HF" in proc.stdout
    assert "whole text identical: True" in proc.stdout


class InterruptAfter(Scripted):
    """Plays back ids, then behaves like a user pressing Ctrl+C."""

    def sample(self, logits):
        if not self.ids:
            raise KeyboardInterrupt
        return super().sample(logits)


def test_generate_interrupted_keeps_tokens(tiny_model, session):
    gen = generate(session, [0, 5, 6, 7], 10, InterruptAfter([11, 12]), eos_id=1)
    assert gen.tokens == [11, 12] and gen.finish_reason == "interrupted"
    # the session is consistent: it continues from prompt + kept tokens
    assert session.tokens == [0, 5, 6, 7, 11, 12]
