"""Where a decode step's time goes, from a CUPTI trace of CUDA-graph replays (the real decode path).

    python -m ds4.engine.gpu.decode_trace MODEL.gguf --ctx 2048 --steps 4 --trace out.json

The torch profiler records each kernel a graph replay runs, with its stream. For the last replayed step
this prints:
- the step's span, the union of its kernels' busy time and the idle time between them;
- per kernel name: launches, summed and mean duration (with PDL on, a kernel's time includes its wait for
  its predecessor: run with DS4_GPU_PDL=0 for true durations);
- the kernels of one middle layer in launch order (start relative to the layer's first kernel, duration,
  stream), so the critical chain and what runs beside it can be read off;
- the no-overlap bound (`chain_bound`): the frontier share of the latency-bound kernels plus the bandwidth floor, the
  least a step can take while those kernels run one after another between the weight-streaming ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import numpy as np
import torch


def _short(name: str) -> str:
    name = name.replace("(anonymous namespace)::", "").replace("ds4gpu::", "")
    return name.split("(")[0].split("<")[0][:48]


def kernels_of(prof) -> list[dict]:
    out = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        low = e.name.lower()
        if "memcpy" in low or "memset" in low:
            continue
        out.append({"name": _short(e.name), "ts": e.time_range.start, "dur": e.time_range.elapsed_us(),
                    "stream": getattr(e, "device_resource_id", 0)})
    return sorted(out, key=lambda k: k["ts"])


def split_steps(ks: list[dict], gap_us: float) -> list[list[dict]]:
    """Kernels grouped into steps: a new step starts after an idle gap longer than gap_us."""
    steps: list[list[dict]] = []
    end = -1e18
    for k in ks:
        if k["ts"] - end > gap_us:
            steps.append([])
        steps[-1].append(k)
        end = max(end, k["ts"] + k["dur"])
    return steps


def summarize(step: list[dict]) -> dict:
    t0 = step[0]["ts"]
    span = max(k["ts"] + k["dur"] for k in step) - t0
    busy, cur_a, cur_b = 0.0, None, None
    for k in step:
        a, b = k["ts"], k["ts"] + k["dur"]
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                busy += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    busy += cur_b - cur_a
    by = defaultdict(lambda: [0, 0.0])
    for k in step:
        by[k["name"]][0] += 1
        by[k["name"]][1] += k["dur"]
    return {"kernels": len(step), "span_us": span, "busy_us": busy, "idle_us": span - busy,
            "by_name": sorted(([n, c, t] for n, (c, t) in by.items()), key=lambda r: -r[2])}


def frontier_advance(step: list[dict]) -> list[list]:
    """[name, launches, advance_us, duration_us] per kernel name, largest advance first. Kernels taken in the order
    they end; each one's advance is how far its end moves the step's frontier (the latest end so far, from the step's
    first start). The advances sum to the span, gaps included. With PDL on, durations include each kernel's wait for
    its predecessor, so summed durations overlap; the advances do not, and follow the chain of kernels that end last.
    A side kernel that ends while a longer one runs takes the time up to its end (the longer one the rest), so
    side-stream kernels can take some of the chain's credit."""
    front = min(k["ts"] for k in step)
    by = defaultdict(lambda: [0, 0.0, 0.0])
    for k in sorted(step, key=lambda k: k["ts"] + k["dur"]):
        end = k["ts"] + k["dur"]
        row = by[k["name"]]
        row[0] += 1
        row[1] += max(0.0, end - front)
        row[2] += k["dur"]
        front = max(front, end)
    return sorted(([n, c, a, d] for n, (c, a, d) in by.items()), key=lambda r: -r[2])


# Decode kernels whose time is a chain of L2 round trips, barriers and arithmetic on activations and KV rows, not a
# stream of weights (none of them reads more than ~0.1 MB of weights per launch): the mHC pre and its Sinkhorn, the
# query/KV norm and RoPE, the attention's partials and combine, the compressors' pooling, the indexer's keys and
# top-k, the activations' quantization, the argmax and the embedding row. Every other kernel (the matvecs, the routed
# experts, the router, anything not named here) counts as weight-streaming, so the bound below errs low.
# torch's own kernels (at::native::...) in a decode step are vector glue (comp_defer's ring store, fills): no weights
LATENCY_BOUND = ("hc_cluster", "hc_mix_pre", "hc_pre", "sinkhorn", "norm_rope", "attn_partial", "attn_combine",
                 "attn_one", "compress_step", "pool_", "index_keys", "topk", "quantize_x", "argmax", "embed",
                 "at::native::")


def latency_bound(name: str) -> bool:
    return any(p in name for p in LATENCY_BOUND)


def chain_bound(rows: list[list], floor_us: float) -> dict:
    """From frontier_advance's rows and the bandwidth floor (weight bytes per token / copy bandwidth, µs): how much of
    the step the latency-bound kernels hold (latency_us) and the weight-streaming ones (weights_us, and the fraction
    of copy speed they reach together: floor_us / weights_us), and bound_us = latency_us + floor_us, the least a step
    takes if every weight-streaming kernel ran at copy speed and the latency-bound ones kept their time and their
    place between them. A design that beats it must overlap latency-bound work with the weights' streaming."""
    lat = sum(a for n, _, a, _ in rows if latency_bound(n))
    wts = sum(a for n, _, a, _ in rows if not latency_bound(n))
    return {"latency_us": lat, "weights_us": wts, "floor_us": floor_us, "bound_us": lat + floor_us,
            "weights_of_copy": floor_us / wts if wts > 0 else float("nan")}


def layer_slice(step: list[dict], n_layer: int, li: int) -> list[dict]:
    """The kernels between the li-th and (li+1)-th launch of the step's most frequent per-layer kernel that
    appears exactly 2 n_layer times (the mHC pre: twice per layer)."""
    counts = defaultdict(int)
    for k in step:
        counts[k["name"]] += 1
    marks = [n for n, c in counts.items() if c == 2 * n_layer]
    if not marks:
        return []
    mark = marks[0]
    starts = [k["ts"] for k in step if k["name"] == mark]
    a, b = starts[2 * li], starts[2 * li + 2] if 2 * li + 2 < len(starts) else 1e30
    return [k for k in step if a <= k["ts"] < b]


def print_bound(rows: list[list], model, span_us: float) -> None:
    from ds4.engine import gpu
    from ds4.engine.model import decode_weight_bytes

    wbytes = sum(decode_weight_bytes(model.file, model.config).values())
    gbps = gpu.load().copy_bandwidth()["gbps"]
    b = chain_bound(rows, wbytes / (gbps * 1e9) * 1e6)
    print(f"no-overlap bound: latency-bound kernels {b['latency_us']:.0f} us of the {span_us:.0f} us step, "
          f"weight-streaming kernels {b['weights_us']:.0f} us ({b['weights_of_copy']:.2f} of copy for "
          f"{wbytes / 1e9:.3f} GB at {gbps:.0f} GB/s: floor {b['floor_us']:.0f} us); with those at copy speed and "
          f"nothing overlapped a step takes >= {b['bound_us']:.0f} us ({1e6 / b['bound_us']:.0f} t/s, "
          f"{b['floor_us'] / b['bound_us']:.2f} of the floor)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=2048, help="context the step decodes at")
    ap.add_argument("--steps", type=int, default=4, help="graph replays profiled (the last one is reported)")
    ap.add_argument("--capacity", type=int, default=0, metavar="N",
                    help="the session's context (default: --ctx + steps + 16); ds4-bench's is ctx-max + gen + 1")
    ap.add_argument("--layer", type=int, nargs="*", default=[10, 11], help="layers whose kernels are listed")
    ap.add_argument("--list-steps", type=int, default=2, help="steps whose layer slices are listed (the last ones)")
    ap.add_argument("--trace", help="write the profiled kernels (name, start, duration, stream) as JSON here")
    args = ap.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile

    from ds4.engine.gpu.session import Session
    from ds4.engine.gpu.weights import Weights
    from ds4.engine.model import Model

    model = Model.load(args.model)
    cfg = model.config
    W = Weights(model, torch.device("cuda"))
    s = Session(model, ctx=max(args.ctx + args.steps + 16, args.capacity), weights=W)
    s.sync([5, 6, 7, 8])
    rng = np.random.default_rng(0)
    s._tokens = list(rng.integers(2, cfg.vocab_size, args.ctx).tolist())  # fast-forward, as bench_session
    s.greedy(4)  # eager step, capture, replays
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            s.greedy(1)
            torch.cuda.synchronize()
    ks = kernels_of(prof)
    steps = [st for st in split_steps(ks, 50.0) if len(st) > 100]
    if not steps:
        print(f"no decode step found among {len(ks)} kernels", file=sys.stderr)
        return 1
    step = steps[-1]
    r = summarize(step)
    spans = ", ".join(f"{summarize(st)['span_us']:.0f}" for st in steps)
    print(f"decode step @{args.ctx}: {r['kernels']} kernels, span {r['span_us']:.0f} us, busy {r['busy_us']:.0f}, "
          f"idle {r['idle_us']:.0f}; spans of all steps: {spans}")
    for name, c, t in r["by_name"][:40]:
        print(f"  {t:8.1f} us {c:5d}x {t / c:6.2f}  {name}")
    print("frontier advance (how far each kernel moves the step's latest end; sums to the span): us, launches, us per"
          " launch, name")
    rows = frontier_advance(step)
    for name, c, a, _ in rows[:25]:
        print(f"  {a:8.1f} us {c:5d}x {a / c:6.2f}  {name}")
    print_bound(rows, model, r["span_us"])
    for si in range(max(0, len(steps) - args.list_steps), len(steps)):
        for li in args.layer:
            lk = layer_slice(steps[si], cfg.n_layer, li)
            if not lk:
                continue
            t0 = lk[0]["ts"]
            streams = sorted({k["stream"] for k in lk})
            end = max(k["ts"] + k["dur"] for k in lk)
            print(f"step {si} slice {li} (from the MoE of layer {li - 1}): {len(lk)} kernels, {end - t0:.1f} us")
            for k in lk:
                print(f"  {k['ts'] - t0:7.1f} {k['dur']:6.1f}  s{streams.index(k['stream'])}  {k['name']}")
    if args.trace:
        with open(args.trace, "w") as fh:
            json.dump({"ctx": args.ctx, "n_layer": cfg.n_layer, "kernels": step}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
