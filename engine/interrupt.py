"""Ctrl+C that is neither lost nor printed as a traceback.

Python runs a signal handler between bytecodes of whatever code is current, and the default SIGINT handler raises
KeyboardInterrupt there. Inside a finalizer (`__del__`, such as llvmlite's, which numba's compiled-code objects run
on collection) or numba/llvmlite's compiler callbacks, that exception is swallowed and printed ("Exception ignored
in ..."), and the program carries on as if no key was pressed. `install()` puts a handler in its place that raises
where the exception reaches the caller and, where it would be swallowed, leaves it pending: `check()`, called at
safe points (between generated tokens), raises it there.
"""
from __future__ import annotations

import os
import signal
import threading

_pending = threading.Event()


def in_swallowing_frame(frame) -> bool:
    """True where an exception raised by a signal handler in `frame` would not reach the caller."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or "llvmlite" in code.co_filename or f"numba{os.sep}" in code.co_filename:
            return True
        frame = frame.f_back
    return False


def _on_sigint(signum, frame) -> None:
    if in_swallowing_frame(frame):
        _pending.set()
        return
    _pending.clear()
    raise KeyboardInterrupt


def install():
    """Handle SIGINT as above; returns the handler it replaced, for `restore`. From the main thread (elsewhere a
    no-op returning None, as signal handlers live there)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, _on_sigint)


def restore(previous) -> None:
    """Put back the handler `install` replaced (None: nothing was installed)."""
    if previous is not None:
        signal.signal(signal.SIGINT, previous)


def forget() -> None:
    """Drop a pending Ctrl+C (one meant for work that has since ended)."""
    _pending.clear()


def check() -> None:
    """Raise the KeyboardInterrupt a Ctrl+C left pending, if any."""
    if _pending.is_set():
        _pending.clear()
        raise KeyboardInterrupt
