"""`ds4-steer`: build, inspect, convert and sweep directional-steering vectors (tooling-spec §8).

    ds4-steer build [--positive A.txt --negative B.txt] -o dir.f32 [--gguf cv.gguf]
    ds4-steer sweep --direction dir.f32 [--prompts P.txt] [--scales -2,-1,0,1,2] [--csv F] [--chart F.png]
    ds4-steer generate --dir-steering-file dir.f32 --dir-steering-ffn -1 -p "Explain ..."
    ds4-steer info dir.f32
    ds4-steer convert dir.f32 dir.gguf       (raw f32 + JSON ↔ llama.cpp control-vector GGUF)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from ds4 import paths
from ds4.cli_util import UsageError, add_model_argument, check_output_folder, count, load_model, run_command
from ds4.steering import apply as steer_apply
from ds4.steering.build import COMPONENT_KIND, DEFAULT_SYSTEM, direction_from_activations, read_prompt_file
from ds4.steering.format import (
    DirectionSet, SteeringFileError, load_directions, read_control_vector, read_f32, sidecar_meta,
    write_control_vector, write_f32,
)

def _data(name: str) -> str:
    return str(paths.data_dir() / "steering" / name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ds4-steer",
        description="Directional steering for DeepSeek V4: build a per-layer unit direction from two prompt sets "
                    "(difference of means of a sublayer output at the last prompt token), apply it at run time "
                    "as y ← y − s·v·(v·y), and sweep scales.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    b = sub.add_parser("build", help="build a direction from positive and negative prompt sets",
                       description="Run both prompt sets (one prompt per line, '#' comments) rendered as chat, capture "
                                   "the chosen sublayer output of every layer at the last prompt token, and write "
                                   "normalize(mean(positive) − mean(negative)) per layer.")
    add_model_argument(b)
    b.add_argument("--positive", default=_data("succinct.txt"), help="target prompts (default: shared succinct.txt)")
    b.add_argument("--negative", default=_data("verbose.txt"), help="contrast prompts (default: shared verbose.txt)")
    b.add_argument("-o", "--output", required=True, help="raw layers×hidden float32 file (+ .json sidecar)")
    b.add_argument("--gguf", default=None, metavar="F", help="also write a llama.cpp control-vector GGUF")
    b.add_argument("--component", choices=sorted(COMPONENT_KIND), default="ffn_out")
    b.add_argument("--think", action="store_true", help="capture after <think> (default: after </think>)")
    b.add_argument("--system", default=DEFAULT_SYSTEM, help=f"system prompt (default: {DEFAULT_SYSTEM!r})")
    b.add_argument("--ctx", type=count, default=512)
    b.add_argument("--pair-normalize", action="store_true", help="mean of normalized pair differences")
    b.add_argument("--no-orthogonalize", action="store_true",
                   help="keep the component along the negative set's mean")
    b.add_argument("--max-prompts", type=count, default=0, help="use the first N pairs (0 = all)")
    b.add_argument("-q", "--quiet", action="store_true")

    s = sub.add_parser("sweep", help="generate at several scales and report response length per scale")
    add_model_argument(s)
    s.add_argument("--direction", required=True, help="direction file (.f32 or control-vector GGUF)")
    s.add_argument("--prompts", default=_data("eval_prompts.txt"), help="default: shared eval_prompts.txt")
    s.add_argument("--scales", default="-2,-1,-0.5,0,0.5,1,2", help="comma list of FFN scales; write --scales=-1,0,1 when the list starts with a minus")
    s.add_argument("--tokens", type=count, default=160, help="tokens to generate per run (default 160)")
    s.add_argument("--ctx", type=count, default=4096)
    s.add_argument("--attn-scale", type=steer_apply._scale, default=0.0)
    s.add_argument("--think", action="store_true", help="thinking mode (default: no thinking)")
    s.add_argument("--system", default="", help="system prompt (default none)")
    s.add_argument("--metric", choices=["tokens", "words", "chars"], default="tokens")
    s.add_argument("--max-prompts", type=count, default=0)
    s.add_argument("--csv", default=None, help="write prompt, scale, metric, text rows")
    s.add_argument("--chart", default=None, metavar="PNG", help="write a chart of the metric against the scale")
    s.add_argument("--show-text", action="store_true", help="print every generation")
    s.add_argument("-q", "--quiet", action="store_true")

    g = sub.add_parser("generate", help="one greedy generation with steering (a quick look)")
    add_model_argument(g)
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("-n", "--tokens", type=count, default=64)
    g.add_argument("--ctx", type=count, default=4096)
    g.add_argument("--think", action="store_true")
    g.add_argument("--system", default="")
    steer_apply.add_arguments(g)

    i = sub.add_parser("info", help="print shape, norms and metadata of a direction file")
    i.add_argument("file")

    c = sub.add_parser("convert", help="convert raw .f32 (+ JSON) ↔ control-vector GGUF (by output name)")
    c.add_argument("input")
    c.add_argument("output", help="*.gguf → control vector, otherwise raw .f32 + .json")
    return p


def _prompts(path: str, limit: int = 0) -> list[str]:
    if not Path(path).is_file():
        raise UsageError(f"{path}: no such file")
    prompts = read_prompt_file(path)
    if not prompts:
        raise UsageError(f"{path}: no prompts")
    return prompts[:limit] if limit else prompts


def cmd_build(args) -> int:
    from tqdm import tqdm

    for out in (args.output, args.gguf):
        check_output_folder(out)

    from ds4.steering.run import capture_last_rows

    good, bad = _prompts(args.positive), _prompts(args.negative)
    n = min(len(good), len(bad))
    if args.max_prompts:
        n = min(n, args.max_prompts)
    good, bad = good[:n], bad[:n]
    model = load_model(args.model)
    t0 = time.perf_counter()
    with tqdm(total=2 * n, unit="prompt", disable=args.quiet, desc="build", dynamic_ncols=True) as bar:
        kw = dict(system=args.system, thinking=args.think, ctx=args.ctx, progress=bar)
        acts_good = capture_last_rows(model, good, args.component, **kw)
        acts_bad = capture_last_rows(model, bad, args.component, **kw)
    vectors = direction_from_activations(acts_good, acts_bad, pair_normalize=args.pair_normalize,
                                         orthogonalize=not args.no_orthogonalize)
    meta = sidecar_meta(vectors.shape, component=args.component, thinking=args.think,
                        pair_normalize=args.pair_normalize, orthogonalize=not args.no_orthogonalize,
                        good_file=args.positive, bad_file=args.negative, model=model.path or "")
    ds = DirectionSet(vectors, meta)
    write_f32(args.output, ds)
    if args.gguf:
        write_control_vector(args.gguf, ds)
    # How separable the sets are per layer: projection gap along the direction, in pooled std units.
    gaps = []
    for layer in range(ds.n_layer):
        pg, pb = acts_good[:, layer] @ vectors[layer], acts_bad[:, layer] @ vectors[layer]
        spread = np.sqrt((pg.var() + pb.var()) / 2) + 1e-12
        gaps.append((pg.mean() - pb.mean()) / spread)
    print(f"{n} pairs, {ds.n_layer} layers × {ds.n_embd}, component {args.component}, "
          f"{time.perf_counter() - t0:.1f} s → {args.output}" + (f", {args.gguf}" if args.gguf else ""))
    print("separation per layer (mean gap / pooled std): " + " ".join(f"{g:.2f}" for g in gaps))
    return 0


def cmd_sweep(args) -> int:
    from ds4.steering.sweep import parse_scales, plot_sweep, run_sweep, table_text, write_csv

    try:
        scales = parse_scales(args.scales)
    except ValueError as e:
        raise UsageError(str(e)) from None
    prompts = _prompts(args.prompts, args.max_prompts)
    for out in (args.csv, args.chart):
        check_output_folder(out)
    model = load_model(args.model)
    cfg = model.config
    ds = load_directions(args.direction, cfg.n_layer, cfg.n_embd)

    def show(row):
        if args.show_text:
            print("=" * 80 + f"\nPROMPT: {row.prompt}\n" + "-" * 80 + f"\nFFN scale: {row.scale:g}\n{row.text}\n")

    rows = run_sweep(model, ds, prompts, scales, tokens=args.tokens, ctx=args.ctx, attn_scale=args.attn_scale,
                     thinking=args.think, system=args.system, metric=args.metric, progress=not args.quiet,
                     on_row=show)
    print(table_text(rows, args.metric))
    if args.csv:
        write_csv(args.csv, rows, args.metric)
        print(f"csv: {args.csv}")
    if args.chart:
        plot_sweep(args.chart, rows, args.metric, title=f"steering sweep: {Path(args.direction).name}")
        print(f"chart: {args.chart}")
    return 0


def cmd_generate(args) -> int:
    from ds4.steering.build import render_prompt
    from ds4.steering.run import generate_greedy

    model = load_model(args.model)
    hooks = steer_apply.hooks_from_args(args, model.config)
    ids = model.tokenizer.encode_chat(render_prompt(args.prompt, args.system, args.think))
    gen = generate_greedy(model, ids, args.tokens, hooks, args.ctx)
    print(gen.text)
    print(f"[{len(gen.tokens)} tokens{', EOS' if gen.stopped else ''}]", file=sys.stderr)
    return 0


def _read_any(path: str) -> DirectionSet:
    if not Path(path).is_file():
        raise UsageError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    return read_control_vector(path) if magic == b"GGUF" else read_f32(path)


def cmd_info(args) -> int:
    ds = _read_any(args.file)
    norms = np.linalg.norm(ds.vectors, axis=1)
    print(f"{args.file}: {ds.n_layer} layers × {ds.n_embd} hidden, component {ds.component}")
    print(f"row norms: min {norms.min():.6f}  max {norms.max():.6f}  zero rows {int((norms == 0).sum())}")
    for k, v in ds.meta.items():
        if k not in ("shape",):
            print(f"  {k}: {v}")
    return 0


def cmd_convert(args) -> int:
    ds = _read_any(args.input)
    if args.output.lower().endswith(".gguf"):
        write_control_vector(args.output, ds)
    else:
        if not ds.meta:
            ds.meta = sidecar_meta(ds.vectors.shape)
        write_f32(args.output, ds)
    print(f"{args.input} → {args.output} ({ds.n_layer} × {ds.n_embd})")
    return 0


COMMANDS = {"build": cmd_build, "sweep": cmd_sweep, "generate": cmd_generate, "info": cmd_info,
            "convert": cmd_convert}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command("ds4-steer", COMMANDS[args.command], args, (SteeringFileError,))


if __name__ == "__main__":
    sys.exit(main())
