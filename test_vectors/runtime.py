"""The thin layer between the tools (vectors, quality, bench) and the engine's Session API.

Every tool loads a model once, opens sessions on it (CPU, or CUDA when asked and built), renders
prompts the way the engine's CLI does, and reads token bytes through the model's tokenizer.
Failures the user can cause (bad path, foreign file) become `ToolError` with a one-line message.
"""

from __future__ import annotations

import os
from pathlib import Path


class ToolError(Exception):
    """A user-facing failure: the CLI prints `error: <message>` and exits with code 2."""


def load_model(path: str | os.PathLike):
    from ds4.engine.model import Model
    from ds4.gguf_tools.reader import GGUFError

    path = Path(path)
    if not path.exists():
        raise ToolError(f"{path}: no such model file")
    if path.is_dir():
        raise ToolError(f"{path}: is a directory, expected a .gguf file")
    try:
        return Model.load(path)
    except (GGUFError, ValueError, OSError, KeyError) as e:  # ModelError is a ValueError
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ToolError(f"{path}: cannot load model: {msg}") from None


def _gpu_session_class():
    """(the CUDA engine's Session class or None, why not): the same probe as the ds4 CLI."""
    try:
        from ds4.engine import gpu
        if not gpu.available():
            return None, gpu.unavailable_reason() or "CUDA unavailable"
        from ds4.engine.gpu.session import Session  # type: ignore[import-not-found]
        return Session, None
    except ImportError as e:
        return None, f"no CUDA engine session in this build ({e})"


def check_backend(backend: str | None) -> str:
    """The backend to use ('cpu' / 'cuda'; None = cuda when it runs, else cpu), or ToolError now,
    before any model is loaded."""
    if backend is None:
        return default_backend()
    if backend == "cuda":
        cls, why = _gpu_session_class()
        if cls is None:
            raise ToolError(f"backend cuda is not available: {why}")
    elif backend != "cpu":
        raise ToolError(f"unknown backend {backend!r} (cpu or cuda)")
    return backend


def available_backends() -> list[str]:
    return ["cpu"] + (["cuda"] if _gpu_session_class()[0] is not None else [])


def open_session(model, ctx: int, backend: str = "cpu", prefill_chunk: int | None = None):
    """A fresh session of `ctx` tokens on `backend`, throttled by --power when one is installed."""
    kwargs = {"ctx": int(ctx)}
    if prefill_chunk:
        kwargs["prefill_chunk"] = int(prefill_chunk)
    if backend == "cpu":
        from ds4.engine.session import Session
    elif backend == "cuda":
        Session, why = _gpu_session_class()
        if Session is None:
            raise ToolError(f"backend cuda is not available: {why}")
    else:
        raise ToolError(f"unknown backend {backend!r} (cpu or cuda)")
    session = Session(model, **kwargs)
    from ds4.engine import power
    power.attach(session)  # --power: throttle between layers
    return session


def default_backend() -> str:
    return "cuda" if "cuda" in available_backends() else "cpu"


def special_id(tok, text: str) -> int:
    sid = getattr(tok, "special_ids", {}).get(text)
    if sid is None:
        sid = tok.token_to_id.get(text)
    if sid is None:
        raise ToolError(f"the model's vocabulary has no {text!r} token")
    return int(sid)


def eos_id(model) -> int:
    from ds4.gguf_tools.constants import EOS_TEXT
    return special_id(model.tokenizer, EOS_TEXT)


def render_nothink(tok, prompt: str, system: str = "") -> list[int]:
    """`BOS + BPE(system)? + <｜User｜> + BPE(prompt) + <｜Assistant｜> + </think>` (runtime-spec §2.7,
    mode NONE): how the official vectors and quality continuations were captured."""
    try:
        from ds4.engine.chat import ThinkMode, encode_chat_prompt
    except ImportError:  # engine without the chat module: the same rule, spelled out
        encode_chat_prompt = None
    if encode_chat_prompt is not None and hasattr(tok, "bos_id"):
        return list(encode_chat_prompt(tok, system, prompt, ThinkMode.NONE))
    from ds4.gguf_tools.constants import ASSISTANT_TEXT, BOS_TEXT, THINK_CLOSE_TEXT, USER_TEXT
    ids = [special_id(tok, BOS_TEXT)]
    if system:
        ids += tok.encode(system)
    ids.append(special_id(tok, USER_TEXT))
    ids += tok.encode(prompt)
    ids.append(special_id(tok, ASSISTANT_TEXT))
    ids.append(special_id(tok, THINK_CLOSE_TEXT))
    return ids
