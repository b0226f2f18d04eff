"""ds4-bench: frontier speed sweeps (tooling-spec §6), charts and comparisons.

    ds4-bench -m MODEL --ctx-start 2048 --ctx-max 65536 --step-incr 2048 --gen-tokens 128 --csv run.csv
    ds4-bench plot run.csv [other.csv ...] -o chart.svg|png
    ds4-bench compare A.csv B.csv [--markdown]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import numpy as np

from ds4 import paths
from ds4.cli_util import add_data_dir_argument, add_model_argument, fail, positive_int
from ds4.engine import power

from .csvio import BenchCsvError, BenchRun, format_csv, git_revision, machine_description, read_csv, write_csv


def _step_mul(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}") from None
    if not v >= 1:
        raise argparse.ArgumentTypeError(f"--step-mul must be >= 1, got {v}")
    return v


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ds4-bench",
        description="Measure prefill and generation speed at increasing context frontiers. Subcommands: "
                    "'ds4-bench plot CSV... -o OUT' and 'ds4-bench compare A.csv B.csv'.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt-file", help="raw text, plain BPE (default: promessi_sposi.txt from the data dir)")
    src.add_argument("--chat-prompt-file", help="text rendered as BOS + system + <｜User｜> text <｜Assistant｜></think>")
    p.add_argument("-sys", "--system", default="You are a helpful assistant.", help="system prompt (chat mode)")
    add_model_argument(p)
    p.add_argument("--backend", choices=("cpu", "cuda"), default=None, help="engine backend (default: cuda if built)")
    add_data_dir_argument(p)
    p.add_argument("--ctx-start", type=positive_int, default=2048)
    p.add_argument("--ctx-max", type=positive_int, default=32768)
    p.add_argument("--ctx-alloc", type=positive_int, default=None, help="session size (default ctx-max + gen + 1)")
    p.add_argument("--step-incr", type=positive_int, default=2048, help="linear step (when --step-mul is 1)")
    p.add_argument("--step-mul", type=_step_mul, default=1.0, help="exponential step factor (> 1)")
    p.add_argument("--gen-tokens", "--tokens", "-n", type=positive_int, default=128)
    p.add_argument("--prefill-chunk", type=positive_int, default=None, help="engine prefill chunk (default: engine's)")
    p.add_argument("-t", "--threads", type=positive_int, default=None, help="CPU threads for the numba kernels")
    p.add_argument("--csv", default=None, help="output CSV (default: stdout)")
    p.add_argument("--label", default=None, help="legend label stored in the CSV header")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed warm-up (numba compiles its kernels on first use; without the "
                        "warm-up the first row measures compilation too)")
    power.add_power_argument(p)
    from ds4.steering import apply as steering
    steering.add_arguments(p)
    return p


def plot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds4-bench plot", description="Chart prefill and generation t/s against context.")
    p.add_argument("csv", nargs="+", help="ds4-bench CSV files (several are overlaid)")
    p.add_argument("-o", "--out", default=None, help="output .svg or .png (default: <first-csv-stem>_ts.svg)")
    p.add_argument("--title", default=None)
    p.add_argument("--width", type=positive_int, default=960)
    p.add_argument("--height", type=positive_int, default=540)
    return p


def compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds4-bench compare", description="Per-frontier t/s ratios of B over A.")
    p.add_argument("a", help="baseline CSV")
    p.add_argument("b", help="candidate CSV")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    return p


def _fail(msg: str) -> int:
    return fail("ds4-bench", msg)


def cmd_plot(argv: list[str]) -> int:
    args = plot_parser().parse_args(argv)
    from .plot import plot_runs
    try:
        runs = [read_csv(c) for c in args.csv]
    except (OSError, BenchCsvError) as e:
        return _fail(str(e) if isinstance(e, BenchCsvError) else f"{e.filename}: {e.strerror}")
    out = Path(args.out) if args.out else Path(args.csv[0]).with_name(Path(args.csv[0]).stem + "_ts.svg")
    if out.suffix.lower() not in (".svg", ".png"):
        return _fail(f"{out}: output must end in .svg or .png")
    try:
        plot_runs(runs, out, title=args.title, width=args.width, height=args.height)
    except ValueError as e:
        return _fail(str(e))
    print(f"wrote {out}")
    return 0


def cmd_compare(argv: list[str]) -> int:
    args = compare_parser().parse_args(argv)
    from .plot import compare_runs, format_comparison
    try:
        a, b = read_csv(args.a), read_csv(args.b)
        rows = compare_runs(a, b)
    except OSError as e:
        return _fail(f"{e.filename}: {e.strerror}")
    except (BenchCsvError, ValueError) as e:
        return _fail(str(e))
    sys.stdout.write(format_comparison(a, b, rows, markdown=args.markdown))
    return 0


def read_prompt_text(args) -> str:
    path = args.chat_prompt_file or args.prompt_file or paths.data_dir(args.data_dir) / "speed-bench" / "promessi_sposi.txt"
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None


def prompt_tokens(args, model, text: str) -> list[int]:
    """The fixed token sequence the sweep walks: plain BPE of the text (or the chat rendering)."""
    from ds4.test_vectors.runtime import render_nothink
    tok = model.tokenizer
    # Tokenize only as much text as the sweep needs (BPE of 1.3 MB in Python takes a while):
    # grow the slice until it yields ctx_max tokens.
    need = args.ctx_max
    n_chars = min(len(text), need * 6 + 1024)
    while True:
        piece = text[:n_chars]
        ids = render_nothink(tok, piece, args.system) if args.chat_prompt_file else tok.encode(piece)
        if len(ids) >= need or n_chars >= len(text):
            break
        n_chars = min(len(text), n_chars * 2)
    if len(ids) < need:
        raise ValueError(f"the prompt has {len(ids)} tokens, fewer than --ctx-max {need}")
    return ids if args.chat_prompt_file else ids[:need]


def _loadavg() -> str:
    """Other processes skew CPU timings; the 1-minute load average at the start says how much."""
    try:
        import os
        return f"{os.getloadavg()[0]:.2f} ({os.cpu_count()} cpus)"
    except OSError:
        return "unknown"


def open_bench_session(model, ctx: int, backend: str, prefill_chunk: int | None, hooks=None):
    """`open_session` (throttled by --power when installed) with the steering hooks, if any, run first."""
    from ds4.engine.hooks import HookList
    from ds4.test_vectors.runtime import ToolError, open_session
    if hooks is not None and backend != "cpu":
        raise ToolError("directional steering needs --backend cpu (the CUDA engine has no hooks)")
    session = open_session(model, ctx, backend, prefill_chunk)
    if hooks is not None:
        session.hooks = hooks if session.hooks is None else HookList(hooks, session.hooks)
    return session


def _steering_meta(args) -> str | None:
    """The steering flags as one CSV header value (None without steering)."""
    if not args.dir_steering_file:
        return None
    return (f"files={','.join(args.dir_steering_file)} attn={args.dir_steering_attn or 'default'} "
            f"ffn={args.dir_steering_ffn or 'default'}")


def cmd_run(argv: list[str]) -> int:
    args = run_parser().parse_args(argv)
    if args.ctx_start > args.ctx_max:
        return _fail("--ctx-start must not exceed --ctx-max")
    ctx_alloc = args.ctx_alloc or args.ctx_max + args.gen_tokens + 1
    if ctx_alloc <= args.ctx_max + args.gen_tokens:
        return _fail("--ctx-alloc must be > ctx-max + gen-tokens")
    from ds4.steering import apply as steering
    from ds4.test_vectors.runtime import ToolError, check_backend, eos_id, load_model

    from .frontier import frontiers, sweep
    model_path = Path(args.model) if args.model else paths.default_model()
    # Installed before any session opens, so every session is throttled between layers too.
    throttle = power.install(args.power)
    try:
        backend = check_backend(args.backend)
        text = read_prompt_text(args)
        model = load_model(model_path)
        tokens = prompt_tokens(args, model, text)
        hooks = steering.hooks_from_args(args, model.config)  # SteeringFileError is a ValueError
        session = open_bench_session(model, ctx_alloc, backend, args.prefill_chunk, hooks)
    except (ToolError, ValueError) as e:
        return _fail(str(e))
    if args.threads:
        import numba
        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
        meta_threads = str(numba.get_num_threads())
    else:
        meta_threads = "default"
    if hasattr(model, "warm"):
        model.warm()  # keep one-time weight conversion out of the first timed prefill
    meta = {"model": str(model_path), "backend": backend, "machine": machine_description(), "git": git_revision(),
            "gen_tokens": str(args.gen_tokens), "power": str(args.power), "loadavg_at_start": _loadavg(),
            "threads": meta_threads}
    meta.update(floor_meta(model, backend))
    if args.label:
        meta["label"] = args.label
    if _steering_meta(args):
        meta["steering"] = _steering_meta(args)
    fronts = list(frontiers(args.ctx_start, args.ctx_max, args.step_incr, args.step_mul))
    if not args.no_warmup:
        # The session itself past the sliding window and a ratio-128 compression boundary, in chunks and token by
        # token, so every kernel is compiled (and the CUDA engine's decode graph captured) before the first timed row;
        # then its timeline is dropped. A second session would hold a second copy of the weights: Flash q2 is 81 GiB.
        # The CUDA engine captures a decode graph per step kind (which compressors pool): warm_steps meets them all.
        # Its graphs of steps that run the indexer, which a short context would not meet, are captured under
        # indexer_forced first.
        n = min(args.ctx_start, 300, len(tokens) - 1)
        logits = session.sync(tokens[:n])
        passes = (session.indexer_forced, contextlib.nullcontext) if hasattr(session, "indexer_forced") else \
            (contextlib.nullcontext,)
        for warm_pass in passes:
            with warm_pass():
                steps = max(2, getattr(session, "warm_steps", lambda: 2)())
                for _ in range(min(steps, session.ctx - n - 1)):
                    logits = session.decode(int(np.argmax(logits)))
                    n += 1
        session.invalidate()
    from tqdm import tqdm
    bar = tqdm(total=len(fronts), desc="frontiers", unit="row", disable=not sys.stderr.isatty())

    def on_row(row):
        bar.update(1)
        bar.set_postfix_str(f"ctx {row.ctx_tokens}: prefill {row.prefill_tps:.1f} t/s, gen {row.gen_tps:.1f} t/s")

    rows = sweep(session, tokens, fronts, args.gen_tokens, eos_id(model), on_row=on_row,
                 throttle_step=power.step if throttle else None)
    bar.close()
    meta.update(gpu_memory_meta(backend))
    run = BenchRun(meta=meta, rows=rows)
    report_floor(run)
    if args.csv:
        write_csv(args.csv, run)
        print(f"wrote {args.csv} ({len(rows)} rows)", file=sys.stderr)
    else:
        sys.stdout.write(format_csv(run))
    return 0


def floor_meta(model, backend: str) -> dict[str, str]:
    """Header fields for the decode bandwidth floor: weight bytes per decoded token (always) and, on
    the GPU, the device-to-device copy bandwidth measured now and the floor they give."""
    from ds4.engine.model import decode_weight_bytes

    if getattr(model, "file", None) is None:
        return {}
    wbytes = sum(decode_weight_bytes(model.file, model.config).values())
    meta = {"weight_bytes_per_token": str(int(wbytes))}
    if backend == "cuda":
        from ds4.engine import gpu

        ext = gpu.load()
        gbps = ext.copy_bandwidth()["gbps"]
        meta["copy_gbps"] = f"{gbps:.0f}"
        meta["floor_ms"] = f"{wbytes / (gbps * 1e9) * 1e3:.4f}"
        meta["gpu_device"] = str(ext.device_info()["name"])
        # build-time switches change the kernels without a runtime trace: record them beside the figures
        meta["gpu_l2_evict_first"] = str(int(ext.l2_evict_first()))
    return meta


def gpu_memory_meta(backend: str) -> dict[str, str]:
    """On the GPU, after the sweep (the session still open, sized for the whole context): the device's memory in use by
    every process (total - free) and torch's peak allocation, in GiB."""
    if backend != "cuda":
        return {}
    import torch

    free, total = torch.cuda.mem_get_info()
    return {"gpu_mem_used_gib": f"{(total - free) / 2**30:.2f}",
            "torch_peak_gib": f"{torch.cuda.max_memory_allocated() / 2**30:.2f}"}


def report_floor(run: BenchRun) -> None:
    """On stderr: each frontier's generation speed as a fraction of the bandwidth floor (when known)."""
    floor = run.meta.get("floor_ms")
    if not floor:
        return
    floor_ms = float(floor)
    print(f"bandwidth floor {floor_ms:.3f} ms/token ({1e3 / floor_ms:.0f} t/s; "
          f"{int(run.meta['weight_bytes_per_token']) / 1e9:.3f} GB at {run.meta['copy_gbps']} GB/s)", file=sys.stderr)
    for row in run.rows:
        print(f"  ctx {row.ctx_tokens}: gen {row.gen_tps:.1f} t/s = {row.gen_tps * floor_ms / 1e3:.2f} of the floor",
              file=sys.stderr)
    if "gpu_mem_used_gib" in run.meta:
        print(f"GPU memory in use after the sweep: {run.meta['gpu_mem_used_gib']} GiB (torch peak "
              f"{run.meta['torch_peak_gib']} GiB)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        return cmd_plot(argv[1:])
    if argv and argv[0] == "compare":
        return cmd_compare(argv[1:])
    if argv and argv[0] == "run":
        argv = argv[1:]
    return cmd_run(argv)


if __name__ == "__main__":
    sys.exit(main())
