"""`python -m ds4.engine.gpu.bench`: the kernel benchmark (see ds4.speed_bench.gpu_kernels)."""

import sys

from ds4.speed_bench.gpu_kernels import main

if __name__ == "__main__":
    sys.exit(main())
