"""`python -m ds4.engine.gpu.bench_fp8`: the dense prefill products with their correction terms on float8
(fp8_split, DS4_GPU_PREFILL_GEMM=fp8) against their peer, the default three float16 GEMMs (weights.split_product),
and the single float16 pass (DS4_GPU_PREFILL_GEMM=f16), on random Q8_0-like weights at Flash shapes for T activation
rows. Prints milliseconds per product (operands already split, as the session hands them over; the float8 packing
included), the ratio peer / fp8, and each form's largest error over 64 output rows against a float64 reference,
relative to sum |w x| of that output. Needs a CUDA device (not the extension)."""

from __future__ import annotations

import torch

from .bench_attn import bench_args, time_ms

# (name, columns, rows, groups): the Flash matrices the dense GEMMs serve (attention output's first projection
# grouped by 8, as Weights.mm_split multiplies it)
SHAPES = [("attn_q_a", 4096, 1024, 1), ("attn_q_b", 1024, 32768, 1), ("attn_kv", 4096, 512, 1),
          ("attn_output_a", 4096, 8192, 8), ("attn_output_b", 8192, 4096, 1), ("ffn_gate_shexp", 4096, 2048, 1),
          ("ffn_down_shexp", 2048, 4096, 1)]
CHECK_ROWS = 64


def q8_weight(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """float32 [rows, cols] with Q8_0's values: int8 codes times a float16 scale per 32 columns."""
    codes = torch.randint(-127, 128, (rows, cols // 32, 32), generator=gen, device="cuda").float()
    d = (torch.rand(rows, cols // 32, 1, generator=gen, device="cuda") * 1e-3 + 1e-3).half().float()
    return (codes * d).reshape(rows, cols)


def activations(T: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Normal rows with a few large channels, as residual-stream activations have."""
    x = torch.randn(T, cols, generator=gen, device="cuda")
    x[:, :: max(1, cols // 8)] *= 40.0
    return x


def rel_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, groups: int) -> float:
    """max over CHECK_ROWS rows of |y - ref| / (|x| @ |w|^T), float64."""
    xs, ys = x[:CHECK_ROWS].double(), y[:CHECK_ROWS].double()
    T, n_in, n_out = xs.shape[0], w.shape[1], w.shape[0] // groups
    xg = xs.view(T, groups, n_in).transpose(0, 1)
    wg = w.double().view(groups, n_out, n_in).transpose(1, 2)
    ref = torch.bmm(xg, wg).transpose(0, 1).reshape(T, -1)
    mag = torch.bmm(xg.abs(), wg.abs()).transpose(0, 1).reshape(T, -1)
    return float(((ys - ref).abs() / mag).max())


def main(argv=None) -> int:
    args = bench_args(argv, __doc__, "bench_fp8", 8192, 5, "activation rows")
    if args is None:
        return 2
    from . import weights as W
    from . import fp8_split

    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    T = args.tokens
    print(f"{'matrix':<16} {'3xf16 ms':>9} {'fp8 ms':>8} {'1xf16 ms':>9} {'3xf16/fp8':>10} "
          f"{'err 3xf16':>10} {'err fp8':>9} {'err 1xf16':>10}")
    tot3 = tot8 = 0.0
    for name, cols, rows, groups in SHAPES:
        w = q8_weight(rows, cols, gen)
        x = activations(T, groups * cols, gen)
        wh = (w * W.W_SCALE).half()
        wl = (w * W.W_SCALE - wh.float()).half()
        xh, xl, s = W.to_half(x, True)
        n_out = rows // groups

        def grouped(t):
            return t.view(groups, n_out, cols).transpose(1, 2) if groups > 1 else t.T

        def xg(t):
            return t.view(T, groups, cols).transpose(0, 1) if groups > 1 else t

        def out(y):
            y = y.transpose(0, 1).reshape(T, rows) if groups > 1 else y
            return y * (s / W.W_SCALE)

        three = lambda: W.split_product(xg(xh), xg(xl), grouped(wh), grouped(wl))  # noqa: E731
        fp8 = lambda: fp8_split.product(xg(xh), xg(xl), grouped(wh), grouped(wl), W.acc_mm)  # noqa: E731
        one = lambda: W.split_product(xg(xh), None, grouped(wh), None)  # noqa: E731
        t3, t8, t1 = time_ms(three, args.reps), time_ms(fp8, args.reps), time_ms(one, args.reps)
        tot3, tot8 = tot3 + t3, tot8 + t8
        e3, e8, e1 = (rel_err(out(f()), x, w, groups) for f in (three, fp8, one))
        print(f"{name:<16} {t3:9.3f} {t8:8.3f} {t1:9.3f} {t3 / t8:10.2f} {e3:10.1e} {e8:9.1e} {e1:10.1e}")
    print(f"{'sum':<16} {tot3:9.3f} {tot8:8.3f} {'':>9} {tot3 / tot8:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
