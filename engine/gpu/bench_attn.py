"""`python -m ds4.engine.gpu.bench_attn`: the one-kernel prefill attention (attn_prefill.cu, DS4_GPU_PREFILL_ATTN=fused)
against its peer, the session's torch products per query block (prefill.attend_rows, float32 or TF32), at Flash
shapes: a top-k layer (ratio 4: window 128 + 512 selected rows) and a ratio-128 layer (window + all visible rows).
Prints milliseconds per call and the ratio to the torch path. Needs a CUDA device and the built extension."""

from __future__ import annotations

import argparse
import math
import sys
import types

import torch

from . import prefill, tc


def _inputs(T: int, n_comp: int, k_sel: int, pos0: int, H=64, d=512, Wn=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, d, device="cuda", generator=g) * 0.3
    win = torch.randn(T + Wn - 1, d, device="cuda", generator=g)
    comp = torch.randn(n_comp, d, device="cuda", generator=g)
    sel = torch.randint(0, n_comp, (T, k_sel), device="cuda", generator=g) if k_sel else None
    sinks = torch.randn(H, device="cuda", generator=g)
    return q, win, comp, sel, sinks


def _torch_attend(q, win_keys, comp, sel, sinks, pos0: int, ratio: int, tf32: bool):
    """The session's torch form (prefill.attn_chunk's block loop) for one chunk, on the same inputs."""
    T, H, d = q.shape
    Wn = win_keys.shape[0] - T + 1
    pos = torch.arange(pos0, pos0 + T, device="cuda")
    ses = types.SimpleNamespace(W=types.SimpleNamespace(vec=lambda name: sinks))  # attend_rows reads the sinks only
    win = win_keys.unfold(0, Wn, 1)
    win_valid = (pos[:, None] - (Wn - 1) + torch.arange(Wn, device="cuda")[None, :]) >= 0
    n_vis = (pos + 1) // ratio
    comp_valid = (sel if sel is not None else torch.arange(comp.shape[0], device="cuda")[None, :]) < n_vis[:, None]
    out = torch.empty_like(q)
    n_keys = Wn + (sel.shape[1] if sel is not None else comp.shape[0]) + 1
    step = prefill.block_rows(H * n_keys * 4 * 3 + (sel.shape[1] * d * 4 if sel is not None else 0))
    with tc.tf32_products(tf32):
        for t0 in range(0, T, step):
            b = slice(t0, min(T, t0 + step))
            prefill.attend_rows(ses, 0, q[b], win[b], win_valid[b], comp, None if sel is None else sel[b],
                                comp_valid[b], out=out[b])
    return out


def time_ms(fn, reps: int) -> float:
    """Milliseconds per call of fn on the current CUDA stream (one warm-up call, then reps timed by events)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def bench_args(argv, doc: str, name: str, tokens: int, reps: int, help_tokens: str, extra=None):
    """The benchmarks' command line: --tokens, --reps (extra(parser) adds more); None (after saying so) without a
    CUDA device."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=tokens, help=f"{help_tokens} (default {tokens})")
    ap.add_argument("--reps", type=int, default=reps)
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA device", file=sys.stderr)
        return None
    return args


def main(argv=None) -> int:
    def extra(ap):
        ap.add_argument("--session-launches", type=int, default=0, metavar="N",
                        help="only N launches of form 3 as the session makes them (top-k layer), for a profiler")
        ap.add_argument("--session-ratio", type=int, choices=(4, 128), default=4,
                        help="with --session-launches: a top-k layer (4) or a ratio-128 layer")
        ap.add_argument("--session-output", choices=("split", "float"), default="split",
                        help="with --session-launches: the session's split output (default) or float32 rows with "
                             "the other options kept (what the split costs)")

    args = bench_args(argv, __doc__, "bench_attn", 2048, 3, "queries per chunk", extra)
    if args is None:
        return 2
    from . import load
    from .fused import Fused

    K = Fused(load(), torch.device("cuda"))
    T = args.tokens
    pos0 = 8192 - T
    if args.session_launches > 0:
        _session_launches(K, T, pos0, args.session_launches, args.session_ratio, args.session_output == "split")
        return 0
    print(f"{'layer':<22} {'fused ms':>9} {'torch f32 ms':>13} {'torch tf32 ms':>14} {'f32 / fused':>12}")
    for name, ratio, n_comp, k_sel in (("top-k (ratio 4)", 4, 2048, 512), ("ratio 128", 128, 64, 0)):
        q, win, comp, sel, sinks = _inputs(T, n_comp, k_sel, pos0)
        fused = time_ms(lambda: K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio), args.reps)
        f32 = time_ms(lambda: _torch_attend(q, win, comp, sel, sinks, pos0, ratio, False), args.reps)
        tf32 = time_ms(lambda: _torch_attend(q, win, comp, sel, sinks, pos0, ratio, True), args.reps)
        ref = _torch_attend(q, win, comp, sel, sinks, pos0, ratio, False)
        got = K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio)
        err = float((got - ref).norm() / ref.norm())
        print(f"{name:<22} {fused:9.2f} {f32:13.2f} {tf32:14.2f} {f32 / fused:12.2f}   (fused vs f32 rel {err:.1e})")
    # the FP8 KV simulation's keys: the exact-keys products, then also the packed rows (the same bits)
    from .ops import fp8_kv_round

    q, win, comp, sel, sinks = _inputs(T, 2048, 512, pos0)
    n_nope = q.shape[2] - 64
    win, comp = fp8_kv_round(win, n_nope), fp8_kv_round(comp, n_nope)
    full = time_ms(lambda: K.prefill_attn(q, win, comp, sel, sinks, pos0, 4), args.reps)
    exact = time_ms(lambda: K.prefill_attn(q, win, comp, sel, sinks, pos0, 4, n_nope, form=2), args.reps)
    packed = time_ms(lambda: K.prefill_attn(q, win, comp, sel, sinks, pos0, 4, n_nope, packed=True, form=2), args.reps)
    same = torch.equal(K.prefill_attn(q, win, comp, sel, sinks, pos0, 4, n_nope, packed=True, form=2),
                       K.prefill_attn(q, win, comp, sel, sinks, pos0, 4))
    print(f"top-k, FP8-rounded keys: fused {full:.2f} ms, form 2 exact keys {exact:.2f} ms, packed keys {packed:.2f} "
          f"ms (packed == full: {same})")
    # form 3 (v25 default): every product on the bfloat16 tensor cores (keys packed, RoPE tail split; not form 2's bits)
    bf16 = time_ms(lambda: K.prefill_attn(q, win, comp, sel, sinks, pos0, 4, n_nope, form=3), args.reps)
    two = K.prefill_attn(q, win, comp, sel, sinks, pos0, 4, n_nope, packed=True, form=2)
    diff = float((K.prefill_attn(q, win, comp, sel, sinks, pos0, 4, n_nope, form=3) - two).norm() / two.norm())
    K.ext.set_attn_tma(0)
    try:  # form 3's key tiles by cp.async pieces (DS4_GPU_ATTN_TMA=0) instead of bulk copies
        pieces = time_ms(lambda: K.prefill_attn(q, win, comp, sel, sinks, pos0, 4, n_nope, form=3), args.reps)
    finally:
        K.ext.set_attn_tma(-1)
    print(f"top-k, FP8-rounded keys: form 3 (bfloat16) {bf16:.2f} ms against packed form 2 {packed:.2f} ms: "
          f"{packed / bf16:.2f}x (rel diff {diff:.1e}); its tiles by cp.async pieces {pieces:.2f} ms")
    # form 3 as the session calls it: raw q_b rows post-processed in the staging, the output's RoPE tail undone and the
    # output as the o_a GEMM's float16 split per 8 heads (the per-CTA prologue and epilogue the plain rows skip)
    kw = _session_options()
    for name, ratio, n_comp, k_sel in (("top-k (ratio 4)", 4, 2048, 512), ("ratio 128", 128, 64, 0)):
        q, win, comp, sel, sinks = _inputs(T, n_comp, k_sel, pos0)
        win, comp = fp8_kv_round(win, n_nope), fp8_kv_round(comp, n_nope)
        parts = {"plain": {}, "q_post": {"q_post": kw["q_post"]}, "inverse RoPE": {"inverse_rope": kw["inverse_rope"]},
                 "inverse RoPE + split output": {"inverse_rope": kw["inverse_rope"], "split_heads": 8}, "all (the session)": kw}
        ms = {k: time_ms(lambda: K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, n_nope, form=3, **o), args.reps)
              for k, o in parts.items()}
        print(f"form 3, {name}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()))
    return 0


def _session_options() -> dict:
    freq = (10000.0 ** (-torch.arange(32, dtype=torch.float32) / 32)).cuda()
    return dict(inverse_rope=(freq, 64), q_post=dict(norm=True, eps=1e-6, freq=freq, rope_dim=64), split_heads=8,
                split_fp8=True)


def _session_launches(K, T: int, pos0: int, n: int, ratio: int = 4, split: bool = True) -> None:
    """n form-3 launches of a top-k (ratio 4) or ratio-128 layer with the session's options (what ncu --launch-skip
    picks from); split False: float32 output rows, the other options kept."""
    from .ops import fp8_kv_round

    q, win, comp, sel, sinks = _inputs(T, *((2048, 512) if ratio == 4 else (64, 0)), pos0)
    n_nope = q.shape[2] - 64
    win, comp = fp8_kv_round(win, n_nope), fp8_kv_round(comp, n_nope)
    kw = _session_options()
    if not split:
        kw.pop("split_heads")
    for _ in range(n):
        K.prefill_attn(q, win, comp, sel, sinks, pos0, ratio, n_nope, form=3, **kw)
    torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
