"""`ds4-bench --dir-steering-*`: the flags reach the bench's sessions. The CSV holds no tokens, so
the greedy probe tokens are recorded at the session level through the bench's own sweep, and the
subprocess runs check acceptance, the CSV header and user errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ds4 import paths
from ds4.engine import power
from ds4.speed_bench.cli import open_bench_session, run_parser
from ds4.speed_bench.csvio import read_csv
from ds4.speed_bench.frontier import sweep
from ds4.steering import apply as steering

FRONTS = [16, 40]
GEN = 6


@pytest.fixture(scope="module")
def direction(tiny_model, tmp_path_factory):
    cfg = tiny_model.config
    v = np.random.default_rng(11).standard_normal((cfg.n_layer, cfg.n_embd)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    path = tmp_path_factory.mktemp("dir") / "dir.f32"
    v.tofile(path)
    return path


class RecordingSession:
    """Passes every call to the real session and keeps the tokens the probe decodes."""

    def __init__(self, session):
        self.session, self.decoded = session, []

    def sync(self, tokens):
        return self.session.sync(tokens)

    def decode(self, token):
        self.decoded.append(int(token))
        return self.session.decode(token)

    def snapshot(self):
        return self.session.snapshot()

    def restore(self, snap):
        self.session.restore(snap)


def probe_tokens(model, *flags: str) -> list[int]:
    """The greedy tokens of the bench sweep, with the session opened as `ds4-bench FLAGS` opens it."""
    args = run_parser().parse_args(["--backend", "cpu", *flags])
    hooks = steering.hooks_from_args(args, model.config)
    text = (paths.data_dir() / "speed-bench" / "promessi_sposi.txt").read_text(encoding="utf-8")[:1000]
    tokens = model.tokenizer.encode(text)[:max(FRONTS)]
    session = RecordingSession(open_bench_session(model, max(FRONTS) + GEN + 1, "cpu", 16, hooks))
    sweep(session, tokens, FRONTS, GEN, model.tokenizer.eos_id)
    assert len(session.decoded) == GEN * len(FRONTS)
    return session.decoded


def test_zero_scale_keeps_probe_tokens_and_nonzero_changes_them(tiny_model, direction):
    base = probe_tokens(tiny_model)
    f = str(direction)
    assert probe_tokens(tiny_model, "--dir-steering-file", f, "--dir-steering-ffn", "0") == base
    assert probe_tokens(tiny_model, "--dir-steering-file", f, "--dir-steering-ffn", "0",
                        "--dir-steering-attn", "0") == base
    steered = probe_tokens(tiny_model, "--dir-steering-file", f, "--dir-steering-ffn", "-30",
                           "--dir-steering-attn", "-30")
    assert steered != base
    # the steering and the --power throttle share the session's hooks: both stay in effect
    try:
        th = power.install(50)
        assert probe_tokens(tiny_model, "--dir-steering-file", f, "--dir-steering-ffn", "-30",
                            "--dir-steering-attn", "-30") == steered
        assert th.busy_s > 0 and th.slept_s > 0
    finally:
        power.install(None)


def bench_cli(*args):
    return subprocess.run([sys.executable, "-m", "ds4.speed_bench.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


RUN = ("--backend", "cpu", "--ctx-start", 16, "--ctx-max", 40, "--step-incr", 24, "--gen-tokens", 2,
       "--prefill-chunk", 16, "--no-warmup")


def test_bench_accepts_steering_flags_and_records_them(tiny_gguf, direction, tmp_path):
    out = tmp_path / "steered.csv"
    r = bench_cli("-m", tiny_gguf, *RUN, "--dir-steering-file", direction, "--dir-steering-ffn", -5,
                  "--dir-steering-attn", 2, "--csv", out)
    assert r.returncode == 0, r.stderr
    run = read_csv(out)
    assert [row.ctx_tokens for row in run.rows] == [16, 40]
    assert str(direction) in run.meta["steering"] and "-5" in run.meta["steering"]
    r = bench_cli("-m", tiny_gguf, *RUN, "--csv", tmp_path / "plain.csv")
    assert r.returncode == 0 and "steering" not in read_csv(tmp_path / "plain.csv").meta


def test_bench_steering_user_errors(tiny_gguf, direction, tmp_path):
    for extra, needle in (((("--dir-steering-file", tmp_path / "nope.f32"),), "nope.f32"),
                          ((("--dir-steering-ffn", 1),), "--dir-steering-file"),
                          ((("--dir-steering-file", direction, "--dir-steering-ffn", 500),), "scale")):
        r = bench_cli("-m", tiny_gguf, *RUN, *extra[0])
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    short = tmp_path / "short.f32"
    np.zeros(7, np.float32).tofile(short)
    r = bench_cli("-m", tiny_gguf, *RUN, "--dir-steering-file", short)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
