"""What the ds4 console scripts share: the one-line error with exit code 2 for user mistakes, the
integer flag types, the -m/--model and --data-dir options, and the checks run before long work
(the model loads, the output folder is writable)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ds4 import paths

EXIT_USAGE = 2
MODEL_HELP = "DS4 GGUF (default: $DS4_MODEL or models/ds4-tiny.gguf)"
DATA_DIR_HELP = "shared data directory (default: $DS4_DATA_DIR or ../shared/data)"


class UsageError(Exception):
    """A user mistake: one line on stderr, exit code 2."""


def fail(prog: str, msg: str) -> int:
    """Print `PROG: error: MSG` on stderr; the exit code for a user mistake."""
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def run_command(prog: str, command, args, user_errors: tuple[type[BaseException], ...] = (),
                interrupted: str = "interrupted") -> int:
    """`command(args)`, with UsageError, `user_errors` and the usual path errors printed as one line
    `PROG: message` (exit 2) and Ctrl+C as `PROG: <interrupted>` (exit 130)."""
    try:
        return command(args)
    except (UsageError, FileNotFoundError, IsADirectoryError, PermissionError, *user_errors) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def count(text: str) -> int:
    """argparse type: an integer >= 0 (0 usually means 'no limit')."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def add_model_argument(p: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:
    p.add_argument("-m", "--model", default=None, help=help)


def add_data_dir_argument(p: argparse.ArgumentParser, help: str = DATA_DIR_HELP) -> None:
    p.add_argument("--data-dir", default=None, help=help)


def check_output_folder(path: str | None) -> None:
    """Fail before hours of work, not after: the output's folder must exist and be writable."""
    if path:
        folder = Path(path).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise UsageError(f"{path}: folder {folder} does not exist or is not writable")


def load_model(path: str | None):
    """The engine Model at `path` (None: the default model), or UsageError('cannot load model: ...')."""
    from ds4.engine.model import Model, ModelError

    path = path or str(paths.default_model())
    try:
        return Model.load(path)
    except (ModelError, OSError, ValueError) as e:
        raise UsageError(f"cannot load model: {e}") from None
