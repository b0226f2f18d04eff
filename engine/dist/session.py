"""The Session API over N ranks: rank 0 drives, every other rank mirrors its calls.

    # on every rank (spawned by ds4.engine.dist.launch, or torchrun):
    s = open_session(model_path, ctx=4096)     # rank 0: a DistSession; ranks > 0: serve, then None
    logits = s.sync(prompt_ids)                # same calls, same results as the one-process engine
    s.decode(tok); s.greedy(32); blob = s.snapshot(); s.restore(blob)
    s.close()                                  # releases the other ranks

Every rank holds a full CUDA-engine Session (ds4.engine.gpu.session, the torch forward; on the CPU
it runs with float32 matmuls) whose weights are `ShardedWeights`: attention, shared expert,
hyper-connections and head replicated, routed experts split. A call that changes the timeline
(sync, decode, prefill, greedy, invalidate, restore) is broadcast to the other ranks on a gloo
control group (a few bytes: the op and its token ids) before rank 0 runs it; they run the same
call, so the MoE collectives inside the forward meet in the same order on every rank. Reads
(tokens, logits, snapshot, kv_bytes) are answered by rank 0 alone: the replicated state is
bitwise the same on every rank (`check_consistent` verifies it).

A SessionError (prompt longer than the context, …) is raised by the argument checks before any
collective, on every rank alike: rank 0 raises it to the caller, the others drop it and wait for
the next call.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch
import torch.distributed as dist

from ds4.engine.gpu.session import Session as TorchSession
from ds4.engine.session import SessionError

from .comm import Combiner
from .shard import ShardedWeights

MIRRORED = ("sync", "decode", "prefill", "greedy", "invalidate", "restore")
STOP, DIGEST, STATS = "__stop__", "__digest__", "__stats__"


class DistSession:
    """Rank 0's handle: the Session API, each timeline change mirrored on every rank."""

    def __init__(self, inner: TorchSession, ctrl_group, world: int):
        self.inner = inner
        self.ctrl = ctrl_group
        self.world = world
        self._closed = False

    # ---- mirrored calls ------------------------------------------------------------------------
    def _send(self, op: str, *args) -> None:
        if self._closed:
            raise SessionError("the distributed session is closed")
        dist.broadcast_object_list([op, args], src=0, group=self.ctrl)

    def _call(self, op: str, *args):
        self._send(op, *args)
        # sync may rebuild (compare the token lists); the others only extend (compare lengths)
        before = self.inner.tokens if op == "sync" else self.inner.pos
        payload = self.comm.payload_bytes
        try:
            return getattr(self.inner, op)(*args)
        finally:
            if op not in ("invalidate", "restore"):
                self._count_replays(before, payload)

    def _count_replays(self, before, payload: int) -> None:
        """Every token a forward processes crosses n_layer combines; on CUDA, decode steps replayed
        from the captured graph skip the Python counters, so add what is missing."""
        if isinstance(before, list):
            after = self.inner.tokens
            kept = len(before) if after[:len(before)] == before else 0
            n_after = len(after)
        else:
            kept, n_after = before, self.inner.pos
        cfg = self.inner.cfg
        row = cfg.n_embd * 4
        missing = (n_after - kept) * cfg.n_layer * row - (self.comm.payload_bytes - payload)
        if missing > 0:
            self.inner.W.combiner.count_replayed(missing // (cfg.n_layer * row), row, cfg.n_layer)

    def sync(self, tokens) -> np.ndarray:
        return self._call("sync", [int(t) for t in tokens])

    def decode(self, token: int) -> np.ndarray:
        return self._call("decode", int(token))

    def prefill(self, tokens, all_logits: bool = False) -> np.ndarray:
        return self._call("prefill", [int(t) for t in tokens], bool(all_logits))

    def greedy(self, n: int) -> list[int]:
        return self._call("greedy", int(n))

    def invalidate(self) -> None:
        self._call("invalidate")

    def restore(self, payload: bytes) -> None:
        self._call("restore", bytes(payload))

    # ---- reads (rank 0's replica) ----------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        return self.inner.tokens

    @property
    def pos(self) -> int:
        return self.inner.pos

    @property
    def logits(self):
        return self.inner.logits

    @property
    def ctx(self) -> int:
        return self.inner.ctx

    @property
    def cfg(self):
        return self.inner.cfg

    @property
    def model(self):
        return self.inner.model

    def common_prefix(self, tokens) -> int:
        return self.inner.common_prefix(tokens)

    def snapshot(self) -> bytes:
        return self.inner.snapshot()

    def kv_bytes(self) -> int:
        return self.inner.kv_bytes()

    def kv_bytes_per_token(self) -> float:
        return self.inner.kv_bytes_per_token()

    @property
    def comm(self):
        """Rank 0's combine statistics (every rank sends the same volume)."""
        return self.inner.W.combiner.stats

    # ---- whole-world helpers ---------------------------------------------------------------------
    def check_consistent(self) -> bool:
        """True when every rank holds the same tokens, logits and KV state (bitwise)."""
        self._send(DIGEST)
        return _gather_digests(self.inner, self.ctrl, self.world)

    def gather_stats(self) -> list[dict]:
        """Per-rank loading and communication figures (collective)."""
        self._send(STATS)
        return _gather_stats(self.inner, self.ctrl, self.world)

    def close(self) -> None:
        if not self._closed:
            dist.broadcast_object_list([STOP, ()], src=0, group=self.ctrl)
            self._closed = True

    def __enter__(self) -> "DistSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _digest(inner: TorchSession) -> str:
    h = hashlib.sha256()
    h.update(np.asarray(inner.tokens, np.int64).tobytes())
    if inner._logits is not None:
        h.update(inner._logits.detach().float().cpu().numpy().tobytes())
    for st in inner.layers:
        for k in sorted(st):
            h.update(st[k].detach().cpu().numpy().tobytes())
    return h.hexdigest()


def _gather_digests(inner, ctrl, world) -> bool:
    out = [None] * world
    dist.all_gather_object(out, _digest(inner), group=ctrl)
    return len(set(out)) == 1


def _gather_stats(inner, ctrl, world) -> list[dict]:
    W = inner.W
    s = W.combiner.stats
    mine = dict(rank=W.rank, experts=(W.e0, W.e1), expert_bytes_read=W.expert_bytes_read,
                weight_bytes=W.nbytes(), comm_calls=s.calls, comm_payload_bytes=s.payload_bytes,
                comm_wire_bytes=s.wire_bytes, comm_seconds=s.seconds)
    out = [None] * world
    dist.all_gather_object(out, mine, group=ctrl)
    return out


def serve(inner: TorchSession, ctrl_group, world: int) -> None:
    """Ranks > 0: run rank 0's calls until it closes the session."""
    while True:
        msg = [None, None]
        dist.broadcast_object_list(msg, src=0, group=ctrl_group)
        op, args = msg
        if op == STOP:
            return
        if op == DIGEST:
            _gather_digests(inner, ctrl_group, world)
            continue
        if op == STATS:
            _gather_stats(inner, ctrl_group, world)
            continue
        if op not in MIRRORED:
            raise RuntimeError(f"rank {dist.get_rank()}: unknown mirrored call '{op}'")
        try:
            getattr(inner, op)(*args)
        except SessionError:
            pass  # rank 0 raised the same error to its caller


# ---- process group and session construction -------------------------------------------------------
def init_distributed(device: str = "cpu") -> tuple[int, int, torch.device]:
    """Join the process group described by the torchrun-style environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT): NCCL on CUDA (NVLink multicast off), gloo on the CPU."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    if device == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        try:  # device_id binds NCCL's communicator eagerly (torch >= 2.3)
            kw = {"device_id": dev} if backend == "nccl" else {}
            dist.init_process_group(backend=backend, rank=rank, world_size=world, **kw)
        except TypeError:
            dist.init_process_group(backend=backend, rank=rank, world_size=world)
    return rank, world, dev


def open_session(model_path: str, *, ctx: int = 4096, prefill_chunk: int = 2048, device: str = "cpu",
                 combine: str = "auto", graphs: bool | None = None, fp8_kv: bool = True,
                 indexer_qat: bool = True) -> DistSession | None:
    """Collective: every rank loads its share and builds its replica. Rank 0 gets the DistSession;
    the other ranks serve rank 0's calls here and get None once it closes the session."""
    from ds4.engine.model import Model

    rank, world, dev = init_distributed(device)
    compute = dist.group.WORLD
    ctrl = dist.new_group(backend="gloo") if dev.type != "cpu" else compute
    model = Model.load(model_path, fp8_kv=fp8_kv, indexer_qat=indexer_qat)
    combiner = Combiner(compute, combine, world)
    weights = ShardedWeights(model, dev, rank, world, combiner)
    inner = TorchSession(model, ctx=ctx, prefill_chunk=prefill_chunk, device=dev, graphs=graphs, weights=weights)
    combiner.stats.reset()
    dist.barrier(group=ctrl)
    if rank == 0:
        return DistSession(inner, ctrl, world)
    serve(inner, ctrl, world)
    return None
