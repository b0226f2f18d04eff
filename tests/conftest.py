"""Shared fixtures: the data directory and the random-weight DS4 models built by our own tools.

`tiny_gguf` is models/ds4-tiny.gguf (what `make setup` builds) when it exists and validates;
otherwise it is built once per session in a temp directory with the real CLI:
`ds4-quantize synth --preset tiny --seed 0` then `ds4-quantize convert --type f16`.
`small_gguf` does the same for the `small` preset (about 500 MB); only tests marked
`@pytest.mark.slow` should request it. `tok` is the DeepSeek tokenizer. `tiny_model` is the
engine Model of `tiny_gguf`, loaded once per test module. `eval_model` is the default model
(`make setup`'s, or $DS4_MODEL) when it exists, else a random `tiny` written once per session
(ds4_tool_util.write_random_tiny).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ds4 import paths

REPO = Path(__file__).resolve().parent.parent


def quantize_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run `ds4-quantize` in a subprocess (the installed entry point's module)."""
    cmd = [sys.executable, "-m", "ds4.gguf_tools.quantize", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def build_model(preset: str, out_dir: Path, seed: int = 0, gguf_type: str = "f16") -> Path:
    hf_dir = out_dir / f"{preset}-hf"
    gguf = out_dir / f"ds4-{preset}.gguf"
    quantize_cli("synth", "--preset", preset, "--seed", str(seed), "--quiet", str(hf_dir))
    quantize_cli("convert", str(hf_dir), str(gguf), "--type", gguf_type, "--quiet")
    return gguf


@pytest.fixture
def ext_on_torch_stream():
    """GPU tests that mix torch ops and extension ops: the extension launches on torch's current stream for the
    test, and goes back to its own stream afterwards (graph captures of later tests use that one)."""
    import torch

    from ds4.engine import gpu

    ext = gpu.load()
    ext.set_stream(torch.cuda.current_stream().cuda_stream)
    yield ext
    torch.cuda.synchronize()
    ext.reset_stream()


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return paths.data_dir()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    from ds4.gguf_tools.reader import GGUFError, open_model

    built = REPO / "models" / "ds4-tiny.gguf"
    if built.exists():
        try:
            open_model(built).close()
            return built
        except GGUFError:
            pass  # stale or broken: build a fresh one below
    return build_model("tiny", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def small_gguf(tmp_path_factory) -> Path:
    """The `small` preset (slow to build): request it only from `@pytest.mark.slow` tests."""
    built = REPO / "models" / "ds4-small.gguf"
    if built.exists():
        return built
    return build_model("small", tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="module")
def tok():
    """The DeepSeek V4 tokenizer from tokenizer.json (no model needed)."""
    from ds4.engine.tokenizer import Tokenizer

    return Tokenizer.from_tokenizer_json()


@pytest.fixture(scope="module")
def tiny_model(tiny_gguf):
    from ds4.engine.model import Model

    return Model.load(tiny_gguf)


@pytest.fixture(scope="session")
def eval_model(tmp_path_factory) -> Path:
    from ds4_tool_util import write_random_tiny

    default = paths.default_model()
    if default.is_file():
        return default
    return write_random_tiny(tmp_path_factory.mktemp("evalmodel") / "tiny.gguf")


@pytest.fixture(scope="module")
def fused_kernels():
    """The CUDA extension's fused kernels (ds4.engine.gpu.fused.Fused) on torch's current stream, once per module;
    skipped without a CUDA device and the built extension (a fixture rather than a module mark, so a module's CPU tests
    run everywhere). Afterwards the extension is back on its own stream (later test files capture on it)."""
    torch = pytest.importorskip("torch")
    from ds4.engine import gpu

    if not (torch.cuda.is_available() and gpu.available()):
        pytest.skip("needs a CUDA device and the built extension")
    from ds4.engine.gpu.fused import Fused

    ext = gpu.load()
    yield Fused(ext, torch.device("cuda"))
    ext.reset_stream()
