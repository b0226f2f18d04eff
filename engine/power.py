"""`--power N`: a duty-cycle throttle for long-running commands.

A laptop (or a shared box) running a long prefill or sweep at 100% gets hot and loud; `--power 50`
keeps the busy fraction near 50% by sleeping after each unit of work for as long as the work took,
scaled so that busy / (busy + sleep) ≈ N / 100. The output is unchanged: the throttle only sleeps
between units (layers in prefill, tokens in decode); it never touches the numbers.

Use:

    throttle = PowerThrottle(50)
    for layer in layers:
        ...work...
        throttle.step()          # sleeps ≈ the time since the previous step()

The engine and the tools share one process-wide throttle: `install(percent)` sets it (the CLIs do
this from `--power`), and `step()` at module level is a cheap no-op when none is installed, so the
forward pass can call it between layers unconditionally.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

# Sleeps shorter than this are carried over to the next step instead of being issued: time.sleep
# has ~50-100 µs of overhead and jitter, which would otherwise dominate tiny units of work.
MIN_SLEEP_S = 0.002


@dataclass
class PowerThrottle:
    """Keeps busy / (busy + slept) ≈ percent / 100 across calls to `step()`."""

    percent: float = 100.0
    busy_s: float = 0.0  # measured compute time (between step() calls, excluding our own sleeps)
    slept_s: float = 0.0  # time actually spent sleeping
    _owed_s: float = 0.0  # sleep not yet issued (accumulated below MIN_SLEEP_S)
    _mark: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        if not (1 <= self.percent <= 100):
            raise ValueError(f"power must be between 1 and 100, got {self.percent}")

    @property
    def active(self) -> bool:
        return self.percent < 100

    def reset(self) -> None:
        """Forget accumulated statistics and start measuring from now."""
        self.busy_s = self.slept_s = self._owed_s = 0.0
        self._mark = time.perf_counter()

    def step(self) -> None:
        """End of one unit of work: account its duration and sleep the matching idle share."""
        now = time.perf_counter()
        busy = now - self._mark
        self.busy_s += busy
        if self.active:
            # busy / (busy + sleep) = p  =>  sleep = busy * (1 - p) / p
            p = self.percent / 100.0
            self._owed_s += busy * (1.0 - p) / p
            if self._owed_s >= MIN_SLEEP_S:
                t0 = time.perf_counter()
                time.sleep(self._owed_s)
                slept = time.perf_counter() - t0
                self.slept_s += slept
                # Oversleeping is credited against the next sleep, so the long-run ratio holds.
                self._owed_s -= slept
        self._mark = time.perf_counter()

    def pause(self) -> None:
        """Exclude the time since the last step (e.g. waiting for user input) from busy time."""
        self._mark = time.perf_counter()

    @property
    def busy_fraction(self) -> float:
        total = self.busy_s + self.slept_s
        return self.busy_s / total if total > 0 else 1.0


_CURRENT: PowerThrottle | None = None


def install(percent: float | None) -> PowerThrottle | None:
    """Set (or with None / 100, clear) the process-wide throttle; returns it."""
    global _CURRENT
    if percent is None or percent >= 100:
        _CURRENT = None
    else:
        _CURRENT = PowerThrottle(float(percent))
    return _CURRENT


def current() -> PowerThrottle | None:
    return _CURRENT


def step() -> None:
    """Throttle point for the engine and tools; a no-op unless a throttle is installed."""
    if _CURRENT is not None:
        _CURRENT.step()


def pause() -> None:
    if _CURRENT is not None:
        _CURRENT.pause()


def _power_value(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--power takes an integer 1-100, got {text!r}") from None
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"--power takes an integer 1-100, got {value}")
    return value


def add_power_argument(parser: argparse.ArgumentParser) -> None:
    """The shared `--power N` flag; call `install(args.power)` after parsing."""
    parser.add_argument(
        "--power", type=_power_value, default=100, metavar="N",
        help="duty cycle in percent (1-100): sleep between layers/tokens so the CPU/GPU is busy "
             "about N%% of the time; output is unchanged (default 100 = no throttling)",
    )


def layer_hooks():
    """A `Hooks` that throttles after every layer (the prefill/decode unit of work inside the
    forward pass). Attach it with `attach(session)`; it does nothing when no throttle is installed."""
    from ds4.engine.hooks import Hooks

    class _PowerHooks(Hooks):
        def residual(self, layer, X):
            step()

    return _PowerHooks()


def attach(session) -> None:
    """Throttle `session` between layers when a throttle is installed, keeping its other hooks."""
    if _CURRENT is None:
        return
    from ds4.engine.hooks import HookList

    existing = getattr(session, "hooks", None)
    session.hooks = HookList(existing, layer_hooks()) if existing is not None else layer_hooks()
