"""`ds4-dist` as a real subprocess: generation, the bench with its JSON, the combine bench, user errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from conftest import quantize_cli  # noqa: E402


def ds4_dist(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds4.engine.dist.launch", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def small_f16(tmp_path_factory):
    out = tmp_path_factory.mktemp("distcli") / "small.gguf"
    quantize_cli("synth", "--preset", "small", "--gguf", str(out), "--mix", "none", "--type", "f16", "--quiet")
    return out


def test_bench_writes_figures_and_ranks_agree(small_f16, tmp_path):
    out = tmp_path / "bench.json"
    res = ds4_dist("-m", str(small_f16), "--nproc", "2", "--bench", "--prompt-tokens", "12", "-n", "2", "--ctx", "64",
                   "--json", str(out))
    assert res.returncode == 0, res.stderr
    r = json.loads(out.read_text())
    assert r["world"] == 2 and r["consistent"] is True
    assert r["prefill_tps"] > 0 and r["decode_tps"] > 0
    assert r["comm_decode"]["calls"] == 8 * 2  # one combine per layer per decoded token
    assert r["comm_decode"]["payload"] == 8 * 2 * 512 * 4
    assert [s["experts"] for s in r["stats"]] == [[0, 16], [16, 32]]
    assert "ranks consistent: True" in res.stdout and "floor" in res.stdout


@pytest.mark.slow
def test_generate_prints_rank0_text(small_f16):
    res = ds4_dist("-m", str(small_f16), "--nproc", "2", "-p", "Hello", "--raw", "-n", "2", "--ctx", "64")
    assert res.returncode == 0, res.stderr
    assert "2 ranks" in res.stderr and "2 generated" in res.stderr
    assert res.stdout.count("\n") >= 1


def test_comm_bench_table():
    res = ds4_dist("--bench-comm", "--nproc", "2", "--comm-rows", "1,16", "--comm-dims", "256", "--iters", "3")
    assert res.returncode == 0, res.stderr
    rows = [line.split() for line in res.stdout.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("256", "1"), ("256", "16")]
    assert all(r[-1] in ("allreduce", "rs_ag", "allgather") for r in rows)


@pytest.mark.parametrize("args,msg", [
    (["-m", "/nonexistent.gguf", "-p", "x"], "no such file"),
    (["--bench"], "a model is required"),
    (["--bench-comm", "--comm-rows", "1,x"], "--comm-rows"),
    (["--nproc", "2", "--device", "cuda", "--bench-comm"], "CUDA devices"),
])
def test_user_errors_are_one_line(args, msg):
    res = ds4_dist(*args)
    assert res.returncode == 2 and msg in res.stderr and "Traceback" not in res.stderr
