"""ds4-server on a real loopback port: the OpenAI chat-completions protocol (JSON and SSE), errors,
and ds4-eval's `--base-url` backend giving the same greedy answers as the local engine."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from ds4.engine.chat import ThinkMode, encode_chat_prompt
from ds4.engine.model import Model
from ds4.engine.session import Session
from ds4.eval.trace import read_trace
from ds4_tool_util import ServerProcess, greedy_oracle, run_cli


@pytest.fixture(scope="module")
def server(eval_model):
    srv = ServerProcess(eval_model, ctx=512)
    yield srv
    srv.stop()


def _post(url, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.headers, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read().decode()


def _sse_events(text):
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


def greedy_reference(model_path, system, user, n):
    """The oracle: our engine driven directly, argmax n tokens after the no-think prompt."""
    model = Model.load(model_path)
    tok = model.tokenizer
    ids = encode_chat_prompt(tok, system, user, ThinkMode.NONE)
    out = greedy_oracle(Session(model, ctx=len(ids) + n + 2), ids, n, tok.eos_id)
    return tok.decode(out).decode("utf-8", "replace")


def test_models_endpoint(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    models = client.models.list().data
    assert [m.id for m in models] == ["deepseek-v4-flash"]
    with urllib.request.urlopen(server.base_url + "/models/foo", timeout=30) as resp:
        obj = json.loads(resp.read())
    assert obj["id"] == "foo" and obj["context_length"] == 512


def test_non_streaming_greedy_matches_engine(server, eval_model):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    resp = client.chat.completions.create(
        model="anything", max_tokens=10, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "What is 2+2?"}],
        extra_body={"thinking": {"type": "disabled"}})
    assert resp.object == "chat.completion" and resp.model == "anything"
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == greedy_reference(eval_model, "Be brief.", "What is 2+2?", 10)
    u = resp.usage
    assert u.completion_tokens <= 10 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert choice.finish_reason == ("length" if u.completion_tokens == 10 else "stop")


def test_streaming_thinking_matches_non_streaming_with_seed(server):
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 24,
            "seed": 1234, "stream": True, "stream_options": {"include_usage": True}}
    status, headers, text = _post(server.base_url + "/chat/completions", body)
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    events = _sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 24
    finish = chunks[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "length"
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-2]]
    kinds = [next(iter(d)) for d in deltas]
    assert set(kinds) <= {"reasoning_content", "content"}
    # reasoning strictly before content
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning_content")
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)

    body["stream"] = False
    status, _, text = _post(server.base_url + "/chat/completions", body)
    message = json.loads(text)["choices"][0]["message"]
    if "reasoning_content" in message:     # the model closed </think>
        assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    else:                                  # never closed: everything is content (§5.5)
        assert message["content"] == reasoning + content


def test_stop_sequence_truncates(server, eval_model):
    full = greedy_reference(eval_model, "", "Hello", 12)
    stop = full[3:6]
    assert stop and full.find(stop) >= 0
    status, _, text = _post(server.base_url + "/chat/completions", {
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 12, "temperature": 0,
        "thinking": False, "stop": [stop]})
    obj = json.loads(text)
    assert status == 200 and obj["choices"][0]["finish_reason"] == "stop"
    assert obj["choices"][0]["message"]["content"] == full[:full.find(stop)]


def test_completions_endpoint(server):
    status, _, text = _post(server.base_url + "/completions",
                            {"prompt": "Once", "max_tokens": 4, "think": False})
    obj = json.loads(text)
    assert status == 200 and obj["object"] == "text_completion"
    assert obj["usage"]["completion_tokens"] <= 4 and isinstance(obj["choices"][0]["text"], str)


@pytest.mark.parametrize("path,body,raw,status,needle", [
    ("/chat/completions", None, b"{not json", 400, "invalid JSON request"),
    ("/chat/completions", {"model": "x"}, None, 400, "missing messages"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                           "reasoning_effort": "extreme"}, None, 400, "reasoning_effort"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi " * 600}]}, None, 400,
     "context_length_exceeded"),
    ("/v1/nothing", {"x": 1}, None, 404, "unknown endpoint"),
])
def test_errors(server, path, body, raw, status, needle):
    url = server.base_url + path if path.startswith("/chat") else \
        server.base_url.rsplit("/v1", 1)[0] + path
    got, headers, text = _post(url, body, raw)
    assert got == status and needle in text
    err = json.loads(text)["error"]
    assert err["type"] == "invalid_request_error"


def test_eval_base_url_matches_local_engine(server, eval_model, tmp_path):
    common = ("--plain", "--questions", "2", "--tokens", "16", "--temp", "0", "--nothink",
              "--seed", "5")
    remote = run_cli("--base-url", server.base_url, *common, "--trace", str(tmp_path / "r.trace"),
                     "--report-json", str(tmp_path / "r.json"))
    local = run_cli("-m", str(eval_model), *common, "--trace", str(tmp_path / "l.trace"),
                    "--report-json", str(tmp_path / "l.json"))
    assert remote.returncode in (0, 1) and local.returncode in (0, 1), remote.stderr + local.stderr
    rh, rcases, rerr = read_trace(tmp_path / "r.trace")
    lh, lcases, lerr = read_trace(tmp_path / "l.trace")
    assert rerr == lerr == [] and len(rcases) == len(lcases) == 2
    assert rh["backend"] == "openai" and lh["backend"] == "local"
    for r, l in zip(rcases, lcases):
        assert r.output == l.output and r.output
        assert (r.picked, r.status) == (l.picked, l.status)
        assert r.prompt_tokens == l.prompt_tokens and r.generated_tokens == l.generated_tokens
    rj = json.loads((tmp_path / "r.json").read_text())
    lj = json.loads((tmp_path / "l.json").read_text())
    strip = [{k: v for k, v in c.items() if k != "elapsed_sec"} for c in rj["cases"]]
    assert strip == [{k: v for k, v in c.items() if k != "elapsed_sec"} for c in lj["cases"]]


def test_eval_base_url_unreachable_is_exit_2():
    done = run_cli("--base-url", "http://127.0.0.1:9/v1", "--plain", "--questions", "1")
    assert done.returncode == 2 and "cannot connect" in done.stderr


def test_stop_mid_stream_over_http_then_server_still_serves(server):
    """ds4-eval stopping a case closes the stream; the server drops that generation and keeps
    serving (the next request gets a full answer)."""
    import threading
    import time

    from ds4.eval.backends import OpenAIBackend
    from ds4.eval.questions import load_questions
    from ds4.eval.runner import EvalRun, GenSettings
    from ds4_tool_util import QUESTIONS

    q = load_questions(QUESTIONS)[0]
    backend = OpenAIBackend(server.base_url)
    settings = GenSettings(tokens=300, think="high", temperature=0, seed=2, soft_budget=20,
                           hard_budget=10)
    run = EvalRun([q], backend, settings)
    worker = threading.Thread(target=run.run)
    worker.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        p = run.results[0].progress
        if p is not None and p.generated >= 3:
            break
        time.sleep(0.02)
    run.control.request_stop()
    worker.join(timeout=60)
    result = run.results[0]
    assert not worker.is_alive() and result.state == "STOPPED"
    assert 3 <= result.generated < 300 and result.output
    status, _, text = _post(server.base_url + "/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "thinking": False,
        "temperature": 0})
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 5
