"""ds4-bench CSV, frontier schedule, charts and comparisons (no engine needed)."""

import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from ds4.speed_bench.csvio import COLUMNS, BenchCsvError, BenchRow, BenchRun, read_csv, write_csv
from ds4.speed_bench.frontier import argmax_excluding, frontiers
from ds4.speed_bench.plot import compare_runs, format_comparison, title_from_name


def _run(scale=1.0, label=None, ctxs=(2048, 4096, 6144)):
    rows = [BenchRow(c, c if i == 0 else 2048, 1000.0 * scale / (1 + i), 128, 50.0 * scale / (1 + i),
                     52184460 + 28188672 * i) for i, c in enumerate(ctxs)]
    meta = {"model": "models/ds4-small.gguf", "backend": "cpu", "machine": "test", "git": "abc123"}
    if label:
        meta["label"] = label
    return BenchRun(meta=meta, rows=rows)


def test_frontier_schedule():
    # linear: ctx_max is always the last row, even off-grid (tooling-spec §6.2)
    assert list(frontiers(2048, 8192, 2048)) == [2048, 4096, 6144, 8192]
    assert list(frontiers(2048, 7000, 2048)) == [2048, 4096, 6144, 7000]
    assert list(frontiers(16, 16, 8)) == [16]
    # exponential: max(ceil(f*mul), f+1), clamped
    assert list(frontiers(1000, 5000, 1, 2.0)) == [1000, 2000, 4000, 5000]
    assert list(frontiers(3, 8, 1, 1.1)) == [3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError):
        list(frontiers(0, 10, 1))


def test_argmax_excluding_eos():
    import numpy as np
    x = np.array([0.1, 5.0, 3.0, 5.0])
    assert argmax_excluding(x, 1) == 3 and argmax_excluding(x, 0) == 1 and argmax_excluding(x, None) == 1


def test_csv_round_trip_and_header(tmp_path):
    run = _run()
    write_csv(tmp_path / "r.csv", run)
    text = (tmp_path / "r.csv").read_text()
    lines = text.splitlines()
    assert lines[0] == "# ds4-bench v1"
    assert [ln for ln in lines if not ln.startswith("#")][0] == ",".join(COLUMNS)
    assert "2048,2048,1000.00,128,50.00,52184460" in lines  # %d,%d,%.2f,%d,%.2f,%llu
    back = read_csv(tmp_path / "r.csv")
    assert back.meta == run.meta
    for got, want in zip(back.rows, run.rows, strict=True):  # t/s are written with 2 decimals
        assert (got.ctx_tokens, got.prefill_tokens, got.gen_tokens, got.kvcache_bytes) == \
            (want.ctx_tokens, want.prefill_tokens, want.gen_tokens, want.kvcache_bytes)
        assert got.prefill_tps == pytest.approx(want.prefill_tps, abs=0.005)
        assert got.gen_tps == pytest.approx(want.gen_tps, abs=0.005)
    assert write_csv(tmp_path / "r2.csv", back) is None and (tmp_path / "r2.csv").read_text() == text


def test_csv_reads_upstream_style_with_bom_and_rejects_garbage(tmp_path):
    p = tmp_path / "m4_max.csv"
    p.write_bytes("\ufeffctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes\n"
                  "2048,2048,300.5,128,30.25,52184460\n4096,2048,280.00,128,29.00,80373132\n".encode())
    run = read_csv(p)
    assert [r.ctx_tokens for r in run.rows] == [2048, 4096] and run.meta == {} and run.label == "m4_max"
    p.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(BenchCsvError, match="missing columns"):
        read_csv(p)
    p.write_text(",".join(COLUMNS) + "\n2048,x,1,1,1,1\n")
    with pytest.raises(BenchCsvError, match="malformed row"):
        read_csv(p)


def test_plot_svg_and_png(tmp_path):
    a, b = tmp_path / "cpu_run.csv", tmp_path / "gpu_run.csv"
    write_csv(a, _run(1.0, "cpu"))
    write_csv(b, _run(3.0, "cuda"))
    cli = [sys.executable, "-m", "ds4.speed_bench.cli", "plot"]
    r = subprocess.run(cli + [str(a), str(b), "-o", str(tmp_path / "both.svg")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    root = ET.parse(tmp_path / "both.svg").getroot()  # well-formed XML
    assert root.tag.endswith("svg")
    svg = (tmp_path / "both.svg").read_text()
    assert "cpu" in svg and "cuda" in svg and "prefill" in svg and "generation" in svg  # legends + axes
    r = subprocess.run(cli + [str(a), "-o", str(tmp_path / "one.png")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "one.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # default output name beside the CSV
    r = subprocess.run(cli + [str(a)], capture_output=True, text=True)
    assert r.returncode == 0 and (tmp_path / "cpu_run_ts.svg").exists()
    r = subprocess.run(cli + [str(tmp_path / "missing.csv")], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert title_from_name("m2_ultra") == "M2 Ultra t/s"


def test_compare_ratios(tmp_path):
    a, b = _run(1.0, "base"), _run(2.0, "fast", ctxs=(2048, 4096, 8192))
    rows = compare_runs(a, b)
    assert [r.ctx_tokens for r in rows] == [2048, 4096]  # only shared frontiers
    assert all(r.prefill_ratio == pytest.approx(2.0) and r.gen_ratio == pytest.approx(2.0) for r in rows)
    md = format_comparison(a, b, rows, markdown=True)
    assert "| 2048 |" in md and "| geomean |" in md and "2.000" in md
    write_csv(tmp_path / "a.csv", a)
    write_csv(tmp_path / "b.csv", b)
    r = subprocess.run([sys.executable, "-m", "ds4.speed_bench.cli", "compare", str(tmp_path / "a.csv"),
                        str(tmp_path / "b.csv")], capture_output=True, text=True)
    assert r.returncode == 0 and "geomean" in r.stdout, r.stderr
