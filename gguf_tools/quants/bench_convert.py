"""End-to-end conversion throughput: `ds4-quantize convert --mix q2` vs ggml on the same tensors.

    python -m ds4.gguf_tools.quants.bench_convert [--preset small | --hf DIR] [--mix q2] [--threads N]

1. Converts a checkpoint (by default a random `small` one, synthesized into a temp folder first and
   not timed) with `convert(..., Policy(base="q8_0", mix=...))`, timed end to end: reading and
   dequantizing the checkpoint, quantizing, writing the GGUF.
2. Then, per quantized tensor of that plan (Q8_0, Q2_K, Q4_K, IQ2_XXS), feeds the same float32
   matrices (per expert for routed tensors, with the same importance: the imatrix's, or the
   synthetic column energy for IQ2_XXS) to ggml's `ggml_quantize_chunk` (llama-cpp-python's
   libggml-base through ctypes, `threads` threads on row slices) and to our kernels, timing only
   the quantization, and checks that both equal the bytes in the converted file.

Prints per type: weights, ours and ggml seconds (quantization only), ratio; then the end-to-end
convert time and weights/s against ggml's summed quantization time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from ..constants import QuantType
from . import ggml_oracle, quantize
from .iq2_xxs import synthetic_importance

TIMED = (QuantType.Q8_0, QuantType.Q2_K, QuantType.Q4_K, QuantType.IQ2_XXS)


def _matrices(ckpt, slot, qtype, imp):
    """(float32 matrix, importance) pairs exactly as convert quantizes the tensor."""
    from ..layout import Kind

    if slot.kind == Kind.EXPERTS:
        for e, w in enumerate(ckpt.iter_slot(slot)):
            yield w, imp.for_tensor(slot, qtype, expert=e) if imp is not None else None
        return
    w = np.concatenate(list(ckpt.iter_slot(slot)), axis=0)
    yield w.reshape(-1, slot.ne[0]), imp.for_tensor(slot, qtype) if imp is not None else None


def run(hf_dir: Path, out: Path, mix: str, threads: int, imatrix: str | None, with_ggml: bool) -> dict:
    import numba

    from ..hf import HFCheckpoint
    from ..importance import Importance
    from ..layout import layout_by_name
    from ..plan import Policy
    from ..quantize import convert
    from ..reader import open_gguf

    numba.set_num_threads(threads)
    policy = Policy(base="q8_0", mix=mix)
    for q in TIMED:  # load the numba caches outside every timing
        quantize(q, np.ones((1, 256), np.float32), np.ones(256, np.float32))
    t0 = time.perf_counter()
    plans = convert(hf_dir, out, policy, imatrix=imatrix, progress=False)
    convert_s = time.perf_counter() - t0
    total_weights = sum(int(np.prod(p.ne)) for p in plans)

    ckpt = HFCheckpoint(hf_dir)
    layout = layout_by_name(ckpt.config)
    imp = Importance.load(imatrix) if imatrix else None
    written = open_gguf(out)
    rows: dict[QuantType, dict] = defaultdict(lambda: {"weights": 0, "tensors": 0, "ours": 0.0, "ggml": 0.0,
                                                       "identical": True})
    for p in plans:
        if p.qtype not in TIMED:
            continue
        r = rows[p.qtype]
        r["tensors"] += 1
        stored = written.raw(p.name).reshape(-1)
        ours_parts, ggml_parts = [], []
        for w, importance in _matrices(ckpt, layout[p.name], p.qtype, imp):
            w = np.ascontiguousarray(w, dtype=np.float32)
            r["weights"] += w.size
            t = time.perf_counter()
            ours_parts.append(quantize(p.qtype, w, importance).reshape(-1))
            r["ours"] += time.perf_counter() - t
            if with_ggml:
                # ggml's IQ2_XXS needs importance: give it the synthetic one ours computes internally
                gimp = synthetic_importance(w) if importance is None and p.qtype == QuantType.IQ2_XXS else importance
                t = time.perf_counter()
                ggml_parts.append(ggml_oracle.quantize_in_process(p.qtype, w, gimp, threads=threads).reshape(-1))
                r["ggml"] += time.perf_counter() - t
        r["identical"] &= bool(np.array_equal(np.concatenate(ours_parts), stored))
        if with_ggml:
            r["identical"] &= bool(np.array_equal(np.concatenate(ggml_parts), stored))
    return {"convert_s": convert_s, "total_weights": total_weights, "rows": dict(rows),
            "bytes": out.stat().st_size, "n_tensors": len(plans)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds4.gguf_tools.quants.bench_convert",
                                 description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", default="small", choices=["small"],
                     help="synthesize a random checkpoint of this preset first (default small; not timed)")
    src.add_argument("--hf", metavar="DIR", help="convert this checkpoint instead")
    ap.add_argument("--mix", default="q2", choices=["q2", "q4"], help="routed-expert mix (default q2)")
    ap.add_argument("--imatrix", metavar="FILE", help="importance matrix passed to convert (and to ggml)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for ours and for ggml")
    ap.add_argument("--no-ggml", action="store_true", help="time ours only")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return 2
    if args.hf and not (Path(args.hf) / "config.json").is_file():
        print(f"error: {args.hf}: not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    with_ggml = not args.no_ggml and ggml_oracle.available()
    if not args.no_ggml and not with_ggml:
        print("note: llama-cpp-python not installed; timing ours only", file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="ds4-bench-convert-") as tmp:
        hf = Path(args.hf) if args.hf else Path(tmp) / f"{args.preset}-hf"
        if not args.hf:
            from ds4.engine.config import preset
            from ..synth import synth_checkpoint

            print(f"synthesizing a random '{args.preset}' checkpoint (seed {args.seed}) ...", file=sys.stderr)
            synth_checkpoint(preset(args.preset), hf, args.seed)
        from ..plan import PlanError

        try:
            res = run(hf, Path(tmp) / "out.gguf", args.mix, args.threads, args.imatrix, with_ggml)
        except (PlanError, ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    rows = res["rows"]
    print(f"convert --type q8_0 --mix {args.mix}{' --imatrix' if args.imatrix else ''} of {hf.name}: "
          f"{res['n_tensors']} tensors, {res['total_weights'] / 1e6:.1f}M weights, {res['bytes'] / 2**20:.1f} MiB, "
          f"{args.threads} threads")
    head = f"{'type':8} {'tensors':>7} {'M weights':>10} {'ours s':>8} {'ggml s':>8} {'ggml/ours':>9}  identical"
    print(head + "\n" + "-" * len(head))
    ours_total = ggml_total = 0.0
    for q in TIMED:
        if q not in rows:
            continue
        r = rows[q]
        ours_total += r["ours"]
        ggml_total += r["ggml"]
        ratio = f"{r['ggml'] / r['ours']:9.2f}" if with_ggml and r["ours"] > 0 else "        -"
        ggml_s = f"{r['ggml']:8.2f}" if with_ggml else "       -"
        print(f"{q.name:8} {r['tensors']:7d} {r['weights'] / 1e6:10.1f} {r['ours']:8.2f} {ggml_s} {ratio}  "
              f"{'yes' if r['identical'] else 'NO'}")
    qweights = sum(r["weights"] for r in rows.values())
    print(f"{'all':8} {sum(r['tensors'] for r in rows.values()):7d} {qweights / 1e6:10.1f} {ours_total:8.2f} "
          + (f"{ggml_total:8.2f} {ggml_total / ours_total:9.2f}" if with_ggml else ""))
    print(f"end-to-end convert: {res['convert_s']:.2f} s = {res['total_weights'] / res['convert_s'] / 1e6:.2f}M weights/s "
          f"(all tensors, incl. reading the checkpoint and writing the GGUF)")
    if with_ggml:
        print(f"ggml quantization alone of the same quantized tensors: {ggml_total:.2f} s; "
              f"convert end to end / ggml quantization = {res['convert_s'] / ggml_total:.2f}")
    ok = all(r["identical"] for r in rows.values())
    if not ok:
        print("MISMATCH: the converted file differs from the kernels' bytes", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
