"""ncu_source: the summary of Nsight Compute's source page, read from a CSV in the layout ncu writes (its first rows
copied from a real export: the profiler's log lines, the kernel name row, then the per-SASS table)."""

import subprocess
import sys

import pytest

from ds4.engine.gpu.ncu_source import summarize

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"# Samples","Instructions Executed","stall_barrier","stall_no_inst","stall_short_sb"')


def _csv(tmp_path, rows):
    lines = ["==PROF== Connected to process 1", '"Kernel Name","void k(int)",', HEADER]
    lines += [",".join(f'"{c}"' for c in r) for r in rows]
    lines.append("==PROF== Disconnected from process 1")
    p = tmp_path / "src.csv"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_summary_ranks_instructions_and_sums_the_stall_reasons(tmp_path):
    rows = [("0x00", "S2R R0, SR_TID.X", "10", "5", "10", "1,000", "0", "10", "0"),
            ("0x10", "BAR.SYNC.DEFER_BLOCKING 0x0", "60", "40", "60", "1,000", "50", "0", "10"),
            ("0x20", "HMMA.16816.F32.BF16 R0, R4, R8, R0", "30", "20", "30", "2,000", "0", "5", "25")]
    out = summarize(str(_csv(tmp_path, rows)), top=2).splitlines()
    assert out[0] == "3 SASS lines, 100 samples, 4e+03 warp instructions"
    assert out[1] == "stalls: stall_barrier 50.0%, stall_short_sb 35.0%, stall_no_inst 15.0%"
    assert out[2].split()[:2] == ["1", "60.0%"] and "BAR.SYNC" in out[2] and "barrier=50" in out[2]
    assert out[3].split()[:2] == ["2", "30.0%"] and "(cum  90.0%)" in out[3] and "short_sb=25" in out[3]
    assert len(out) == 4


def test_a_file_without_the_source_table_is_one_line_and_exit_1(tmp_path):
    p = tmp_path / "details.csv"
    p.write_text('"ID","Kernel Name","Metric Name","Metric Value"\n"0","k","Duration","1.0"\n')
    with pytest.raises(ValueError, match="no source table"):
        summarize(str(p), 5)
    r = subprocess.run([sys.executable, "-m", "ds4.engine.gpu.ncu_source", str(p)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "no source table" in r.stderr
