"""`python -m ds4.engine.gpu.bench_barrier`: what a grid-wide barrier costs inside one resident grid (barrier.cu), the
brick of a persistent decode kernel, against what it would replace: a kernel launch inside a CUDA graph (empty
kernels, so pure launch gap). Prints microseconds per barrier for each form at one and two CTAs per SM, and per
graph-launched kernel. Needs a CUDA device and the built extension."""

from __future__ import annotations

import argparse
import sys

import torch

FORMS = {0: "fenced + sleep (matvec_chain)", 1: "acquire/release", 2: "grid.sync (cooperative groups)"}


def barrier_us(ext, mode: int, ctas: int, threads: int, iters: int) -> float:
    slots = torch.zeros(iters, dtype=torch.int32, device="cuda")
    data = torch.zeros(iters, ctas, dtype=torch.int32, device="cuda")
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    ext.barrier_check(mode, ctas, threads, slots.data_ptr(), data.data_ptr(), 8, bad.data_ptr())  # warm-up
    slots.zero_()
    data.zero_()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    ext.barrier_check(mode, ctas, threads, slots.data_ptr(), data.data_ptr(), iters, bad.data_ptr())
    end.record()
    torch.cuda.synchronize()
    if int(bad.item()):
        raise RuntimeError(f"barrier form {mode}: {int(bad.item())} CTAs passed a barrier early")
    return start.elapsed_time(end) * 1e3 / iters


def relay_hop_us(ext, ctas: int, laps: int, cluster: bool = False) -> float:
    """Microseconds per hop of flag_relay (one CTA's store-release through L2 seen by the next CTA's acquire spin) or,
    with cluster, of cluster_relay (the same through distributed shared memory inside one cluster)."""
    flags = torch.zeros(ctas, dtype=torch.int32, device="cuda")
    data = torch.zeros(ctas, dtype=torch.int32, device="cuda")
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")

    def relay(n: int) -> None:
        if cluster:
            ext.cluster_relay(ctas, n, bad.data_ptr(), flags.data_ptr())  # flags[0] counts the hops
        else:
            ext.flag_relay(ctas, flags.data_ptr(), data.data_ptr(), n, bad.data_ptr())

    relay(8)  # warm-up
    flags.zero_()
    data.zero_()
    torch.cuda.current_stream().synchronize()  # this stream only: a copy may run beside it
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    relay(laps)
    end.record()
    torch.cuda.current_stream().synchronize()  # this stream only: a copy may run beside it
    if int(bad.item()):
        raise RuntimeError(f"{'cluster' if cluster else 'flag'} relay of {ctas} CTAs: {int(bad.item())} hops saw a stale "
                           "store or timed out")
    return start.elapsed_time(end) * 1e3 / (laps * ctas)


def relay_hop_loaded_us(ext, ctas: int, laps: int, load: str = "copy", gib: float = 2.0,
                        cluster: bool = False) -> tuple[float, float]:
    """relay_hop_us while another stream keeps DRAM busy, as a persistent kernel's weight streaming would: `copy`
    rewrites a gib GiB buffer again and again (an elementwise kernel reading and writing), `read` sums it (reads
    only, as the matvecs do). Returns (µs per hop, the load's GB/s meanwhile). The load is queued first, so the relay's
    CTAs share the SMs with it."""
    n = int(gib * 2**30) // 4
    src = torch.ones(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src) if load == "copy" else torch.empty((), device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    passes = 12 if load == "copy" else 24
    with torch.cuda.stream(side):
        c0.record()
        for _ in range(passes):
            if load == "copy":
                torch.add(src, 1.0, out=dst)
            else:
                torch.sum(src, dim=0, out=dst)
        c1.record()
    hop = relay_hop_us(ext, ctas, laps, cluster)
    torch.cuda.synchronize()
    moved = (2 if load == "copy" else 1) * n * 4 * passes
    return hop, moved / (c0.elapsed_time(c1) * 1e-3) / 1e9


def graph_launch_us(ext, n: int) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ext.set_stream(stream.cuda_stream)
        ext.launch_empty(8)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            ext.set_stream(torch.cuda.current_stream().cuda_stream)
            ext.launch_empty(n)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
    ext.set_stream(torch.cuda.current_stream().cuda_stream)
    return start.elapsed_time(end) * 1e3 / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000, help="barriers (and graph launches) per timing (default 2000)")
    ap.add_argument("--threads", type=int, default=256, help="threads per CTA (default 256)")
    ap.add_argument("--ctas", type=int, nargs="+", default=[8, 32],
                    help="barrier grids besides one and two CTAs per SM (default 8 32)")
    ap.add_argument("--loaded", action="store_true",
                    help="also the flag relay while another stream copies or reads a 2 GiB buffer (DRAM busy)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_barrier: needs a CUDA device", file=sys.stderr)
        return 2
    from . import load

    ext = load()
    ext.set_stream(torch.cuda.current_stream().cuda_stream)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    most = ext.barrier_max_ctas(args.threads)
    peer = graph_launch_us(ext, args.iters)
    print(f"peer: one empty kernel launched from a CUDA graph: {peer:.2f} us")
    print(f"{'barrier form':<34} {'CTAs':>5} {'us / barrier':>13} {'peer / barrier':>15}")
    for mode, name in FORMS.items():
        for ctas in sorted({min(c, most) for c in args.ctas if c > 0} | {sms, min(2 * sms, most)}):
            us = barrier_us(ext, mode, ctas, args.threads, args.iters)
            print(f"{name:<34} {ctas:>5} {us:13.2f} {peer / us:15.2f}")
    laps = max(1, args.iters // 4)
    for ctas in sorted({2, 8, ext.flag_relay_max_ctas()}):
        us = relay_hop_us(ext, ctas, laps)
        print(f"{'flag relay, one hop':<34} {ctas:>5} {us:13.2f} {peer / us:15.2f}")
    for ctas in (2, 8):
        us = relay_hop_us(ext, ctas, laps, cluster=True)
        print(f"{'cluster relay, one hop':<34} {ctas:>5} {us:13.2f} {peer / us:15.2f}")
    if args.loaded:
        for load in ("copy", "read"):
            for ctas in (2, 8, 32):
                us, gbps = relay_hop_loaded_us(ext, ctas, laps, load)
                print(f"{'flag relay under a ' + load:<34} {ctas:>5} {us:13.2f} {peer / us:15.2f}   "
                      f"({load} {gbps:.0f} GB/s)")
            for ctas in (2, 8):
                us, gbps = relay_hop_loaded_us(ext, ctas, laps, load, cluster=True)
                print(f"{'cluster relay under a ' + load:<34} {ctas:>5} {us:13.2f} {peer / us:15.2f}   "
                      f"({load} {gbps:.0f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
