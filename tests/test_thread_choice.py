"""ds4.thread_choice: serial or threaded by the clock; the engine's decode products give the same
bits whichever mode runs."""

from __future__ import annotations

import numba
import numpy as np

from ds4.engine import dense
from ds4.thread_choice import CHOICES, ThreadChoice, timed_choice


def _drive(choice: ThreadChoice, seconds, calls: int) -> list[bool]:
    """Run `calls` picks, recording seconds[mode] for each; return the modes picked."""
    picked = []
    for _ in range(calls):
        mode = choice.threaded()
        picked.append(mode)
        choice.record(mode, seconds[mode])
    return picked


def test_measures_both_then_keeps_the_faster_and_retries_the_other():
    choice = ThreadChoice(retry=16)
    picked = _drive(choice, {False: 2e-3, True: 1e-3}, 64)
    assert picked[:2] == [False, True]           # serial first, then threaded
    assert picked[2:].count(False) == 4          # the slower mode on calls 16, 32, 48, 64
    assert all(picked[i] for i in range(2, 64) if (i + 1) % 16)


def test_follows_the_load():
    """When threaded calls turn slow (another process holds a core), serial takes over within the
    median window; when they are fast again, the retries bring threaded back."""
    choice = ThreadChoice(retry=4, keep=5)
    _drive(choice, {False: 2e-3, True: 1e-3}, 20)
    assert choice.threaded() is True or choice.calls % 4 == 0
    picked = _drive(choice, {False: 2e-3, True: 20e-3}, 60)
    assert picked[-20:].count(True) <= 5         # only the retries
    picked = _drive(choice, {False: 2e-3, True: 1e-3}, 60)
    assert picked[-20:].count(False) <= 5


def test_timed_choice_runs_one_of_them_and_records_it():
    key = ("test", object())
    ran = []
    for _ in range(3):
        assert timed_choice(key, lambda: ran.append("s") or 1, lambda: ran.append("t") or 1) == 1
    assert ran[:2] == ["s", "t"] and len(ran) == 3
    assert len(CHOICES[key].samples[0]) >= 1 and len(CHOICES[key].samples[1]) >= 1


def test_decode_products_give_the_same_bits_in_either_mode():
    rng = np.random.default_rng(11)
    w = rng.standard_normal((16384, 640)).astype(np.float16).view(np.uint16)   # head-sized: > 8M weights
    x = rng.standard_normal((1, 640)).astype(np.float32)
    numba.set_num_threads(1)
    ref = dense.dense_matmul(w, x)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    outs = [dense.dense_matmul(w, x) for _ in range(6)]   # serial, threaded, then the faster
    for out in outs:
        assert np.array_equal(out, ref)
    if numba.get_num_threads() > 1:
        key = ("dense", 16384, 640, w.dtype.char, numba.get_num_threads())
        assert all(CHOICES[key].samples)      # both modes ran
