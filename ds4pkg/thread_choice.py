"""Serial or threaded by the clock, for work whose result does not depend on the thread count.

    out = timed_choice(("dense", O, K), lambda: serial(...), lambda: threaded(...))

Used by the CPU engine's decode products (ds4.engine.dense, ds4.engine.kernels, the fused quant
matmuls): each output there is summed by one thread in a fixed order, so both ways give the same
bits and only the time differs.
"""

from __future__ import annotations

import time


class ThreadChoice:
    """Serial or threaded for one kind of decode product, chosen by the clock.

    A parallel region waits for all of its threads. On a quiet machine two threads read the
    weights faster than one; while another process holds a core, a worker can be descheduled for a
    whole time slice and the region takes up to 10x longer (measured on small, 2 threads, 17
    threaded regions per token: 10.4 ms per token quiet, 136 ms under load). The results are the
    same bits either way (each output is summed by one thread in a fixed order), so the choice
    follows the measured time: the median of each mode's last few calls; the faster mode runs and
    the other is tried again every `retry` calls, so the choice follows the machine's load."""

    def __init__(self, retry: int = 16, keep: int = 5):
        self.retry = retry
        self.keep = keep
        self.samples: tuple[list[float], list[float]] = ([], [])  # serial, threaded
        self.calls = 0

    def _estimate(self, threaded: bool) -> float | None:
        s = self.samples[threaded]
        return sorted(s)[len(s) // 2] if s else None

    def threaded(self) -> bool:
        self.calls += 1
        serial, par = self._estimate(False), self._estimate(True)
        if serial is None or par is None:
            return serial is not None   # measure serial first, then threaded
        faster = par < serial
        return (not faster) if self.calls % self.retry == 0 else faster

    def record(self, threaded: bool, seconds: float) -> None:
        s = self.samples[threaded]
        s.append(seconds)
        if len(s) > self.keep:
            del s[0]


CHOICES: dict[tuple, ThreadChoice] = {}  # one per kind of product (shape, dtype, threads)


def timed_choice(key: tuple, serial, threaded):
    """Run serial() or threaded() for a decode product of kind `key`, as its ThreadChoice says,
    and record the time. Both must compute the same result."""
    choice = CHOICES.get(key)
    if choice is None:
        choice = CHOICES[key] = ThreadChoice()
    use = choice.threaded()
    t0 = time.perf_counter()
    out = threaded() if use else serial()
    choice.record(use, time.perf_counter() - t0)
    return out
