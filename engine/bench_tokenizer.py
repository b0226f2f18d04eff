"""Tokenizer speed: ds4's tokenizer (this package) vs Hugging Face `tokenizers` on one long text.

    python -m ds4.engine.bench_tokenizer [--text FILE] [--repeat N]

Default text: I Promessi Sposi (speed-bench/promessi_sposi.txt in the data directory). Ours is
timed twice: "cold" on a fresh tokenizer (empty piece cache: the honest first-encode figure) and
"warm" (the cache filled by the cold run). HF is the best of --repeat runs of one `encode` call
(single thread, no special tokens). The ratio printed is ours-cold / HF.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ds4.engine.tokenizer import Tokenizer, default_tokenizer_json
from ds4.paths import data_dir


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds4.engine.bench_tokenizer", description=__doc__.splitlines()[0])
    ap.add_argument("--text", type=Path, default=None, help="text file (default: speed-bench/promessi_sposi.txt)")
    ap.add_argument("--data-dir", default=None, help="data directory (default: $DS4_DATA_DIR or ../shared/data)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (best is kept)")
    args = ap.parse_args(argv)
    path = args.text or data_dir(args.data_dir) / "speed-bench" / "promessi_sposi.txt"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        print(f"bench_tokenizer: error: cannot read {path}: {e}", file=sys.stderr)
        return 2
    repeat = max(1, args.repeat)

    t0 = time.perf_counter()
    Tokenizer.from_tokenizer_json()
    load_s = time.perf_counter() - t0

    def cold():
        tok = Tokenizer.from_tokenizer_json()
        t = time.perf_counter()
        ids = tok.encode(text)
        return time.perf_counter() - t, ids, tok

    runs = [cold() for _ in range(repeat)]
    cold_s, ours, tok = min(runs, key=lambda r: r[0])
    warm_s, _ = _best(lambda: tok.encode(text), repeat)
    print(f"text: {path} ({len(text.encode('utf-8')) / 1e6:.2f} MB)")
    print(f"ds4 tokenizer: load {load_s:.2f} s, {len(ours)} tokens")
    print(f"  cold: {len(ours) / cold_s:12,.0f} tokens/s ({cold_s:.3f} s)")
    print(f"  warm: {len(ours) / warm_s:12,.0f} tokens/s ({warm_s:.3f} s)")
    try:
        import tokenizers
    except ImportError:
        print("HF tokenizers not installed: no comparison")
        return 0
    hf = tokenizers.Tokenizer.from_file(str(default_tokenizer_json()))
    hf_s, enc = _best(lambda: hf.encode(text, add_special_tokens=False), repeat)
    hf_ids = enc.ids
    print(f"HF tokenizers {tokenizers.__version__}: {len(hf_ids)} tokens")
    print(f"        {len(hf_ids) / hf_s:12,.0f} tokens/s ({hf_s:.3f} s)")
    lines = [line for line in text.split("\n") if line]
    agree = sum(1 for line in lines if tok.encode(line) == hf.encode(line, add_special_tokens=False).ids)
    print(f"agreement: whole text identical: {ours == hf_ids}; lines identical {agree}/{len(lines)} "
          f"({100 * agree / len(lines):.2f}%; the rest hold non-ASCII punctuation, split differently by design)")
    ratio = (len(ours) / cold_s) / (len(hf_ids) / hf_s)
    print(f"ratio ds4/HF tokens/s: cold {ratio:.2f}x, warm {(len(ours) / warm_s) / (len(hf_ids) / hf_s):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
