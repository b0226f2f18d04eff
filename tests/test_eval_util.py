"""Shared helpers for the ds4-eval and ds4-server tests (no tests of its own).

`eval_model_path()` is the default model when `make setup` has built it, else a random `tiny`
GGUF written once per test session with our own writer and the real DeepSeek tokenizer tables.
`start_server()` runs the real `ds4-server` on a free loopback port and returns its base URL.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
QUESTIONS = REPO.parent / "shared" / "data" / "eval" / "questions.jsonl"
_CACHE: dict[str, Path] = {}


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    from ds4.engine.config import preset
    from ds4.engine.model import expected_shapes
    from ds4.engine.tokenizer import load_tokenizer_json
    from ds4.gguf_tools.constants import BOS_TEXT, EOS_TEXT, LayerTensor, QuantType
    from ds4.gguf_tools.writer import ds4_metadata, write_tensors

    cfg = preset("tiny")
    tokens, merges = load_tokenizer_json()
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith(LayerTensor.FFN_GATE_TID2EID.value):
            tensors[name] = (QuantType.I32, rng.integers(0, cfg.n_expert, size=shape).astype(np.int32))
        elif len(shape) == 1:
            tensors[name] = (QuantType.F32, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            w = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
            small = len(shape) == 2 and shape[0] < 64
            tensors[name] = (QuantType.F32 if small else QuantType.F16, w)
    meta = ds4_metadata(cfg, tokens, merges, bos_id=tokens.index(BOS_TEXT),
                        eos_id=tokens.index(EOS_TEXT))
    write_tensors(path, meta, tensors)
    return path


def eval_model_path(tmp_path_factory) -> Path:
    from ds4.paths import default_model
    if "model" not in _CACHE:
        default = default_model()
        if default.is_file():
            _CACHE["model"] = default
        else:
            _CACHE["model"] = write_tiny_gguf(tmp_path_factory.mktemp("evalmodel") / "tiny.gguf")
    return _CACHE["model"]


def run_cli(*args: str, timeout: float = 120, env=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ds4-eval"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


class ServerProcess:
    def __init__(self, model: Path, ctx: int = 1024, extra: tuple[str, ...] = ()):
        self.proc = subprocess.Popen(
            [str(BIN / "ds4-server"), "-m", str(model), "--port", "0", "--ctx", str(ctx),
             "--quiet", *extra], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            m = re.search(r"listening on (http://[0-9.]+:\d+/v1)", line)
            if m:
                self.base_url = m.group(1)
                return
            if self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"ds4-server did not start: {line!r}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def env_without_tty() -> dict:
    env = dict(os.environ)
    env.pop("DS4_MODEL", None)
    return env
