"""Expert parallelism: which experts a rank owns, reading only their bytes, and the sharded MoE.

Rank r of N owns the contiguous experts [e0, e1) of every layer (`expert_range`; the first
n_expert mod N ranks take one more). A routed-expert tensor is stored expert-major (GGUF ne =
[cols, rows, experts]), so a rank's share is one contiguous byte range of the tensor:
offset + e0·expert_bytes .. offset + e1·expert_bytes. `expert_blocks` returns exactly that range
as a zero-copy view of the file's mmap (a split GGUF maps the part holding the tensor), so a rank
never touches another rank's expert pages.

`ShardedWeights` is the CUDA engine's `Weights` (ds4.engine.gpu.session) with two changes, so the
same torch forward runs sharded without editing it:
- `mat()` of a routed-expert tensor holds only the rank's slice (uploaded to the extension on CUDA,
  dequantized to float32 otherwise);
- `moe()` computes the rank's experts for the tokens routed to them, then combines the partial
  outputs of all ranks (`comm.Combiner`: all-reduce by default). Attention, the shared expert,
  the hyper-connections and the head stay replicated: every rank holds the full activations, so
  the routed inputs need no dispatch, only the outputs a sum.
"""

from __future__ import annotations

import numpy as np
import torch

from ds4.engine.gpu import ops
from ds4.engine.gpu.weights import EXT_TYPES, Weights
from ds4.gguf_tools import constants as C
from ds4.gguf_tools.constants import QuantType

from .comm import Combiner

L = C.LayerTensor
ROUTED = (L.FFN_GATE_EXPS, L.FFN_UP_EXPS, L.FFN_DOWN_EXPS)
_FUSED = (QuantType.Q8_0, QuantType.Q2_K, QuantType.Q4_K, QuantType.IQ2_XXS)


def expert_range(n_expert: int, rank: int, world: int) -> tuple[int, int]:
    """[e0, e1) owned by `rank`: contiguous, sizes differing by at most one, lower ranks larger."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    if world > n_expert:
        raise ValueError(f"{world} ranks but only {n_expert} experts per layer")
    base, extra = divmod(n_expert, world)
    e0 = rank * base + min(rank, extra)
    return e0, e0 + base + (1 if rank < extra else 0)


def is_routed(name: str) -> bool:
    """A routed-expert tensor (blk.N.ffn_{gate,up,down}_exps.weight)."""
    return name.startswith("blk.") and name.endswith(tuple("." + t.value for t in ROUTED))


def expert_blocks(dsfile, name: str, e0: int, e1: int) -> np.ndarray:
    """The stored bytes of experts [e0, e1) of a routed tensor: a zero-copy [e1-e0, rows, row_bytes]
    view of the file mapping covering exactly that byte range (nothing else is read)."""
    info = dsfile.info(name)
    if len(info.ne) != 3:
        raise ValueError(f"'{name}' is not an expert tensor (ne={list(info.ne)})")
    n_expert = int(info.ne[2])
    if not 0 <= e0 < e1 <= n_expert:
        raise ValueError(f"expert range [{e0}, {e1}) outside the {n_expert} experts of '{name}'")
    per_expert = info.nbytes // n_expert
    rows = int(info.ne[1])
    mm = dsfile.mapping(name)  # the file, or the split part holding the tensor
    flat = np.frombuffer(mm, dtype=np.uint8, count=(e1 - e0) * per_expert, offset=info.offset + e0 * per_expert)
    return flat.reshape(e1 - e0, rows, per_expert // rows)


def expert_slice_f32(model, name: str, e0: int, e1: int) -> np.ndarray:
    """Experts [e0, e1) of `name` as float32 [e1-e0, rows, cols], decoding only their blocks."""
    f = model.file
    if f is None:  # an in-memory model (tests): slice the array
        return np.ascontiguousarray(model.w(name)[e0:e1], np.float32)
    info = f.info(name)
    raw = expert_blocks(f, name, e0, e1)
    n, rows, rb = raw.shape
    cols = int(info.ne[0])
    qt = info.qtype
    if qt in _FUSED:
        from ds4.gguf_tools import quants

        out = quants.dequantize(QuantType(qt), raw.reshape(n * rows, rb), cols)
        return np.asarray(out, np.float32).reshape(n, rows, cols)
    direct = {QuantType.F32: "<f4", QuantType.F16: "<f2"}
    if qt in direct:
        return raw.reshape(-1).view(direct[qt]).astype(np.float32).reshape(n, rows, cols)
    if qt == QuantType.BF16:
        bits = raw.reshape(-1).view("<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(n, rows, cols)
    raise ValueError(f"'{name}' has type {info.type_name}, which the sharded loader cannot decode")


class ShardedWeights(Weights):
    """The CUDA engine's weights holding only this rank's routed experts (see the module doc)."""

    def __init__(self, model, device: torch.device, rank: int, world: int, combiner: Combiner,
                 static_moe: bool | None = None):
        super().__init__(model, device)
        # static: every slot computed with masked weights (CUDA-graph capturable; the CUDA default);
        # otherwise each local expert multiplies only its tokens (eager, the CPU default)
        self.static_moe = device.type == "cuda" if static_moe is None else static_moe
        self.rank, self.world = rank, world
        self.e0, self.e1 = expert_range(model.config.n_expert, rank, world)
        self.combiner = combiner
        self.expert_bytes_read = 0  # bytes of routed-expert data this rank took from the file

    @property
    def n_local(self) -> int:
        return self.e1 - self.e0

    # ---- storage -------------------------------------------------------------------------------
    def mat(self, name: str):
        if not is_routed(name):
            return super().mat(name)
        m = self._mats.get(name)
        if m is None:
            m = self._load_slice(name)
            self._mats[name] = m
        return m

    def _load_slice(self, name: str):
        f = self.model.file
        info = f.info(name) if f is not None else None
        qt = int(info.qtype) if info is not None else -1
        if info is not None:
            self.expert_bytes_read += info.nbytes // int(info.ne[2]) * self.n_local
        if self.ext is not None and qt in EXT_TYPES and qt != int(QuantType.F16) and info.ne[0] % EXT_TYPES[qt] == 0:
            raw = np.ascontiguousarray(expert_blocks(f, name, self.e0, self.e1)).reshape(-1)
            ne = [int(info.ne[0]), int(info.ne[1]), self.n_local]
            return self.ext.upload(name, qt, ne, raw)
        return torch.from_numpy(expert_slice_f32(self.model, name, self.e0, self.e1)).to(self.device)

    # ---- routed experts ------------------------------------------------------------------------
    def moe(self, li: int, b: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, limit: float) -> torch.Tensor:
        """Σ over this rank's experts of the routed contributions, summed over all ranks."""
        local = (ids >= self.e0) & (ids < self.e1)
        gate = self.mat(C.blk(li, L.FFN_GATE_EXPS))
        if isinstance(gate, torch.Tensor) and not self.static_moe:
            y = self._moe_grouped(li, b, ids, wts, local, limit)
        else:
            # Static shapes (CUDA-graph capturable): slots routed elsewhere point at the rank's first
            # expert with weight 0, so they add exactly 0 (their expert rows are still read).
            lid = torch.where(local, ids - self.e0, torch.zeros_like(ids))
            lw = torch.where(local, wts, torch.zeros_like(wts))
            y = super().moe(li, b, lid, lw, limit)
        return self.combiner.combine(y)

    def _moe_grouped(self, li, b, ids, wts, local, limit) -> torch.Tensor:
        """Eager path: each local expert multiplies only the tokens routed to it (ascending expert
        order, as ds4.engine.forward.moe does)."""
        g, u, d = (self.mat(C.blk(li, t)) for t in ROUTED)
        T, k = ids.shape
        y = torch.zeros_like(b)
        flat = ids.reshape(-1)
        sel = torch.nonzero(local.reshape(-1)).reshape(-1)
        if sel.numel() == 0:
            return y
        for e in torch.unique(flat[sel]).tolist():
            slots = sel[flat[sel] == e]
            tok = torch.div(slots, k, rounding_mode="floor")
            x = b[tok]
            j = e - self.e0
            h = ops.swiglu(x @ g[j].T, x @ u[j].T, limit) * wts.reshape(-1)[slots, None]
            y.index_add_(0, tok, h @ d[j].T)
        return y
