"""`ds4 --dir-steering-*` and `ds4 --power`, as real subprocesses on the tiny GGUF."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ds4.engine.config import preset
from test_cli_ds4 import assert_user_error, ds4

PROMPT = ["-p", "Tell me about rivers.", "--nothink", "--ctx", "256", "-n", "8"]


@pytest.fixture(scope="module")
def direction(tmp_path_factory):
    """A raw layers×hidden float32 direction file for the tiny preset (unit rows)."""
    cfg = preset("tiny")
    v = np.random.default_rng(3).standard_normal((cfg.n_layer, cfg.n_embd)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    path = tmp_path_factory.mktemp("steer") / "dir.f32"
    v.tofile(path)
    return path


def logprobs(tiny_gguf, tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    r = ds4("-m", tiny_gguf, *PROMPT, "--dump-logprobs", out, *extra)
    assert r.returncode == 0, r.stderr
    steps = json.loads(out.read_text())["steps"]
    return [s["selected"]["id"] for s in steps], np.array([[t["logit"] for t in s["top_logprobs"]] for s in steps])


def test_steering_changes_logprobs_and_zero_scale_does_not(tiny_gguf, tmp_path, direction):
    ids, base = logprobs(tiny_gguf, tmp_path, "base")
    ids0, zero = logprobs(tiny_gguf, tmp_path, "zero", "--dir-steering-file", direction,
                          "--dir-steering-ffn", 0, "--dir-steering-attn", 0)
    assert ids0 == ids and np.array_equal(zero, base)
    ids_f, ffn = logprobs(tiny_gguf, tmp_path, "ffn", "--dir-steering-file", direction)  # ffn scale 1
    assert np.abs(ffn[0] - base[0]).max() > 1e-3
    ids_a, attn = logprobs(tiny_gguf, tmp_path, "attn", "--dir-steering-file", direction,
                           "--dir-steering-attn", -20, "--dir-steering-ffn", 0)
    assert np.abs(attn[0] - base[0]).max() > 1e-3
    assert np.abs(attn[0] - ffn[0]).max() > 1e-3


def test_steering_changes_greedy_text(tiny_gguf, direction):
    base = ds4("-m", tiny_gguf, *PROMPT, "--temp", 0)
    assert base.returncode == 0, base.stderr
    steered = ds4("-m", tiny_gguf, *PROMPT, "--temp", 0, "--dir-steering-file", direction,
                  "--dir-steering-ffn", -30, "--dir-steering-attn", -30)
    assert steered.returncode == 0, steered.stderr
    assert steered.stdout != base.stdout
    zero = ds4("-m", tiny_gguf, *PROMPT, "--temp", 0, "--dir-steering-file", direction, "--dir-steering-ffn", 0)
    assert zero.returncode == 0 and zero.stdout == base.stdout


def test_steering_user_errors(tiny_gguf, tmp_path, direction):
    assert_user_error(ds4("-m", tiny_gguf, *PROMPT, "--dir-steering-file", tmp_path / "nope.f32"), "no such file")
    short = tmp_path / "short.f32"
    np.zeros(10, np.float32).tofile(short)
    assert_user_error(ds4("-m", tiny_gguf, *PROMPT, "--dir-steering-file", short))
    assert_user_error(ds4("-m", tiny_gguf, *PROMPT, "--dir-steering-ffn", 1), "--dir-steering-file")
    assert_user_error(ds4("-m", tiny_gguf, *PROMPT, "--dir-steering-file", direction, "--dir-steering-ffn", 500))


def test_power_keeps_output(tiny_gguf):
    base = ds4("-m", tiny_gguf, *PROMPT, "--temp", 0)
    slow = ds4("-m", tiny_gguf, *PROMPT, "--temp", 0, "--power", 60)
    assert slow.returncode == 0, slow.stderr
    assert slow.stdout == base.stdout
    assert_user_error(ds4("-m", tiny_gguf, *PROMPT, "--power", 0), "--power")
