"""Quantizer throughput: ours vs ggml's `ggml_quantize_chunk`, timed in the same run.

    python -m ds4.gguf_tools.quants.bench [--rows 2048 --cols 4096] [--types IQ2_XXS Q2_K ...]

For each type, quantizes one Flash-shaped expert tensor (gate: 2048 rows x 4096 columns, with an
importance vector) with ours and with ggml, on one core and on all cores, checks that the bytes
agree, and prints weights/s and the ratio. ggml runs through ctypes in this process (llama-cpp-python
must be installed; without it only our figures are printed). "All cores" means numba's thread pool
for ours and the same number of threads each calling ggml on a slice of rows for ggml.

From the all-core rates it projects the time to quantize the routed experts of the full Flash q2 mix
(43 layers x 256 experts: gate+up IQ2_XXS, down Q2_K) plus the Q8_0 tensors.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from ..constants import QuantType
from . import ggml_oracle, quantize

# Flash q2 mix weight counts (model-spec §8.1 shapes): routed gate+up, routed down, Q8_0 dense parts.
FLASH_LAYERS, FLASH_EXPERTS, FLASH_D, FLASH_FF = 43, 256, 4096, 2048
FLASH_Q2_WEIGHTS = {
    QuantType.IQ2_XXS: FLASH_LAYERS * FLASH_EXPERTS * 2 * FLASH_D * FLASH_FF,
    QuantType.Q2_K: FLASH_LAYERS * FLASH_EXPERTS * FLASH_D * FLASH_FF,
    QuantType.Q8_0: int(6.21e9),  # attention projections 4.60B + shared experts 1.08B + output 0.53B
}


def _timed_interleaved(fns: list, repeats: int) -> list[tuple[float, np.ndarray]]:
    """Best-of-`repeats` time of each function, taking turns (a, b, a, b, ...) so that a load that
    comes and goes on a shared machine hits both sides alike."""
    best, outs = [float("inf")] * len(fns), [None] * len(fns)
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            outs[k] = fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return list(zip(best, outs))


def bench_type(qtype: QuantType, x: np.ndarray, imp: np.ndarray, single_rows: int, threads: int,
               repeats: int, with_ggml: bool) -> dict:
    import numba

    xs = np.ascontiguousarray(x[:single_rows])
    quantize(qtype, x[:2], imp)  # compile / load the numba cache outside the timing
    res = {"type": qtype.name, "threads": threads}

    def ours(rows: np.ndarray, n: int):
        def run():
            numba.set_num_threads(n)
            return quantize(qtype, rows, imp)
        return run

    for key, rows, n in (("1", xs, 1), ("n", x, threads)):
        fns = [ours(rows, n)]
        if with_ggml:
            fns.append(lambda rows=rows, n=n: ggml_oracle.quantize_in_process(qtype, rows, imp, threads=n))
        timed = _timed_interleaved(fns, repeats)
        res[f"ours_{key}"] = rows.size / timed[0][0]
        if with_ggml:
            res[f"ggml_{key}"] = rows.size / timed[1][0]
            res[f"identical_{key}"] = bool(np.array_equal(timed[0][1], timed[1][1]))
    if with_ggml:
        res["identical"] = res.pop("identical_1") and res.pop("identical_n")
    return res


def _fmt_rate(r: float | None) -> str:
    return "-" if r is None else f"{r / 1e6:9.2f}"


def _fmt_hours(s: float) -> str:
    return f"{s / 3600:.2f} h" if s >= 3600 else f"{s / 60:.1f} min"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds4.gguf_tools.quants.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048, help="rows of the test tensor (default 2048, a Flash gate)")
    ap.add_argument("--cols", type=int, default=4096, help="columns (default 4096)")
    ap.add_argument("--single-rows", type=int, default=256,
                    help="rows used for the one-core measurement (default 256 = 1M weights)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for 'all cores'")
    ap.add_argument("--types", nargs="+", default=["Q8_0", "Q4_K", "Q2_K", "IQ2_XXS"],
                    choices=["Q8_0", "Q4_K", "Q2_K", "IQ2_XXS"])
    ap.add_argument("--repeats", type=int, default=1,
                    help="best of N timings, ours and ggml taking turns (default 1)")
    ap.add_argument("--no-ggml", action="store_true", help="time ours only")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cols % 256 or args.rows < 1 or args.single_rows < 1 or args.threads < 1:
        print("error: --cols must be a multiple of 256; rows, single-rows and threads must be >= 1", file=sys.stderr)
        return 2
    with_ggml = not args.no_ggml and ggml_oracle.available()
    if not args.no_ggml and not with_ggml:
        print("note: llama-cpp-python not installed; timing ours only", file=sys.stderr)

    rng = np.random.default_rng(args.seed)
    x = (rng.standard_normal((args.rows, args.cols)) * 0.02).astype(np.float32)
    imp = rng.gamma(0.5, 1.0, args.cols).astype(np.float32)
    single = min(args.single_rows, args.rows)
    print(f"tensor {args.rows} x {args.cols} ({x.size / 1e6:.1f}M weights) with importance; "
          f"1-core on {single} rows; all cores = {args.threads} threads")
    head = f"{'type':8} {'ours 1c':>9} {'ggml 1c':>9} {'ratio':>6} | {'ours Nc':>9} {'ggml Nc':>9} {'ratio':>6}  identical"
    print(head + "\n" + "-" * len(head) + "   (M weights/s)")
    rates = {}
    for name in args.types:
        qtype = QuantType[name]
        r = bench_type(qtype, x, imp, single, args.threads, args.repeats, with_ggml)
        rates[qtype] = r
        ratio1 = f"{r['ours_1'] / r['ggml_1']:6.2f}" if with_ggml else "     -"
        ration = f"{r['ours_n'] / r['ggml_n']:6.2f}" if with_ggml else "     -"
        ident = ("yes" if r["identical"] else "NO") if with_ggml else "-"
        print(f"{name:8} {_fmt_rate(r['ours_1'])} {_fmt_rate(r.get('ggml_1'))} {ratio1} | "
              f"{_fmt_rate(r['ours_n'])} {_fmt_rate(r.get('ggml_n'))} {ration}  {ident}", flush=True)

    if all(q in rates for q in FLASH_Q2_WEIGHTS):
        for who in ("ours", "ggml") if with_ggml else ("ours",):
            for key, label in ((f"{who}_n", f"{args.threads} threads"), (f"{who}_1", "1 core")):
                secs = sum(n / rates[q][key] for q, n in FLASH_Q2_WEIGHTS.items())
                print(f"projected Flash q2 mix ({sum(FLASH_Q2_WEIGHTS.values()) / 1e9:.0f}B weights), "
                      f"{who}, {label}: {_fmt_hours(secs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
