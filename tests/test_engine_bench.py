"""`make bench-engine` (ds4.engine.bench) end to end on a fresh tiny checkpoint with tiny sizes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys


def test_bench_engine_runs_every_peer(tmp_path):
    peers = ["ours", "transformers"] + (["llama.cpp"] if importlib.util.find_spec("llama_cpp") else [])
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "-m", "ds4.engine.bench", "--presets", "tiny", "--peers", ",".join(peers),
                        "--prefill", "24", "--decode", "3", "--repeats", "1", "--threads", "2",
                        "--models-dir", str(tmp_path / "models"), "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = {row["peer"]: row for row in json.loads(out.read_text())}
    assert set(rows) == set(peers)
    for peer, row in rows.items():
        assert "error" not in row, row
        assert row["prefill_tps"] > 0 and row["decode_tps"] > 0 and row["peak_rss_mib"] > 10
        assert len(row["tokens"]) == 3
        # every peer runs the same model: the first greedy token after the prompt agrees
        assert row["tokens"][0] == rows["ours"]["tokens"][0], peer
    assert "| tiny | ours |" in r.stdout and "ours/peer decode" in r.stdout
    assert (tmp_path / "models" / "ds4-tiny.gguf").exists()


def test_bench_engine_bad_arguments():
    r = subprocess.run([sys.executable, "-m", "ds4.engine.bench", "--peers", "vllm"], capture_output=True, text=True)
    assert r.returncode == 2 and "vllm" in r.stderr
