"""Model weights on the device for the CUDA engine session (ds4.engine.gpu.session).

Quantized matrices become resident extension tensors (uploaded once from the GGUF mmap, repacked
on the GPU); vectors, small float32 matrices the fused kernels read directly (`dense`) and anything
the kernels cannot multiply stay torch tensors. On a machine without the extension the same class
holds float32 torch tensors, so the session's logic runs (and is tested) on the CPU.
"""

from __future__ import annotations

import math
import os
import weakref

import numpy as np
import torch

from ds4.gguf_tools import constants as C

from . import fp8_split, moe_gemm, ops

L = C.LayerTensor
F32 = torch.float32
EXT_TYPES = {1: 8, 8: 32, 10: 256, 12: 256, 16: 256}  # qtype -> ne0 multiple the kernels need
MOE_PIECE = 64  # tokens per routed-MoE launch in prefill (bounds the extension's scratch)
# Prefill products with at least this many rows go through f16 tensor-core GEMMs on weights dequantized
# for the call (dequant.cu) instead of the int8 matvec kernels (which stream the weight once per 8 rows);
# routed experts from MOE_GEMM_MIN tokens, since that path dequantizes every expert of the layer.
GEMM_MIN = int(os.environ.get("DS4_GPU_GEMM_MIN", "16"))
MOE_GEMM_MIN = int(os.environ.get("DS4_GPU_MOE_GEMM_MIN", "256"))
# DS4_GPU_PREFILL_GEMM: the dense prefill products. fp8 (default, v26): float16 hi.hi plus both correction terms in
# one float8 GEMM (fp8_split.py); exact: three float16 GEMMs hi.hi + lo.hi + hi.lo; f16: hi.hi alone; mmq: below
PREFILL_GEMM_MODES = ("fp8", "exact", "f16", "mmq")


def parse_prefill_gemm(value: str) -> str:
    mode = value.strip().lower() or "fp8"
    if mode not in PREFILL_GEMM_MODES:
        raise ValueError(f"DS4_GPU_PREFILL_GEMM={value!r}: unknown mode (known: {', '.join(PREFILL_GEMM_MODES)})")
    return mode


PREFILL_GEMM = parse_prefill_gemm(os.environ.get("DS4_GPU_PREFILL_GEMM", ""))
EXACT_GEMM = PREFILL_GEMM != "f16"
# DS4_GPU_PREFILL_GEMM=mmq: quantized weights (Q8_0, Q2_K, Q4_K, IQ2_XXS: in Flash q2 the attention projections and the
# shared expert) on the int8 tensor cores straight from their codes (mmq.cu: the decode kernels' activation
# quantization and exact block sums, no dequant pass, two int8 products instead of three f16 ones); F16 weights as in
# exact mode. v10: written without a device, not yet run.
MMQ_GEMM = PREFILL_GEMM == "mmq"
# fp8: two float16-pass equivalents instead of three, ~2^-18 of sum |w x| per product where exact gives ~2^-22 (v26
# call 1: 8192-token prefill 4160 -> 4354 t/s; the session suite passes)
FP8_GEMM = PREFILL_GEMM == "fp8"
# ... for weights of at least this many elements (v26 call 1, 8192 rows: the Flash q_a and kv products, 4M and 2M, lost
# 0.56 against 0.31 and 0.50 against 0.17 ms to the packing; the 33M ones won 1.2-1.4x)
FP8_MIN = int(os.environ.get("DS4_GPU_FP8_MIN", str(8 << 20)))
# mm_split_then: the grouped product's rescale and the next product's split in one launch (v26, prepared; off until
# run on a GPU: tests/test_gpu_prefill.py -k split_then holds it to the two-step bits)
SPLIT_GROUPS = os.environ.get("DS4_GPU_SPLIT_GROUPS", "1") == "1"
# DS4_GPU_DEQUANT_FP8 (v27; default 1 since v28): where a product takes the float8 path and the weight's float8 scale
# is known, the dequant writes the corrections' float8 operand itself (no lo plane, no pack pass; the same bytes)
DEQUANT_FP8 = os.environ.get("DS4_GPU_DEQUANT_FP8", "1") == "1"
# DS4_GPU_FOLD_SWIGLU (v28; default 1 since v30, within the noise of off: 4707 / 4687 against 4728 / 4708 t/s at 8192
# tokens, v30 call 2; two launches fewer per layer): with swiglu_ffn(..., unscaled=True) (the session's
# DS4_GPU_FOLD_POST), the shared expert's gate and up products reach the SwiGLU launch unscaled and it applies their
# per-row rescales as it reads them (the same bits), not a torch multiply over [T, 2048] each (4.6 ms per 8192-token
# prefill, v28 call 4's profile)
FOLD_SWIGLU = os.environ.get("DS4_GPU_FOLD_SWIGLU", "1") == "1"
PF_CTAS = int(os.environ.get("DS4_GPU_PF_CTAS", "0"))  # L2 prefetch grid (see prefetch); 0: one CTA per SM
PF_MODE = int(os.environ.get("DS4_GPU_PF_MODE", "0"))  # 0: bulk (TMA) prefetch, 1: per 128-byte line
# decode: dependent matvec pairs in one launch (A/B): 1 the register form (matvec_chain.cu), 2 the bulk-copy form
# (matvec_tma.cu) where it takes the shapes
MV_CHAIN = os.environ.get("DS4_GPU_MV_CHAIN", "0") in ("1", "2")
# ... and the shared expert too (0: o_a -> o_b only; the shared expert runs on a side branch of the decode graph, where
# a chained grid's barrier waits for CTAs that the main branch's kernels may hold off)
MV_CHAIN_FFN = os.environ.get("DS4_GPU_MV_CHAIN_FFN", "1") == "1"
# decode: o_b in two column slices ("2", the default; anything else: off), whose parts the next mHC post adds
# (matvec_sliced; v18: o_b alone 14.0 -> 11.5 us in the kernel bench; v19: decode 7.32 / 7.40 against 7.40 / 7.49 ms)
OB_SLICES = 2 if os.environ.get("DS4_GPU_OB_SLICES", "2") == "2" else 0
# prefill routed experts: the padded batch holds up to this many times the mean load per expert (the rest of a
# busy expert goes to plain GEMMs); padding rows cost GEMM work, overflow costs launches (A/B, v8: not measured)
MOE_CAP_FACTOR = float(os.environ.get("DS4_GPU_MOE_CAP", "2"))
SPLIT_MEMO = int(os.environ.get("DS4_GPU_SPLIT_MEMO", "3"))  # to_half's splits kept for reuse (0: none, the v14 form)
W_SCALE = 1024.0  # weights times 2^10 before the hi/lo split: their lo parts stay above f16's subnormals


def default_device() -> torch.device:
    from ds4.engine import gpu

    if torch.cuda.is_available() and gpu.available():
        return torch.device("cuda")
    return torch.device("cpu")


# Weights.shared: (model, device) -> the upload some session still holds
_SHARED: dict[tuple[int, str], tuple[weakref.ref, weakref.ref]] = {}


class Weights:
    """Weights on the device: extension tensors for the matrices it can multiply, torch otherwise."""

    @classmethod
    def shared(cls, model, device: torch.device) -> Weights:
        """The weights of this model already on this device while any session holds them, else a new upload. Why:
        a tool that opens a session while another is alive (the REPL's /ctx, a case per session, a warm-up session)
        would hold a second copy of the weights, and Flash q2's 81 GiB do not fit an H200 twice."""
        key = (id(model), str(device))
        model_ref, w_ref = _SHARED.get(key, (None, None))
        w = w_ref() if w_ref is not None and model_ref() is model else None
        if w is None:
            w = cls(model, device)
            for k in [k for k, (m, x) in _SHARED.items() if m() is None or x() is None]:
                del _SHARED[k]  # uploads no session holds any more (and ids that may be reused)
            _SHARED[key] = (weakref.ref(model), weakref.ref(w))
        return w

    def __init__(self, model, device: torch.device, emulate_kernels: bool = False):
        self.model, self.device = model, device
        # CPU only: round activations as the extension's quantized kernels do (ops.quantize_hilo), so
        # the CPU twin reproduces the GPU's arithmetic up to summation order
        self.emulate = emulate_kernels and device.type == "cpu"
        self.ext = None
        if device.type == "cuda":
            from ds4.engine import gpu

            self.ext = gpu.load()
            self.ext.reserve_scratch(64 << 20)
        self._mats: dict[str, object] = {}
        self._vecs: dict[str, torch.Tensor] = {}
        self.folded_norms = 0  # mm(..., norm=) launches whose matvec applied the RMS norm itself (see mm)
        # to_half's last splits: a prefill layer multiplies the same activations by several weights (its input by
        # q_a, kv, the compressors and the indexer's projection; the FFN input by the router and the shared expert)
        self._splits: list[tuple[tuple, torch.Tensor, tuple]] = []
        self.split_hits = 0
        self._fp8_scales: dict[int, torch.Tensor] = {}  # DS4_GPU_PREFILL_GEMM=fp8: each weight's scale (fp8_split)

    # ---- storage ---------------------------------------------------------------------------
    def vec(self, name: str) -> torch.Tensor:
        t = self._vecs.get(name)
        if t is None:
            t = torch.from_numpy(np.ascontiguousarray(self.model.w(name), np.float32)).to(self.device)
            self._vecs[name] = t
        return t

    def ids(self, name: str) -> torch.Tensor:
        t = self._vecs.get(name)
        if t is None:
            t = torch.from_numpy(self.model.ids(name)).to(self.device)
            self._vecs[name] = t
        return t

    def embedding(self) -> torch.Tensor:
        t = self._vecs.get(C.TOKEN_EMBD)
        if t is None:
            f = self.model.file
            if self.ext is not None and f is not None and int(f.info(C.TOKEN_EMBD).qtype) == 1:
                raw = f.raw(C.TOKEN_EMBD).reshape(-1).view(np.float16)
                t = torch.from_numpy(np.ascontiguousarray(raw)).to(self.device).view(*self.model.shape(C.TOKEN_EMBD))
            else:
                t = torch.from_numpy(self.model.w(C.TOKEN_EMBD)).to(self.device)
            self._vecs[C.TOKEN_EMBD] = t
        return t

    def mat(self, name: str):
        m = self._mats.get(name)
        if m is None:
            f = self.model.file
            info = f.info(name) if (self.ext is not None and f is not None) else None
            qt = int(info.qtype) if info is not None else -1
            routed_f16 = "_exps." in name and qt == 1  # the MoE kernels take quantized experts only
            if info is not None and qt in EXT_TYPES and info.ne[0] % EXT_TYPES[qt] == 0 and not routed_f16:
                m = self.ext.upload(name, qt, [int(n) for n in info.ne], f.raw(name).reshape(-1))
            else:
                m = torch.from_numpy(np.ascontiguousarray(self.model.w(name), np.float32)).to(self.device)
            self._mats[name] = m
        return m

    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self._vecs.values())
        for m in self._mats.values():
            n += m.numel() * 4 if isinstance(m, torch.Tensor) else int(m.nbytes)
        return n

    # ---- products ----------------------------------------------------------------------------
    def _arr(self, t: torch.Tensor):
        return self.ext.Array.view(t.data_ptr(), list(t.shape), t.dtype == torch.int32)

    def _sync_stream(self) -> None:
        self.ext.set_stream(torch.cuda.current_stream(self.device).cuda_stream)

    def mm(self, name: str, x: torch.Tensor, groups: int = 1,
           norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """x [T, groups·in] → [T, out] for a 2-D weight W[out, in] (groups: block-diagonal rows).
        norm = (w, eps): the product of rms_norm(x) * w instead; for one token on CUDA the streaming matvec applies
        the norm while it stages x (no norm launch), with the bits of the rms_norm kernel's output."""
        w = self.mat(name)
        x = x.contiguous()
        if norm is not None:
            nw, eps = norm
            if self.ext is not None and x.shape[0] == 1 and groups == 1 and not isinstance(w, torch.Tensor):
                self._sync_stream()
                y = torch.empty((1, w.nrows), dtype=F32, device=self.device)
                # the extension falls back to its rms_norm launch where the streaming kernel declines W
                self.folded_norms += bool(self.ext.matvec(w, self._arr(x), self._arr(y), 1, nw.contiguous().data_ptr(),
                                                          float(eps)))
                return y
            x = self._rms_norm(x, nw, eps)
        if isinstance(w, torch.Tensor):
            if self.emulate and self._quantized(name):
                x = ops.quantize_hilo(x)
            if groups == 1:
                return x @ w.T
            T = x.shape[0]
            wg = w.reshape(groups, w.shape[0] // groups, w.shape[1])
            return torch.einsum("tgi,goi->tgo", x.reshape(T, groups, -1), wg).reshape(T, -1)
        T = x.shape[0]
        if T >= GEMM_MIN:
            return self._gemm(w, x, groups)
        self._sync_stream()
        y = torch.empty((T, w.nrows), dtype=F32, device=self.device)
        for i in range(0, T, 8):
            xs, ys = x[i:i + 8], y[i:i + 8]
            self.ext.matvec(w, self._arr(xs), self._arr(ys), groups)
        return y

    def mm_unscaled(self, name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(z, r) with mm(name, x) == z * r bit for bit: the hi/lo GEMM path (prefill rows) leaves its per-row rescale
        r [T, 1] to a consumer that reads the product anyway (one pass over [T, out] less); every other path
        returns its product and r = None."""
        w = self.mat(name)
        x = x.contiguous()
        if self.ext is None or isinstance(w, torch.Tensor) or x.shape[0] < GEMM_MIN or MMQ_GEMM:
            return self.mm(name, x), None
        hi, lo, scale, b8 = self._operands(w)
        xh, xl, s = self.to_half(x)
        return self._dense_product(w, xh, xl, hi.T, None if lo is None else lo.T, b8=b8), s / scale

    def takes_split(self, name: str, T: int) -> bool:
        """Whether mm(name, x) of T rows multiplies to_half's exact split of x by the weight's hi/lo GEMMs, so a
        kernel that produces x may hand over the split itself (mm_split)."""
        w = self.mat(name)
        return self.ext is not None and not isinstance(w, torch.Tensor) and T >= GEMM_MIN and EXACT_GEMM \
            and not MMQ_GEMM

    def takes_fp8(self, name: str, T: int, groups: int = 1) -> bool:
        """Whether mm_split(name, ..., groups) of T rows runs the float8 correction GEMM (fp8_split), so the split's
        producer may hand over the float8 operand instead of lo."""
        w = self.mat(name)
        return self.takes_split(name, T) and FP8_GEMM and w.qtype != 1 and w.nrows * w.ncols >= FP8_MIN \
            and fp8_split.available(self.device) and w.ncols % 16 == 0 and (w.nrows // groups) % 16 == 0

    def _mm_split_groups(self, name: str, split: tuple, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """mm_split's product before its per-(row, group) rescale: (y [groups, T, out / groups], r [T, groups])."""
        w = self.mat(name)
        xh, xl, s = split[:3]
        a8 = split[3] if len(split) > 3 else None
        T = xh.shape[0]
        if tuple(s.shape) != (T, groups) or xh.shape[1] != groups * w.ncols:
            raise ValueError(f"mm_split '{name}': split of {tuple(xh.shape)} with scales {tuple(s.shape)} for "
                             f"{groups} groups of {w.ncols} columns")
        hi, lo, scale, b8 = self._operands(w, groups)
        n_in, n_out = w.ncols, w.nrows // groups
        xg = lambda t: t.view(T, groups, n_in).transpose(0, 1)  # noqa: E731
        wg = lambda t: None if t is None else t.view(groups, n_out, n_in).transpose(1, 2)  # noqa: E731
        y = self._dense_product(w, xg(xh), None if xl is None else xg(xl), wg(hi), wg(lo), a8, b8)  # [groups, T, n_out]
        return y, s / scale

    def mm_split(self, name: str, split: tuple, groups: int) -> torch.Tensor:
        """mm(name, x, groups) from x's split made by its producer: hi, lo [T, groups·in] float16 with
        hi + lo = x / s per group, s [T, groups] (to_half's operations with one scale per row and group); or
        (hi, None, s, a8) with a8 [groups, T, 2 in] the float8 operand of fp8_split (takes_fp8)."""
        y, r = self._mm_split_groups(name, split, groups)
        G, T, n_out = y.shape
        return (y.transpose(0, 1) * r[:, :, None]).reshape(T, G * n_out)

    def mm_split_then(self, first: str, split: tuple, groups: int, second: str, unscaled: bool = False):
        """mm(second, mm_split(first, split, groups)), the same bits. DS4_GPU_SPLIT_GROUPS=1 (v27 default; 0: the v26
        form): first's grouped output is rescaled and split for second in one launch (dequant.cu split_groups; with
        second's float8 operand in place of lo where it takes the float8 path), not a strided torch multiply, then
        split_half and the float8 pack. unscaled: second's product as ops.Unscaled where its rescale is left over
        (the consumer applies it), else the tensor."""
        wb = self.mat(second)
        y, r = self._mm_split_groups(first, split, groups)
        G, T, n = y.shape
        if not (SPLIT_GROUPS and self.takes_split(second, T) and G * n == wb.ncols and G * n <= 8192 and n % 4 == 0):
            return self.mm(second, (y.transpose(0, 1) * r[:, :, None]).reshape(T, G * n))
        fp8 = self.takes_fp8(second, T)
        xh = torch.empty((T, G * n), dtype=torch.float16, device=self.device)
        xl = None if fp8 else torch.empty_like(xh)
        a8 = torch.empty((T, 2 * G * n), dtype=fp8_split.E4M3, device=self.device) if fp8 else None
        s = torch.empty((T, 1), dtype=F32, device=self.device)
        y, r = y.contiguous(), r.contiguous()
        self._sync_stream()
        self.ext.split_groups(y.data_ptr(), r.data_ptr(), G, T, n, xh.data_ptr(), 0 if xl is None else xl.data_ptr(),
                              0 if a8 is None else a8.data_ptr(), s.data_ptr())
        hi, lo, scale, b8 = self._operands(wb)
        z = self._dense_product(wb, xh, xl, hi.T, None if lo is None else lo.T, a8, b8)
        return ops.Unscaled(z, s / scale) if unscaled else z * (s / scale)

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(x) * w as the session computes it: the extension's kernel on CUDA (fused.Fused.rms_norm)."""
        if self.ext is None:
            return ops.rms_norm(x, w, eps)
        y = torch.empty_like(x)
        self._sync_stream()
        n = x.shape[-1]
        self.ext.rms_norm(x.data_ptr(), w.contiguous().data_ptr(), y.data_ptr(), x.numel() // n, n, float(eps))
        return y

    def mm_then(self, first: str, x: torch.Tensor, groups: int, second: str) -> torch.Tensor:
        """second · (first · x) with first grouped; decode with DS4_GPU_MV_CHAIN=1 or 2: one chained launch
        (matvec_chain.cu, matvec_tma.cu) where the kernel takes the shapes."""
        if MV_CHAIN and self.ext is not None and x.shape[0] == 1:
            wa, wb = self.mat(first), self.mat(second)
            if not isinstance(wa, torch.Tensor) and not isinstance(wb, torch.Tensor):
                self._sync_stream()
                x = x.contiguous()
                mid = torch.empty((1, wa.nrows), dtype=F32, device=self.device)
                y = torch.empty((1, wb.nrows), dtype=F32, device=self.device)
                if self.ext.matvec_chain([wa], x.data_ptr(), [mid.data_ptr()], groups, wb, y.data_ptr()):
                    return y
        return self.mm(second, self.mm(first, x, groups))

    def mm_then_parts(self, first: str, x: torch.Tensor, groups: int, second: str) -> tuple[torch.Tensor, ...]:
        """mm_then as summands: (y,), or with DS4_GPU_OB_SLICES=2 in decode on CUDA the two column-slice parts of
        second's product (y = y0 + y1 up to float rounding), for a consumer that adds them (the mHC post)."""
        if OB_SLICES == 2 and not MV_CHAIN and self.ext is not None and x.shape[0] == 1:
            wb = self.mat(second)
            if not isinstance(wb, torch.Tensor):
                mid = self.mm(first, x, groups).contiguous()
                parts = torch.empty((2, wb.nrows), dtype=F32, device=self.device)
                self._sync_stream()
                if self.ext.matvec_sliced(wb, mid.data_ptr(), parts.data_ptr(), 2):
                    return parts[0:1], parts[1:2]
                return (self.mm(second, mid),)
        return (self.mm_then(first, x, groups, second),)

    def prefetch(self, names: list[str], fraction: float = 1.0, groups: int = 1) -> None:
        """Ask L2 for the first `fraction` of these weights (a launch that issues requests and returns): a
        matvec after latency-bound kernels then finds them there (groups: of each row block, for a grouped
        matvec). Nothing on CPU or for torch matrices."""
        if self.ext is None:
            return
        ws = [w for w in (self.mat(n) for n in names) if not isinstance(w, torch.Tensor)]
        if ws:
            self._sync_stream()
            self.ext.prefetch_l2(ws, float(fraction), PF_CTAS, PF_MODE, groups)

    def mm_many(self, names: list[str], x: torch.Tensor,
                norm: tuple[torch.Tensor, float] | None = None) -> list[torch.Tensor]:
        """[W_i x] for matrices of the same width; on CUDA the activation is quantized once for all.
        norm = (w, eps): the products of rms_norm(x) * w, the norm applied by the one launch where it takes them
        (one token; the bits of mm(name, x, norm=norm) for each)."""
        ws = [self.mat(n) for n in names]
        if self.ext is None or any(isinstance(w, torch.Tensor) for w in ws) or len({w.ncols for w in ws}) != 1 \
                or x.shape[0] >= GEMM_MIN:
            return [self.mm(n, x, norm=norm) for n in names]
        self._sync_stream()
        x = x.contiguous()
        T = x.shape[0]
        ys = [torch.empty((T, w.nrows), dtype=F32, device=self.device) for w in ws]
        if norm is not None:
            nw, eps = norm
            if T == 1 and self.ext.matvec_multi(ws, x.data_ptr(), [y.data_ptr() for y in ys], False, 0.0,
                                                nw.contiguous().data_ptr(), float(eps)):
                self.folded_norms += len(ws)
                return ys
            return [self.mm(n, x, norm=norm) for n in names]
        if T == 1 and self.ext.matvec_multi(ws, x.data_ptr(), [y.data_ptr() for y in ys]):
            return ys  # one launch for all of them (matvec_stream.cu)
        for i in range(0, T, 8):
            self.ext.matvec_shared(ws, self._arr(x[i:i + 8]), [self._arr(y[i:i + 8]) for y in ys])
        return ys

    def swiglu_ffn(self, names: list[str], x: torch.Tensor, limit: float, swiglu, fuse: bool = True,
                   unscaled: bool = False):
        """down · swiglu(gate · x, up · x) for names = [gate, up, down] (the shared expert). Decode on CUDA:
        gate and up in one launch into [g | u]; with fuse, SwiGLU is applied by the down launch while it stages
        x (swiglu_kernel's arithmetic), else by `swiglu`. unscaled: the down product as ops.Unscaled where the
        hi/lo GEMMs leave its rescale over (mm_unscaled), else the tensor; with DS4_GPU_FOLD_SWIGLU=1 gate and up
        reach `swiglu` that way too (it must take ops.Unscaled: Fused.swiglu)."""
        gate, up, down = (self.mat(n) for n in names)
        if self.ext is not None and x.shape[0] == 1 and not any(isinstance(w, torch.Tensor) for w in (gate, up, down)):
            self._sync_stream()
            x = x.contiguous()
            F = gate.nrows
            gu = torch.empty((1, 2 * F), dtype=F32, device=self.device)
            if fuse and MV_CHAIN and MV_CHAIN_FFN and up.nrows == F and down.ncols == F:  # gate + up, then down, in one launch
                y = torch.empty((1, down.nrows), dtype=F32, device=self.device)
                if self.ext.matvec_chain([gate, up], x.data_ptr(), [gu.data_ptr(), gu[:, F:].data_ptr()], 1, down,
                                         y.data_ptr(), True, float(limit)):
                    return y
            if up.nrows == F and self.ext.matvec_multi([gate, up], x.data_ptr(), [gu.data_ptr(), gu[:, F:].data_ptr()]):
                y = torch.empty((1, down.nrows), dtype=F32, device=self.device)
                if fuse and down.ncols == F and \
                        self.ext.matvec_multi([down], gu.data_ptr(), [y.data_ptr()], True, float(limit)):
                    return y
                return self.mm(names[2], swiglu(gu[:, :F], gu[:, F:], limit))
        if unscaled and FOLD_SWIGLU and x.shape[0] >= GEMM_MIN:
            # gate and up reach `swiglu` (Fused.swiglu) unscaled: it rescales as it reads. Fewer rows than GEMM_MIN
            # keep mm_many (activations quantized once for both matvecs); no rescale is left over there anyway.
            g, u = (self._maybe_unscaled(n, x) for n in names[:2])
        else:
            g, u = self.mm_many(names[:2], x)
        if not unscaled:
            return self.mm(names[2], swiglu(g, u, limit))
        return self._maybe_unscaled(names[2], swiglu(g, u, limit))

    def _maybe_unscaled(self, name: str, x: torch.Tensor):
        """mm(name, x), as ops.Unscaled where the hi/lo GEMMs leave its rescale over (mm_unscaled)."""
        z, r = self.mm_unscaled(name, x)
        return z if r is None else ops.Unscaled(z, r)

    def moe_takes_xq(self, li: int, T: int) -> bool:
        """Whether moe(li, b of T rows, xq=...) can take an x quantized beforehand (quantize_x_into)."""
        names = [C.blk(li, t) for t in (L.FFN_GATE_EXPS, L.FFN_UP_EXPS, L.FFN_DOWN_EXPS)]
        mats = [self.mat(n) for n in names]
        return T == 1 and self.ext is not None and not any(isinstance(m, torch.Tensor) for m in mats) and \
            mats[0].qtype != 1 and mats[2].qtype != 1 and mats[0].ncols % 32 == 0

    def quantize_x_into(self, x: torch.Tensor, buf: torch.Tensor) -> int:
        """x [1, n] quantized into buf (uint8, ext.xq_bytes(1, n) bytes) on the current stream; returns buf's
        address for moe(..., xq=)."""
        x = x.contiguous()
        self._sync_stream()
        self.ext.quantize_x_into(x.data_ptr(), x.shape[0], x.shape[1], buf.data_ptr())
        return buf.data_ptr()

    def moe_shexp_takes(self, li: int, shexp: list[str]) -> bool:
        """Whether moe_shexp(li, ...) runs layer li's routed experts with its shared expert `shexp` (gate, up, down)."""
        names = [C.blk(li, t) for t in (L.FFN_GATE_EXPS, L.FFN_UP_EXPS, L.FFN_DOWN_EXPS)]
        mats = [self.mat(n) for n in names + shexp]
        return self.ext is not None and not any(isinstance(m, torch.Tensor) for m in mats) and \
            bool(self.ext.moe_shexp_takes(mats[0], mats[2], *mats[3:]))

    def moe_shexp(self, li: int, b: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, limit: float,
                  shexp: list[str], xq: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode, one token (DS4_GPU_MOE_SHEXP; where moe_shexp_takes): (the routed experts' sum, the shared expert's
        output) from one gate/up launch and one down launch for both."""
        names = [C.blk(li, t) for t in (L.FFN_GATE_EXPS, L.FFN_UP_EXPS, L.FFN_DOWN_EXPS)]
        mats = [self.mat(n) for n in names + shexp]
        self._sync_stream()
        b = b.contiguous()
        y, ys = torch.empty_like(b), torch.empty_like(b)
        if not self.ext.moe_shexp(*mats, self._arr(b), self._arr(ids.to(torch.int32).contiguous()),
                                  self._arr(wts.contiguous()), self._arr(y), self._arr(ys), float(limit), xq):
            raise ValueError(f"moe_shexp does not take layer {li}'s experts (ask moe_shexp_takes first)")
        return y, ys

    def moe(self, li: int, b: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, limit: float,
            xq: int = 0) -> torch.Tensor:
        """Routed experts; xq: the address of b already quantized by quantize_x_into (one token; moe_takes_xq)."""
        names = [C.blk(li, t) for t in (L.FFN_GATE_EXPS, L.FFN_UP_EXPS, L.FFN_DOWN_EXPS)]
        gate, up, down = (self.mat(n) for n in names)
        T = b.shape[0]
        if not isinstance(gate, torch.Tensor) and not isinstance(down, torch.Tensor):
            if T >= MOE_GEMM_MIN:
                with torch.profiler.record_function("moe_gemm"):  # a prefill phase (bench_session --gaps)
                    if moe_gemm.MOE_GEMM in ("mmq", "mmf", "mmw"):
                        y = moe_gemm.routed_experts_codes(self, gate, up, down, b, ids, wts, limit, moe_gemm.MOE_GEMM)
                        if y is not None:
                            return y
                    if moe_gemm.MOE_GEMM != "padded" and 1 not in (gate.qtype, up.qtype, down.qtype):
                        return moe_gemm.routed_experts(self, gate, up, down, b, ids, wts, limit)
                    return self._moe_gemm(gate, up, down, b, ids, wts, limit)  # F16 experts take the padded path
            self._sync_stream()
            ids32 = ids.to(torch.int32).contiguous()
            wts = wts.contiguous()
            b = b.contiguous()
            y = torch.empty_like(b)
            for i in range(0, T, MOE_PIECE):
                j = min(T, i + MOE_PIECE)
                self.ext.moe(gate, up, down, self._arr(b[i:j]), self._arr(ids32[i:j]), self._arr(wts[i:j]),
                             self._arr(y[i:j]), float(limit), xq if T == 1 else 0)
            return y
        # float32 fallback (F16/F32 experts): gathered expert matrices, no host sync (capturable)
        g, u, d = (self._dense3(n, m) for n, m in zip(names, (gate, up, down)))
        if self.emulate and self._quantized(names[0]):
            b = ops.quantize_hilo(b)
        h = ops.swiglu(torch.einsum("tkfd,td->tkf", g[ids], b), torch.einsum("tkfd,td->tkf", u[ids], b), limit)
        h = h * wts[..., None]
        if self.emulate and self._quantized(names[2]):
            h = ops.quantize_hilo(h)
        return torch.einsum("tkdf,tkf->td", d[ids], h)

    # ---- prefill GEMMs (f16 tensor cores, f32 accumulation and output) ---------------------------
    # Exact mode (default): weight and activation each split into f16 hi + lo parts (~22 bits), products
    # hi·hi + hi·lo + lo·hi, so prefill keeps float32-level agreement with decode and the CPU engine (a
    # single f16 pass, DS4_GPU_PREFILL_GEMM=f16, is ~2e-4 per product: enough to flip near-tied expert
    # routing, which the measured logits show as 1e-3..4e-3 differences on `small`).
    def half(self, w, split: bool) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """A resident weight as fresh float16 tensors [rows, cols]: (hi, lo or None, scale), hi + lo = W·scale."""
        split = split and w.qtype != 1  # F16 weights are exact in one part
        scale = W_SCALE if split else 1.0
        hi = torch.empty((w.nrows, w.ncols), dtype=torch.float16, device=self.device)
        lo = torch.empty_like(hi) if split else None
        self._sync_stream()
        self.ext.dequant(w, hi.data_ptr(), 0 if lo is None else lo.data_ptr(), scale)
        return hi, lo, scale

    def clear_splits(self) -> None:
        """Forget to_half's kept splits (the session calls this after each prefill chunk)."""
        self._splits = []

    def to_half(self, x: torch.Tensor):
        """to_half in one kernel (split_half of dequant.cu) for float32 rows on the device. The last few splits are
        kept (DS4_GPU_SPLIT_MEMO, v15): the same tensor at the same version is split once. Each entry holds its
        tensor, so its memory cannot be handed to another tensor while cached; torch bumps the version on in-place
        writes (the extension's kernels write only tensors they were given as outputs, which are fresh)."""
        if self.ext is None:
            return to_half(x, EXACT_GEMM)
        x = x.contiguous()
        key = (x.data_ptr(), x._version, tuple(x.shape), x.dtype)
        memo = SPLIT_MEMO > 0 and x.shape[-1] <= 8192  # not the attention output's [T, H d]: used once, and large
        if memo:
            for k, _, split in self._splits:
                if k == key:
                    self.split_hits += 1
                    return split
        rows, n = x.shape
        hi = torch.empty((rows, n), dtype=torch.float16, device=self.device)
        lo = torch.empty_like(hi) if EXACT_GEMM else None
        s = torch.empty((rows, 1), dtype=F32, device=self.device)
        self._sync_stream()
        self.ext.split_half(x.data_ptr(), rows, n, hi.data_ptr(), 0 if lo is None else lo.data_ptr(), s.data_ptr())
        if memo:
            self._splits = [(key, x, (hi, lo, s))] + self._splits[:SPLIT_MEMO - 1]
        return hi, lo, s

    def _gemm(self, w, x: torch.Tensor, groups: int) -> torch.Tensor:
        T = x.shape[0]
        if MMQ_GEMM:
            y = torch.empty((T, w.nrows), dtype=F32, device=self.device)
            self._sync_stream()
            if self.ext.mmq(w, self._arr(x.contiguous()), self._arr(y), groups):
                return y
        hi, lo, scale, b8 = self._operands(w, groups)
        xh, xl, s = self.to_half(x)
        if groups == 1:
            return self._dense_product(w, xh, xl, hi.T, None if lo is None else lo.T, b8=b8) * (s / scale)
        n_in, n_out = w.ncols, w.nrows // groups

        def wg(t):
            return None if t is None else t.view(groups, n_out, n_in).transpose(1, 2)

        def xg(t):
            return None if t is None else t.view(T, groups, n_in).transpose(0, 1)

        y = self._dense_product(w, xg(xh), xg(xl), wg(hi), wg(lo), b8=b8)
        return y.transpose(0, 1).reshape(T, groups * n_out) * (s / scale)

    def _operands(self, w, groups: int = 1):
        """(hi, lo, scale, b8): half(w)'s split and b8 None; or with DS4_GPU_DEQUANT_FP8=1, where the product takes the
        float8 path and the weight's float8 scale is known (kept from its first product), hi and the corrections'
        float8 operand written by the dequant itself: lo None, b8 [rows, 2 cols] e4m3 (fp8_split.pack_w's bytes), or
        [groups, rows / groups, 2 cols]."""
        sigma = self._fp8_scales.get(id(w))
        if not (DEQUANT_FP8 and FP8_GEMM and EXACT_GEMM and sigma is not None and w.qtype != 1
                and w.nrows * w.ncols >= FP8_MIN and w.ncols % 16 == 0 and (w.nrows // groups) % 16 == 0):
            return (*self.half(w, EXACT_GEMM), None)
        hi = torch.empty((w.nrows, w.ncols), dtype=torch.float16, device=self.device)
        b8 = torch.empty((w.nrows, 2 * w.ncols), dtype=fp8_split.E4M3, device=self.device)
        self._sync_stream()
        self.ext.dequant(w, hi.data_ptr(), 0, W_SCALE, b8=b8.data_ptr(), kp=sigma.data_ptr())
        return hi, None, W_SCALE, (b8 if groups == 1 else b8.view(groups, w.nrows // groups, 2 * w.ncols))

    def _dense_product(self, w, xh, xl, wh, wl, a8=None, b8=None) -> torch.Tensor:
        """split_product of a dense weight's parts; DS4_GPU_PREFILL_GEMM=fp8: the correction terms in one float8
        GEMM (fp8_split) where the weight is large enough to repay the packing, with the weight's scale computed once
        (weights do not change) and kept. a8: the activations' float8 operand, packed by their producer (then xl is
        None); b8: the weight's, packed by the dequant (_operands; then wl is None)."""
        if a8 is not None and ((wl is None and b8 is None) or not fp8_split.usable(xh, wh)):
            raise ValueError("a float8 activation operand needs the float8 path (Weights.takes_fp8)")
        if FP8_GEMM and (xl is not None or a8 is not None) and (wl is not None or b8 is not None) \
                and w.nrows * w.ncols >= FP8_MIN and fp8_split.usable(xh, wh):
            sigma = self._fp8_scales.get(id(w))
            if sigma is None:
                sigma = self._fp8_scales[id(w)] = fp8_split.weight_scale(wh)
            try:
                return fp8_split.product(xh, xl, wh, wl, acc_mm, sigma, a8, b8)
            except (RuntimeError, TypeError, NotImplementedError, AttributeError) as e:
                fp8_split.refuse()
                print(f"ds4: float8 GEMM refused ({str(e).splitlines()[0][:200]}); float16 passes from here",
                      flush=True)
                if a8 is not None:  # its producer wrote no lo: take it back from the operand (4 bits of it)
                    xl = fp8_split.unpack_lo(a8, xh)
        if wl is None and b8 is not None:  # the dequant wrote no lo plane: write it now, laid out as wh
            _, lo, _ = self.half(w, EXACT_GEMM)
            wl = lo.as_strided(wh.size(), wh.stride(), wh.storage_offset())
        return split_product(xh, xl, wh, wl)

    def _moe_gemm(self, gate, up, down, b, ids, wts, limit: float) -> torch.Tensor:
        """Routed experts for many tokens. Assignments sorted by expert; each expert's first `cap` of them go
        into one zero-padded [E, cap, ·] batched GEMM per matrix (cap ~ twice the mean load), the rest of a
        busy expert's (routing can be very uneven: one expert taking half the tokens) into plain GEMMs on
        that expert's weights, so the padding never multiplies the work."""
        T, k = ids.shape
        n_expert, n_ff, n_embd = int(gate.ne[2]), int(gate.ne[1]), int(gate.ne[0])
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n_expert)
        counts_host = counts.cpu().tolist()  # the one host sync of the layer
        cap = min(max(counts_host), max(16, math.ceil(MOE_CAP_FACTOR * T * k / n_expert)))
        starts = torch.cumsum(counts, 0) - counts
        e_sorted = flat[order]
        slot = torch.arange(T * k, device=self.device) - starts[e_sorted]
        in_batch = slot < cap
        eb, sb = e_sorted[in_batch], slot[in_batch]
        starts_host = [0] * n_expert
        for e in range(1, n_expert):
            starts_host[e] = starts_host[e - 1] + counts_host[e - 1]
        overflow = [(e, starts_host[e] + cap, starts_host[e] + c) for e, c in enumerate(counts_host) if c > cap]
        tok = order // k

        def experts(w, xh, xl, n_out: int, n_in: int) -> torch.Tensor:
            hi, lo, scale = self.half(w, EXACT_GEMM)
            wh = hi.view(n_expert, n_out, n_in).transpose(1, 2)
            wl = None if lo is None else lo.view(n_expert, n_out, n_in).transpose(1, 2)

            def batch(rows):
                if rows is None:
                    return None
                xb = torch.zeros((n_expert, cap, n_in), dtype=torch.float16, device=self.device)
                xb[eb, sb] = rows[in_batch]
                return xb

            y = split_product(batch(xh), batch(xl), wh, wl)
            out = torch.empty((T * k, n_out), dtype=F32, device=self.device)
            out[in_batch] = y[eb, sb]
            for e, r0, r1 in overflow:
                out[r0:r1] = split_product(xh[r0:r1], None if xl is None else xl[r0:r1], wh[e],
                                           None if wl is None else wl[e])
            return out * (1.0 / scale)

        xh, xl, s = self.to_half(b)
        sa = s[tok]
        pick = (lambda t: None if t is None else t[tok])
        g = experts(gate, pick(xh), pick(xl), n_ff, n_embd) * sa
        u = experts(up, pick(xh), pick(xl), n_ff, n_embd) * sa
        h = torch.empty_like(g)
        self.ext.swiglu(g.data_ptr(), u.data_ptr(), g.numel(), float(limit), h.data_ptr())
        h *= wts.reshape(-1)[order, None]
        hh, hl, hs = self.to_half(h)
        y_sorted = experts(down, hh, hl, n_embd, n_ff) * hs
        y = torch.empty((T * k, n_embd), dtype=F32, device=self.device)
        y[order] = y_sorted  # back to (token, expert) order: the k-sum below is deterministic
        return y.view(T, k, n_embd).sum(dim=1)

    def _quantized(self, name: str) -> bool:
        f = self.model.file
        return f is not None and int(f.info(name).qtype) in EXT_TYPES and int(f.info(name).qtype) != 1

    def dense(self, name: str) -> torch.Tensor:
        """A matrix as a float32 device tensor (small matrices the fused kernels read directly), cached."""
        key = name + "#f32"
        t = self._vecs.get(key)
        if t is None:
            t = torch.from_numpy(np.ascontiguousarray(self.model.w(name), np.float32)).to(self.device)
            self._vecs[key] = t
        return t

    def _dense3(self, name: str, m) -> torch.Tensor:
        if isinstance(m, torch.Tensor):
            return m
        key = name + "#dense"
        t = self._vecs.get(key)
        if t is None:
            t = torch.from_numpy(self.model.w(name)).to(self.device)
            self._vecs[key] = t
        return t


def to_half(x: torch.Tensor, split: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x [..., n] float32 -> (hi, lo or None, s [..., 1]) with hi + lo = x / s in float16 and s the row's
    largest magnitude, so no activation overflows float16 and every row keeps its relative precision."""
    s = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    xn = x / s  # the split_half kernel of dequant.cu computes the same, bit for bit
    hi = xn.to(torch.float16)
    return hi, (xn - hi.float()).to(torch.float16) if split else None, s


def split_product(xh, xl, wh, wl) -> torch.Tensor:
    """(xh + xl) @ (wh + wl) in float32 without the lo·lo term (below float32 rounding); lo parts may be None.
    The lo products accumulate into the result inside the GEMM (beta = 1): no extra pass over it."""
    y = mm_f32(xh, wh)
    if xl is not None:
        acc_mm(y, xl, wh)
    if wl is not None:
        acc_mm(y, xh, wl)
    return y


_OUT_DTYPE = [True]  # torch.mm/bmm(..., out_dtype=float32) available (torch >= 2.8 on CUDA)


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for float16 operands (2-D or batched 3-D) with float32 accumulation and a float32 result."""
    fn = torch.mm if a.dim() == 2 else torch.bmm
    if _OUT_DTYPE[0]:
        try:
            return fn(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE[0] = False
    return fn(a.float(), b.float())  # an f16 result could overflow or round away the lo parts


_ACC_DTYPE = [True]  # torch.addmm/baddbmm(..., out_dtype=float32, out=y) available


def acc_mm(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """y += a @ b (float16 operands, float32 y), in the GEMM's epilogue where torch supports it."""
    if _ACC_DTYPE[0] and y.is_cuda:
        fn = torch.addmm if a.dim() == 2 else torch.baddbmm
        try:
            fn(y, a, b, out_dtype=torch.float32, out=y)
            return
        except (TypeError, RuntimeError, NotImplementedError):
            _ACC_DTYPE[0] = False
    y += mm_f32(a, b)
