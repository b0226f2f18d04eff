"""A loaded DeepSeek V4 model: config, the GGUF file, weights by GGUF tensor name, tokenizer.

Weights stay in the file's mmap and the CPU forward pass never copies a whole tensor: F16 tensors
are multiplied as their half bits (`Model.dense(name)`, a uint16 view converted on the fly by the
kernels), quantized ones (Q8_0, Q4_K, Q2_K, IQ2_XXS) straight from their blocks
(`Model.quantized(name)`, `ds4.gguf_tools.quants.fused`), and row lookups (token embedding, APE,
tid2eid) convert only the rows they take (`Model.rows`, `Model.id_rows`). So the resident memory is
the pages of the file actually read plus activations.

`Model.w(name)` still gives any tensor as float32 for other users (tests, the GPU upload, the
numpy reference path): F32 tensors as zero-copy views, others converted once and cached.

`Model.from_tensors(config, tensors)` builds a model from an in-memory mapping of GGUF names to
arrays (tests, oracle comparisons) without any file.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from ds4.engine.config import Config
from ds4.gguf_tools import constants as C

F32 = np.float32


class ModelError(ValueError):
    """A model file that cannot be used (missing tensor, wrong shape, foreign file)."""


def decode_weight_bytes(file: Any, cfg: Config) -> dict[str, float]:
    """Weight bytes one decoded token reads from a GGUF as stored, by part (model-spec §8.2): the
    output head, every other layer/model tensor, k of E routed experts per layer, one embedding row.
    The bandwidth floor of decode is their sum over the memory bandwidth."""
    parts = {"head": 0.0, "layers": 0.0, "experts": 0.0, "embedding row": 0.0}
    for name, t in file.tensors.items():
        if name == C.OUTPUT:
            parts["head"] += t.nbytes
        elif name == C.TOKEN_EMBD:
            parts["embedding row"] += t.nbytes / cfg.vocab_size
        elif "_exps." in name:
            parts["experts"] += t.nbytes * cfg.n_expert_used / cfg.n_expert
        elif "tid2eid" not in name:  # the hash table is read one row per token
            parts["layers"] += t.nbytes
    return parts


class Model:
    def __init__(self, config: Config, tensors: Mapping[str, Any], file: Any = None, path: str | None = None,
                 fused_quant: bool = True):
        self.config = config
        self.fused_quant = fused_quant
        self.file = file
        self.path = path
        self._source = tensors  # name -> array (numpy) or a DS4File-backed loader
        self._cache: dict[str, np.ndarray] = {}
        self._dense: dict[str, np.ndarray] = {}
        self.plans: dict = {}  # per-layer argument tuples the kernels build once (ds4.engine.kernels)
        self._tokenizer = None

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike, *, fp8_kv: bool = True, indexer_qat: bool = True,
             fused_quant: bool = True) -> "Model":
        """Open a DS4 GGUF. The file stays mapped; no weight is copied until first use.

        With `fused_quant` (default) quantized tensors (Q8_0, Q4_K, Q2_K, IQ2_XXS) are multiplied
        straight from their blocks by `ds4.gguf_tools.quants.matmul` (fused decode + fixed-order
        dot, batch-invariant; no float32 copy). `fused_quant=False` dequantizes them once to
        float32 like F16 tensors: faster prefill on CPU, about 4-16x the memory for them."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ModelError(f"model file not found: {path}")
        dsfile = _open_gguf(path)
        cfg = dsfile.config.with_numerics(fp8_kv=fp8_kv, indexer_qat=indexer_qat)
        model = cls(cfg, _FileTensors(dsfile), file=dsfile, path=path, fused_quant=fused_quant)
        model.check_tensors()
        return model

    @classmethod
    def from_tensors(cls, config: Config, tensors: Mapping[str, np.ndarray]) -> "Model":
        model = cls(config, dict(tensors))
        model.check_tensors()
        return model

    def with_numerics(self, *, fp8_kv: bool | None = None, indexer_qat: bool | None = None) -> "Model":
        """A model sharing the same weights (and cache) with the rounding simulations switched."""
        other = Model(self.config.with_numerics(fp8_kv=fp8_kv, indexer_qat=indexer_qat), self._source,
                      file=self.file, path=self.path, fused_quant=self.fused_quant)
        other._cache = self._cache
        other._dense = self._dense
        other.plans = self.plans
        other._tokenizer = self._tokenizer
        return other

    # ---- weights ------------------------------------------------------------------------------
    def quantized(self, name: str) -> C.QuantType | None:
        """The block quant type of a file tensor multiplied in fused form, else None."""
        src = self._source.get(name)
        if not self.fused_quant or not isinstance(src, _Lazy):
            return None
        qt = src.qtype
        return qt if qt in (C.QuantType.Q8_0, C.QuantType.Q2_K, C.QuantType.Q4_K, C.QuantType.IQ2_XXS) else None

    def raw(self, name: str) -> np.ndarray:
        """The stored blocks of a file tensor, zero-copy: (rows..., row_bytes)."""
        return self.file.raw(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._source[name].shape)

    def has(self, name: str) -> bool:
        return name in self._source

    def w(self, name: str) -> np.ndarray:
        """The tensor as float32 (numpy shape = reversed GGUF ne), cached."""
        arr = self._cache.get(name)
        if arr is None:
            if name not in self._source:
                raise ModelError(f"tensor '{name}' is missing from the model")
            src = self._source[name]
            arr = np.ascontiguousarray(np.asarray(src), dtype=F32) if not isinstance(src, _Lazy) else src.load()
            self._cache[name] = arr
        return arr

    def dense(self, name: str) -> np.ndarray:
        """A float (non-block) weight in the form the dense kernels multiply: F16 file tensors as
        their half bits (uint16, a zero-copy view of the mmap: never converted or copied), F32 file
        tensors and in-memory arrays as float32 (zero-copy when already float32); other types
        (BF16) as a cached float32 conversion. numpy shape = reversed GGUF ne."""
        arr = self._dense.get(name)
        if arr is None:
            src = self._source.get(name)
            if src is None:
                raise ModelError(f"tensor '{name}' is missing from the model")
            if isinstance(src, _Lazy) and src.qtype == C.QuantType.F16:
                arr = self.file.raw(name).view(np.uint16).reshape(src.shape)
            else:  # F32 file tensor or in-memory array: zero-copy; BF16: converted once
                arr = self.w(name)
            self._dense[name] = arr
        return arr

    def rows(self, name: str, index) -> np.ndarray:
        """float32 rows W[index] of a float weight (token embedding, APE tables), converting only
        those rows (no copy of the whole tensor)."""
        w = self.dense(name)
        picked = w[index]
        if picked.dtype == np.uint16:
            return picked.view(np.float16).astype(F32)
        return np.asarray(picked, dtype=F32)

    def id_rows(self, name: str, index) -> np.ndarray:
        """Rows of an integer tensor (tid2eid) as int64, converting only those rows."""
        src = self._source[name]
        if isinstance(src, _Lazy):
            arr = self._dense.get(name)
            if arr is None:
                arr = self._dense[name] = src.load()  # I32: a zero-copy view of the file
            return np.asarray(arr[index]).astype(np.int64)
        return np.asarray(src)[index].astype(np.int64)

    def ids(self, name: str) -> np.ndarray:
        """An integer tensor (tid2eid) as int64."""
        src = self._source[name]
        return np.asarray(src.load() if isinstance(src, _Lazy) else src).astype(np.int64)

    def matmul(self, name: str, x: np.ndarray) -> np.ndarray:
        """x[..., in] @ W.T → [..., out] for a 2-D weight W[out, in]."""
        return np.matmul(x, self.w(name).T).astype(F32, copy=False)

    def check_tensors(self) -> None:
        """Every tensor the forward needs is present with the config's shape."""
        for name, shape in expected_shapes(self.config).items():
            if name not in self._source:
                raise ModelError(f"tensor '{name}' is missing from the model")
            got = tuple(self._source[name].shape)
            if got != shape:
                raise ModelError(f"tensor '{name}' has shape {got}, expected {shape}")

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from ds4.engine.tokenizer import Tokenizer  # written by the tokenizer helper

            if self.file is None:
                raise ModelError("this model has no GGUF file to read a tokenizer from")
            self._tokenizer = Tokenizer.from_gguf(self.file)
        return self._tokenizer

    def warm(self) -> None:
        """Look up every weight view the fast path multiplies by (no conversion: F16 stays in the mmap)."""
        from ds4.engine.forward import warm_weights

        warm_weights(self)


def expected_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """numpy shapes (reversed GGUF ne) of every tensor the forward reads, by GGUF name."""
    D, H, d, V = cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.vocab_size
    hc, mix = cfg.n_hc, cfg.hc_mix
    Rq, G, Ro = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    E, F, k = cfg.n_expert, cfg.expert_ffn, cfg.n_expert_used
    Hi, di = cfg.indexer_heads, cfg.indexer_dim
    out = {C.TOKEN_EMBD: (V, D), C.OUTPUT: (V, D), C.OUTPUT_NORM: (D,), C.OUTPUT_HC_FN: (hc, hc * D),
           C.OUTPUT_HC_BASE: (hc,), C.OUTPUT_HC_SCALE: (1,)}
    L = C.LayerTensor
    for i in range(cfg.n_layer):
        def put(t: L, shape: tuple[int, ...]) -> None:
            out[C.blk(i, t)] = shape
        for fn, sc, base in ((L.HC_ATTN_FN, L.HC_ATTN_SCALE, L.HC_ATTN_BASE), (L.HC_FFN_FN, L.HC_FFN_SCALE, L.HC_FFN_BASE)):
            put(fn, (mix, hc * D)); put(sc, (3,)); put(base, (mix,))
        put(L.ATTN_NORM, (D,)); put(L.FFN_NORM, (D,))
        put(L.ATTN_Q_A, (Rq, D)); put(L.ATTN_Q_A_NORM, (Rq,)); put(L.ATTN_Q_B, (H * d, Rq))
        put(L.ATTN_KV, (d, D)); put(L.ATTN_KV_A_NORM, (d,)); put(L.ATTN_SINKS, (H,))
        put(L.ATTN_OUTPUT_A, (G * Ro, H * d // G)); put(L.ATTN_OUTPUT_B, (D, G * Ro))
        r = cfg.ratio(i)
        if r:
            w = cfg.compressor_width(i)
            put(L.COMP_KV, (w, D)); put(L.COMP_GATE, (w, D)); put(L.COMP_APE, (r, w)); put(L.COMP_NORM, (d,))
        if r == 4:
            put(L.IDX_Q_B, (Hi * di, Rq)); put(L.IDX_PROJ, (Hi, D))
            put(L.IDX_COMP_KV, (2 * di, D)); put(L.IDX_COMP_GATE, (2 * di, D))
            put(L.IDX_COMP_APE, (4, 2 * di)); put(L.IDX_COMP_NORM, (di,))
        put(L.FFN_GATE_INP, (E, D))
        if cfg.is_hash_layer(i):
            put(L.FFN_GATE_TID2EID, (V, k))
        put(L.FFN_GATE_EXPS, (E, F, D)); put(L.FFN_UP_EXPS, (E, F, D)); put(L.FFN_DOWN_EXPS, (E, D, F))
        put(L.FFN_GATE_SHEXP, (F, D)); put(L.FFN_UP_SHEXP, (F, D)); put(L.FFN_DOWN_SHEXP, (D, F))
    return out


# ---- file access ------------------------------------------------------------------------------
class _Lazy:
    """A tensor in the file, converted to float32 on first use."""

    def __init__(self, dsfile: Any, name: str, shape: tuple[int, ...], qtype: Any = None):
        self.dsfile, self.name, self.shape, self.qtype = dsfile, name, shape, qtype

    def load(self) -> np.ndarray:
        arr = self.dsfile.array(self.name)
        if arr.dtype.kind in "iu":
            return arr
        return np.ascontiguousarray(arr, dtype=F32)


class _FileTensors(dict):
    def __init__(self, dsfile: Any):
        super().__init__()
        for name, info in dsfile.tensors.items():
            shape = tuple(int(x) for x in reversed(tuple(info.ne))) if hasattr(info, "ne") else tuple(info.shape)
            self[name] = _Lazy(dsfile, name, shape, getattr(info, "qtype", None))


def _open_gguf(path: str) -> Any:
    from ds4.gguf_tools.reader import GGUFError, open_model

    try:
        return open_model(path)
    except GGUFError as e:
        raise ModelError(str(e)) from None
