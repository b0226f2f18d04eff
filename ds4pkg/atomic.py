"""Atomic file output for every ds4 tool: write a temp file beside the target, then rename it into
place, so neither a reader nor a crash ever sees half a file. The finished file gets the mode a
plain open() would have given it (mkstemp creates 0600 files)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def _umask_mode() -> int:
    """The mode a plain open() would give a new file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Give a finished temp file ordinary permissions and rename it into place."""
    os.chmod(tmp, _umask_mode())
    os.replace(tmp, path)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """`write(tmp)` fills a temp file in `path`'s folder, which is then renamed to `path`.

    The folder must exist (FileNotFoundError otherwise); on any failure the temp file is removed.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        publish(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda p: p.write_bytes(data))


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """UTF-8 text with '\\n' line ends; creates missing parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8", newline="\n"))


def save_figure_atomic(fig, path: str | os.PathLike, **savefig_kw) -> None:
    """matplotlib `fig.savefig` through a temp file; pass `format=` (the temp name has no image suffix)."""
    atomic_write(path, lambda p: fig.savefig(p, **savefig_kw))
