"""Where the GPU waits for the host: idle gaps in a torch-profiler chrome trace, attributed to the code
that launched the work after each gap.

A prefill is a long stream of torch launches. Where the host issues them more slowly than the device runs
them, or blocks on a sync, the device idles; the wall time then exceeds the summed kernel time. This reads
the trace the profiler exports (CPU and CUDA activities) and reports:
- span (first host op to last device event), device busy time (union of kernels, copies and fills), idle;
- idle per section: each gap is charged to the innermost `record_function` label (cat user_annotation) that
  was open when the host launched the first work after the gap, and to the aten op that launched it;
- per section, host time (the label's own duration) and device time (the work it launched);
- host syncs (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, device-to-host copies).

`python -m ds4.engine.gpu.trace_gaps TRACE.json[.gz]` prints the report; bench_session --gaps makes a
trace of one prefill and prints it, and with `host_sync_sites` the lines of our code that made the host wait.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
SCAN_BACK = 4096  # intervals searched back from a time for one that contains it
MIN_GAP_US = 2.0  # shorter gaps are the device's own launch spacing, not the host's doing


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        data = json.load(fh)
    return [e for e in data.get("traceEvents", data if isinstance(data, list) else []) if e.get("ph") == "X"]


class Spans:
    """Host intervals of one category, searchable for the innermost one open at a time."""

    def __init__(self, events: list[dict]):
        self.ev = sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0)))
        self.starts = [e["ts"] for e in self.ev]

    def innermost(self, t: float) -> str | None:
        """Name of the latest-starting interval that contains t (nested labels: the inner one)."""
        i = bisect.bisect_right(self.starts, t) - 1
        for j in range(i, max(-1, i - SCAN_BACK), -1):  # finished siblings lie between t and the parent
            e = self.ev[j]
            if e["ts"] + e.get("dur", 0) >= t:
                return e["name"]
        return None


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def analyse(events: list[dict]) -> dict:
    dev = [e for e in events if e.get("cat") in DEVICE_CATS]
    if not dev:
        raise ValueError("the trace has no device events (profile with ProfilerActivity.CUDA)")
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    labels = Spans([e for e in events if e.get("cat") == "user_annotation"])
    ops = Spans([e for e in events if e.get("cat") == "cpu_op"])
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    dev.sort(key=lambda e: e["ts"])
    busy = _union([(e["ts"], e["ts"] + e.get("dur", 0)) for e in dev])
    t_first = min([e["ts"] for e in host] + [busy[0][0]])
    span = busy[-1][1] - t_first
    busy_us = sum(b - a for a, b in busy)
    starts = [e["ts"] for e in dev]
    idle_by_label: dict[str, float] = defaultdict(float)
    idle_by_op: dict[str, float] = defaultdict(float)
    prev_end = t_first
    gaps = []
    for a, b in busy:
        gap = a - prev_end
        if gap >= MIN_GAP_US:
            first = dev[bisect.bisect_left(starts, a)]
            launch = runtime.get(first.get("args", {}).get("correlation"))
            t = launch["ts"] if launch else a
            idle_by_label[labels.innermost(t) or "(no section)"] += gap
            idle_by_op[ops.innermost(t) or "(no op)"] += gap
            gaps.append(gap)
        prev_end = b
    # device time per section: each device event charged to the label open at its launch
    dev_by_label: dict[str, float] = defaultdict(float)
    for e in dev:
        launch = runtime.get(e.get("args", {}).get("correlation"))
        dev_by_label[(labels.innermost(launch["ts"]) if launch else None) or "(no section)"] += e.get("dur", 0)
    host_by_label: dict[str, float] = defaultdict(float)
    for e in labels.ev:
        host_by_label[e["name"]] += e.get("dur", 0)
    syncs = [e for e in runtime.values() if e["name"].startswith(SYNC_CALLS)
             or (e["name"].startswith("cudaMemcpy") and "DtoH" in json.dumps(e.get("args", {})))]
    return {"span_us": span, "busy_us": busy_us, "idle_us": span - busy_us, "gaps": len(gaps),
            "idle_by_section": dict(sorted(idle_by_label.items(), key=lambda kv: -kv[1])),
            "idle_by_op": dict(sorted(idle_by_op.items(), key=lambda kv: -kv[1])[:15]),
            "host_by_section": dict(host_by_label), "device_by_section": dict(dev_by_label),
            "syncs": len(syncs), "sync_us": sum(e.get("dur", 0) for e in syncs),
            "device_events": len(dev)}


def host_sync_sites(fn) -> dict[str, int]:
    """Run fn with torch's CUDA sync debug mode on and count, per calling line, the operations that made the host
    wait for the device (an .item(), a device-to-host copy, torch.bincount's size read...). A site is the innermost
    frame outside torch, as "file:line code". The trace shows that the host waited; this says which line did."""
    import os
    import traceback
    import warnings

    import torch

    torch_dir = os.path.dirname(torch.__file__)
    sites: dict[str, int] = defaultdict(int)

    def record(message, category, filename, lineno, file=None, line=None):
        here = [f for f in traceback.extract_stack()[:-1]
                if not f.filename.startswith(torch_dir) and f.filename not in (__file__, warnings.__file__)]
        f = here[-1] if here else None
        if f is None:
            site = f"{filename}:{lineno}"
        else:
            site = f"{os.path.basename(f.filename)}:{f.lineno} {(f.line or '').strip()[:90]}"
        sites[site] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(sites)


def report_sync_sites(sites: dict[str, int], out=sys.stdout) -> None:
    print(f"host syncs by calling line ({sum(sites.values())} in all):", file=out)
    for site, n in sorted(sites.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}x  {site}", file=out)


def report(r: dict, out=sys.stdout) -> None:
    ms = 1e-3
    print(f"span {r['span_us'] * ms:.1f} ms, device busy {r['busy_us'] * ms:.1f} ms, idle {r['idle_us'] * ms:.1f} ms "
          f"in {r['gaps']} gaps; {r['device_events']} device events; {r['syncs']} host syncs "
          f"({r['sync_us'] * ms:.1f} ms)", file=out)
    names = sorted(set(r["idle_by_section"]) | set(r["host_by_section"]) | set(r["device_by_section"]),
                   key=lambda n: -r["idle_by_section"].get(n, 0.0))
    print(f"{'section':<16}{'idle ms':>10}{'host ms':>10}{'device ms':>11}", file=out)
    for n in names:
        print(f"{n[:16]:<16}{r['idle_by_section'].get(n, 0) * ms:>10.1f}{r['host_by_section'].get(n, 0) * ms:>10.1f}"
              f"{r['device_by_section'].get(n, 0) * ms:>11.1f}", file=out)
    print("idle by the op that launched the work after the gap:", file=out)
    for n, v in r["idle_by_op"].items():
        print(f"  {v * ms:8.1f} ms  {n[:70]}", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds4.engine.gpu.trace_gaps",
                                 description="Idle gaps of the device in a torch-profiler chrome trace, by section.")
    ap.add_argument("trace", help="chrome trace JSON from torch.profiler (optionally .gz), with CPU and CUDA events")
    args = ap.parse_args(argv)
    try:
        r = analyse(load(args.trace))
    except (OSError, ValueError, KeyError) as e:
        print(f"trace_gaps: cannot read {args.trace}: {e}", file=sys.stderr)
        return 2
    report(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
