"""`ds4-imatrix`: collect, inspect and convert routed-MoE importance matrices (tooling-spec §3).

    ds4-imatrix collect [-m MODEL] [--dataset F | --rendered F] -o imatrix.dat|.gguf [--heatmap P.png]
    ds4-imatrix build-dataset records.jsonl -o rendered.txt [--modes think,nothink]
    ds4-imatrix stats FILE [--heatmap P.png]
    ds4-imatrix convert IN OUT            (.dat ↔ .gguf, chosen by OUT's name)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ds4 import paths
from ds4.atomic import atomic_write
from ds4.cli_util import UsageError, add_model_argument, check_output_folder, count, load_model, run_command
from ds4.imatrix import format as fmt


def default_dataset() -> Path:
    return paths.data_dir() / "imatrix" / "prompts.jsonl.gz"


def _modes(text: str) -> tuple[str, ...]:
    from ds4.imatrix.dataset import MODES

    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes must be a comma list of {', '.join(MODES)}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ds4-imatrix",
        description="Collect per-expert importance matrices for DeepSeek V4 routed experts through the engine "
                    "hooks, and read, print, plot or convert them (legacy .dat as ds4 writes it, GGUF imatrix).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("collect", help="run calibration prompts through the model and write an imatrix",
                       description="Prefill every calibration prompt (each from a fresh state) and accumulate, per "
                                   "layer and routed expert, the sum of squared gate/up and down inputs and the "
                                   "number of routed tokens. Ctrl+C writes what was collected so far (marked "
                                   "partial).")
    add_model_argument(c)
    src = c.add_mutually_exclusive_group()
    src.add_argument("--dataset", default=None,
                     help="JSONL(.gz) chat records, or rendered marker text (default: the shared calibration set "
                          "imatrix/prompts.jsonl.gz)")
    src.add_argument("--rendered", default=None, help="pre-rendered text with DS4_IMATRIX_PROMPT markers (.txt/.gz)")
    c.add_argument("-o", "--output", required=True, help="output file: *.gguf → GGUF imatrix, otherwise legacy .dat")
    c.add_argument("--format", choices=[f.value for f in fmt.ImatrixFormat], default=None,
                   help="force the output format instead of choosing it by file name")
    c.add_argument("--modes", type=_modes, default=("nothink", "think"),
                   help="think variants to use from JSONL records (default nothink,think)")
    c.add_argument("--max-prompts", type=count, default=0, help="stop after N prompts (0 = all)")
    c.add_argument("--max-tokens", type=count, default=0, help="stop after N tokens in total (0 = unlimited)")
    c.add_argument("--ctx", type=count, default=32768, help="truncate each prompt to N tokens (default 32768)")
    c.add_argument("--chunk", type=count, default=2048, help="prefill batch size (default 2048)")
    c.add_argument("--all-tensors", action="store_true",
                   help="also collect shared-expert (and, where the engine reports them, attention) inputs")
    c.add_argument("--heatmap", default=None, metavar="PNG", help="also write a heat-map of expert usage")
    c.add_argument("--backend", choices=["cpu", "cuda"], default="cpu", help="engine backend (default cpu)")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no statistics")
    from ds4.engine import power
    power.add_power_argument(c)

    b = sub.add_parser("build-dataset", help="render a JSONL of chat records into calibration text",
                       description="Render chat records ({messages, tools?, mode?}) with the engine's chat renderer "
                                   "in think and/or no-think mode into the DS4_IMATRIX_PROMPT marker format (or JSONL "
                                   "with a 'rendered' field when OUT ends in .jsonl).")
    b.add_argument("input", help="JSONL(.gz) file of chat records")
    b.add_argument("-o", "--output", required=True, help="rendered text (.txt) or records with 'rendered' (.jsonl)")
    b.add_argument("--modes", type=_modes, default=("nothink", "think"), help="default nothink,think")
    b.add_argument("--rerender", action="store_true", help="render records that already carry 'rendered' text again")

    s = sub.add_parser("stats", help="print tokens, per-layer expert coverage; optional heat-map PNG")
    s.add_argument("file", help="imatrix (.dat or GGUF)")
    s.add_argument("--heatmap", default=None, metavar="PNG")

    q = sub.add_parser("quant-error", help="measure the weighted quantization error of routed experts with and "
                                           "without an imatrix, on held-out activations",
                       description="Capture held-out routed inputs of one layer through the engine, quantize each "
                                   "expert of a routed tensor with ds4's default importance (column energy of W) "
                                   "and with the imatrix, and report Σ‖(W−Ŵ)x‖² / Σ‖Wx‖² for both.")
    add_model_argument(q)
    q.add_argument("--imatrix", required=True, help="imatrix file (.dat or GGUF)")
    qsrc = q.add_mutually_exclusive_group()
    qsrc.add_argument("--dataset", default=None, help="held-out prompts (JSONL records or marker text)")
    qsrc.add_argument("--rendered", default=None)
    q.add_argument("--skip-prompts", type=count, default=0, help="skip the first N prompts (held out = unseen)")
    q.add_argument("--max-tokens", type=count, default=2048)
    q.add_argument("--layer", type=count, default=3)
    q.add_argument("--kind", choices=["gate", "up", "down"], default="gate")
    q.add_argument("--type", default="iq2_xxs", choices=["iq2_xxs", "q2_k", "q4_k", "q8_0"])
    q.add_argument("--max-experts", type=count, default=0)

    v = sub.add_parser("convert", help="convert between legacy .dat and GGUF imatrix")
    v.add_argument("input")
    v.add_argument("output", help="*.gguf → GGUF, otherwise .dat")
    return p


# ---- subcommands ---------------------------------------------------------------------------------

def cmd_stats(args) -> int:
    from ds4.imatrix.stats import plot_heatmap, summary_lines

    im = fmt.load(args.file)
    print("\n".join(summary_lines(im)))
    if args.heatmap:
        try:
            plot_heatmap(im, args.heatmap)
        except ValueError as e:
            raise UsageError(str(e)) from None
        print(f"heat-map: {args.heatmap}")
    return 0


def cmd_convert(args) -> int:
    im = fmt.load(args.input)
    fmt.save(args.output, im)
    print(f"{args.input} → {args.output} ({len(im.entries)} entries, {Path(args.output).stat().st_size} bytes)")
    return 0


def cmd_build_dataset(args) -> int:
    import json

    from ds4.imatrix.collect import iter_jsonl
    from ds4.imatrix.dataset import RecordError, render_record, rendered_file_text

    src = Path(args.input)
    if not src.is_file():
        raise UsageError(f"{src}: no such file")
    prompts, records = [], []
    try:
        for i, rec in enumerate(iter_jsonl(src)):
            for p in render_record(rec, args.modes, index=i, rerender=args.rerender):
                prompts.append(p)
                records.append({"id": p.id, "category": p.category, "mode": p.mode, "source": p.source,
                                "messages": rec.get("messages", []), "rendered": p.text})
    except (RecordError, ValueError) as e:
        raise UsageError(str(e)) from None
    out = Path(args.output)
    if out.name.endswith(".jsonl"):
        text = "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in records)
    else:
        text = rendered_file_text(prompts)
    atomic_write(out, lambda p: p.write_text(text, encoding="utf-8"))
    print(f"{len(prompts)} prompts from {src} → {out} ({len(text.encode())} bytes)")
    return 0


def cmd_collect(args) -> int:
    from ds4.imatrix.collect import collect, load_prompts

    check_output_folder(args.output)
    check_output_folder(args.heatmap)

    source = args.rendered or args.dataset or str(default_dataset())
    try:
        prompts = load_prompts(source, args.modes)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not prompts:
        raise UsageError(f"{source}: no prompts")
    if args.max_prompts:
        prompts = prompts[: args.max_prompts]
    if args.ctx == 0 or args.chunk == 0:
        raise UsageError("--ctx and --chunk must be > 0")
    model = _load_model(args.model, args.backend)
    from ds4.engine import power
    throttle = power.install(args.power)  # collect() attaches it to its session
    t0 = time.perf_counter()
    result = collect(model, prompts, ctx=args.ctx, max_tokens=args.max_tokens, chunk=args.chunk,
                     all_tensors=args.all_tensors, progress=not args.quiet)
    elapsed = time.perf_counter() - t0
    im = result.accumulator.to_imatrix(dataset=source, chunk_size=args.chunk, partial=result.interrupted)
    fmt.save(args.output, im, args.format)
    size = Path(args.output).stat().st_size
    if not args.quiet:
        from ds4.imatrix.stats import summary_lines

        print("\n".join(summary_lines(im)))
    rate = result.tokens / elapsed if elapsed > 0 else 0.0
    state = "interrupted; partial file" if result.interrupted else "done"
    print(f"{state}: {result.prompts} prompts, {result.tokens} tokens in {elapsed:.1f} s ({rate:.1f} tok/s) "
          f"→ {args.output} ({size} bytes)", file=sys.stderr)
    if throttle is not None:
        print(f"--power {args.power}: busy fraction {throttle.busy_fraction:.2f} ({throttle.busy_s:.1f} s busy, "
              f"{throttle.slept_s:.1f} s slept)", file=sys.stderr)
    if args.heatmap:
        from ds4.imatrix.stats import plot_heatmap

        plot_heatmap(im, args.heatmap)
    return 130 if result.interrupted else 0


def _load_model(path: str | None, backend: str):
    if backend != "cpu":
        raise UsageError("only --backend cpu collects an imatrix in this version")
    return load_model(path)


def cmd_quant_error(args) -> int:
    from ds4.engine.session import Session
    from ds4.gguf_tools.constants import QuantType
    from ds4.imatrix.collect import load_prompts
    from ds4.imatrix.evaluate import LayerInputRecorder, compare_quantization

    im = fmt.load(args.imatrix)
    model = _load_model(args.model, "cpu")
    if args.layer >= model.config.n_layer:
        raise UsageError(f"--layer {args.layer}: the model has {model.config.n_layer} layers")
    source = args.rendered or args.dataset or str(default_dataset())
    try:
        prompts = load_prompts(source)[args.skip_prompts:]
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    rec = LayerInputRecorder(args.layer)
    used = 0
    for p in prompts:
        ids = model.tokenizer.encode_chat(p.text)[: args.max_tokens - used]
        if not ids:
            break
        Session(model, ctx=max(len(ids), 2), hooks=rec).prefill(ids)
        used += len(ids)
    rows = compare_quantization(model, im, rec, args.kind, QuantType[args.type.upper()], args.max_experts)
    if not rows:
        raise UsageError("no expert received enough held-out rows; raise --max-tokens")
    print(f"layer {args.layer} {args.kind}, {args.type}, {used} held-out tokens")
    print(f"{'expert':>6} {'rows':>6} {'err default':>12} {'err imatrix':>12} {'change':>8}")
    for r in rows:
        print(f"{r.expert:>6} {r.rows:>6} {r.err_default:>12.5f} {r.err_imatrix:>12.5f} "
              f"{100 * (r.err_imatrix / r.err_default - 1):>7.2f}%")
    d = sum(r.err_default * r.rows for r in rows) / sum(r.rows for r in rows)
    w = sum(r.err_imatrix * r.rows for r in rows) / sum(r.rows for r in rows)
    better = sum(r.err_imatrix < r.err_default for r in rows)
    print(f"row-weighted mean: default {d:.5f}, imatrix {w:.5f} ({100 * (w / d - 1):+.2f}%); "
          f"imatrix better on {better}/{len(rows)} experts")
    return 0


COMMANDS = {"collect": cmd_collect, "quant-error": cmd_quant_error, "build-dataset": cmd_build_dataset, "stats": cmd_stats, "convert": cmd_convert}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command("ds4-imatrix", COMMANDS[args.command], args, (fmt.ImatrixError,),
                       interrupted="interrupted (nothing written)")


if __name__ == "__main__":
    sys.exit(main())
