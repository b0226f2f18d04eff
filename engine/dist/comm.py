"""Combining the ranks' partial routed-MoE outputs, with a count of what crosses the wire.

With attention replicated, every rank already holds every token's routed input b [T, D], so expert
parallelism needs no dispatch (no all-to-all of tokens): each rank computes its own experts'
contributions y_r [T, D] (zero rows for tokens none of its experts serve) and the layer output is
Σ_r y_r. Three ways to form that sum on every rank, all giving identical bits on every rank (each
rank ends with the same reduced values, so the replicated state never drifts apart):

- `allreduce`: one collective; a ring moves 2(N-1)/N · S bytes per rank (S = T·D·4).
- `rs_ag`: reduce-scatter then all-gather of the flattened [T·D] (padded to a multiple of N); the
  same bytes as a ring all-reduce, in two collectives (two latencies at batch 1). It pays only
  when work can run on the scattered shard between the two (sequence-parallel tails), which the
  replicated attention here cannot use.
- `allgather`: all-gather the N partials and sum them locally in rank order: one collective but
  (N-1) · S bytes per rank, so it can only win where latency, not volume, decides (batch 1).

`auto` (the default) picks all-gather for payloads up to AUTO_GATHER_BYTES and all-reduce above:
measured with gloo (README.md), one all-gather beats the all-reduce at batch 1 (a ring all-gather is
N-1 steps, a ring all-reduce 2(N-1), and at these sizes every step is latency), and the all-reduce
wins from about T = 64 rows on (it sends 2(N-1)/N · S instead of (N-1) · S). The choice depends
only on T, so every rank makes the same one. On CUDA (NCCL) `auto` is always all-reduce: on two
NVLink H200s it beat both others at every payload from 16 KiB to 56 MiB.

`bench_combine` times the three on the current process group (ds4-dist --bench-comm).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

STRATEGIES = ("auto", "allreduce", "rs_ag", "allgather")
MEASURED = STRATEGIES[1:]  # what bench_combine times
AUTO_GATHER_BYTES = 256 << 10  # auto: all-gather up to this payload (decode, small batches), all-reduce above
# torch 2.13 renamed the flat-tensor collectives; older releases only have the *_tensor names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def wire_bytes(strategy: str, payload: int, world: int) -> float:
    """Bytes one rank sends for one combine of `payload` bytes (ring algorithms)."""
    if world <= 1:
        return 0.0
    if strategy == "auto":
        strategy = "allgather" if payload <= AUTO_GATHER_BYTES else "allreduce"
    if strategy in ("allreduce", "rs_ag"):
        return 2.0 * (world - 1) / world * payload
    if strategy == "allgather":
        return float((world - 1) * payload)
    raise ValueError(f"unknown combine strategy '{strategy}' (choose {', '.join(STRATEGIES)})")


@dataclass
class CommStats:
    calls: int = 0
    payload_bytes: int = 0  # Σ T·D·4 of the partial outputs combined
    wire_bytes: float = 0.0  # Σ bytes this rank sent (ring estimate, see wire_bytes)
    seconds: float = 0.0  # host wall time inside the collectives (CPU backends; async on CUDA)
    per_tokens: dict = field(default_factory=dict)  # T -> calls with that many rows

    def reset(self) -> None:
        self.calls, self.payload_bytes, self.wire_bytes, self.seconds = 0, 0, 0.0, 0.0
        self.per_tokens = {}


class Combiner:
    """y_r → Σ_r y_r on every rank of `group`, by `strategy`; counts calls and bytes."""

    def __init__(self, group=None, strategy: str = "auto", world: int | None = None):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown combine strategy '{strategy}' (choose {', '.join(STRATEGIES)})")
        self.group = group
        self.strategy = strategy
        self.world = world if world is not None else (dist.get_world_size(group) if dist.is_initialized() else 1)
        self.stats = CommStats()

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return y
        n = y.numel() * y.element_size()
        strategy = self.strategy
        if strategy == "auto":
            # NCCL on 2 NVLink H200s: all-reduce was fastest at every size measured (T = 1..2048,
            # D = 4096/7168; BENCHMARKS.md), so the gloo-derived all-gather cut-off is CPU-only.
            strategy = "allreduce" if y.is_cuda or n > AUTO_GATHER_BYTES else "allgather"
        t0 = time.perf_counter()
        if strategy == "allreduce":
            y = y.contiguous()
            dist.all_reduce(y, group=self.group)
            out = y
        elif strategy == "rs_ag":
            out = self._rs_ag(y)
        else:
            flat = y.contiguous().reshape(-1)
            parts = flat.new_empty(self.world * flat.numel())
            _all_gather(parts, flat, group=self.group)
            out = parts.view(self.world, *y.shape).sum(dim=0)
        s = self.stats
        s.seconds += time.perf_counter() - t0
        s.calls += 1
        s.payload_bytes += n
        s.wire_bytes += wire_bytes(strategy, n, self.world)
        s.per_tokens[y.shape[0]] = s.per_tokens.get(y.shape[0], 0) + 1
        return out

    def count_replayed(self, steps: int, row_bytes: int, n_layer: int) -> None:
        """Account decode steps replayed from a CUDA graph: their combines ran on the device
        without passing through `combine` (n_layer one-row combines per step)."""
        if self.world == 1 or steps <= 0:
            return
        s = self.stats
        s.calls += steps * n_layer
        s.payload_bytes += steps * n_layer * row_bytes
        s.wire_bytes += steps * n_layer * wire_bytes(self.strategy, row_bytes, self.world)
        s.per_tokens[1] = s.per_tokens.get(1, 0) + steps * n_layer

    def _rs_ag(self, y: torch.Tensor) -> torch.Tensor:
        N = self.world
        flat = y.reshape(-1)
        m = -(-flat.numel() // N)
        if m * N != flat.numel():
            flat = torch.cat([flat, flat.new_zeros(m * N - flat.numel())])
        else:
            flat = flat.contiguous()
        mine = flat.new_empty(m)
        _reduce_scatter(mine, flat, group=self.group)
        full = flat.new_empty(m * N)
        _all_gather(full, mine, group=self.group)
        return full[:y.numel()].reshape(y.shape)


def bench_combine(rows=(1, 8, 64, 512, 2048), dims=(4096, 7168), iters: int = 20, warmup: int = 3,
                  device: torch.device | str = "cpu", group=None) -> list[dict]:
    """Median seconds per combine for each strategy, T rows × D float32, on every rank of `group`
    (collective: all ranks must call it). Returns rank 0's rows: strategy, T, D, bytes, us."""
    device = torch.device(device)
    world = dist.get_world_size(group)
    out = []
    for D in dims:
        for T in rows:
            y = torch.full((T, D), float(dist.get_rank() + 1), device=device)
            for strategy in MEASURED:
                c = Combiner(group, strategy, world)
                for _ in range(warmup):
                    c.combine(y.clone())
                times = []
                for _ in range(iters):
                    _sync(device)
                    dist.barrier(group=group)
                    t0 = time.perf_counter()
                    r = c.combine(y.clone())
                    _sync(device)
                    times.append(time.perf_counter() - t0)
                dt = float(np.median(times))
                want = world * (world + 1) / 2
                if not torch.allclose(r, torch.full_like(r, want)):
                    raise RuntimeError(f"{strategy} combined to {float(r.flatten()[0])}, expected {want}")
                worst = torch.tensor([dt], dtype=torch.float64)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=_cpu_group(group, device))
                out.append(dict(strategy=strategy, T=T, D=D, bytes=T * D * 4, world=world,
                                us=float(worst[0]) * 1e6))
    return out


_GLOO: dict = {}


def _cpu_group(group, device: torch.device):
    """A gloo group for host-side scalars when the compute group is NCCL."""
    if device.type == "cpu":
        return group
    if "g" not in _GLOO:
        _GLOO["g"] = dist.new_group(backend="gloo")
    return _GLOO["g"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
