"""trace_gaps: the device's idle gaps in a profiler trace, charged to the section that launched the work after
each gap. The hand-made trace below has its answers by construction; a real CPU-only profiler trace (no device
events) must give a clear error, not a traceback."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from ds4.engine.gpu import trace_gaps


def _ev(cat, name, ts, dur, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


# host: section "attend" [0, 100) launches kernel 1 from aten::mm at t=12 and kernel 2 from aten::softmax at 82;
# section "moe" [100, 150) launches kernel 3 from aten::bmm at 105, then the host syncs at 131 for 5 us.
# device: kernel 1 [20, 50), kernel 2 [90, 100), kernel 3 [110, 130).
TRACE = [
    _ev("user_annotation", "attend", 0, 100), _ev("user_annotation", "moe", 100, 50),
    _ev("cpu_op", "aten::mm", 10, 5), _ev("cuda_runtime", "cudaLaunchKernel", 12, 2, corr=1),
    _ev("cpu_op", "aten::softmax", 80, 5), _ev("cuda_runtime", "cudaLaunchKernel", 82, 2, corr=2),
    _ev("cpu_op", "aten::bmm", 103, 5), _ev("cuda_runtime", "cudaLaunchKernel", 105, 2, corr=3),
    _ev("cuda_runtime", "cudaStreamSynchronize", 131, 5, corr=4),
    _ev("kernel", "k1", 20, 30, corr=1), _ev("kernel", "k2", 90, 10, corr=2), _ev("kernel", "k3", 110, 20, corr=3),
]


def test_gaps_are_charged_to_the_launching_section_and_op():
    r = trace_gaps.analyse(TRACE)
    assert r["span_us"] == 130 and r["busy_us"] == 60 and r["idle_us"] == 70 and r["gaps"] == 3
    # gaps: [0, 20) and [50, 90) before attend's launches, [100, 110) before moe's
    assert r["idle_by_section"] == {"attend": 60, "moe": 10}
    assert r["idle_by_op"] == {"aten::softmax": 40, "aten::mm": 20, "aten::bmm": 10}
    assert r["host_by_section"] == {"attend": 100, "moe": 50}
    assert r["device_by_section"] == {"attend": 40, "moe": 20}
    assert r["syncs"] == 1 and r["sync_us"] == 5


def test_nested_sections_charge_the_inner_one():
    inner = _ev("user_annotation", "moe_gemm", 104, 4)
    r = trace_gaps.analyse(TRACE + [inner])
    assert r["idle_by_section"] == {"attend": 60, "moe_gemm": 10}


def test_cli_reads_a_gzipped_trace_and_rejects_a_trace_without_device_events(tmp_path):
    good = tmp_path / "t.json.gz"
    with gzip.open(good, "wt") as fh:
        json.dump({"traceEvents": TRACE}, fh)
    out = subprocess.run([sys.executable, "-m", "ds4.engine.gpu.trace_gaps", str(good)], capture_output=True, text=True)
    assert out.returncode == 0 and "attend" in out.stdout and "idle 0.1 ms" in out.stdout

    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8) @ torch.ones(8)
    cpu_only = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(cpu_only))
    out = subprocess.run([sys.executable, "-m", "ds4.engine.gpu.trace_gaps", str(cpu_only)], capture_output=True,
                         text=True)
    assert out.returncode == 2 and "no device events" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "bad.json").write_text("{not json")
    out = subprocess.run([sys.executable, "-m", "ds4.engine.gpu.trace_gaps", str(tmp_path / "bad.json")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr


def test_host_sync_sites_name_the_waiting_lines():
    """host_sync_sites on real CUDA work: an .item() and torch.bincount each make the host wait and are named by
    their line; moe_gemm.expert_counts, which replaced bincount in the routed experts' tile table, makes none."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    from ds4.engine.gpu.moe_gemm import expert_counts

    ids = torch.randint(0, 256, (4096, 6), device="cuda")
    item = trace_gaps.host_sync_sites(lambda: ids.sum().item())
    assert list(item) and all("ids.sum().item()" in site for site in item)
    counted = trace_gaps.host_sync_sites(lambda: torch.bincount(ids.reshape(-1), minlength=256))
    assert any("torch.bincount" in site for site in counted)
    assert trace_gaps.host_sync_sites(lambda: expert_counts(ids, 256)) == {}
    assert torch.equal(expert_counts(ids, 256), torch.bincount(ids.reshape(-1), minlength=256))
