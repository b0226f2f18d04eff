"""Where the tools find their data and the default model."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def data_dir(override: str | os.PathLike | None = None) -> Path:
    """The shared data directory: explicit path, else $DS4_DATA_DIR, else ../shared/data."""
    if override:
        return Path(override)
    env = os.environ.get("DS4_DATA_DIR")
    if env:
        return Path(env)
    return REPO_ROOT.parent / "shared" / "data"


def default_model() -> Path:
    """The embedded default model built by `make setup`; $DS4_MODEL overrides."""
    env = os.environ.get("DS4_MODEL")
    if env:
        return Path(env)
    return REPO_ROOT / "models" / "ds4-tiny.gguf"
