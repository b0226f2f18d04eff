"""Steering through the engine hooks on the `tiny` model: logits change only for non-zero scales, the
edit the engine applies is the projection, a planted difference is recovered by the builder, and the
build / sweep / generate commands run end to end."""

from __future__ import annotations

import csv
import subprocess
import sys

import numpy as np
import pytest

from ds4.engine.hooks import HookList, Hooks
from ds4.engine.session import Session
from ds4.steering import apply as A
from ds4.steering.format import DirectionSet, load_directions, write_f32
from ds4.steering.run import capture_last_rows

PROMPTS_A = ["Tell me about rivers.", "What is a prime number?", "Describe a quiet morning.",
             "How do bridges stay up?", "Name three colours."]
PROMPTS_B = ["Explain the water cycle.", "Why is the sea salty?", "What do cats eat?",
             "How does a clock work?", "Write a line about snow."]


@pytest.fixture(scope="module")
def prompt_ids(tiny_model):
    return tiny_model.tokenizer.encode_chat("<｜begin▁of▁sentence｜><｜User｜>Steer me.<｜Assistant｜></think>")


def _random_dirs(cfg, seed):
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((cfg.n_layer, cfg.n_embd)).astype(np.float32)
    return DirectionSet(v / np.linalg.norm(v, axis=1, keepdims=True))


def _logits(model, ids, hooks):
    return Session(model, ctx=64, hooks=hooks).prefill(ids, all_logits=True)


def test_logits_change_only_for_nonzero_scales(tiny_model, prompt_ids):
    ds = _random_dirs(tiny_model.config, 0)
    base = _logits(tiny_model, prompt_ids, None)
    zero = A.SteeringHooks(A.Steering([A.SteeringDirection(ds, attn_scale=0.0, ffn_scale=0.0)]))
    assert np.array_equal(_logits(tiny_model, prompt_ids, zero), base)
    for attn, ffn in ((0.0, 1.0), (0.7, 0.0), (-1.0, -1.0)):
        hooks = A.SteeringHooks(A.Steering([A.SteeringDirection(ds, attn_scale=attn, ffn_scale=ffn)]))
        steered = _logits(tiny_model, prompt_ids, hooks)
        assert np.max(np.abs(steered - base)) > 1e-4, (attn, ffn)


class SublayerRecorder(Hooks):
    def __init__(self):
        self.rows = {}

    def sublayer_output(self, layer, kind, y):
        self.rows[(layer, kind)] = y.copy()


def test_engine_applies_the_projection(tiny_model, prompt_ids):
    """With steering first and a recorder after it in a HookList, the recorded outputs have no
    component along v (s = 1), in prefill and in decode."""
    ds = _random_dirs(tiny_model.config, 1)
    rec = SublayerRecorder()
    hooks = HookList(A.SteeringHooks(A.Steering([A.SteeringDirection(ds, attn_scale=1.0, ffn_scale=1.0)])), rec)
    s = Session(tiny_model, ctx=64, hooks=hooks)
    s.prefill(prompt_ids)
    for step in range(2):
        for (layer, kind), y in rec.rows.items():
            v = ds.vectors[layer]
            assert np.max(np.abs(y @ v)) < 1e-4 * max(1.0, float(np.abs(y).max())), (step, layer, kind)
        s.decode(int(np.argmax(s.logits)))


class Plant(Hooks):
    """Adds alpha·u_l to the FFN output of every layer: the planted difference to recover."""

    def __init__(self, u, alpha):
        self.u, self.alpha = u, alpha

    def sublayer_output(self, layer, kind, y):
        if kind == "ffn":
            return y + np.float32(self.alpha) * self.u[layer]
        return None


def test_builder_recovers_a_planted_direction(tiny_model):
    from ds4.steering.build import direction_from_activations

    cfg = tiny_model.config
    u = _random_dirs(cfg, 2).vectors
    bad = capture_last_rows(tiny_model, PROMPTS_B, "ffn_out")
    scale = float(np.median(np.linalg.norm(bad, axis=2)))
    good = capture_last_rows(tiny_model, PROMPTS_A, "ffn_out", extra_hooks=Plant(u, 20 * scale))
    d = direction_from_activations(good, bad, orthogonalize=False)
    cos = np.sum(d * u, axis=1)
    assert np.all(cos > 0.97), cos
    # without the plant the same two sets give a direction unrelated to u
    plain = direction_from_activations(capture_last_rows(tiny_model, PROMPTS_A, "ffn_out"), bad, orthogonalize=False)
    assert np.all(np.abs(np.sum(plain * u, axis=1)) < 0.6)


def _steer_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ds4.steering.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def test_build_sweep_generate_commands(tiny_gguf, tmp_path, capsys):
    from ds4.steering.cli import main

    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("\n".join(PROMPTS_A[:2]) + "\n")
    bad.write_text("# contrast\n" + "\n".join(PROMPTS_B[:2]) + "\n")
    out = tmp_path / "dir.f32"
    r = _steer_cli("build", "-m", tiny_gguf, "--positive", good, "--negative", bad, "-o", out,
                   "--gguf", tmp_path / "dir.gguf", "-q")
    assert r.returncode == 0, r.stderr
    ds = load_directions(out)
    np.testing.assert_allclose(np.linalg.norm(ds.vectors, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(load_directions(tmp_path / "dir.gguf").vectors, ds.vectors)
    assert ds.meta["good_file"] == str(good) and ds.meta["component"] == "ffn_out"

    (tmp_path / "eval.txt").write_text("Explain why databases use indexes.\n")
    r = _steer_cli("sweep", "-m", tiny_gguf, "--direction", out, "--prompts", tmp_path / "eval.txt",
                   "--scales=-1,0,1", "--tokens", "3", "--csv", tmp_path / "s.csv", "--chart", tmp_path / "s.png", "-q")
    assert r.returncode == 0, r.stderr
    assert "ffn -1" in r.stdout and "mean" in r.stdout
    rows = list(csv.DictReader(open(tmp_path / "s.csv")))
    assert [row["ffn_scale"] for row in rows] == ["-1", "0", "1"]
    assert all(0 <= int(row["tokens"]) <= 3 for row in rows)
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"

    # in-process from here on (the subprocess paths are covered above)
    capsys.readouterr()
    assert main(["generate", "-m", str(tiny_gguf), "-p", "Hi", "-n", "4", "--dir-steering-file", str(out),
                 "--dir-steering-ffn=-2"]) == 0
    assert "tokens" in capsys.readouterr().err
    assert main(["sweep", "-m", str(tiny_gguf), "--direction", str(out), "--scales", "1,500"]) == 2
    assert "[-100, 100]" in capsys.readouterr().err
    write_f32(tmp_path / "wrong.f32", DirectionSet(np.ones((3, 64), np.float32)), sidecar=False)
    assert main(["generate", "-m", str(tiny_gguf), "-p", "Hi", "--dir-steering-file", str(tmp_path / "wrong.f32")]) == 2
    assert "bytes" in capsys.readouterr().err
