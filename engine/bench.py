"""`make bench-engine`: prefill and decode tokens/s of the CPU engine next to llama.cpp and
transformers on the same weights, measured in one run (issue 3's benchmark).

    python -m ds4.engine.bench                       # tiny and small, all peers
    python -m ds4.engine.bench --presets small --prefill 512 --decode 32 --threads 2

For each preset the random checkpoint (`ds4-quantize synth`, seed 0) is converted once to an F16
GGUF (models/ds4-<preset>.gguf, as `make setup` does for tiny); the peers read the same weights:

* ours: `Session` on that GGUF (official numerics on unless --no-rounding-sim; F16 weights multiplied
  straight from the mmap, no float32 copy);
* llama.cpp (llama-cpp-python): a copy with llama.cpp-compatible metadata
  (`ds4.engine.llamacpp_gguf`), default F16 KV cache, its own CPU kernels;
* transformers: `DeepseekV4ForCausalLM` in float32 from the same checkpoint
  (`gguf_tools.synth.write_transformers_checkpoint`), default experts implementation.

Every engine runs in its own subprocess (so the peak RSS is its own), with the same thread count,
on the same prompt ids (the speed-bench text, tokenized by our tokenizer): one untimed warm-up
(compilation, weight conversion), then `--repeats` timed runs of a prefill of `--prefill` tokens in
one call followed by `--decode` greedy decode steps; the fastest prefill and the fastest decode are
reported (on a shared machine other load only ever slows a run). Ratios are ours / peer (> 1 = ours
faster). The greedy tokens of each peer are compared with ours as a check that all run the same model.

Decode on CPU streams the weights from memory, so the report ends with the decode floor of each
preset: weight bytes read per decoded token (output head, every non-expert layer tensor, the
n_expert_used routed experts of each layer, one embedding row) over this machine's read bandwidth
measured with the same thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ds4 import paths

PRESETS = ("tiny", "small")
PEERS = ("ours", "llama.cpp", "transformers")
WARM_TOKENS = 16
REPO = Path(__file__).resolve().parent.parent


# ---- inputs ----------------------------------------------------------------------------------------
def prepare(preset: str, models_dir: Path, peers: tuple[str, ...], log=print) -> dict[str, Path]:
    """Build (once) the checkpoint, our GGUF, the llama.cpp copy and the transformers folder."""
    from ds4.engine.config import preset as config_preset

    models_dir.mkdir(parents=True, exist_ok=True)
    official = models_dir / f"{preset}-hf"
    gguf = models_dir / f"ds4-{preset}.gguf"
    out = {"official": official, "ours": gguf}
    quantize = [sys.executable, "-m", "ds4.gguf_tools.quantize"]
    if not (official / "config.json").exists():
        log(f"building the {preset} checkpoint in {official}")
        subprocess.run([*quantize, "synth", "--preset", preset, "--seed", "0", "--quiet", str(official)], check=True)
    if not gguf.exists():
        log(f"converting {official} to {gguf} (F16)")
        subprocess.run([*quantize, "convert", str(official), str(gguf), "--type", "f16", "--quiet"], check=True)
    if "llama.cpp" in peers:
        ll = models_dir / "bench" / f"ds4-{preset}-llamacpp.gguf"
        if not ll.exists() or ll.stat().st_mtime < gguf.stat().st_mtime:
            from ds4.engine.llamacpp_gguf import write_llamacpp_gguf

            ll.parent.mkdir(parents=True, exist_ok=True)
            write_llamacpp_gguf(gguf, ll)
        out["llama.cpp"] = ll
    if "transformers" in peers:
        tf = models_dir / "bench" / f"{preset}-transformers"
        if not (tf / "config.json").exists():
            from ds4.gguf_tools.synth import write_transformers_checkpoint

            log(f"writing the transformers checkpoint {tf}")
            write_transformers_checkpoint(config_preset(preset), tf, seed=0, official_dir=official)
        out["transformers"] = tf
    return out


def bench_prompt(n: int) -> list[int]:
    from ds4.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_tokenizer_json()
    text = (paths.data_dir() / "speed-bench" / "promessi_sposi.txt").read_text(encoding="utf-8")
    ids = [tok.bos_id] + tok.encode(text[: 8 * n])
    if len(ids) < n:
        raise SystemExit(f"the speed-bench text gives only {len(ids)} tokens, fewer than --prefill {n}")
    return ids[:n]


# ---- workers (one engine per process) --------------------------------------------------------------
def _peak_rss_mib() -> float:
    """This process image's peak RSS (VmHWM; ru_maxrss would include the parent's peak before exec)."""
    try:
        for ln in Path("/proc/self/status").read_text().splitlines():
            if ln.startswith("VmHWM:"):
                return int(ln.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def best_of(timed, repeats: int) -> dict:
    """Fastest prefill and fastest decode over `repeats` runs of `timed() -> (t0, t1, t2, tokens)`
    (a shared machine only ever slows a run down)."""
    pre, dec, out = [], [], None
    for _ in range(repeats):
        t0, t1, t2, out = timed()
        pre.append(t1 - t0)
        dec.append(t2 - t1)
    return {"prefill_s": min(pre), "decode_s": min(dec), "tokens": out, "prefill_runs_s": pre, "decode_runs_s": dec}


def run_ours(path: str, ids: list[int], n_decode: int, threads: int, repeats: int, sim: bool = True) -> dict:
    import numba

    from ds4.engine.model import Model
    from ds4.engine.session import Session

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    model = Model.load(path, fp8_kv=sim, indexer_qat=sim)
    ctx = len(ids) + n_decode + 8
    warm = Session(model, ctx=ctx)
    logits = warm.sync(ids[:WARM_TOKENS])
    warm.decode(int(np.argmax(logits)))

    def timed():
        s = Session(model, ctx=ctx)
        t0 = time.perf_counter()
        logits = s.sync(ids)
        t1 = time.perf_counter()
        out = []
        for _ in range(n_decode):
            out.append(int(np.argmax(logits)))
            logits = s.decode(out[-1])
        return t0, t1, time.perf_counter(), out

    return best_of(timed, repeats)


def run_llamacpp(path: str, ids: list[int], n_decode: int, threads: int, repeats: int) -> dict:
    import llama_cpp

    n_ctx = len(ids) + n_decode + 8
    ll = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=len(ids), n_ubatch=len(ids),
                         n_threads=threads, n_threads_batch=threads, verbose=False)
    n_vocab = ll.n_vocab()

    def next_id() -> int:  # argmax of the last evaluated position's logits (no copy into ll.scores)
        return int(np.argmax(np.ctypeslib.as_array(ll._ctx.get_logits(), shape=(n_vocab,))))

    ll.eval(ids[:WARM_TOKENS])
    ll.eval([next_id()])

    def timed():
        ll.reset()  # forget the cached tokens: the next eval clears the KV cache and prefills
        t0 = time.perf_counter()
        ll.eval(ids)
        t1 = time.perf_counter()
        out = []
        for _ in range(n_decode):
            out.append(next_id())
            ll.eval([out[-1]])
        return t0, t1, time.perf_counter(), out

    return best_of(timed, repeats) | {"version": getattr(llama_cpp, "__version__", "?")}


def run_transformers(path: str, ids: list[int], n_decode: int, threads: int, repeats: int) -> dict:
    import torch
    import transformers
    from transformers import DeepseekV4ForCausalLM

    torch.set_num_threads(threads)
    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def run(prompt, steps):
        with torch.inference_mode():
            t0 = time.perf_counter()
            o = model(input_ids=torch.tensor([prompt]), use_cache=True)
            t1 = time.perf_counter()
            past, logits, out = o.past_key_values, o.logits[0, -1], []
            for _ in range(steps):
                out.append(int(torch.argmax(logits)))
                o = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=past, use_cache=True)
                past, logits = o.past_key_values, o.logits[0, -1]
        return t0, t1, time.perf_counter(), out

    run(ids[:WARM_TOKENS], 1)
    return best_of(lambda: run(ids, n_decode), repeats) | {
        "version": transformers.__version__,
        "experts": getattr(model.config, "_experts_implementation", None) or "default"}


WORKERS = {"ours": run_ours, "llama.cpp": run_llamacpp, "transformers": run_transformers}


def worker_main(args) -> int:
    ids = json.loads(Path(args.ids).read_text())
    extra = {"sim": not args.no_rounding_sim} if args.worker == "ours" else {}
    r = WORKERS[args.worker](args.model, ids, args.decode, args.threads, args.repeats, **extra)
    r.update(prefill_tps=len(ids) / r["prefill_s"], decode_tps=args.decode / r["decode_s"] if args.decode else 0.0,
             peak_rss_mib=_peak_rss_mib())
    print("BENCH " + json.dumps(r))
    return 0


def measure(peer: str, model: Path, ids_file: Path, n_decode: int, threads: int, repeats: int,
            no_sim: bool = False) -> dict:
    cmd = [sys.executable, "-m", "ds4.engine.bench", "--worker", peer, "--model", str(model), "--ids", str(ids_file),
           "--decode", str(n_decode), "--threads", str(threads), "--repeats", str(repeats)]
    if no_sim:
        cmd.append("--no-rounding-sim")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("BENCH ")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exit {p.returncode}: {tail}"}
    return json.loads(lines[-1][6:])


# ---- decode floor -----------------------------------------------------------------------------------
def decode_bytes_per_token(gguf: Path) -> dict[str, float]:
    """Weight bytes one decode step reads from the GGUF (as stored), by part."""
    from ds4.engine.model import decode_weight_bytes
    from ds4.gguf_tools.reader import open_model

    f = open_model(gguf)
    try:
        return decode_weight_bytes(f, f.config)
    finally:
        f.close()


def read_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Best read bandwidth (bytes/s) of a float32 sum over `mib` MiB with `threads` numba threads."""
    import numba

    from ds4.engine.dense import read_sum

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    a = np.ones(mib * (1 << 20) // 4, np.float32)
    read_sum(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        read_sum(a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


def floor_lines(models_dir: Path, presets: list[str], threads: int, rows: list[dict]) -> list[str]:
    bw = read_bandwidth(threads)
    out = [f"read bandwidth, {threads} threads: {bw / 1e9:.1f} GB/s"]
    for preset in presets:
        gguf = models_dir / f"ds4-{preset}.gguf"
        if not gguf.exists():
            continue
        parts = decode_bytes_per_token(gguf)
        total = sum(parts.values())
        ours = next((r for r in rows if r["preset"] == preset and r["peer"] == "ours" and "decode_tps" in r), None)
        got = f"; ours {ours['decode_tps']:.1f} t/s = {ours['decode_tps'] / (bw / total):.2f} of the floor" if ours else ""
        detail = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in parts.items())
        out.append(f"{preset}: {total / 1e6:.1f} MB of weights per decoded token ({detail}); "
                   f"floor {bw / total:.1f} t/s{got}")
    return out


# ---- report -----------------------------------------------------------------------------------------
def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def table(rows: list[dict]) -> str:
    head = "| preset | engine | prefill t/s | decode t/s | peak RSS MiB | ours/peer prefill | ours/peer decode |"
    out = [head, "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['preset']} | {r['peer']} | – | – | – | – | – |  ({r['error']})")
            continue
        ratio_p = ratio_d = "–"
        if r["peer"] != "ours" and r.get("ours_prefill"):
            ratio_p = f"{r['ours_prefill'] / r['prefill_tps']:.2f}"
            ratio_d = f"{r['ours_decode'] / r['decode_tps']:.2f}" if r["decode_tps"] else "–"
        out.append(f"| {r['preset']} | {r['peer']} | {r['prefill_tps']:.1f} | {r['decode_tps']:.2f} | "
                   f"{r['peak_rss_mib']:.0f} | {ratio_p} | {ratio_d} |")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ds4.engine.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated engines: " + ", ".join(PEERS))
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens prefilled in one timed call")
    p.add_argument("--decode", type=int, default=32, help="timed greedy decode steps")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine; the fastest is reported")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for every engine")
    p.add_argument("--models-dir", default=str(REPO / "models"), help="where checkpoints and GGUFs are built")
    p.add_argument("--no-rounding-sim", action="store_true",
                   help="run ours without the official FP8 KV / FP4 indexer roundings (as the peers run)")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    p.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--ids", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args)
    presets = [s for s in args.presets.split(",") if s]
    peers = tuple(s for s in args.peers.split(",") if s)
    bad = [p for p in peers if p not in PEERS] + [p for p in presets if p not in ("tiny", "small", "flash", "pro")]
    if bad or args.prefill < WARM_TOKENS or args.decode < 0 or args.threads < 1 or args.repeats < 1:
        print(f"bench: bad arguments {bad or ''} (prefill >= {WARM_TOKENS}, decode >= 0, threads >= 1)",
              file=sys.stderr)
        return 2
    if "ours" not in peers:
        peers = ("ours",) + peers
    import tempfile

    ids = bench_prompt(args.prefill)
    rows = []
    print(f"# {machine()}; {args.threads} threads; prefill {args.prefill} tokens, decode {args.decode} tokens",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="ds4-bench-") as tmp:
        ids_file = Path(tmp) / "ids.json"
        ids_file.write_text(json.dumps(ids))
        for preset in presets:
            files = prepare(preset, Path(args.models_dir), peers, log=lambda m: print(m, file=sys.stderr))
            ours = None
            for peer in peers:
                print(f"{preset}: {peer} ...", file=sys.stderr, flush=True)
                r = measure(peer, files[peer], ids_file, args.decode, args.threads, args.repeats, args.no_rounding_sim)
                r.update(preset=preset, peer=peer)
                if peer == "ours" and "error" not in r:
                    ours = r
                if ours is not None:
                    r.update(ours_prefill=ours["prefill_tps"], ours_decode=ours["decode_tps"])
                    if peer != "ours" and "tokens" in r:
                        same = sum(a == b for a, b in zip(r["tokens"], ours["tokens"]))
                        r["greedy_same_as_ours"] = f"{same}/{len(ours['tokens'])}"
                rows.append(r)
    print(table(rows))
    for r in rows:
        if r["peer"] != "ours" and "greedy_same_as_ours" in r:
            extra = f", experts={r['experts']}" if "experts" in r else ""
            print(f"  {r['preset']} {r['peer']} {r.get('version', '')}: greedy tokens equal to ours "
                  f"{r['greedy_same_as_ours']}{extra}")
    for line in floor_lines(Path(args.models_dir), presets, args.threads, rows):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
