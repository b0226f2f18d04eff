"""`ds4-quantize splice`: replace chosen layers' routed experts of one DS4 GGUF by another's (tooling-spec §1.9).

    ds4-quantize splice --base q2.gguf --donor q4.gguf --q4-layers 37-42 --out q2-q4.gguf

This is how the published q2-q4 product is made: the q2 file (base) with the Q4_K routed experts
of its last six layers taken from the q4 file (donor). Both files must describe the same model
(same config, same tensors with the same shapes; types may differ). The output keeps the base's
header and metadata byte for byte (no record of the splice), rewrites the tensor directory with
the donor's type where a tensor was taken from it, and streams every payload in 64 MiB pieces
into `OUT.tmp`, which is fsynced and renamed to OUT only when complete.
"""

from __future__ import annotations

import os
import re
import struct
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from ds4.engine.config import Config, ConfigError
from ds4.gguf_tools.reader import GGUFFile, GGUFError, TensorInfo, _Cursor, open_gguf

ROUTED = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
CHUNK = 64 << 20
HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count


class SpliceError(ValueError):
    """Two GGUFs that cannot be spliced, or a bad layer list (one-line message)."""


def parse_layers(spec: str) -> list[int]:
    """'37-42' or '0-2,40,41': comma-separated layer ids and inclusive ranges, sorted, no duplicates."""
    layers: set[int] = set()
    for item in spec.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise SpliceError(f"layer list '{spec}': '{item}' is not a layer id or a range like 37-42")
        lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if hi < lo:
            raise SpliceError(f"layer list '{spec}': descending range '{item}'")
        layers.update(range(lo, hi + 1))
    if not layers:
        raise SpliceError(f"layer list '{spec}' is empty")
    return sorted(layers)


@dataclass(frozen=True)
class Piece:
    """One output tensor: its directory entry (`info.offset` relative to the data start) and where its bytes are."""
    info: TensorInfo
    source: GGUFFile
    source_offset: int
    from_donor: bool


@dataclass
class SplicePlan:
    base: GGUFFile
    donor: GGUFFile
    layers: list[int]
    pieces: list[Piece]
    kv_blob: bytes

    @property
    def payload_bytes(self) -> int:
        return sum(p.info.nbytes for p in self.pieces)

    def summary(self) -> list[str]:
        a = self.base.alignment
        pad = lambda n: -(-n // a) * a  # noqa: E731
        base_bytes = sum(pad(t.nbytes) for t in self.base.tensors.values())
        mixed = sum(pad(p.info.nbytes) for p in self.pieces)
        types = Counter(p.info.type_name for p in self.pieces)
        taken = sum(p.from_donor for p in self.pieces)
        return [f"layers: {','.join(map(str, self.layers))}",
                f"donor_tensors: {taken}",
                "types: " + ", ".join(f"{k} {n}" for k, n in sorted(types.items())),
                f"base_payload_bytes: {base_bytes} ({base_bytes / 2**30:.3f} GiB)",
                f"mixed_payload_bytes: {mixed} ({mixed / 2**30:.3f} GiB)",
                f"delta_bytes: {mixed - base_bytes:+d} ({(mixed - base_bytes) / 2**30:+.3f} GiB)"]


def _kv_blob(f: GGUFFile) -> bytes:
    """The metadata records of `f` as stored (from the end of the header to the tensor directory)."""
    c = _Cursor(f._mm, f.path)
    c.pos = HEADER.size
    for _ in range(len(f.metadata)):
        key = c.string("metadata key")
        c.value(c.u32("metadata type"), key)
    return bytes(f._mm[HEADER.size:c.pos])


def _config(f: GGUFFile) -> Config:
    try:
        return replace(Config.from_metadata(f.metadata), name="")
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        raise SpliceError(f"{f.path}: not a DS4 model GGUF ({e})") from None


def build_plan(base_path: str | os.PathLike, donor_path: str | os.PathLike, layers: list[int]) -> SplicePlan:
    base, donor = open_gguf(base_path), open_gguf(donor_path)
    for f in (base, donor):
        if len(f.parts) > 1:
            raise SpliceError(f"{f.path}: a split GGUF; merge it first (splice works on single files)")
    cb, cd = _config(base), _config(donor)
    if cb != cd:
        diff = [k for k in cb.__dataclass_fields__ if getattr(cb, k) != getattr(cd, k)]
        raise SpliceError(f"base and donor are different models (config differs in {', '.join(diff)})")
    if base.version != donor.version:
        raise SpliceError(f"GGUF versions differ: base {base.version}, donor {donor.version}")
    if len(base.tensors) != len(donor.tensors):
        raise SpliceError(f"tensor counts differ: base {len(base.tensors)}, donor {len(donor.tensors)}")
    if base.alignment != donor.alignment:
        raise SpliceError(f"alignments differ: base {base.alignment}, donor {donor.alignment}")
    bad = [i for i in layers if i >= cb.n_layer]
    if bad:
        raise SpliceError(f"layer {bad[0]} selected, the model has layers 0-{cb.n_layer - 1}")
    chosen = set(layers)
    pieces, offset = [], 0
    for name, t in base.tensors.items():
        d = donor.tensors.get(name)
        if d is None:
            raise SpliceError(f"{donor.path}: has no tensor '{name}'")
        if d.ne != t.ne:
            raise SpliceError(f"tensor '{name}': base shape {list(t.ne)}, donor shape {list(d.ne)}")
        m = ROUTED.match(name)
        take = m is not None and int(m.group(1)) in chosen
        src_file, src = (donor, d) if take else (base, t)
        pieces.append(Piece(replace(src, offset=offset), src_file, src.offset, take))
        offset += -(-src.nbytes // base.alignment) * base.alignment
    if not any(p.from_donor for p in pieces):
        raise SpliceError(f"no routed expert tensors in layers {','.join(map(str, layers))}")
    return SplicePlan(base, donor, layers, pieces, _kv_blob(base))


def _directory(plan: SplicePlan) -> bytes:
    out = bytearray(HEADER.pack(b"GGUF", plan.base.version, len(plan.pieces), len(plan.base.metadata)))
    out += plan.kv_blob
    for p in plan.pieces:
        name = p.info.name.encode("utf-8")
        out += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(p.info.ne))
        out += struct.pack(f"<{len(p.info.ne)}Q", *p.info.ne)
        out += struct.pack("<IQ", int(p.info.qtype), p.info.offset)
    out += bytes(-len(out) % plan.base.alignment)
    return bytes(out)


def write_spliced(plan: SplicePlan, out: str | os.PathLike, *, force: bool = False, progress: bool = False) -> Path:
    """Write the spliced file to OUT.tmp, fsync, rename onto OUT (never a partial OUT)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        raise SpliceError(f"{tmp} exists (left by an interrupted run? remove it)")
    if out.exists() and not force:
        raise SpliceError(f"{out} exists (use --force to replace it)")
    if not out.parent.is_dir():
        raise SpliceError(f"{out.parent}: no such directory")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=plan.payload_bytes, unit="B", unit_scale=True, desc=f"splicing {out.name}", leave=False)
    align = plan.base.alignment
    try:
        with open(tmp, "xb") as fout:
            fout.write(_directory(plan))
            for p in plan.pieces:
                mm = p.source._mm
                for start in range(0, p.info.nbytes, CHUNK):
                    n = min(CHUNK, p.info.nbytes - start)
                    fout.write(mm[p.source_offset + start:p.source_offset + start + n])
                    if bar is not None:
                        bar.update(n)
                fout.write(bytes(-p.info.nbytes % align))
            fout.flush()
            os.fsync(fout.fileno())
        os.replace(tmp, out)
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise
    finally:
        if bar is not None:
            bar.close()
    return out


def splice(base: str | os.PathLike, donor: str | os.PathLike, out: str | os.PathLike, layers: list[int] | str,
           *, force: bool = False, progress: bool = False, dry_run: bool = False) -> SplicePlan:
    """Base GGUF with the routed experts of `layers` taken from the donor GGUF, written to `out`."""
    plan = build_plan(base, donor, parse_layers(layers) if isinstance(layers, str) else sorted(set(layers)))
    if not dry_run:
        write_spliced(plan, out, force=force, progress=progress)
    return plan


def add_parser(sub) -> None:
    s = sub.add_parser("splice", help="replace chosen layers' routed experts with another GGUF's (q2-q4 mix)",
                       description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[2],
                       formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    s.add_argument("--base", required=True, metavar="GGUF", help="the file to start from (e.g. the q2 mix)")
    s.add_argument("--donor", required=True, metavar="GGUF", help="the file giving the experts (e.g. the q4 mix)")
    s.add_argument("--out", required=True, metavar="GGUF", help="output file")
    s.add_argument("--q4-layers", "--layers", dest="layers", required=True, metavar="SPEC",
                   help="layers whose routed experts come from the donor: ids and inclusive ranges, e.g. 37-42 or 0-2,40-42")
    s.add_argument("--dry-run", action="store_true", help="print the summary, write nothing")
    s.add_argument("--force", action="store_true", help="replace an existing OUT")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_splice)


def cmd_splice(args) -> int:
    plan = splice(args.base, args.donor, args.out, args.layers, force=args.force, progress=not args.quiet,
                  dry_run=args.dry_run)
    print("\n".join(plan.summary()))
    if not args.dry_run:
        print(f"wrote {args.out}")
    return 0


__all__ = ["SpliceError", "SplicePlan", "build_plan", "parse_layers", "splice", "write_spliced", "GGUFError"]
