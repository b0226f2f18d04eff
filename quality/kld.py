"""KL divergence between a base model and a test (e.g. quantized) model over a text.

For each scored position with base log-probs a = log p and test log-probs b = log q over the
vocabulary, and the true next token y:
    KLD      = Σ_v p_v (a_v − b_v)            (nats; ≥ 0)
    Δp       = q_y − p_y                      (probability the test model gives the right token,
                                               minus the base's)
    same top = argmax p == argmax q
    nll_base = −a_y,   nll_test = −b_y        (→ both perplexities)
The report carries the same statistics llama.cpp's `perplexity --kl-divergence` prints: mean ± standard
error, max, percentiles 99.9 … 0.1, min for KLD and Δp, RMS Δp, "same top p", and the perplexity
comparison (both PPLs, their log-ratio and correlation).

Saved base logits (`--save-logits`) let the two models run at different times. File layout (ours,
little-endian):
    8 bytes  magic b"DS4KLDv1"
    u32      header length H, then H bytes of UTF-8 JSON:
             {"n_vocab", "ctx", "n_chunks", "score_start", "dtype": "f16"|"f32", "model", "text"}
    u32      tokens[n_chunks * ctx]          (each chunk as fed, BOS first)
    dtype    logprobs[n_chunks * (ctx - 1 - score_start)][n_vocab]
             base log-softmax for positions score_start … ctx−2 of each chunk (the prediction
             of tokens score_start+1 … ctx−1)
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ds4.atomic import publish, save_figure_atomic

from .metrics import log_softmax

LOGITS_MAGIC = b"DS4KLDv1"
PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)


class LogitsFormatError(ValueError):
    pass


# ----------------------------------------------------------------------------------------------
# Per-position math


@dataclass
class PositionStats:
    kld: np.ndarray       # [n]
    dp: np.ndarray        # [n]  q_y - p_y
    same_top: np.ndarray  # [n]  bool
    nll_base: np.ndarray  # [n]
    nll_test: np.ndarray  # [n]


def position_stats(base_logprobs: np.ndarray, test_logprobs: np.ndarray, targets: np.ndarray) -> PositionStats:
    """All per-position quantities for rows of log-probs [n, V] (already log-softmaxed)."""
    a = np.asarray(base_logprobs, dtype=np.float64)
    b = np.asarray(test_logprobs, dtype=np.float64)
    y = np.asarray(targets, dtype=np.int64)
    p = np.exp(a)
    # p_v * (a_v - b_v) with 0 * anything = 0 (tokens the base gives no mass contribute nothing)
    diff = np.where(p > 0, a - b, 0.0)
    kld = np.sum(p * diff, axis=-1)
    kld = np.maximum(kld, 0.0)  # rounding can give −1e-17 for identical rows
    rows = np.arange(a.shape[0])
    ay, by = a[rows, y], b[rows, y]
    return PositionStats(kld=kld, dp=np.exp(by) - np.exp(ay),
                         same_top=np.argmax(a, axis=-1) == np.argmax(b, axis=-1),
                         nll_base=-ay, nll_test=-by)


@dataclass
class KldAccumulator:
    """Collects per-position stats chunk by chunk."""

    parts: list[PositionStats] = field(default_factory=list)

    def add(self, base_logprobs, test_logits_or_logprobs, targets, test_is_logits: bool = True) -> PositionStats:
        tl = log_softmax(test_logits_or_logprobs) if test_is_logits else np.asarray(test_logits_or_logprobs)
        ps = position_stats(base_logprobs, tl, targets)
        self.parts.append(ps)
        return ps

    def result(self) -> "KldResult":
        cat = lambda name: np.concatenate([getattr(p, name) for p in self.parts])  # noqa: E731
        return KldResult(kld=cat("kld"), dp=cat("dp"), same_top=cat("same_top"),
                         nll_base=cat("nll_base"), nll_test=cat("nll_test"))


def _sem(x: np.ndarray) -> float:
    n = x.shape[0]
    return float(np.std(x, ddof=1) / math.sqrt(n)) if n > 1 else 0.0


@dataclass
class KldResult:
    kld: np.ndarray
    dp: np.ndarray
    same_top: np.ndarray
    nll_base: np.ndarray
    nll_test: np.ndarray

    @property
    def n(self) -> int:
        return int(self.kld.shape[0])

    def summary(self) -> dict:
        """Every printed number, as a flat dict (also what `--json` writes and `compare` reads)."""
        n = self.n
        d = {"tokens": n}
        # perplexities: PPL = exp(mean nll); errors by the delta method
        mb, mt = float(self.nll_base.mean()), float(self.nll_test.mean())
        sb, st = _sem(self.nll_base), _sem(self.nll_test)
        ln_ratio = self.nll_test - self.nll_base
        mr, sr = float(ln_ratio.mean()), _sem(ln_ratio)
        ppl_b, ppl_t = math.exp(mb), math.exp(mt)
        cov = float(np.cov(self.nll_base, self.nll_test)[0, 1]) / n if n > 1 else 0.0
        diff_var = ppl_t ** 2 * st ** 2 + ppl_b ** 2 * sb ** 2 - 2 * ppl_t * ppl_b * cov
        if n > 1 and np.std(self.nll_base) > 0 and np.std(self.nll_test) > 0:
            corr = float(np.corrcoef(self.nll_base, self.nll_test)[0, 1])
        else:
            corr = 1.0
        d.update(ppl_test=ppl_t, ppl_test_err=ppl_t * st, ppl_base=ppl_b, ppl_base_err=ppl_b * sb,
                 ln_ppl_corr=corr, ln_ppl_ratio=mr, ln_ppl_ratio_err=sr,
                 ppl_ratio=math.exp(mr), ppl_ratio_err=math.exp(mr) * sr,
                 ppl_diff=ppl_t - ppl_b, ppl_diff_err=math.sqrt(max(diff_var, 0.0)))
        # KLD
        d.update(kld_mean=float(self.kld.mean()), kld_mean_err=_sem(self.kld),
                 kld_max=float(self.kld.max()), kld_min=float(self.kld.min()))
        for q in PERCENTILES:
            d[f"kld_p{q:g}"] = float(np.percentile(self.kld, q))
        # Δp
        dp2 = self.dp ** 2
        rms = math.sqrt(float(dp2.mean()))
        d.update(dp_mean=float(self.dp.mean()), dp_mean_err=_sem(self.dp),
                 dp_max=float(self.dp.max()), dp_min=float(self.dp.min()),
                 dp_rms=rms, dp_rms_err=(_sem(dp2) / (2 * rms) if rms > 0 else 0.0))
        for q in PERCENTILES:
            d[f"dp_p{q:g}"] = float(np.percentile(self.dp, q))
        same = float(self.same_top.mean())
        d.update(same_top=same, same_top_err=math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0)
        return d


def _pct_name(q: float) -> str:
    return "Median" if q == 50.0 else f"{q:4.1f}%"


def format_report(s: dict) -> str:
    """The llama.cpp-style text report of a `KldResult.summary()`."""
    L = []
    L.append(f"====== Perplexity statistics ({s['tokens']} tokens) ======")
    L.append(f"Mean PPL(Q)                   : {s['ppl_test']:10.6f} ± {s['ppl_test_err']:10.6f}")
    L.append(f"Mean PPL(base)                : {s['ppl_base']:10.6f} ± {s['ppl_base_err']:10.6f}")
    L.append(f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['ln_ppl_corr']:6.2f}%")
    L.append(f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio']:10.6f} ± {s['ln_ppl_ratio_err']:10.6f}")
    L.append(f"Mean PPL(Q)/PPL(base)         : {s['ppl_ratio']:10.6f} ± {s['ppl_ratio_err']:10.6f}")
    L.append(f"Mean PPL(Q)-PPL(base)         : {s['ppl_diff']:10.6f} ± {s['ppl_diff_err']:10.6f}")
    L.append("")
    L.append("====== KL divergence statistics ======")
    L.append(f"Mean    KLD: {s['kld_mean']:10.6f} ± {s['kld_mean_err']:10.6f}")
    L.append(f"Maximum KLD: {s['kld_max']:10.6f}")
    for q in PERCENTILES:
        L.append(f"{_pct_name(q):7s} KLD: {s[f'kld_p{q:g}']:10.6f}")
    L.append(f"Minimum KLD: {s['kld_min']:10.6f}")
    L.append("")
    L.append("====== Token probability statistics ======")
    L.append(f"Mean    Δp: {100 * s['dp_mean']:8.3f} ± {100 * s['dp_mean_err']:.3f} %")
    L.append(f"Maximum Δp: {100 * s['dp_max']:8.3f}%")
    for q in PERCENTILES:
        L.append(f"{_pct_name(q):7s} Δp: {100 * s[f'dp_p{q:g}']:8.3f}%")
    L.append(f"Minimum Δp: {100 * s['dp_min']:8.3f}%")
    L.append(f"RMS Δp    : {100 * s['dp_rms']:8.3f} ± {100 * s['dp_rms_err']:.3f} %")
    L.append(f"Same top p: {100 * s['same_top']:8.3f} ± {100 * s['same_top_err']:.3f} %")
    return "\n".join(L) + "\n"


def plot_histogram(kld: np.ndarray, out: str | os.PathLike, title: str = "KL divergence per token") -> None:
    """Histogram of per-token KLD on log-spaced bins (zeros clipped to the smallest bin)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.asarray(kld, dtype=np.float64)
    floor = 1e-9
    x = np.maximum(x, floor)
    hi = max(float(x.max()), floor * 10)
    bins = np.logspace(math.log10(floor), math.log10(hi) + 0.1, 60)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.hist(x, bins=bins, color="#2563eb")
    ax.set_xscale("log")
    ax.set_xlabel("KL(base ‖ test) per token, nats (values < 1e-9 shown at 1e-9)")
    ax.set_ylabel("tokens")
    ax.axvline(float(np.mean(kld)), color="#dc2626", linestyle="--", label=f"mean {np.mean(kld):.4g}")
    ax.axvline(float(np.median(kld)), color="#16a34a", linestyle=":", label=f"median {np.median(kld):.4g}")
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    _save_fig_atomic(fig, out)
    plt.close(fig)


def _save_fig_atomic(fig, out: str | os.PathLike) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_figure_atomic(fig, out, format=out.suffix.lstrip(".").lower() or "png")


# ----------------------------------------------------------------------------------------------
# Saved base logits: writer and reader


class LogitsWriter:
    """Streams base log-probs chunk by chunk to a temp file; `close()` renames it into place."""

    def __init__(self, path: str | os.PathLike, n_vocab: int, ctx: int, n_chunks: int, score_start: int,
                 dtype: str = "f16", model: str = "", text: str = ""):
        if dtype not in ("f16", "f32"):
            raise ValueError("dtype must be f16 or f32")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.np_dtype = np.dtype("<f2") if dtype == "f16" else np.dtype("<f4")
        self.n_vocab, self.ctx, self.n_chunks, self.score_start = n_vocab, ctx, n_chunks, score_start
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self.f = os.fdopen(fd, "wb")
        header = json.dumps({"n_vocab": n_vocab, "ctx": ctx, "n_chunks": n_chunks, "score_start": score_start,
                             "dtype": dtype, "model": model, "text": text}).encode("utf-8")
        self.f.write(LOGITS_MAGIC + struct.pack("<I", len(header)) + header)
        self.tokens: list[np.ndarray] = []
        self.body: list[str] = []
        self.chunks_written = 0
        # tokens come first in the file but are known chunk by chunk: logprobs go to a side file
        fd2, self.tmp_body = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".body", dir=self.path.parent)
        self.fb = os.fdopen(fd2, "wb")

    def add_chunk(self, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype="<u4")
        want = (self.ctx - 1 - self.score_start, self.n_vocab)
        if tokens.shape != (self.ctx,) or logprobs.shape != want:
            raise ValueError(f"chunk shapes {tokens.shape}, {logprobs.shape}; expected ({self.ctx},), {want}")
        self.tokens.append(tokens)
        lp = np.maximum(np.asarray(logprobs, dtype=np.float64), -60000.0)  # -inf → finite f16
        self.fb.write(lp.astype(self.np_dtype).tobytes())
        self.chunks_written += 1

    def close(self) -> None:
        if self.chunks_written != self.n_chunks:
            raise ValueError(f"{self.chunks_written} chunks written, header says {self.n_chunks}")
        self.fb.close()
        self.f.write(np.concatenate(self.tokens).tobytes())
        with open(self.tmp_body, "rb") as fb:
            while block := fb.read(1 << 24):
                self.f.write(block)
        self.f.close()
        os.unlink(self.tmp_body)
        publish(self.tmp, self.path)

    def abort(self) -> None:
        for f, p in ((self.f, self.tmp), (self.fb, self.tmp_body)):
            f.close()
            if os.path.exists(p):
                os.unlink(p)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


@dataclass
class SavedLogits:
    header: dict
    tokens: np.ndarray    # [n_chunks, ctx] u32
    logprobs: np.ndarray  # [n_chunks, ctx-1-score_start, n_vocab] memmap

    @property
    def ctx(self) -> int:
        return int(self.header["ctx"])

    @property
    def score_start(self) -> int:
        return int(self.header["score_start"])

    def chunk_logprobs(self, i: int) -> np.ndarray:
        """Chunk i's base log-probs, renormalized (the f16 rounding leaves Σp ≠ 1 by ~1e-4)."""
        return log_softmax(np.asarray(self.logprobs[i], dtype=np.float64))


def read_saved_logits(path: str | os.PathLike) -> SavedLogits:
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) < 12 or head[:8] != LOGITS_MAGIC:
            raise LogitsFormatError(f"{path}: not a ds4 saved-logits file")
        (hlen,) = struct.unpack("<I", head[8:])
        try:
            header = json.loads(f.read(hlen).decode("utf-8"))
            n_vocab, ctx, n_chunks, s0 = (int(header[k]) for k in ("n_vocab", "ctx", "n_chunks", "score_start"))
            dtype = {"f16": np.dtype("<f2"), "f32": np.dtype("<f4")}[header["dtype"]]
        except (ValueError, KeyError, UnicodeDecodeError):
            raise LogitsFormatError(f"{path}: bad header") from None
    tok_off = 12 + hlen
    lp_off = tok_off + 4 * n_chunks * ctx
    n_scored = ctx - 1 - s0
    want = lp_off + n_chunks * n_scored * n_vocab * dtype.itemsize
    if size != want:
        raise LogitsFormatError(f"{path}: {size} bytes, header implies {want} (truncated file?)")
    tokens = np.memmap(path, dtype="<u4", mode="r", offset=tok_off, shape=(n_chunks, ctx))
    logprobs = np.memmap(path, dtype=dtype, mode="r", offset=lp_off, shape=(n_chunks, n_scored, n_vocab))
    return SavedLogits(header=header, tokens=np.asarray(tokens), logprobs=logprobs)
