"""µs per call of a torch-stream GPU op, timed over replays of a CUDA graph that captures it `per_graph` times.

Why a graph: a Python call costs the host ~20 µs, more than most decode kernels; launching them one by one would time
the host. The op is warmed up once on a side stream outside the capture (lazy allocations, cuBLAS handles)."""

from __future__ import annotations


def torch_graph_us(fn, reps: int, per_graph: int = 20) -> float:
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n_graphs = max(1, reps // per_graph)
    start.record()
    for _ in range(n_graphs):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / (n_graphs * per_graph)
