"""Benchmark of the CUDA engine session on a GGUF: prefill and decode t/s, and the bandwidth floor.

    python -m ds4.engine.gpu.bench_session MODEL.gguf --ctx 2048 8192 32768 --decode 64 --json out.json

Weights are uploaded once and shared by one session per context size. Decode at context P runs
in a session built for P + decode tokens whose timeline is fast-forwarded to P positions (the
decode graph has static shapes over the whole context buffer, so its cost depends on the
session's context, not on the values in the state). Prefill is timed on a real prompt of
--prefill tokens. The floor is the weight bytes one decoded token reads (every non-expert matrix,
k of E experts per layer, one embedding row) over the device-to-device copy bandwidth measured in
the same run (model-spec §8.2-8.4).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch


def profile_kernels(fn, top: int = 40, trace: str | None = None, ops: bool = False) -> dict:
    """CUDA kernels fn() launches (profiled with CUPTI), their summed device time and the kernels
    that take the most time; trace: also write a chrome trace (launch order, grids, durations);
    ops: also the torch operators (with input shapes) by device time, as a table."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if ops else [])
    with profile(activities=acts, record_shapes=ops) as prof:
        fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        name = e.name
        if e.device_type != torch.autograd.DeviceType.CUDA or "memcpy" in name.lower() or "memset" in name.lower():
            continue
        short = name.replace("(anonymous namespace)::", "").replace("<unnamed>::", "").split("(")[0].split("<")[0]
        row = by_name.setdefault(short[:70], [0, 0.0])
        row[0] += 1
        row[1] += e.time_range.elapsed_us()
    if trace:
        prof.export_chrome_trace(trace)
    n = sum(v[0] for v in by_name.values())
    busy = sum(v[1] for v in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    out = {"kernels": n, "kernel_us": busy, "top": [{"name": k, "count": v[0], "us": v[1]} for k, v in ranked]}
    if ops:
        out["ops_table"] = prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=40, max_shapes_column_width=70)
    return out


def count_kernels(model, W, ctx: int, top: int = 40, trace: str | None = None) -> dict:
    """The kernels of one decode step (an eager step; a graph replays the same ones)."""
    from ds4.engine.gpu.session import Session

    s = Session(model, ctx=ctx, weights=W, graphs=False)
    s.sync([5, 6, 7, 8])
    s.decode(9)
    return profile_kernels(lambda: s.decode(10), top, trace)


def prefill_gaps(model, W, n: int, chunk: int, rng, keep: str | None) -> dict:
    """Trace one prefill of n tokens (after a warm-up of the same length) with host and device activities and
    report where the device waited for the host (trace_gaps)."""
    import gzip
    import shutil
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from ds4.engine.gpu import trace_gaps
    from ds4.engine.gpu.session import Session

    s = Session(model, ctx=n + 8, weights=W, prefill_chunk=chunk)
    toks = rng.integers(2, model.config.vocab_size, n).tolist()
    s.sync(toks)
    s.invalidate()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.time()
        s.sync(toks)
        torch.cuda.synchronize()
        dt = time.time() - t
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/prefill.json"
        prof.export_chrome_trace(path)
        r = trace_gaps.analyse(trace_gaps.load(path))
        if keep:
            with open(path, "rb") as src, (gzip.open if keep.endswith(".gz") else open)(keep, "wb") as dst:
                shutil.copyfileobj(src, dst)
    print(f"prefill {n} under the profiler (after a warm-up of the same length): {dt:.2f} s", flush=True)
    trace_gaps.report(r)
    r["wall_s"] = dt

    def again():
        s.invalidate()
        s.sync(toks)

    r["sync_sites"] = trace_gaps.host_sync_sites(again)
    trace_gaps.report_sync_sites(r["sync_sites"])
    return r


def _print_profile(title: str, prof: dict) -> None:
    print(f"{title}: {prof['kernels']} kernels, summed kernel time {prof['kernel_us'] / 1e3:.2f} ms", flush=True)
    for row in prof["top"]:
        print(f"  {row['us']:9.1f} us {row['count']:5d}x  {row['name']}", flush=True)


def allocator_counts() -> dict:
    """torch's caching-allocator counters: a retry frees the cache and synchronizes the device, and
    cudaMalloc/cudaFree of large blocks stall the launch queue, so prefill time depends on them."""
    st = torch.cuda.memory_stats()
    return {k: int(st.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, nargs="*", default=[2048, 8192], help="decode contexts (none: no decode)")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--decode-capacity", type=int, default=0, metavar="N",
                    help="decode in sessions of context N (ds4-bench's is ctx-max + gen + 1) instead of P + decode + "
                         "8: the graph is sized for the whole context, so this shows what a large --ctx costs")
    ap.add_argument("--prefill", type=int, nargs="*", default=[2048])
    ap.add_argument("--json")
    ap.add_argument("--count-kernels", action="store_true", help="profile one eager decode step: kernels per token")
    ap.add_argument("--trace", help="with --count-kernels: write the step's chrome trace (kernel order, grids) here")
    ap.add_argument("--prefill-runs", type=int, default=1, metavar="R",
                    help="timed prefills per length, each of a new random prompt (the table reports the first; "
                         "later runs are printed too)")
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="tokens per prefill chunk (the session default)")
    ap.add_argument("--profile-prefill", type=int, default=0, metavar="N",
                    help="also profile the kernels of one prefill of N tokens")
    ap.add_argument("--profile-from", type=int, default=0, metavar="P",
                    help="with --profile-prefill: prefill P tokens first, unprofiled, and profile only the extension "
                         "to N (ds4-bench's 8k row is the 6144 tokens from 2048)")
    ap.add_argument("--profile-top", type=int, default=40, metavar="K",
                    help="with --profile-prefill: rows of the kernel and operator tables (default 40)")
    ap.add_argument("--gaps", type=int, default=0, metavar="N",
                    help="also trace one prefill of N tokens (host and device) and print where the device idles"
                         " and which lines made the host wait")
    ap.add_argument("--gaps-trace", help="with --gaps: keep that chrome trace here (gzip if it ends in .gz)")
    args = ap.parse_args(argv)
    if args.decode_capacity < 0:
        print("bench_session: --decode-capacity must be >= 0", file=sys.stderr)
        return 2
    if args.profile_prefill and not 0 <= args.profile_from < args.profile_prefill:
        print("bench_session: --profile-from must be in 0..N-1 for --profile-prefill N", file=sys.stderr)
        return 2
    if not 1 <= args.profile_top <= 1000:
        print("bench_session: --profile-top must be in 1..1000", file=sys.stderr)
        return 2

    from ds4.engine import gpu
    from ds4.engine.gpu import moe_gemm
    from ds4.engine.gpu.session import Session
    from ds4.engine.gpu.weights import Weights
    from ds4.engine.model import Model, decode_weight_bytes

    ext = gpu.load()
    t0 = time.time()
    model = Model.load(args.model)
    cfg = model.config
    dev = torch.device("cuda")
    W = Weights(model, dev)
    first = Session(model, ctx=64, weights=W)
    torch.cuda.synchronize()
    upload_s = time.time() - t0
    bw = ext.copy_bandwidth()["gbps"]
    wbytes = int(sum(decode_weight_bytes(model.file, cfg).values()))
    floor_ms = wbytes / (bw * 1e9) * 1e3
    res = {"model": args.model, "device": ext.device_info()["name"], "upload_s": upload_s,
           "copy_gbps": bw, "weight_bytes_per_token": wbytes, "floor_ms": floor_ms,
           "floor_tps": 1e3 / floor_ms, "weights_gpu_bytes": W.nbytes(), "prefill": [], "decode": []}
    print(f"upload {upload_s:.1f} s; copy {bw:.0f} GB/s; weights/token {wbytes / 1e9:.3f} GB; "
          f"floor {floor_ms:.3f} ms ({1e3 / floor_ms:.0f} t/s)", flush=True)
    del first
    rng = np.random.default_rng(0)
    for n in args.prefill:
        s = Session(model, ctx=n + 8, weights=W, prefill_chunk=args.prefill_chunk)
        toks = rng.integers(2, cfg.vocab_size, n).tolist()
        s.sync(toks[:min(n, 512)])  # warm-up (allocator, cuBLAS, the GEMM and matvec paths)
        torch.cuda.reset_peak_memory_stats()
        runs = []
        for i in range(args.prefill_runs):  # the first run of a length also pays its shapes' first calls
            if i:  # a new prompt: other routing, so other expert-bucket shapes (as a server's next request)
                toks = rng.integers(2, cfg.vocab_size, n).tolist()
            s.invalidate()
            torch.cuda.synchronize()
            before = allocator_counts()
            t = time.time()
            s.sync(toks)
            torch.cuda.synchronize()
            runs.append(time.time() - t)
        dt = runs[0]
        alloc = {k: v - before[k] for k, v in allocator_counts().items()}
        fill = moe_gemm.TILE_FILL
        if fill["slots"]:  # the routed experts' tiles so far in this process: the share of rows that are padding
            print(f"routed-expert tiles: {fill['rows']} rows in {fill['slots']} slots "
                  f"({1 - fill['rows'] / fill['slots']:.1%} padding); activation splits reused: "
                  f"{W.split_hits}", flush=True)
        # the chunk's working set: the torch allocator's peak (activations, KV, scratch; the weights are the
        # extension's own allocations) and the device's memory in use once the runs are done
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
        free, total = torch.cuda.mem_get_info()
        res["prefill"].append({"tokens": n, "chunk": args.prefill_chunk, "s": dt, "tps": n / dt, "allocator": alloc,
                               "runs_s": runs, "torch_peak_gib": peak_gib, "gpu_mem_used_gib": (total - free) / 2**30})
        more = f"; later runs {', '.join(f'{n / r:.0f}' for r in runs[1:])} t/s" if len(runs) > 1 else ""
        print(f"prefill {n}: {dt:.2f} s, {n / dt:.0f} t/s{more} (allocator, last run: {alloc['num_alloc_retries']} "
              f"retries, {alloc['num_device_alloc']} cudaMalloc, {alloc['num_device_free']} cudaFree; torch peak "
              f"{peak_gib:.1f} GiB, GPU mem {(total - free) / 2**30:.1f} GiB)", flush=True)
        del s
    for P in args.ctx:
        s = Session(model, ctx=max(P + args.decode + 136, args.decode_capacity), weights=W)
        s.sync([5, 6, 7, 8])
        s._tokens = list(rng.integers(2, cfg.vocab_size, P).tolist())  # fast-forward the timeline
        s.greedy(max(2, s.warm_steps()))  # eager first steps + a graph capture per step kind
        torch.cuda.synchronize()
        t = time.time()
        s.greedy(args.decode)
        torch.cuda.synchronize()
        dt = time.time() - t
        free, total = torch.cuda.mem_get_info()
        row = {"ctx": P, "capacity": s.ctx, "tokens": args.decode, "ms_per_token": dt / args.decode * 1e3,
               "tps": args.decode / dt,
               "fraction_of_floor": floor_ms / (dt / args.decode * 1e3), "gpu_mem_used_gib": (total - free) / 2**30,
               "kv_bytes": s.kv_bytes()}
        res["decode"].append(row)
        print(f"decode @{P} (session ctx {s.ctx}): {row['ms_per_token']:.2f} ms/token, {row['tps']:.1f} t/s, "
              f"{row['fraction_of_floor']:.2f} of floor, GPU mem {row['gpu_mem_used_gib']:.1f} GiB", flush=True)
        del s
    if args.count_kernels:
        prof = count_kernels(model, W, min(args.ctx, default=2048) + 16, trace=args.trace)
        res["kernels_per_token"], res["kernel_profile"] = prof["kernels"], prof
        _print_profile("kernels per decoded token (eager step)", prof)
    if args.profile_prefill:
        n = args.profile_prefill
        s = Session(model, ctx=n + 8, weights=W, prefill_chunk=args.prefill_chunk)
        toks = rng.integers(2, cfg.vocab_size, n).tolist()
        p0 = args.profile_from
        if p0:
            s.sync(toks[:p0])  # the profile covers the chunk(s) from p0 to n only
        else:
            s.sync(toks[:min(n, 512)])  # warm, then start again from 0
            s.invalidate()
        prof = profile_kernels(lambda: s.sync(toks), top=args.profile_top, ops=True)
        res["prefill_profile"] = prof
        _print_profile(f"prefill of {n - p0} tokens from position {p0}", prof)
        print(prof["ops_table"], flush=True)
        del s
    if args.gaps:
        res["prefill_gaps"] = prefill_gaps(model, W, args.gaps, args.prefill_chunk, rng, args.gaps_trace)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
