"""ds4-vectors: check a model against logprob test vectors, or capture new ones from a model.

    ds4-vectors -m MODEL.gguf                      # the official vectors from the data dir
    ds4-vectors -m MODEL.gguf --vectors DIR        # any vector directory (manifest.json + official/)
    ds4-vectors -m MODEL.gguf --capture DIR        # pin this model's behaviour (same schema)

Exit code: 0 all checked cases pass, 1 a case failed, 2 usage or file error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ds4 import paths
from ds4.cli_util import add_data_dir_argument, add_model_argument, fail
from ds4.engine import power

from .compare import DEFAULT_TOLERANCE, DEFAULT_TOP_K
from .formats import VectorFormatError, load_vector_dir, write_text_atomic
from .runtime import ToolError, check_backend, load_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ds4-vectors",
        description="Check a DS4 GGUF against logprob test vectors (tooling-spec §5), or capture vectors "
                    "from a local model with --capture.")
    add_model_argument(p)
    p.add_argument("--vectors", default=None,
                   help="vector directory with manifest.json (default: <data-dir>/test-vectors)")
    add_data_dir_argument(p)
    p.add_argument("--only", action="append", default=[], metavar="ID", help="check/capture only this case (repeatable)")
    p.add_argument("--include-skipped", action="store_true",
                   help="also check long_memory_archive (skipped upstream: API and official graph disagree)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="max |Δ logprob| in nats (default 4)")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="local top-k searched for alternatives (default 20)")
    p.add_argument("--ctx", type=int, default=None, help="override every case's context size")
    p.add_argument("--backend", choices=("cpu", "cuda"), default=None,
                   help="engine backend (default: cuda when it can run, else cpu)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the per-step report as JSON")
    p.add_argument("--capture", metavar="DIR", default=None,
                   help="capture mode: run the model greedily on the vector prompts and write manifest.json, "
                        "official/*.official.json, prompts/*.txt and official.vec under DIR")
    p.add_argument("--steps", type=int, default=4, help="steps per case in capture mode (default 4)")
    power.add_power_argument(p)
    return p


def _fail(msg: str) -> int:
    return fail("ds4-vectors", msg)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    power.install(args.power)
    if args.top_k < 1 or args.steps < 1 or (args.ctx is not None and args.ctx < 2):
        return _fail("--top-k, --steps and --ctx must be positive")
    vec_dir = Path(args.vectors) if args.vectors else paths.data_dir(args.data_dir) / "test-vectors"
    try:
        args.backend = check_backend(args.backend)
        vs = load_vector_dir(vec_dir)
        cases = vs.cases
        if args.only:
            known = {c.id for c in cases}
            unknown = [i for i in args.only if i not in known]
            if unknown:
                return _fail(f"unknown case id(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
            cases = [c for c in cases if c.id in args.only]
        model_path = Path(args.model) if args.model else paths.default_model()
        model = load_model(model_path)
    except (VectorFormatError, ToolError) as e:
        return _fail(str(e))

    from tqdm import tqdm

    from .runner import OFFICIAL_SKIP, CaptureSpec, capture_case, check_case, format_report, report_json, write_capture

    if args.capture:
        captures = []
        for c in tqdm(cases, desc="capture", unit="case", disable=not sys.stderr.isatty()):
            spec = CaptureSpec(id=c.id, prompt=c.prompt or "", ctx=args.ctx or c.ctx, steps=args.steps, kind=c.kind)
            try:
                data = capture_case(model, spec.id, spec.prompt, spec.ctx, spec.steps, kind=spec.kind,
                                    backend=args.backend, top_k=args.top_k, model_name=model_path.name)
            except ValueError as e:
                return _fail(str(e))
            captures.append((spec, data))
            toks = [bytes(s["token"]["bytes"]).decode("utf-8", errors="replace") for s in data["steps"]]
            print(f"{c.id}: {len(data['steps'])} steps {toks!r}")
        write_capture(args.capture, captures, model_path.name, args.top_k, args.steps)
        print(f"wrote {len(captures)} cases to {args.capture}")
        return 0

    reports = []
    official = vs.manifest.source == "deepseek-official-api"
    for c in tqdm(cases, desc="vectors", unit="case", disable=not sys.stderr.isatty()):
        if official and c.id in OFFICIAL_SKIP and not args.include_skipped and not args.only:
            from .runner import CaseReport
            reports.append(CaseReport(id=c.id, prompt_tokens=0, skipped="known API/official-graph disagreement"))
            continue
        reports.append(check_case(model, c, backend=args.backend, top_k=args.top_k, tolerance=args.tolerance,
                                  ctx=args.ctx))
    sys.stdout.write(format_report(reports))
    if args.json:
        write_text_atomic(args.json, json.dumps(report_json(reports), indent=2) + "\n")
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
