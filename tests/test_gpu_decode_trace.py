"""decode_trace's analysis of a kernel list (no GPU needed: the functions take the profiler's events as dicts)."""

from __future__ import annotations

import ds4.engine.gpu.decode_trace as dt


def _k(name: str, ts: float, dur: float, stream: int = 7) -> dict:
    return {"name": name, "ts": ts, "dur": dur, "stream": stream}


def _step(t0: float, n_layer: int) -> list[dict]:
    """A made-up step: per layer mHC pre, a matvec beside a side-stream kernel, mHC pre, routing; then the head."""
    ks, t = [], t0
    for _ in range(n_layer):
        ks += [_k("hc_mix_pre_kernel", t, 10.0), _k("matvec_stream_kernel", t + 11.0, 12.0),
               _k("compress_step_kernel", t + 12.0, 4.0, stream=9), _k("hc_mix_pre_kernel", t + 24.0, 10.0),
               _k("router_kernel", t + 35.0, 5.0)]
        t += 41.0
    ks.append(_k("matvec_stream_kernel", t, 130.0))
    return ks


def test_steps_split_at_idle_gaps_and_spans_count_overlap_once():
    steps = dt.split_steps(_step(0.0, 3) + _step(1000.0, 3), gap_us=50.0)
    assert [len(s) for s in steps] == [16, 16]
    r = dt.summarize(steps[0])
    assert r["kernels"] == 16
    assert r["span_us"] == 3 * 41.0 + 130.0
    # per layer: busy 10 + 12 (the side kernel inside the matvec's time) + 10 + 5, idle 1 + 1 + 1 + 1 ... up to 41
    assert r["busy_us"] == 3 * 37.0 + 130.0
    assert r["idle_us"] == r["span_us"] - r["busy_us"]
    names = {n: (c, t) for n, c, t in r["by_name"]}
    assert names["hc_mix_pre_kernel"] == (6, 60.0) and names["matvec_stream_kernel"] == (4, 166.0)
    assert r["by_name"][0][0] == "matvec_stream_kernel"  # ordered by summed time


def test_layer_slice_runs_from_one_mark_to_the_next():
    step = _step(0.0, 4)
    lk = dt.layer_slice(step, n_layer=4, li=1)  # hc_mix_pre_kernel is the only kernel with 2 n_layer launches
    assert [k["ts"] for k in lk] == [41.0 + d for d in (0.0, 11.0, 12.0, 24.0, 35.0)]
    assert dt.layer_slice(step, n_layer=5, li=1) == []  # no kernel appears 2 n_layer times


def test_short_names_drop_namespaces_and_templates():
    assert dt._short("void ds4gpu::(anonymous namespace)::matvec_stream_kernel<1, 2, 4>(ds4gpu::MvArgs)") == \
        "void matvec_stream_kernel"
