"""Memory per rank and bandwidth floors of the expert-parallel engine (figures for engine/dist/README.md).

    python -m ds4.engine.dist.floors                  # Flash q2 on 1/2/4 ranks, PRO q2 on 4 at 2k/8k
    python -m ds4.engine.dist.floors --preset pro --mix q2 --ranks 4 --ctx 2048,8192

Decode floor (batch 1): every rank reads, per token, all replicated weights (attention, compressors,
indexer, router, HC, shared expert, head; one embedding row) plus the routed experts the token
selected among its own, plus the KV rows it attends to. The slowest rank sets the pace, so the
routed share is the expected maximum over ranks of the selected experts a rank owns (k of E
distinct experts, uniform routing; exact hypergeometric maximum by Monte Carlo with a fixed seed),
not k/N. Floor = bytes / HBM bandwidth.

Prefill floor (chunks of C tokens): a batched kernel reads each weight once per chunk, so bytes per
chunk are the replicated weights plus the rank's share of the experts the chunk touches; floor =
C · bandwidth / bytes. Prefill is normally bound by arithmetic instead, so the compute floor
(2 FLOP per weight per token plus attention, at a stated dense peak) is printed beside it.

The default bandwidth is the H200 device-to-device copy measured by the single-GPU engine
(engine/gpu/NOTES.md: 4257 GB/s read+write).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Iterable

import numpy as np

from ds4.engine.config import Config, preset
from ds4.gguf_tools.constants import TOKEN_EMBD

H200_COPY_BW = 4257e9  # bytes/s, engine/gpu/NOTES.md (D2D copy, read+write)
H200_BF16_PEAK = 989e12  # dense tensor-core FLOP/s (reference point for the compute floor)
H200_HBM_BYTES = 141e9  # nominal; about 139 GiB usable


def expected_max_local(n_expert: int, k: int, world: int, samples: int = 20000, seed: int = 0) -> float:
    """E[max over ranks of how many of a token's k distinct experts the rank owns]."""
    if world == 1:
        return float(k)
    from .shard import expert_range

    owner = np.empty(n_expert, np.int64)
    for r in range(world):
        e0, e1 = expert_range(n_expert, r, world)
        owner[e0:e1] = r
    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((samples, n_expert)), axis=1)[:, :k]
    counts = np.zeros((samples, world), np.int64)
    np.add.at(counts, (np.repeat(np.arange(samples), k), owner[picks].reshape(-1)), 1)
    return float(counts.max(axis=1).mean())


def _split(cfg: Config, tensors: Iterable[tuple[str, tuple, int]]):
    rep = exps = emb = 0
    rep_elems = exp_elems = 0
    for name, ne, nbytes in tensors:
        n = math.prod(ne)
        if name == TOKEN_EMBD:
            emb += nbytes
        elif "_exps." in name:
            exps += nbytes
            exp_elems += n
        else:
            rep += nbytes
            if len(ne) >= 2:
                rep_elems += n
    return rep, exps, emb, rep_elems, exp_elems


def attn_bytes_and_flops(cfg: Config, ctx: int) -> tuple[float, float]:
    """KV bytes read and attention+indexer FLOPs for one token at position `ctx` (all layers)."""
    by = fl = 0.0
    d, H = cfg.head_dim, cfg.n_head
    for i in range(cfg.n_layer):
        r = cfg.ratio(i)
        keys = min(ctx, cfg.sliding_window)
        if r == 128:
            keys += ctx // 128
        elif r == 4:
            keys += min(ctx // 4, cfg.indexer_top_k)
            by += (ctx // 4) * cfg.indexer_dim * 4
            fl += 2.0 * cfg.indexer_heads * cfg.indexer_dim * (ctx // 4)
        by += keys * d * 4
        fl += 4.0 * H * d * keys
    return by, fl


def floors(cfg: Config, tensors: list[tuple[str, tuple, int]], world: int, ctx: int, chunk: int = 2048,
           bw: float = H200_COPY_BW, peak: float = H200_BF16_PEAK) -> dict:
    rep, exps, emb, rep_elems, exp_elems = _split(cfg, tensors)
    E, k = cfg.n_expert, cfg.n_expert_used
    per_expert = exps / E
    kv, attn_fl = attn_bytes_and_flops(cfg, ctx)
    emax = expected_max_local(E, k, world)
    dec_bytes = rep + emb / cfg.vocab_size + emax * per_expert + kv
    # prefill: one chunk touches E·(1-(1-k/E)^C) experts per layer; the rank owns its share of them
    touched = E * (1.0 - (1.0 - k / E) ** chunk)
    chunk_bytes = rep + emb / cfg.vocab_size * chunk + touched / world * per_expert
    # compute per token on one rank: replicated matmuls + its share of the routed ones + attention at ~ctx/2
    _, attn_half = attn_bytes_and_flops(cfg, max(1, ctx // 2))
    flops = 2.0 * rep_elems + 2.0 * exp_elems / E * k / world + attn_half
    # what splitting the replicated matrices N ways too (tensor-parallel attention/shared/head) would give
    split_bytes = (rep + kv) / world + emb / cfg.vocab_size + emax * per_expert
    return dict(world=world, ctx=ctx, rank_bytes=rep + emb + exps / world,
                decode_bytes=dec_bytes, decode_routed_experts=emax, decode_tps=bw / dec_bytes,
                decode_tps_all_split=bw / split_bytes,
                prefill_chunk_bytes=chunk_bytes, prefill_tps=chunk * bw / chunk_bytes,
                prefill_compute_tps=peak / flops,
                comm_payload_per_token=cfg.n_layer * cfg.n_embd * 4,
                note=f"{bw / 1e9:.0f} GB/s per GPU, routed share = E[max] {emax:.2f} of k={k} experts")


def floors_for(model, world: int, ctx: int) -> dict:
    """Floors of a loaded model's actual tensor types."""
    f = model.file
    tensors = [(t.name, tuple(t.ne), t.nbytes) for t in f.tensors.values()]
    return floors(model.config, tensors, world, ctx)


def floors_for_plan(name: str, mix: str | None, world: int, ctx: int, base: str = "q8_0") -> dict:
    """Floors of a preset written with the published layout (no file needed)."""
    from ds4.gguf_tools.plan import Policy, plan

    cfg = preset(name)
    tensors = [(p.name, tuple(p.ne), p.nbytes) for p in plan(cfg, Policy(base=base, mix=mix))]
    return floors(cfg, tensors, world, ctx)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds4.engine.dist.floors", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", action="append", choices=["small", "flash", "pro"])
    ap.add_argument("--mix", default="q2")
    ap.add_argument("--ranks", default=None, help="comma list (default: 1,2,4 for flash, 4 for pro)")
    ap.add_argument("--ctx", default="2048,8192")
    args = ap.parse_args(argv)
    presets = args.preset or ["flash", "pro"]
    print("| model | ranks | ctx | weights GiB per rank | decode GB/token/rank | E[max] experts | decode floor t/s "
          "| (if attention+shared+head were split too) | prefill floor t/s (bw) | prefill floor t/s (BF16 compute) "
          "| combine KiB/token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in presets:
        ranks = [int(x) for x in args.ranks.split(",")] if args.ranks else ([1, 2, 4] if name != "pro" else [4])
        for world in ranks:
            for ctx in (int(x) for x in args.ctx.split(",")):
                r = floors_for_plan(name, args.mix, world, ctx)
                print(f"| {name} {args.mix} | {world} | {ctx} | {r['rank_bytes'] / 2**30:.1f} | "
                      f"{r['decode_bytes'] / 1e9:.2f} | {r['decode_routed_experts']:.2f} | {r['decode_tps']:.0f} | "
                      f"{r['decode_tps_all_split']:.0f} | "
                      f"{r['prefill_tps']:.0f} | {r['prefill_compute_tps']:.0f} | "
                      f"{r['comm_payload_per_token'] / 1024:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
