"""One mutable timeline per model (runtime-spec §6.1): tokens, KV state, next-token logits.

    s = Session(model, ctx=4096)
    logits = s.sync(prompt_ids)        # reuse the longest common prefix, extend, or rebuild
    logits = s.decode(next_id)         # one token at position len(s.tokens)
    blob = s.snapshot(); s2.restore(blob)   # the DSV4 session payload (runtime-spec §6.2)

Prefill runs in chunks of `prefill_chunk` tokens (first chunk of an extension shortened so chunks
end on absolute multiples of the chunk size, as ds4 does); because the compressors stream through
their frontiers, any chunking gives the logits token-by-token decode gives.
"""

from __future__ import annotations

import struct

import numpy as np

from ds4.engine.forward import KVState, forward_chunk, frontier_shape
from ds4.engine.hooks import Hooks

MAGIC = 0x34565344  # "DSV4" little-endian
VERSION = 1
HEADER = struct.Struct("<13I")
RESUME_PREFILL_MIN = 4  # shorter extensions run as single-token decodes


def kv_bytes_per_token(cfg) -> float:
    """model-spec §4.5: bytes of f32 compressed rows per token, d·4/r per compressed layer plus the
    indexer's di·4/4 on ratio-4 layers (the raw ring and the frontiers are a constant on top)."""
    total = 0.0
    for i in range(cfg.n_layer):
        r = cfg.ratio(i)
        if r:
            total += cfg.head_dim * 4 / r
        if r == 4:
            total += cfg.indexer_dim * 4 / 4
    return total


class SessionError(ValueError):
    """A prompt that does not fit, or a session payload that cannot be restored here."""


class Timeline:
    """The token timeline every session keeps (CPU here, CUDA in ds4.engine.gpu.session): `_tokens`,
    `ctx`, and the sync policy over the subclass's `prefill`, `invalidate` and `logits`."""

    _tokens: list[int]
    ctx: int

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def pos(self) -> int:
        return len(self._tokens)

    def _has_logits(self) -> bool:
        return self.logits is not None

    def common_prefix(self, tokens) -> int:
        n = 0
        for a, b in zip(self._tokens, tokens):
            if a != int(b):
                break
            n += 1
        return n

    def sync(self, tokens) -> np.ndarray:
        """Make the timeline equal `tokens` and return the next-token logits.

        Extends when the current tokens are a prefix of `tokens` (nothing to do when equal),
        otherwise rebuilds from scratch: compressed rows and frontiers cannot be rolled back.
        """
        tokens = [int(t) for t in tokens]
        if not tokens or len(tokens) >= self.ctx:
            raise SessionError(f"prompt exceeds context ({len(tokens)} tokens, ctx {self.ctx})")
        common = self.common_prefix(tokens)
        if common < len(self._tokens):
            self.invalidate()
        elif common == len(tokens) and self._has_logits():
            return self.logits
        self.prefill(tokens[len(self._tokens):])
        return self.logits


class Session(Timeline):
    def __init__(self, model, ctx: int = 4096, prefill_chunk: int = 2048, hooks: Hooks | None = None,
                 impl: str = "fast", progress=None):
        if ctx < 2:
            raise SessionError(f"context must be at least 2 tokens, got {ctx}")
        if prefill_chunk < 1:
            raise SessionError(f"prefill chunk must be positive, got {prefill_chunk}")
        self.model = model
        self.cfg = model.config
        self.ctx = int(ctx)
        self.prefill_chunk = int(min(prefill_chunk, ctx))
        self.hooks = hooks
        self.impl = impl
        self.progress = progress  # optional callable(n_done, n_total) during prefill
        self.state = KVState(self.cfg, self.ctx)
        self._tokens: list[int] = []
        self.logits: np.ndarray | None = None

    # ---- timeline -----------------------------------------------------------------------------
    def invalidate(self) -> None:
        """Forget everything (the next sync rebuilds)."""
        self.state.reset()
        self._tokens = []
        self.logits = None

    def decode(self, token: int) -> np.ndarray:
        """Append one token and return the logits that follow it."""
        if self.pos + 1 > self.ctx:
            raise SessionError(f"context full ({self.ctx} tokens)")
        return self._run([int(token)])

    def prefill(self, tokens, all_logits: bool = False) -> np.ndarray:
        """Append `tokens` in chunks; return the last logits, or [T, V] for every new position."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            if all_logits:
                return np.zeros((0, self.cfg.vocab_size), np.float32)
            return self.logits
        if self.pos + len(tokens) > self.ctx:
            raise SessionError(f"prompt exceeds context ({self.pos + len(tokens)} tokens, ctx {self.ctx})")
        if len(tokens) < RESUME_PREFILL_MIN and self.pos > 0:
            outs = [self._run([t], all_logits) for t in tokens]
            return np.concatenate(outs) if all_logits else self.logits
        outs = []
        done, total = 0, len(tokens)
        while done < total:
            # End chunks on absolute multiples of the chunk size (ds4's resumed-prefill alignment).
            n = min(self.prefill_chunk - self.pos % self.prefill_chunk, total - done)
            outs.append(self._run(tokens[done:done + n], all_logits))
            done += n
            if self.progress is not None:
                self.progress(done, total)
        return np.concatenate(outs) if all_logits else self.logits

    def _run(self, tokens: list[int], all_logits: bool = False) -> np.ndarray:
        try:
            out = forward_chunk(self.model, self.state, tokens, self.hooks, all_logits=all_logits, impl=self.impl)
        except BaseException:
            self.invalidate()  # a half-updated state must never be reused
            raise
        self._tokens.extend(tokens)
        self.logits = out[-1] if all_logits else out
        return out if all_logits else self.logits

    # ---- memory -------------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of KV state allocated for this context (raw ring, compressed rows, frontiers)."""
        return self.state.nbytes()

    def kv_bytes_per_token(self) -> float:
        return kv_bytes_per_token(self.cfg)

    # ---- DSV4 payload (runtime-spec §6.2) ------------------------------------------------------
    def _header(self, n_tokens: int) -> tuple[int, ...]:
        st = self.state
        return (MAGIC, VERSION, self.ctx, self.prefill_chunk, st.raw_cap, st.raw_window, st.comp_cap,
                n_tokens, self.cfg.n_layer, self.cfg.head_dim, self.cfg.indexer_dim, self.cfg.vocab_size,
                min(n_tokens, st.raw_window))

    def snapshot(self) -> bytes:
        """The session payload: header, tokens, logits, counts, then per-layer rows and frontiers."""
        st, n = self.state, self.pos
        hdr = self._header(n)
        raw_live = hdr[12]
        parts = [HEADER.pack(*hdr), np.asarray(self._tokens, "<u4").tobytes()]
        logits = self.logits if self.logits is not None else np.zeros(self.cfg.vocab_size, np.float32)
        parts.append(np.asarray(logits, "<f4").tobytes())
        parts.append(np.array([ls.n_comp for ls in st.layers], "<u4").tobytes())
        parts.append(np.array([ls.n_idx for ls in st.layers], "<u4").tobytes())
        live = np.arange(n - raw_live, n) % st.raw_cap
        for ls in st.layers:
            parts.append(np.ascontiguousarray(ls.raw[live], "<f4").tobytes())
            if ls.ratio:
                parts += [ls.comp[:ls.n_comp].astype("<f4").tobytes(), ls.comp_kv.astype("<f4").tobytes(),
                          ls.comp_score.astype("<f4").tobytes()]
            if ls.ratio == 4:
                parts += [ls.idx[:ls.n_idx].astype("<f4").tobytes(), ls.idx_kv.astype("<f4").tobytes(),
                          ls.idx_score.astype("<f4").tobytes()]
        return b"".join(parts)

    def restore(self, payload: bytes) -> None:
        """Load a payload written by `snapshot` (or by ds4 for the same model shape). On any error
        the session is left empty and SessionError says what did not match."""
        try:
            self._restore(memoryview(payload))
        except SessionError:
            self.invalidate()
            raise

    def _restore(self, buf: memoryview) -> None:
        cfg, st = self.cfg, self.state
        if len(buf) < HEADER.size:
            raise SessionError(f"session payload truncated: {len(buf)} bytes, header needs {HEADER.size}")
        (magic, version, ctx, chunk, _raw_cap, raw_window, comp_cap, n_tokens, n_layer, head_dim, idx_dim,
         vocab, raw_live) = HEADER.unpack_from(buf, 0)
        if magic != MAGIC:
            raise SessionError(f"not a DSV4 session payload (magic {magic:#010x})")
        if version != VERSION:
            raise SessionError(f"session payload version {version}, expected {VERSION}")
        mine = (cfg.n_layer, cfg.head_dim, cfg.indexer_dim, cfg.vocab_size)
        if (n_layer, head_dim, idx_dim, vocab) != mine:
            raise SessionError(f"session is for another model shape (layers/head dim/indexer dim/vocab "
                               f"{(n_layer, head_dim, idx_dim, vocab)}, this model {mine})")
        if ctx > self.ctx or n_tokens >= self.ctx:
            raise SessionError(f"session needs ctx {ctx} with {n_tokens} tokens; this session has ctx {self.ctx}")
        if chunk != self.prefill_chunk or raw_window != st.raw_window:
            raise SessionError(f"session prefill chunk/raw window {chunk}/{raw_window} differ from this "
                               f"session's {self.prefill_chunk}/{st.raw_window}")
        if raw_live != min(n_tokens, raw_window) or comp_cap > st.comp_cap:
            raise SessionError("session header is inconsistent (raw_live or comp_cap)")
        off = HEADER.size

        def take(count: int, dtype: str) -> np.ndarray:
            nonlocal off
            nbytes = count * 4
            if off + nbytes > len(buf):
                raise SessionError(f"session payload truncated at byte {len(buf)} (needs more than {off + nbytes})")
            arr = np.frombuffer(buf, dtype, count, off)
            off += nbytes
            return arr

        tokens = take(n_tokens, "<u4").astype(np.int64)
        if n_tokens and tokens.max() >= vocab:
            raise SessionError("session holds a token id outside the vocabulary")
        logits = take(vocab, "<f4").astype(np.float32)
        n_comp, n_idx = take(n_layer, "<u4"), take(n_layer, "<u4")
        for i in range(n_layer):
            r = cfg.ratio(i)
            want = n_tokens // r if r else 0
            if n_comp[i] != want or n_idx[i] != (want if r == 4 else 0):
                raise SessionError(f"layer {i}: {n_comp[i]}/{n_idx[i]} compressed rows do not match "
                                   f"{n_tokens} tokens at ratio {r}")
        fresh = KVState(cfg, self.ctx)
        fresh.n_tokens = n_tokens
        live = np.arange(n_tokens - raw_live, n_tokens) % fresh.raw_cap
        for i, ls in enumerate(fresh.layers):
            ls.raw[live] = take(raw_live * head_dim, "<f4").reshape(raw_live, head_dim)
            if ls.ratio:
                ls.n_comp = int(n_comp[i])
                ls.comp[:ls.n_comp] = take(ls.n_comp * head_dim, "<f4").reshape(-1, head_dim)
                shape = frontier_shape(ls.ratio, cfg.compressor_width(i))
                ls.comp_kv[:] = take(shape[0] * shape[1], "<f4").reshape(shape)
                ls.comp_score[:] = take(shape[0] * shape[1], "<f4").reshape(shape)
            if ls.ratio == 4:
                ls.n_idx = int(n_idx[i])
                ls.idx[:ls.n_idx] = take(ls.n_idx * idx_dim, "<f4").reshape(-1, idx_dim)
                shape = frontier_shape(4, 2 * idx_dim)
                ls.idx_kv[:] = take(shape[0] * shape[1], "<f4").reshape(shape)
                ls.idx_score[:] = take(shape[0] * shape[1], "<f4").reshape(shape)
        if off != len(buf):
            raise SessionError(f"session payload has {len(buf) - off} trailing bytes")
        self.state = fresh
        self._tokens = [int(t) for t in tokens]
        self.logits = logits if n_tokens else None
