"""The ds4-bench CSV (tooling-spec §6.2): one reader and one writer.

    # ds4-bench v1
    # model: models/ds4-small.gguf
    # backend: cpu
    # machine: x86_64, 2 cores, Linux-6.1
    # git: 0c6e68a
    # gen_tokens: 128
    ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes
    2048,2048,1234.56,128,45.67,52184460

Header comment lines are `# key: value`; the reader returns them as a dict. Files written by
upstream ds4-bench (no comments, maybe a UTF-8 BOM) read the same way.
"""

from __future__ import annotations

import io
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

COLUMNS = ("ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "kvcache_bytes")
MAGIC = "ds4-bench v1"


class BenchCsvError(ValueError):
    pass


@dataclass
class BenchRow:
    ctx_tokens: int
    prefill_tokens: int
    prefill_tps: float
    gen_tokens: int
    gen_tps: float
    kvcache_bytes: int

    def line(self) -> str:
        return (f"{self.ctx_tokens},{self.prefill_tokens},{self.prefill_tps:.2f},{self.gen_tokens},"
                f"{self.gen_tps:.2f},{self.kvcache_bytes}")


@dataclass
class BenchRun:
    meta: dict[str, str]
    rows: list[BenchRow]
    path: Path | None = None

    @property
    def label(self) -> str:
        """Legend text: the `label` comment, else model + backend, else the file stem."""
        if self.meta.get("label"):
            return self.meta["label"]
        if self.meta.get("model"):
            name = Path(self.meta["model"]).stem
            return f"{name} ({self.meta['backend']})" if self.meta.get("backend") else name
        return self.path.stem if self.path else "run"


def git_revision(repo: str | os.PathLike | None = None) -> str:
    """Short git revision of the ds4 checkout (+ '-dirty' when the tree has changes); 'unknown' outside git."""
    repo = repo or Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()}-{platform.release()}"


def format_csv(run: BenchRun) -> str:
    out = io.StringIO()
    out.write(f"# {MAGIC}\n")
    for k, v in run.meta.items():
        out.write(f"# {k}: {str(v).replace(chr(10), ' ')}\n")
    out.write(",".join(COLUMNS) + "\n")
    for r in run.rows:
        out.write(r.line() + "\n")
    return out.getvalue()


def write_csv(path: str | os.PathLike, run: BenchRun) -> None:
    from ds4.test_vectors.formats import write_text_atomic
    write_text_atomic(path, format_csv(run))


def parse_csv(text: str, path: Path | None = None) -> BenchRun:
    where = str(path) if path else "<csv>"
    meta: dict[str, str] = {}
    header: list[str] | None = None
    rows: list[BenchRow] = []
    for n, line in enumerate(text.lstrip("\ufeff").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            body = line[1:].strip()
            if ":" in body and header is None:
                k, v = body.split(":", 1)
                meta[k.strip()] = v.strip()
            continue
        fields = [f.strip() for f in line.split(",")]
        if header is None:
            header = fields
            missing = [c for c in ("ctx_tokens", "prefill_tps", "gen_tps") if c not in header]
            if missing:
                raise BenchCsvError(f"{where}: not a ds4-bench CSV (missing columns {', '.join(missing)})")
            continue
        rec = dict(zip(header, fields))
        try:
            rows.append(BenchRow(
                ctx_tokens=int(rec["ctx_tokens"]), prefill_tokens=int(rec.get("prefill_tokens", 0) or 0),
                prefill_tps=float(rec["prefill_tps"]), gen_tokens=int(rec.get("gen_tokens", 0) or 0),
                gen_tps=float(rec["gen_tps"]), kvcache_bytes=int(rec.get("kvcache_bytes", 0) or 0)))
        except (KeyError, ValueError):
            raise BenchCsvError(f"{where}:{n}: malformed row {line!r}") from None
    if header is None:
        raise BenchCsvError(f"{where}: empty (no CSV header)")
    return BenchRun(meta=meta, rows=rows, path=path)


def read_csv(path: str | os.PathLike) -> BenchRun:
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise BenchCsvError(f"{path}: not UTF-8 text") from None
    return parse_csv(text, path)
