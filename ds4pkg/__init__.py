"""ds4: a workbench for running and tooling DeepSeek V4 locally."""

import os

__version__ = "0.1.0"

# numba's threads (set before numba is first imported, which reads them then; explicit settings
# are kept). GNU OpenMP with a short spin: after a parallel region the workers spin ~3,000 turns
# for the next one, then sleep. Measured on the 2-core box, 2 threads, prefill / decode t/s
# (`python -m ds4.engine.bench --peers ours`): tiny 2471 / 587 and small 439 / 113 with spin 3000;
# OpenMP's default spin (300,000) 821 / 186 and 207 / 43 (the spinning worker takes the core from
# the single-threaded work between kernels); the sleeping workqueue layer 1619 / 488 and 256 / 88
# (each region waits for its workers to wake). ds4.engine.dense repeats the choice for programs
# that imported numba first. OpenMP missing: numba falls back to workqueue.
os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", "omp workqueue tbb")
os.environ.setdefault("GOMP_SPINCOUNT", "3000")
