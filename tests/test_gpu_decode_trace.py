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


def test_frontier_advance_credits_the_kernels_that_end_last_and_sums_to_the_span():
    step = _step(0.0, 2)
    rows = {n: (c, a, d) for n, c, a, d in dt.frontier_advance(step)}
    assert sum(a for _, a, _ in rows.values()) == dt.summarize(step)["span_us"]
    # layer 0: hc 0-10 (+10), the side kernel 12-16 (+6), the matvec 11-23 (+7), hc 24-34 (+11), router 35-40 (+6);
    # layer 1 the same 41 us later, the 1 us gap before it credited to its first hc (+11); the head 82-212 (+1 + 130)
    assert rows["compress_step_kernel"] == (2, 12.0, 8.0)
    assert rows["router_kernel"] == (2, 12.0, 10.0)
    assert rows["hc_mix_pre_kernel"] == (4, 10.0 + 11.0 + 11.0 + 11.0, 40.0)
    assert rows["matvec_stream_kernel"] == (3, 7.0 + 7.0 + 131.0, 154.0)
    assert dt.frontier_advance(step)[0][0] == "matvec_stream_kernel"


def test_a_kernel_ending_inside_a_longer_one_takes_the_time_up_to_its_end():
    """The attribution follows the order of ends: a side kernel that ends while a longer one runs takes the time up to
    its end, the longer one the rest; one that starts and ends inside an already advanced span takes nothing."""
    step = [_k("long", 0.0, 20.0), _k("inside", 5.0, 3.0, stream=9), _k("after", 21.0, 4.0),
            _k("late", 21.5, 1.0, stream=9), _k("nested", 22.0, 1.0, stream=11)]
    rows = {n: a for n, _, a, _ in dt.frontier_advance(step)}
    assert rows == {"inside": 8.0, "long": 12.0, "late": 2.5, "nested": 0.5, "after": 2.0}


def test_chain_bound_adds_the_latency_bound_share_to_the_floor():
    rows = dt.frontier_advance(_step(0.0, 2))
    # the made-up step: hc_mix_pre 43 and compress_step 12 are latency-bound; the matvecs 145 and router 12 stream
    b = dt.chain_bound(rows, floor_us=100.0)
    assert b["latency_us"] == 43.0 + 12.0
    assert b["weights_us"] == 145.0 + 12.0
    assert b["bound_us"] == 155.0
    assert b["weights_of_copy"] == 100.0 / 157.0
    assert b["latency_us"] + b["weights_us"] == dt.summarize(_step(0.0, 2))["span_us"]


def test_the_decode_kernels_are_classified_by_what_bounds_them():
    for name in ("hc_cluster_kernel", "sinkhorn4_kernel", "attn_partial_kernel", "attn_combine_kernel",
                 "compress_step_kernel", "index_keys_v2_kernel", "topk_rows_kernel", "quantize_x_kernel",
                 "norm_rope_warp_kernel", "argmax_kernel", "embed_kernel",
                 "void at::native::vectorized_elementwise_kernel", "void at::native::index_elementwise_kernel"):
        assert dt.latency_bound(name), name
    for name in ("matvec_stream_kernel", "matvec_pair_kernel", "matvec_tma_kernel", "moe_gateup_rows_kernel",
                 "moe_down_kernel", "router_one_kernel", "some_new_kernel"):
        assert not dt.latency_bound(name), name
