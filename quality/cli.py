"""ds4-quality: how close is a (quantized) model to its reference?

    ds4-quality collect -m BASE.gguf --out DIR          greedy continuations of prompts.jsonl (a local
                                                        stand-in for the official API continuations)
    ds4-quality score -m MODEL.gguf --manifest DIR/manifest.tsv -o OUT.tsv
    ds4-quality diff OLD.tsv NEW.tsv                    tooling-spec §4.4 comparison
    ds4-quality kld BASE.gguf TEST.gguf [--ctx 512 --chunks 8]
    ds4-quality kld BASE.gguf --save-logits base.kld    then later:  ds4-quality kld --base-logits base.kld TEST.gguf
    ds4-quality compare A.json B.json C.tsv ... --csv T.csv --md T.md --chart T.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ds4 import paths
from ds4.cli_util import add_data_dir_argument, add_model_argument, fail, positive_int
from ds4.engine import power
from ds4.test_vectors.formats import write_text_atomic
from ds4.test_vectors.runtime import ToolError, load_model


def _fail(msg: str) -> int:
    return fail("ds4-quality", msg)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds4-quality", description="Score a DS4 model against reference "
                                "continuations, or measure its KL divergence from a base model.")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("collect", help="write greedy continuations of the quality prompts from a local model")
    add_model_argument(c)
    c.add_argument("--prompts", default=None, help="prompts.jsonl (default: <data-dir>/quality/prompts.jsonl)")
    c.add_argument("--out", required=True, help="output directory (manifest.tsv, prompts/, continuations/)")
    c.add_argument("--count", type=positive_int, default=100)
    c.add_argument("--max-tokens", type=positive_int, default=24)
    c.add_argument("--ctx", type=positive_int, default=4096)
    c.add_argument("--base-url", default=None,
                   help="collect from an OpenAI-compatible endpoint instead of a local model "
                        "(e.g. https://api.deepseek.com or a ds4-server's http://host:port/v1)")
    c.add_argument("--api-model", default="deepseek-v4-flash", help="model name sent to the endpoint")
    c.add_argument("--attempts", type=positive_int, default=6, help="tries per prompt (pauses 1 s × 1.7^k between)")
    c.add_argument("--api-key-env", default="DEEPSEEK_API_KEY",
                   help="environment variable holding the bearer key (default DEEPSEEK_API_KEY; unset = none)")

    s = sub.add_parser("score", help="per-token NLL, first-token match, greedy prefix length (§4.3)")
    add_model_argument(s)
    s.add_argument("--manifest", required=True, help="manifest.tsv of a continuation set")
    s.add_argument("-o", "--out", required=True, help="output TSV")
    s.add_argument("--ctx", type=positive_int, default=4096)
    s.add_argument("--count", type=positive_int, default=None, help="score only the first N cases")

    d = sub.add_parser("diff", help="compare two score TSVs (§4.4)")
    d.add_argument("old")
    d.add_argument("new")

    k = sub.add_parser("kld", help="KL divergence of TEST from BASE over a text (llama.cpp-style report)")
    k.add_argument("models", nargs="*", help="BASE.gguf [TEST.gguf], or TEST.gguf with --base-logits")
    k.add_argument("--text", default=None, help="text file (default: promessi_sposi.txt from the data dir)")
    k.add_argument("--ctx", type=positive_int, default=512, help="tokens per chunk (default 512)")
    k.add_argument("--chunks", type=positive_int, default=4, help="number of chunks (default 4)")
    k.add_argument("--score-from", type=int, default=None,
                   help="first scored position of each chunk (default ctx/2: the first half is context)")
    k.add_argument("--save-logits", default=None, metavar="FILE", help="store the base log-probs for later")
    k.add_argument("--logits-dtype", choices=("f16", "f32"), default="f16")
    k.add_argument("--base-logits", default=None, metavar="FILE", help="use stored base log-probs")
    k.add_argument("--json", default=None, metavar="FILE", help="write the statistics as JSON (for compare)")
    k.add_argument("--hist", default=None, metavar="PNG", help="histogram of per-token KLD")
    k.add_argument("--label", default=None, help="name of this result in compare tables")

    m = sub.add_parser("compare", help="several score TSVs / kld JSONs in one table and bar chart")
    m.add_argument("files", nargs="+")
    m.add_argument("--csv", default=None)
    m.add_argument("--md", default=None)
    m.add_argument("--chart", default=None, help="bar chart .png/.svg")

    for sp in (c, s, k):
        sp.add_argument("--backend", choices=("cpu", "cuda"), default=None,
                        help="engine backend (default: cuda when it can run, else cpu)")
        add_data_dir_argument(sp)
        power.add_power_argument(sp)
    return p


def _bar(total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, disable=not sys.stderr.isatty())


def cmd_collect(args) -> int:
    import os
    import time

    from .run import api_continuation, greedy_continuation, read_prompts_jsonl, write_collection
    prompts = read_prompts_jsonl(args.prompts or paths.data_dir(args.data_dir) / "quality" / "prompts.jsonl")
    prompts = prompts[: args.count]
    if args.base_url:
        import openai
        client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get(args.api_key_env) or "none",
                               max_retries=0, timeout=120.0)
    else:
        model_path = Path(args.model) if args.model else paths.default_model()
        model = load_model(model_path)
    items = []
    bar = _bar(len(prompts), "collect")
    for cid, prompt in prompts:
        if args.base_url:
            resp = api_continuation(client, args.api_model, prompt, args.max_tokens, attempts=args.attempts)
            text = (resp.get("choices") or [{}])[0].get("message", {}).get("content") or ""
            if not text:
                print(f"ds4-quality: warning: {cid}: empty continuation", file=sys.stderr)
            time.sleep(0.05)  # the 50 ms pause between prompts of collect_official.py
        else:
            text, ids = greedy_continuation(model, prompt, args.max_tokens, args.ctx, args.backend)
            resp = {"source": "ds4-local", "model": model_path.name, "id": cid, "max_tokens": args.max_tokens,
                    "tokens": ids, "choices": [{"message": {"role": "assistant", "content": text}}]}
        items.append((cid, prompt, text, resp))
        bar.update(1)
    bar.close()
    write_collection(args.out, items)
    print(f"wrote {len(items)} continuations to {args.out}")
    return 0


def cmd_score(args) -> int:
    from .metrics import summarize, write_scores
    from .run import read_manifest_tsv, score_case
    cases = read_manifest_tsv(args.manifest)[: args.count]
    model = load_model(Path(args.model) if args.model else paths.default_model())
    scores = []
    bar = _bar(len(cases), "score")
    for case in cases:
        sc, _ = score_case(model, case, args.ctx, args.backend)
        scores.append(sc)
        bar.update(1)
    bar.close()
    write_scores(args.out, scores)
    print(summarize(scores).line(), file=sys.stderr)
    return 0


def cmd_diff(args) -> int:
    from .metrics import ScoreFormatError, compare_scores, read_scores
    try:
        rep = compare_scores(read_scores(args.old), read_scores(args.new)).report()
    except ScoreFormatError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"{e.filename}: {e.strerror}")
    sys.stdout.write(rep)
    return 0


def cmd_kld(args) -> int:
    from .kld import LogitsFormatError, LogitsWriter, format_report, plot_histogram, read_saved_logits
    from .run import run_kld, text_chunks
    models = list(args.models)
    if args.base_logits and args.save_logits:
        return _fail("--base-logits and --save-logits exclude each other")
    if args.base_logits:
        if len(models) != 1:
            return _fail("with --base-logits give exactly one model (the test model)")
        base_path, test_path = None, models[0]
    elif args.save_logits:
        if len(models) not in (1, 2):
            return _fail("with --save-logits give BASE.gguf [TEST.gguf]")
        base_path, test_path = models[0], (models[1] if len(models) == 2 else None)
    else:
        if len(models) != 2:
            return _fail("give BASE.gguf TEST.gguf (or use --save-logits / --base-logits)")
        base_path, test_path = models
    saved = None
    if args.base_logits:
        try:
            saved = read_saved_logits(args.base_logits)
        except (OSError, LogitsFormatError) as e:
            return _fail(str(e) if isinstance(e, LogitsFormatError) else f"{args.base_logits}: {e.strerror}")
    base = load_model(base_path) if base_path else None
    test = load_model(test_path) if test_path else None
    tok = (test or base).tokenizer
    if saved is not None:
        chunks = saved.tokens.astype("int64")
        score_start = saved.score_start
        if int(saved.header["n_vocab"]) != tok.n_vocab or chunks.max() >= tok.n_vocab:
            return _fail(f"{args.base_logits}: saved for a {saved.header['n_vocab']}-token vocabulary, "
                         f"this model has {tok.n_vocab}")
    else:
        ctx = args.ctx
        if ctx < 4:
            return _fail("--ctx must be at least 4")
        score_start = ctx // 2 if args.score_from is None else args.score_from
        if not 0 <= score_start < ctx - 1:
            return _fail(f"--score-from must be in 0..{ctx - 2}")
        text_path = Path(args.text) if args.text else paths.data_dir(args.data_dir) / "speed-bench" / "promessi_sposi.txt"
        try:
            text = text_path.read_text(encoding="utf-8-sig")
        except OSError as e:
            return _fail(f"{text_path}: {e.strerror}")
        except UnicodeDecodeError:
            return _fail(f"{text_path}: not UTF-8 text")
        chunks = text_chunks(tok, text, ctx, args.chunks)
    writer = None
    if args.save_logits:
        writer = LogitsWriter(args.save_logits, tok.n_vocab, chunks.shape[1], len(chunks), score_start,
                              dtype=args.logits_dtype, model=str(base_path),
                              text=str(args.text or "promessi_sposi.txt"))
    bar = _bar(len(chunks), "kld" if test is not None else "base logits")
    try:
        acc = run_kld(base, test, chunks, score_start, args.backend, saved=saved, save=writer,
                      progress=lambda i: bar.update(1))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    bar.close()
    if writer is not None:
        writer.close()
        print(f"saved base log-probs of {len(chunks)} chunks to {args.save_logits}", file=sys.stderr)
    if acc is None:
        return 0
    res = acc.result()
    summary = res.summary()
    sys.stdout.write(format_report(summary))
    if args.json:
        meta = {"kind": "ds4-quality-kld", "label": args.label or Path(test_path).stem,
                "base": str(base_path or args.base_logits), "test": str(test_path),
                "ctx": int(chunks.shape[1]), "chunks": int(len(chunks)), "score_start": int(score_start)}
        write_text_atomic(args.json, json.dumps({**meta, "stats": summary}, indent=2) + "\n")
    if args.hist:
        plot_histogram(res.kld, args.hist, title=f"KLD per token: {Path(test_path).name}")
    return 0


def cmd_compare(args) -> int:
    from .report import CompareError, compare_files
    try:
        compare_files(args.files, csv_out=args.csv, md_out=args.md, chart=args.chart)
    except CompareError as e:
        return _fail(str(e))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "power"):
        power.install(args.power)
    handlers = {"collect": cmd_collect, "score": cmd_score, "diff": cmd_diff, "kld": cmd_kld, "compare": cmd_compare}
    try:
        if hasattr(args, "backend"):
            from ds4.test_vectors.runtime import check_backend
            args.backend = check_backend(args.backend)
        return handlers[args.cmd](args)
    except ToolError as e:
        return _fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
