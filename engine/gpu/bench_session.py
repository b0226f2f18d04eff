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


def count_kernels(model, W, ctx: int, top: int = 40, trace: str | None = None) -> dict:
    """CUDA kernels one decode step launches (an eager step profiled with CUPTI; a graph replays the
    same ones), their summed device time and the kernels that take the most time."""
    from torch.profiler import ProfilerActivity, profile

    from ds4.engine.gpu.session import Session

    s = Session(model, ctx=ctx, weights=W, graphs=False)
    s.sync([5, 6, 7, 8])
    s.decode(9)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        s.decode(10)
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
    if trace:  # chrome trace: every kernel in launch order with its grid, block and duration
        prof.export_chrome_trace(trace)
    n = sum(v[0] for v in by_name.values())
    busy = sum(v[1] for v in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": n, "kernel_us": busy,
            "top": [{"name": k, "count": v[0], "us": v[1]} for k, v in ranked]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prefill", type=int, nargs="*", default=[2048])
    ap.add_argument("--json")
    ap.add_argument("--count-kernels", action="store_true", help="profile one eager decode step: kernels per token")
    ap.add_argument("--trace", help="with --count-kernels: write the step's chrome trace (kernel order, grids) here")
    args = ap.parse_args(argv)

    from ds4.engine import gpu
    from ds4.engine.gpu.session import Session
    from ds4.engine.gpu.weights import Weights
    from ds4.engine.model import Model, decode_weight_bytes

    ext = gpu.load()
    t0 = time.time()
    model = Model.load(args.model)
    cfg = model.config
    dev = torch.device("cuda")
    W = Weights(model, dev)
    first = Session(model, ctx=max(64, min(args.ctx)), weights=W)
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
        s = Session(model, ctx=n + 8, weights=W)
        toks = rng.integers(2, cfg.vocab_size, n).tolist()
        s.sync(toks[:8])  # warm-up (allocator, first launches)
        s.invalidate()
        torch.cuda.synchronize()
        t = time.time()
        s.sync(toks)
        torch.cuda.synchronize()
        dt = time.time() - t
        res["prefill"].append({"tokens": n, "s": dt, "tps": n / dt})
        print(f"prefill {n}: {dt:.2f} s, {n / dt:.0f} t/s", flush=True)
        del s
    for P in args.ctx:
        s = Session(model, ctx=P + args.decode + 8, weights=W)
        s.sync([5, 6, 7, 8])
        s._tokens = list(rng.integers(2, cfg.vocab_size, P).tolist())  # fast-forward the timeline
        s.greedy(2)  # eager first step + graph capture
        torch.cuda.synchronize()
        t = time.time()
        s.greedy(args.decode)
        torch.cuda.synchronize()
        dt = time.time() - t
        free, total = torch.cuda.mem_get_info()
        row = {"ctx": P, "tokens": args.decode, "ms_per_token": dt / args.decode * 1e3, "tps": args.decode / dt,
               "fraction_of_floor": floor_ms / (dt / args.decode * 1e3), "gpu_mem_used_gib": (total - free) / 2**30,
               "kv_bytes": s.kv_bytes()}
        res["decode"].append(row)
        print(f"decode @{P}: {row['ms_per_token']:.2f} ms/token, {row['tps']:.1f} t/s, "
              f"{row['fraction_of_floor']:.2f} of floor, GPU mem {row['gpu_mem_used_gib']:.1f} GiB", flush=True)
        del s
    if args.count_kernels:
        prof = count_kernels(model, W, min(args.ctx) + 16, trace=args.trace)
        res["kernels_per_token"], res["kernel_profile"] = prof["kernels"], prof
        print(f"kernels per decoded token: {prof['kernels']}, summed kernel time {prof['kernel_us'] / 1e3:.2f} ms "
              f"(eager step)", flush=True)
        for row in prof["top"]:
            print(f"  {row['us']:9.1f} us {row['count']:5d}x  {row['name']}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
