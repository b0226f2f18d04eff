"""Model weights on the device for the CUDA engine session (ds4.engine.gpu.session).

Quantized matrices become resident extension tensors (uploaded once from the GGUF mmap, repacked
on the GPU); vectors, small float32 matrices the fused kernels read directly (`dense`) and anything
the kernels cannot multiply stay torch tensors. On a machine without the extension the same class
holds float32 torch tensors, so the session's logic runs (and is tested) on the CPU.
"""

from __future__ import annotations

import numpy as np
import torch

from ds4.gguf_tools import constants as C

from . import ops

L = C.LayerTensor
F32 = torch.float32
EXT_TYPES = {1: 8, 8: 32, 10: 256, 12: 256, 16: 256}  # qtype -> ne0 multiple the kernels need
MOE_PIECE = 64  # tokens per routed-MoE launch in prefill (bounds the extension's scratch)


def default_device() -> torch.device:
    from ds4.engine import gpu

    if torch.cuda.is_available() and gpu.available():
        return torch.device("cuda")
    return torch.device("cpu")


class Weights:
    """Weights on the device: extension tensors for the matrices it can multiply, torch otherwise."""

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

    def mm(self, name: str, x: torch.Tensor, groups: int = 1) -> torch.Tensor:
        """x [T, groups·in] → [T, out] for a 2-D weight W[out, in] (groups: block-diagonal rows)."""
        w = self.mat(name)
        x = x.contiguous()
        if isinstance(w, torch.Tensor):
            if self.emulate and self._quantized(name):
                x = ops.quantize_hilo(x)
            if groups == 1:
                return x @ w.T
            T = x.shape[0]
            wg = w.reshape(groups, w.shape[0] // groups, w.shape[1])
            return torch.einsum("tgi,goi->tgo", x.reshape(T, groups, -1), wg).reshape(T, -1)
        self._sync_stream()
        T = x.shape[0]
        y = torch.empty((T, w.nrows), dtype=F32, device=self.device)
        for i in range(0, T, 8):
            xs, ys = x[i:i + 8], y[i:i + 8]
            self.ext.matvec(w, self._arr(xs), self._arr(ys), groups)
        return y

    def mm_many(self, names: list[str], x: torch.Tensor) -> list[torch.Tensor]:
        """[W_i x] for matrices of the same width; on CUDA the activation is quantized once for all."""
        ws = [self.mat(n) for n in names]
        if self.ext is None or any(isinstance(w, torch.Tensor) for w in ws) or len({w.ncols for w in ws}) != 1:
            return [self.mm(n, x) for n in names]
        self._sync_stream()
        x = x.contiguous()
        T = x.shape[0]
        ys = [torch.empty((T, w.nrows), dtype=F32, device=self.device) for w in ws]
        for i in range(0, T, 8):
            self.ext.matvec_shared(ws, self._arr(x[i:i + 8]), [self._arr(y[i:i + 8]) for y in ys])
        return ys

    def moe(self, li: int, b: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, limit: float) -> torch.Tensor:
        names = [C.blk(li, t) for t in (L.FFN_GATE_EXPS, L.FFN_UP_EXPS, L.FFN_DOWN_EXPS)]
        gate, up, down = (self.mat(n) for n in names)
        T = b.shape[0]
        if not isinstance(gate, torch.Tensor) and not isinstance(down, torch.Tensor):
            self._sync_stream()
            ids32 = ids.to(torch.int32).contiguous()
            wts = wts.contiguous()
            b = b.contiguous()
            y = torch.empty_like(b)
            for i in range(0, T, MOE_PIECE):
                j = min(T, i + MOE_PIECE)
                self.ext.moe(gate, up, down, self._arr(b[i:j]), self._arr(ids32[i:j]), self._arr(wts[i:j]),
                             self._arr(y[i:j]), float(limit))
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
