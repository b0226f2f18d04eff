"""Spawn N ranks (torchrun-style environment) and run a program on rank 0 over a DistSession.

    ds4-dist -m model.gguf --nproc 4 --device cuda -p "Hello" -n 32      # generate (rank 0 prints)
    ds4-dist -m model.gguf --nproc 4 --device cuda --bench --prompt-tokens 2048 -n 64
    ds4-dist --nproc 4 --bench-comm                                        # combine strategies
    python -m ds4.engine.dist.launch ...                                   # same

Ranks are processes started with torch.multiprocessing (spawn) with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT set as torchrun sets them; under torchrun itself (those variables
already present) the ranks are not spawned again. Rank 0 does all the I/O: it reads the prompt,
prints, and writes --json; the other ranks only load their share of the model and serve.

`run(program, nproc, model, ...)` is the same machinery for Python callers: `program(session)` runs
on rank 0 (it must be importable by name, e.g. a module-level function) and its return value comes
back to the caller.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from .comm import MEASURED, STRATEGIES


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads_per_rank(nproc: int) -> int:
    """torch CPU threads per rank: DS4_DIST_THREADS (ds4-dist -t), else the cores shared evenly."""
    env = os.environ.get("DS4_DIST_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (os.cpu_count() or 1) // nproc)


def _rank_entry(local_rank: int, nproc: int, port: int, target: Callable, args: tuple, result: str | None,
                device: str) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    _run_rank(target, args, result, nproc)


def _run_rank(target: Callable, args: tuple, result: str | None, nproc: int) -> Any:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(_threads_per_rank(nproc))
    try:
        out = target(*args)
        if int(os.environ.get("RANK", "0")) == 0 and result is not None:
            tmp = result + ".tmp"
            with open(tmp, "wb") as f:
                pickle.dump(out, f)
            os.replace(tmp, result)
        return out
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(target: Callable, args: tuple = (), nproc: int = 2, device: str = "cpu") -> Any:
    """Run target(*args) on nproc ranks; return rank 0's return value. Under torchrun (this process
    is already one rank) run it here and return its own value: rank 0's result, None elsewhere."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        out = _run_rank(target, args, None, int(os.environ["WORLD_SIZE"]))
        return out if int(os.environ["RANK"]) == 0 else None
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ds4-dist-") as d:
        result = os.path.join(d, "rank0.pkl")
        mp.spawn(_rank_entry, args=(nproc, free_port(), target, args, result, device), nprocs=nproc, join=True)
        with open(result, "rb") as f:
            return pickle.load(f)


def _session_program(program: Callable, model: str, opts: dict) -> Any:
    from .session import open_session

    s = open_session(model, **opts)
    if s is None:
        return None
    with s:
        return program(s)


def run(program: Callable, nproc: int, model: str | os.PathLike, **opts) -> Any:
    """Spawn nproc ranks sharing `model`; run program(session) on rank 0; return its result.
    opts: ctx, prefill_chunk, device ('cpu' or 'cuda'), combine, graphs, fp8_kv, indexer_qat."""
    return spawn(_session_program, (program, os.fspath(model), opts), nproc=nproc, device=opts.get("device", "cpu"))


# ---- the ds4-dist programs (rank 0) ------------------------------------------------------------------
def generate_program(s, prompt: str, n: int, raw: bool) -> dict:
    tok = s.model.tokenizer
    ids = tok.encode(prompt) if raw else tok.encode_chat(prompt)
    t0 = time.perf_counter()
    s.sync(ids)
    t1 = time.perf_counter()
    out = s.greedy(n) if n else []
    t2 = time.perf_counter()
    text = tok.decode(out).decode("utf-8", errors="replace")
    return dict(prompt_tokens=len(ids), tokens=out, text=text, prefill_s=t1 - t0, decode_s=t2 - t1,
                stats=s.gather_stats())


def bench_program(s, prompt_tokens: int, n: int, seed: int) -> dict:
    import numpy as np

    from .floors import floors_for

    cfg = s.cfg
    ids = np.random.default_rng(seed).integers(2, cfg.vocab_size, prompt_tokens).tolist()
    s.comm.reset()
    t0 = time.perf_counter()
    s.sync(ids)
    t1 = time.perf_counter()
    pre = dict(calls=s.comm.calls, payload=s.comm.payload_bytes, wire=s.comm.wire_bytes, seconds=s.comm.seconds)
    s.comm.reset()
    t2 = time.perf_counter()
    s.greedy(n)
    t3 = time.perf_counter()
    dec = dict(calls=s.comm.calls, payload=s.comm.payload_bytes, wire=s.comm.wire_bytes, seconds=s.comm.seconds)
    world = s.world
    floor = floors_for(s.model, world, prompt_tokens)
    return dict(world=world, prompt_tokens=prompt_tokens, gen_tokens=n,
                prefill_tps=prompt_tokens / (t1 - t0), decode_tps=n / max(t3 - t2, 1e-12),
                comm_prefill=pre, comm_decode=dec, floor=floor, stats=s.gather_stats(),
                consistent=s.check_consistent())


def _bench_comm_program(device: str, rows: tuple, dims: tuple, iters: int) -> list[dict] | None:
    from .comm import bench_combine
    from .session import init_distributed

    rank, world, dev = init_distributed(device)
    out = bench_combine(rows=rows, dims=dims, iters=iters, device=dev)
    return out if rank == 0 else None


# ---- command line -------------------------------------------------------------------------------------
class UsageError(Exception):
    pass


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds4-dist", description="DeepSeek V4 over several ranks: routed experts split "
                                "across processes (expert parallelism), everything else replicated.")
    p.add_argument("-m", "--model", help="DS4 GGUF (for a split file: its first part, NAME-00001-of-0000N.gguf)")
    p.add_argument("--nproc", "--gpus", type=_positive, default=2, help="number of ranks (one per GPU on CUDA)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: gloo ranks; cuda: NCCL, one GPU each")
    p.add_argument("--combine", choices=STRATEGIES, default="auto",
                   help="how partial MoE outputs are summed (auto: all-gather for small payloads, else all-reduce)")
    p.add_argument("-c", "--ctx", type=_positive, default=4096, help="context size in tokens")
    p.add_argument("--prefill-chunk", type=_positive, default=2048)
    p.add_argument("--no-graphs", action="store_true", help="CUDA: decode without CUDA graphs")
    p.add_argument("--no-rounding-sim", action="store_true", help="turn off the FP8 KV / FP4 indexer rounding")
    p.add_argument("-p", "--prompt", help="prompt text (chat template unless --raw)")
    p.add_argument("--raw", action="store_true", help="tokenize the prompt as written, no chat template")
    p.add_argument("-n", "--tokens", type=int, default=32, help="tokens to generate (greedy)")
    p.add_argument("--bench", action="store_true", help="time prefill of --prompt-tokens random tokens, then -n decodes")
    p.add_argument("--prompt-tokens", type=_positive, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bench-comm", action="store_true", help="time the three combine strategies (no model)")
    p.add_argument("--comm-rows", default="1,8,64,512,2048", help="--bench-comm: token counts")
    p.add_argument("--comm-dims", default="4096,7168", help="--bench-comm: hidden sizes")
    p.add_argument("--iters", type=_positive, default=20)
    p.add_argument("-t", "--threads", type=_positive, default=None, help="CPU threads per rank (default: cores / ranks)")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    return p


def _ints(text: str, flag: str) -> tuple:
    try:
        v = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{flag} expects comma-separated integers, got '{text}'") from None
    if not v or min(v) < 1:
        raise UsageError(f"{flag} expects positive integers, got '{text}'")
    return v


def _check(args) -> None:
    if args.device == "cuda":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < args.nproc:
            raise UsageError(f"--nproc {args.nproc} needs {args.nproc} CUDA devices, this machine has {n}")
    if args.bench_comm:
        return
    if not args.model:
        raise UsageError("a model is required (-m FILE.gguf)")
    from ds4.gguf_tools.reader import GGUFError, open_model

    try:
        cfg = open_model(args.model).config
    except GGUFError as e:
        raise UsageError(str(e)) from None
    if args.nproc > cfg.n_expert:
        raise UsageError(f"--nproc {args.nproc} exceeds the model's {cfg.n_expert} experts per layer")
    if not args.bench and args.prompt is None:
        raise UsageError("give a prompt (-p TEXT), or --bench")
    if args.tokens < 0:
        raise UsageError("-n must be >= 0")
    if args.bench and args.prompt_tokens + args.tokens >= args.ctx:
        raise UsageError(f"--prompt-tokens + -n must stay below --ctx ({args.ctx})")


def _print_comm_table(rows: list[dict]) -> None:
    print(f"{'D':>6} {'T':>6} {'bytes':>10} " + " ".join(f"{s:>12}" for s in MEASURED) + "   (us per combine)")
    keyed = {(r["D"], r["T"], r["strategy"]): r for r in rows}
    for D, T in sorted({(r["D"], r["T"]) for r in rows}):
        us = [keyed[(D, T, s)]["us"] for s in MEASURED]
        best = MEASURED[min(range(len(us)), key=us.__getitem__)]
        print(f"{D:>6} {T:>6} {T * D * 4:>10} " + " ".join(f"{u:>12.1f}" for u in us) + f"   best {best}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        os.environ["DS4_DIST_THREADS"] = str(args.threads)  # inherited by the spawned ranks
    try:
        _check(args)
        opts = dict(ctx=args.ctx, prefill_chunk=args.prefill_chunk, device=args.device, combine=args.combine,
                    graphs=False if args.no_graphs else None, fp8_kv=not args.no_rounding_sim,
                    indexer_qat=not args.no_rounding_sim)
        if args.bench_comm:
            rows = spawn(_bench_comm_program, (args.device, _ints(args.comm_rows, "--comm-rows"),
                                               _ints(args.comm_dims, "--comm-dims"), args.iters),
                         nproc=args.nproc, device=args.device)
            if rows is None:
                return 0  # a rank > 0 under torchrun: rank 0 reports
            _print_comm_table(rows)
            result: Any = rows
        elif args.bench:
            result = run(_BenchCall(args.prompt_tokens, args.tokens, args.seed), args.nproc, args.model, **opts)
            if result is None:
                return 0
            print(f"{result['world']} ranks ({args.device}, {args.combine}): prefill {result['prefill_tps']:.2f} t/s "
                  f"({args.prompt_tokens} tokens), decode {result['decode_tps']:.2f} t/s ({args.tokens} tokens); "
                  f"MoE combine per decoded token {result['comm_decode']['payload'] / max(args.tokens, 1) / 1024:.1f} KiB "
                  f"payload, {result['comm_decode']['wire'] / max(args.tokens, 1) / 1024:.1f} KiB sent per rank; "
                  f"ranks consistent: {result['consistent']}")
            f = result["floor"]
            print(f"floor ({f['note']}): decode {f['decode_tps']:.1f} t/s, prefill {f['prefill_tps']:.1f} t/s")
        else:
            result = run(_GenerateCall(args.prompt, args.tokens, args.raw), args.nproc, args.model, **opts)
            if result is None:
                return 0
            sys.stdout.write(result["text"] + "\n")
            print(f"[{args.nproc} ranks: {result['prompt_tokens']} prompt tokens in {result['prefill_s']:.2f} s, "
                  f"{len(result['tokens'])} generated in {result['decode_s']:.2f} s]", file=sys.stderr)
        if args.json:
            tmp = Path(args.json).with_name(f".{Path(args.json).name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(result, indent=1, default=_jsonable))
            os.replace(tmp, args.json)
        return 0
    except UsageError as e:
        print(f"ds4-dist: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ds4-dist: interrupted", file=sys.stderr)
        return 130


def _jsonable(o):
    if isinstance(o, tuple):
        return list(o)
    return str(o)


class TraceCall:
    """rank 0 program: sync(prompt), then `decodes` argmax decodes, then greedy(`greedy`); returns every
    logits row, the tokens, rank figures and whether all ranks hold the same state (tests, --dump)."""

    def __init__(self, prompt: list[int], decodes: int, greedy: int):
        self.a = (list(prompt), decodes, greedy)

    def __call__(self, s):
        import numpy as np

        prompt, decodes, greedy = self.a
        s.comm.reset()
        rows = [s.sync(prompt)]
        prefill_comm = dict(vars(s.comm))
        for _ in range(decodes):
            rows.append(s.decode(int(np.argmax(rows[-1]))))
        g = s.greedy(greedy) if greedy else []
        return dict(logits=np.stack(rows), greedy=g, greedy_logits=s.logits, tokens=s.tokens,
                    comm=dict(vars(s.comm)), prefill_comm=prefill_comm, stats=s.gather_stats(),
                    consistent=s.check_consistent(), snapshot=s.snapshot())


class _BenchCall:
    def __init__(self, prompt_tokens: int, n: int, seed: int):
        self.a = (prompt_tokens, n, seed)

    def __call__(self, s):
        return bench_program(s, *self.a)


class _GenerateCall:
    def __init__(self, prompt: str, n: int, raw: bool):
        self.a = (prompt, n, raw)

    def __call__(self, s):
        return generate_program(s, *self.a)


if __name__ == "__main__":
    sys.exit(main())
