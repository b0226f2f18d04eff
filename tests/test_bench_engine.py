"""ds4-bench on the tiny model (small ctx values), and `--power` on a real decode loop."""

import subprocess
import sys
import time

import numpy as np
import pytest

from ds4 import paths
from ds4.engine import power
from ds4.speed_bench.csvio import COLUMNS, read_csv


def bench_cli(*args):
    return subprocess.run([sys.executable, "-m", "ds4.speed_bench.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=600)


def test_sweep_csv_schema_and_monotone_frontiers(tiny_gguf, tmp_path):
    out = tmp_path / "tiny.csv"
    r = bench_cli("-m", tiny_gguf, "--backend", "cpu", "--ctx-start", 16, "--ctx-max", 70, "--step-incr", 24,
                  "--gen-tokens", 3, "--prefill-chunk", 16, "--csv", out, "--label", "tiny cpu")
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    header = [ln for ln in text.splitlines() if not ln.startswith("#")][0]
    assert header == ",".join(COLUMNS)
    run = read_csv(out)
    for key in ("model", "backend", "machine", "git", "gen_tokens"):
        assert run.meta.get(key), key
    assert run.meta["backend"] == "cpu" and run.label == "tiny cpu"
    ctx = [row.ctx_tokens for row in run.rows]
    assert ctx == [16, 40, 64, 70]  # linear steps, ctx-max always last (tooling-spec §6.2)
    assert [row.prefill_tokens for row in run.rows] == [16, 24, 24, 6]  # only the new interval
    assert all(row.gen_tokens == 3 and row.prefill_tps > 0 and row.gen_tps > 0 for row in run.rows)
    kv = [row.kvcache_bytes for row in run.rows]
    assert all(b > a for a, b in zip(kv, kv[1:])), kv  # snapshot grows with the frontier
    # the snapshot is the DSV4 payload: its size at a frontier matches a fresh session's snapshot
    from ds4.engine.model import Model
    from ds4.engine.session import Session
    m = Model.load(tiny_gguf)
    tokens = m.tokenizer.encode((paths.data_dir() / "speed-bench" / "promessi_sposi.txt").read_text()[:2000])
    s = Session(m, ctx=70 + 3 + 1, prefill_chunk=16)
    s.sync(tokens[:40])
    assert len(s.snapshot()) == kv[1]
    # the chart of this run is a valid SVG
    r = bench_cli("plot", out, "-o", tmp_path / "tiny.svg")
    assert r.returncode == 0 and (tmp_path / "tiny.svg").read_text().lstrip().startswith("<?xml")


def test_sweep_header_has_weight_bytes_per_token(tiny_gguf, tmp_path):
    """The decode floor's numerator in the header, checked against gguf-py's own tensor sizes."""
    from gguf import GGUFReader

    from ds4.engine.model import Model

    out = tmp_path / "floor.csv"
    r = bench_cli("-m", tiny_gguf, "--backend", "cpu", "--ctx-start", 16, "--ctx-max", 16, "--gen-tokens", 2,
                  "--no-warmup", "--csv", out)
    assert r.returncode == 0, r.stderr
    cfg = Model.load(tiny_gguf).config
    expect = 0.0
    for t in GGUFReader(str(tiny_gguf)).tensors:
        if t.name == "token_embd.weight":
            expect += int(t.n_bytes) / cfg.vocab_size
        elif "_exps." in t.name:
            expect += int(t.n_bytes) * cfg.n_expert_used / cfg.n_expert
        elif "tid2eid" not in t.name:
            expect += int(t.n_bytes)
    assert int(read_csv(out).meta["weight_bytes_per_token"]) == int(expect)
    assert "floor_ms" not in read_csv(out).meta  # no bandwidth is measured on the CPU backend
    assert "gpu_mem_used_gib" not in read_csv(out).meta


def test_bench_user_errors(tiny_gguf, tmp_path):
    r = bench_cli("-m", tiny_gguf, "--ctx-start", 64, "--ctx-max", 32)
    assert r.returncode == 2 and "--ctx-start" in r.stderr and "Traceback" not in r.stderr
    r = bench_cli("-m", tiny_gguf, "--ctx-start", 8, "--ctx-max", 100, "--prompt-file", tmp_path / "missing.txt")
    assert r.returncode == 2 and "missing.txt" in r.stderr and r.stderr.count("\n") == 1
    (tmp_path / "short.txt").write_text("too short")
    r = bench_cli("-m", tiny_gguf, "--ctx-start", 8, "--ctx-max", 100, "--prompt-file", tmp_path / "short.txt")
    assert r.returncode == 2 and "fewer than --ctx-max" in r.stderr
    r = bench_cli("-m", tiny_gguf, "--power", 0)
    assert r.returncode == 2 and "--power" in r.stderr


def _greedy(model, prompt, n):
    from ds4.test_vectors.runtime import open_session
    s = open_session(model, 64)
    logits = s.sync(prompt)
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        logits = s.decode(t)
        power.step()  # between tokens, as the tools do
    return out


def test_power_halves_busy_fraction_and_keeps_output(tiny_gguf):
    from ds4.engine.model import Model
    m = Model.load(tiny_gguf)
    prompt = m.tokenizer.encode("La nebbia agli irti colli piovigginando sale")
    try:
        power.install(None)
        _greedy(m, prompt, 2)  # warm caches / JIT outside the measurement
        t0, c0 = time.perf_counter(), time.process_time()
        ref = _greedy(m, prompt, 8)
        wall_full, cpu_full = time.perf_counter() - t0, time.process_time() - c0
        th = power.install(50)
        t0, c0 = time.perf_counter(), time.process_time()
        got = _greedy(m, prompt, 8)
        wall_half, cpu_half = time.perf_counter() - t0, time.process_time() - c0
    finally:
        power.install(None)
    assert got == ref  # throttling never changes the numbers
    # the throttle's own accounting: busy ≈ 50% of its measured time (sleeps between layers/tokens)
    assert 0.4 < th.busy_fraction < 0.6, (th.busy_s, th.slept_s)
    # and from outside: the CPU-busy share of wall time drops to about half (loose bound: other
    # processes share this machine, so only the ratio within one run is compared)
    ratio = (cpu_half / wall_half) / (cpu_full / wall_full)
    assert 0.25 < ratio < 0.8, (cpu_full, wall_full, cpu_half, wall_half)


def test_power_throttle_unit():
    th = power.PowerThrottle(25)
    for _ in range(5):
        t = time.perf_counter()
        while time.perf_counter() - t < 0.01:
            pass
        th.step()
    assert 0.15 < th.busy_fraction < 0.35
    with pytest.raises(ValueError):
        power.PowerThrottle(0)
