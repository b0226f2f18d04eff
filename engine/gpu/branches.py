"""Side branches of the decode graph: a sublayer's independent work launched on a second stream.

Why: a decoded token is a chain of ~1000 kernels, most of them latency-bound (mHC, norms, router, routed
gate/up), so DRAM idles while they run. Work that does not depend on that chain can run beside it: the
shared expert beside the router and the routed experts (`ffn`), the compressors beside q_a/kv, q_b and the
norms (`comp`), the indexer's q, keys and top-k beside q_b and its RoPE (`idx`, ratio-4 layers). Captured
into the CUDA graph, the fork and join become graph edges.

$DS4_GPU_BRANCH: branch names separated by "," or "+" (default `ffn,comp`, the fastest set measured on the
H200; empty: none). $DS4_GPU_SIDE_PER_SM: CTAs per SM of the streaming matvecs launched on a side branch
(default 0: as many as fit), so the main branch's kernels find room beside them. Read once.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

BRANCH_NAMES = ("ffn", "comp", "idx")


def parse_branches(spec: str) -> frozenset[str]:
    names = frozenset(filter(None, (t.strip() for t in spec.replace("+", ",").split(","))))
    bad = sorted(names - set(BRANCH_NAMES))
    if bad:
        raise ValueError(f"DS4_GPU_BRANCH: unknown branch {', '.join(bad)} (known: {', '.join(BRANCH_NAMES)})")
    return names


BRANCHES = parse_branches(os.environ.get("DS4_GPU_BRANCH", "ffn,comp"))
SIDE_PER_SM = int(os.environ.get("DS4_GPU_SIDE_PER_SM", "0") or 0)


# $DS4_GPU_HC_DEFER (default 1 since v22; 0 off): decode's mHC Sinkhorn beside the chain (DeferredSinkhorn). v21 measured
# no gain when the arrival-count kernel hid Sinkhorn behind its out pass; in the cluster kernel it is the tail, and
# v22 measured decode 6.40 / 6.49 -> 6.11 / 6.17 ms at 2k / 8k (both orders of the A/B).
HC_DEFER = os.environ.get("DS4_GPU_HC_DEFER", "1") == "1"


class DeferredSinkhorn:
    """comb of decode's one-launch mHC kernels made on a stream of its own.

    Why: comb (Sinkhorn's 20 dependent iterations, one thread of the kernel's last CTA) is read only by the next
    sublayer's mHC, but the next kernel of the chain waits for the whole mHC grid, Sinkhorn included. Here the mHC
    kernel writes comb's 16 logits and `sinkhorn4_kernel` runs beside the chain; `join()` (before the next mHC reads
    comb) makes the current stream wait for it. The same arithmetic on the same logits: the same bits."""

    def __init__(self, K, device: torch.device):
        self.K, self.device = K, device
        self.stream: torch.cuda.Stream | None = None
        self.pending = False

    def post_pre(self, X: torch.Tensor, pending: tuple, args: tuple, ring: tuple | None = None):
        """K.hc_post_pre(X, *pending, *args, ring=ring) with comb deferred; args = (fn, scale, base, norm, iters,
        eps_rms, eps_hc)."""
        self.join()  # pending's comb is the previous deferred one
        main = torch.cuda.current_stream(self.device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        logits = torch.empty((X.shape[0], 16), dtype=torch.float32, device=self.device)
        Xn, out, post, comb = self.K.hc_post_pre(X, *pending, *args, logits=logits, ring=ring)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            self.K.sinkhorn(logits, args[4], args[6], comb)
        for t in (logits, comb):  # used on the side stream too: the allocator must not hand them out before it is done
            t.record_stream(self.stream)
        self.pending = True
        return Xn, out, post, comb

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.pending = False


class SideStream:
    """One side stream per session. `fork()` makes it wait for everything launched so far on the current
    stream and routes the extension's launches to it inside the block; `join()` makes the current stream wait
    for everything launched on it."""

    def __init__(self, ext, device: torch.device):
        self.ext, self.device = ext, device
        self.stream: torch.cuda.Stream | None = None
        self.pending = False

    def _route(self) -> None:
        self.ext.set_stream(torch.cuda.current_stream(self.device).cuda_stream)

    @contextmanager
    def fork(self):
        main = torch.cuda.current_stream(self.device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(main)
        try:
            with torch.cuda.stream(self.stream):
                self._route()
                if SIDE_PER_SM:
                    self.ext.set_mv_cap(SIDE_PER_SM)
                yield
        finally:
            if SIDE_PER_SM:
                self.ext.set_mv_cap(0)
            self._route()  # back to the main stream
            self.pending = True

    def mark(self) -> torch.cuda.Event:
        """Inside fork(): an event at this point of the side stream, for wait()."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def wait(self, ev: torch.cuda.Event) -> None:
        """The current stream waits for the side stream's work up to mark()'s point only (join() waits for all)."""
        torch.cuda.current_stream(self.device).wait_event(ev)

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.pending = False
