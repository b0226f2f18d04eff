"""Random DS4 GGUFs written directly as valid blocks (`ds4-quantize synth --gguf OUT --mix q2`).

No Hugging Face detour and no quantizer: every quantized tensor is random bytes with the fields
that matter fixed up so the blocks decode to zero-mean weights of the same spread the HF synth
gives (std 1/sqrt(fan_in), half for output projections), which keeps activations O(1) through
the layers. That makes a full-size Flash file a matter of seconds per GB (speed benchmarks at
real size), with the tensor names, types (model-spec §2.4 via `plan`) and metadata of the
published files.

Per type (model-spec §2.6):
- Q8_0: random int8 codes (zero mean), d = std / 73.6 (the std of a uniform int8);
- Q2_K: codes random; per 16-value sub-block a scale nibble sc in 1..10 and the min nibble
  m = round(1.5·sc), with dmin = d, so d·sc·q − d·m has mean ≈ 0 over q ∈ {0..3};
- Q4_K: 6-bit scales sc in 1..15 with m = sc and dmin = 7.5·d (mean of q ∈ 0..15 is 7.5);
- IQ2_XXS: every byte pattern is valid (256 grid entries, 128 sign patterns, 4-bit scales),
  signs come in even-parity patterns so the mean is 0; only d is set;
- F16: large matrices draw from a 256-entry table of normal quantiles (fast), small ones
  (HC mixes, ape) and all F32/I32 tensors use the HF synth's values for the same seed.

`split_max_bytes` writes the model as llama.cpp's gguf-split does (`--split-max-size`): parts
`NAME-00001-of-0000N.gguf`, tensors in file order, a new part whenever the next tensor (padded to
the alignment) would take the current part's tensor data past the limit (a tensor larger than the
limit gets a part of its own); part 1 holds all metadata, every part `split.no` (u16, 0-based),
`split.count` (u16) and `split.tensors.count` (i32). The later parts also carry
`general.architecture`, which the gguf package writes into every file (loaders ignore it there).
All parts are written under temporary names and renamed together at the end.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np

from ds4.engine.config import Config
from ds4.gguf_tools.constants import BLOCK, DEFAULT_ALIGNMENT, OUTPUT, TOKEN_EMBD, Key, LayerTensor as T, QuantType
from ds4.gguf_tools.layout import Kind, layout_by_name
from ds4.gguf_tools.plan import Policy, plan
from ds4.gguf_tools.reader import split_path
from ds4.gguf_tools.writer import TensorPlan, Typed, ds4_metadata, encode, write_gguf, write_tensor_at
from gguf.constants import GGUFValueType

Q = QuantType
CHUNK_BYTES = 64 << 20  # bytes generated per piece (streaming: memory stays near this)
SMALL_VALUES = 1 << 21
POOL_BLOCKS = 1 << 18  # distinct random blocks per tensor (16-36 MiB)  # float matrices up to this many values use the HF synth's exact values
_HALF_GAIN = {T.ATTN_OUTPUT_B, T.FFN_DOWN_SHEXP, T.FFN_DOWN_EXPS}
_UNIFORM_INT8_STD = math.sqrt((256 ** 2 - 1) / 12)  # std of a uniform byte as int8


def weight_std(name: str, n_in: int) -> float:
    """The spread the HF synth gives this matrix (see synth.slot_values)."""
    if name == TOKEN_EMBD:
        return 1.0
    if name == OUTPUT:
        return 2.0 / math.sqrt(n_in)
    suffix = name.split(".", 2)[2] if name.startswith("blk.") else None
    half = suffix is not None and any(suffix == t.value for t in _HALF_GAIN)
    return (0.5 if half else 1.0) / math.sqrt(n_in)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.atleast_1d(np.asarray(v, np.float16)).view(np.uint8)


def random_blocks(qtype: QuantType, n_blocks: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """[n_blocks, block_bytes] uint8 of valid `qtype` blocks decoding to zero-mean weights of ~std."""
    bb = BLOCK[qtype].nbytes
    blk = np.frombuffer(rng.bytes(n_blocks * bb), np.uint8).reshape(n_blocks, bb).copy()
    if qtype == Q.Q8_0:
        blk[:, 0:2] = _f16_bytes(std / _UNIFORM_INT8_STD)
    elif qtype == Q.IQ2_XXS:
        # |w| ≈ d·(0.5+s)·0.25·grid with grid ∈ {8, 25, 43} (rms ≈ 29) and s uniform in 0..15 (rms ≈ 9.2)
        blk[:, 0:2] = _f16_bytes(std / (0.25 * 9.2 * 29.0))
    elif qtype == Q.Q2_K:  # scales[16], qs[64], d, dmin
        sc = 1 + blk[:, :16] % 10
        m = np.rint(1.5 * sc).astype(np.uint8)
        blk[:, :16] = sc | (m << 4)
        d = std / 7.0  # rms of sc·(q − 1.5) over sc ∈ 1..10, q ∈ 0..3 is ≈ 7
        blk[:, 80:82] = _f16_bytes(d)
        blk[:, 82:84] = _f16_bytes(d)
    elif qtype == Q.Q4_K:  # d, dmin, scales[12], qs[128]
        sc = 1 + blk[:, 4:12] % 15  # 8 sub-block scales < 16, so every 6-bit field's top bits are 0
        blk[:, 4:8] = sc[:, :4]
        blk[:, 8:12] = sc[:, :4]  # mins = scales
        blk[:, 12:16] = (sc[:, 4:] & 15) | ((sc[:, 4:] & 15) << 4)
        d = std / 40.0  # rms of sc·(q − 7.5) over sc ∈ 1..15, q ∈ 0..15 is ≈ 40
        blk[:, 0:2] = _f16_bytes(d)
        blk[:, 2:4] = _f16_bytes(7.5 * d)
    else:
        raise ValueError(f"no random-block recipe for {qtype.name}")
    return blk


def _normal_table(std: float, rng: np.random.Generator) -> np.ndarray:
    q = (np.arange(256) + 0.5) / 256.0
    from statistics import NormalDist

    nd = NormalDist(0.0, std)
    table = np.array([nd.inv_cdf(float(p)) for p in q], np.float16)
    return table[rng.permutation(256)]


def _seed_rng(seed: int, name: str, piece: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), piece, 0x5EED])


def tensor_bytes(cfg: Config, p: TensorPlan, slot, seed: int) -> Iterator[np.ndarray]:
    """The stored bytes of one tensor, in pieces of about CHUNK_BYTES (whole rows each)."""
    n_values = int(np.prod(p.ne))
    small_float = p.qtype in (Q.F32, Q.F16, Q.BF16) and n_values <= SMALL_VALUES
    if p.qtype in (Q.I32,) or slot.kind == Kind.VECTOR or small_float:
        from ds4.gguf_tools.synth import slot_values

        if slot.kind == Kind.EXPERTS:
            for e in range(p.ne[2]):
                yield encode(p.qtype, slot_values(cfg, slot, seed, expert=e))
        else:
            yield encode(p.qtype, slot_values(cfg, slot, seed))
        return
    n_in = p.ne[0]
    std = weight_std(p.name, n_in)
    rows = n_values // n_in
    row_bytes = p.nbytes // rows
    per = max(1, CHUNK_BYTES // row_bytes)
    if p.qtype in (Q.F16, Q.F32, Q.BF16):
        table = _normal_table(std, _seed_rng(seed, p.name, 1 << 30))
        for i, r0 in enumerate(range(0, rows, per)):
            n = min(per, rows - r0)
            idx = np.frombuffer(_seed_rng(seed, p.name, i).bytes(n * n_in), np.uint8)
            vals = table[idx]
            yield encode(p.qtype, vals) if p.qtype != Q.F16 else vals
        return
    bpr = n_in // BLOCK[p.qtype].elements
    # Fresh random blocks for a pool of up to POOL_BLOCKS, then every piece is that pool read from a
    # random block offset (a memcpy): large tensors cost write bandwidth, not random generation.
    rng = _seed_rng(seed, p.name, 0)
    n_pool = min(POOL_BLOCKS, rows * bpr)
    pool = random_blocks(p.qtype, n_pool, std, rng)
    pool2 = np.concatenate([pool, pool])
    for r0 in range(0, rows, per):
        n = min(per, rows - r0) * bpr
        out = np.empty((n, pool.shape[1]), np.uint8)
        done = 0
        while done < n:
            off = int(rng.integers(n_pool))
            k = min(n - done, n_pool)
            out[done:done + k] = pool2[off:off + k]
            done += k
        yield out.reshape(-1)


def synth_gguf(cfg: Config, out: str | os.PathLike, *, mix: str | None = "q2", base: str = "q8_0", seed: int = 0,
               tokenizer: str | None = None, progress: bool = True,
               split_max_bytes: int | None = None, jobs: int = 1) -> list[TensorPlan]:
    """Write a random DS4 GGUF of `cfg`'s shape with the published type layout (base q8_0 + mix);
    with `split_max_bytes`, as split parts next to `out` (see `split_outputs` for their names).
    `jobs` worker processes write parts, or one file's tensors, at once (the bytes do not depend
    on `jobs`)."""
    from ds4.gguf_tools.quantize import tokenizer_tables

    layout = layout_by_name(cfg)
    plans = plan(cfg, Policy(base=base, mix=mix))
    tokens, merges = tokenizer_tables(tokenizer)
    if len(tokens) != cfg.vocab_size:
        raise ValueError(f"tokenizer has {len(tokens)} tokens, the preset's vocab_size is {cfg.vocab_size}")
    meta = ds4_metadata(cfg, tokens, merges, name=f"ds4-synth-{cfg.name}-{mix or base}")
    produce = lambda p: tensor_bytes(cfg, p, layout[p.name], seed)  # noqa: E731
    if split_max_bytes is None:
        write_gguf(Path(out), meta, plans, produce, progress=progress, jobs=jobs,
                   tensor_writer=functools.partial(_write_synth_tensors, cfg, mix, base, seed))
    else:
        write_split(out, meta, plans, produce, split_max_bytes, progress=progress, jobs=jobs,
                    part_writer=functools.partial(_write_synth_part, cfg, mix, base, seed))
    return plans


def _synth_plans(cfg: Config, mix, base) -> dict[str, TensorPlan]:
    return {p.name: p for p in plan(cfg, Policy(base=base, mix=mix))}


def _write_synth_tensors(cfg: Config, mix, base, seed, path: Path, items: list[tuple[str, int]]) -> None:
    """Tensors of one file at their offsets, in a worker process (write_gguf's parallel form)."""
    layout, by_name = layout_by_name(cfg), _synth_plans(cfg, mix, base)
    for name, offset in items:
        write_tensor_at(path, offset, by_name[name], tensor_bytes(cfg, by_name[name], layout[name], seed))


def _write_synth_part(cfg: Config, mix, base, seed, path: Path, meta: dict, names: list[str]) -> None:
    """One part in a worker process (picklable: rebuilds the plan and the producer from the recipe)."""
    layout, by_name = layout_by_name(cfg), _synth_plans(cfg, mix, base)
    write_gguf(path, meta, [by_name[n] for n in names], lambda p: tensor_bytes(cfg, p, layout[p.name], seed))


def split_plans(plans: list[TensorPlan], max_bytes: int, alignment: int = DEFAULT_ALIGNMENT) -> list[list[TensorPlan]]:
    """Tensors per part, llama.cpp gguf-split's rule: a new part when the part's padded tensor
    bytes would pass `max_bytes` with the next tensor (never an empty part)."""
    if max_bytes < 1:
        raise ValueError("split size must be positive")
    parts: list[list[TensorPlan]] = [[]]
    size = 0
    for p in plans:
        n = -(-p.nbytes // alignment) * alignment
        if parts[-1] and size + n > max_bytes:
            parts.append([])
            size = 0
        parts[-1].append(p)
        size += n
    return parts


def split_outputs(out: str | os.PathLike, count: int) -> list[Path]:
    """Part files for OUT (a trailing .gguf is dropped): OUT-00001-of-0000N.gguf, ..."""
    prefix = os.fspath(out)
    if prefix.endswith(".gguf"):
        prefix = prefix[:-5]
    return [split_path(prefix, i, count) for i in range(count)]


def write_split(out: str | os.PathLike, meta: dict, plans: list[TensorPlan], produce, max_bytes: int, *,
                progress: bool = False, jobs: int = 1, part_writer=None) -> list[Path]:
    """Write `plans` as split GGUF parts (module doc); returns the part paths. With jobs > 1 and a
    picklable part_writer(path, meta, names), parts are written by that many processes at once."""
    groups = split_plans(plans, max_bytes)
    n = len(groups)
    if n > 0xFFFF:
        raise ValueError(f"{n} parts do not fit split.count (u16); raise the split size")
    paths = split_outputs(out, n)
    tmp_dir = paths[0].parent / f".{paths[0].name}.parts-tmp-{os.getpid()}"
    tmp_dir.mkdir()
    try:
        metas = []
        for i in range(n):
            keys = {Key.SPLIT_NO.value: Typed(i, GGUFValueType.UINT16),
                    Key.SPLIT_COUNT.value: Typed(n, GGUFValueType.UINT16),
                    Key.SPLIT_TENSORS_COUNT.value: Typed(len(plans), GGUFValueType.INT32)}
            metas.append({**meta, **keys} if i == 0 else keys)
        if jobs > 1 and part_writer is not None and n > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(min(jobs, n), mp_context=mp.get_context("spawn")) as ex:
                futs = [ex.submit(part_writer, tmp_dir / path.name, m, [p.name for p in g])
                        for path, m, g in zip(paths, metas, groups)]
                for f in futs:
                    f.result()
        else:
            for group, path, m in zip(groups, paths, metas):
                write_gguf(tmp_dir / path.name, m, group, produce, progress=progress)
        for path in paths:
            os.replace(tmp_dir / path.name, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp_dir)
    return paths
