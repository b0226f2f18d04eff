"""The test suite's one helper module (no tests of its own; fixtures live in conftest.py).

- random DS4 models written with our own GGUF writer and the real DeepSeek tokenizer tables
  (`write_random_model`, `write_random_tiny`), and GGUF copies with one tensor edited or every
  matrix re-encoded (`rewrite_gguf`, `perturb_rows`, `quantize_copy`);
- the configs the quantized-model tests share (`tiny_wide_ffn_config`, `reduced_config`);
- the ds4-eval / ds4-server runners (`run_cli`, `ServerProcess`) and the shared data paths.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ds4.gguf_tools.constants import QuantType
from ds4.gguf_tools.layout import Kind, tensor_layout
from ds4.gguf_tools.reader import open_gguf
from ds4.gguf_tools.writer import TensorPlan, Typed, encode, write_gguf

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
QUESTIONS = REPO.parent / "shared" / "data" / "eval" / "questions.jsonl"
SAMPLE_TEXT = ("The quick brown fox jumps over the lazy dog while the model routes every token to a few "
               "experts; importance is the mean square of what each expert sees. ") * 4


# ---- models -------------------------------------------------------------------------------------

def _metadata(f) -> dict:
    return {k: Typed(v, *f.metadata_types[k]) for k, v in f.metadata.items()}


def rewrite_gguf(src: Path, dst: Path, choose: Callable[[str, object], tuple[QuantType, np.ndarray] | None]) -> Path:
    """Copy `src` to `dst`; `choose(name, info)` returns (type, float values) to re-encode a tensor,
    or None to copy its bytes unchanged."""
    f = open_gguf(src)
    plans, edits = [], {}
    for name, t in f.tensors.items():
        ch = choose(name, t)
        if ch is None:
            plans.append(TensorPlan(name, QuantType(t.qtype), t.ne))
        else:
            qtype, values = ch
            edits[name] = (qtype, values)
            plans.append(TensorPlan(name, QuantType(qtype), t.ne))

    def produce(p: TensorPlan):
        if p.name in edits:
            qtype, values = edits[p.name]
            return encode(qtype, values)
        return np.asarray(f.raw(p.name)).reshape(-1)

    return write_gguf(dst, _metadata(f), plans, produce)


def perturb_rows(src: Path, dst: Path, tensor: str, rows, scale: float) -> Path:
    """Copy with rows (numpy first axis) of one float tensor multiplied by `scale`."""
    def choose(name, t):
        if name != tensor:
            return None
        a = np.array(open_gguf(src).array(name), dtype=np.float32)
        a[list(rows)] *= scale
        return QuantType(t.qtype), a
    return rewrite_gguf(src, dst, choose)


def quantize_copy(src: Path, dst: Path, qtype: QuantType, fallback: QuantType | None = QuantType.Q8_0,
                  keep: tuple[str, ...] = ()) -> Path:
    """Every matrix / expert tensor whose rows fit `qtype`'s block becomes `qtype` (else `fallback`
    when its rows fit that, else unchanged): a crude stand-in for ds4-quantize on test models."""
    from ds4.gguf_tools.constants import BLOCK
    f = open_gguf(src)
    from ds4.engine.config import Config
    cfg = Config.from_metadata(f.metadata)
    kinds = {s.name: s.kind for s in tensor_layout(cfg)}

    def choose(name, t):
        if kinds.get(name) not in (Kind.MATRIX, Kind.EXPERTS) or name in keep:
            return None
        for q in (qtype, fallback):
            if q is not None and t.ne[0] % BLOCK[q].elements == 0:
                return q, np.array(f.array(name), dtype=np.float32)
        return None
    return rewrite_gguf(src, dst, choose)


def write_random_model(path: Path, cfg, seed: int = 0) -> Path:
    """A random model of any config, with the real tokenizer: F32 vectors near 1, F16 matrices at
    1/sqrt(fan-in) (F32 for the small ones), random hash-routing tables."""
    from ds4.engine.model import expected_shapes
    from ds4.engine.tokenizer import load_tokenizer_json
    from ds4.gguf_tools.constants import BOS_TEXT, EOS_TEXT, LayerTensor
    from ds4.gguf_tools.writer import ds4_metadata, write_tensors

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
            tensors[name] = (QuantType.F32 if len(shape) == 2 and shape[0] < 64 else QuantType.F16, w)
    meta = ds4_metadata(cfg, tokens, merges, bos_id=tokens.index(BOS_TEXT), eos_id=tokens.index(EOS_TEXT))
    write_tensors(path, meta, tensors)
    return path


def write_random_tiny(path: Path, seed: int = 0) -> Path:
    """A random `tiny` preset model (see `write_random_model`)."""
    from ds4.engine.config import preset
    return write_random_model(path, preset("tiny"), seed)


def greedy_oracle(session, ids: list[int], n: int, eos_id: int) -> list[int]:
    """The engine driven directly: sync `ids`, then up to `n` argmax tokens, stopping before EOS
    (which is neither returned nor evaluated). The oracle for every tool that generates greedily."""
    logits, out = session.sync(ids), []
    for _ in range(n):
        t = int(np.argmax(logits))
        if t == eos_id:
            break
        out.append(t)
        logits = session.decode(t)
    return out


# ---- configs ------------------------------------------------------------------------------------

def tiny_wide_ffn_config():
    """`tiny` with 256-wide expert FFNs: the expert down projections then take 256-value quant blocks
    (Q2_K, Q4_K, IQ2_XXS), like the routed experts of a real 2-bit mix, while the model stays tiny."""
    from ds4.engine.config import preset
    return dataclasses.replace(preset("tiny"), expert_ffn=256, name="ds4-tiny-wide-ffn")


def reduced_config(n_expert: int = 32):
    """`small` narrowed to hidden 256 and 4 layers (window, window, ratio 4, ratio 128), so every matrix
    the q2/q4 mixes quantize has rows of a multiple of 256 and Q4_K/Q2_K/IQ2_XXS all apply, while
    synth + convert stay a few seconds."""
    from ds4.engine.config import preset
    return dataclasses.replace(preset("small"), n_layer=4, n_embd=256, compress_ratios=(0, 0, 4, 128),
                               swiglu_clamp=(10.0,) * 4, n_expert=n_expert, name="ds4-reduced")


# ---- ds4-eval / ds4-server ----------------------------------------------------------------------

def run_cli(*args: str, timeout: float = 120, env=None, **kw) -> subprocess.CompletedProcess:
    """The installed `ds4-eval` in a subprocess."""
    return subprocess.run([str(BIN / "ds4-eval"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


class ServerProcess:
    """The real `ds4-server` on a free loopback port; `base_url` once it listens."""

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
