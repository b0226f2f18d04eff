"""Directional steering at run time (model-spec §6, tooling-spec §8.4).

For every token row y of a sublayer output (attention after the grouped output projection, or the FFN
= routed sum + shared expert), before the hyper-connection post step, in prefill and in decode:

    y ← y − s · v_l · (v_l · y)          v_l unit-norm, one per layer

s = 1 removes the component along v_l exactly, s = 0 leaves y untouched, a negative s amplifies it.
Up to 8 directions can be stacked; each has its own attention and FFN scale and is applied in the
order given.

Tools add the flags with one call and get a hooks object back:

    steering.apply.add_arguments(parser)
    ...
    hooks = steering.apply.hooks_from_args(args, model.config)   # None when no file was given
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from ds4.engine.hooks import HookList, Hooks
from ds4.steering.format import DirectionSet, SteeringFileError, load_directions

MAX_DIRECTIONS = 8
SCALE_LIMIT = 100.0
ATTN, FFN = "attn", "ffn"


def project_out(y: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """y − s·v·(v·y) for each row of y ([..., D]); float32 like the runtime. Returns a new array."""
    y = np.asarray(y, dtype=np.float32)
    v = np.asarray(v, dtype=np.float32)
    dots = y @ v  # [...]
    return y - np.float32(scale) * dots[..., None] * v


def project_out_reference(y: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """The same edit row by row with an explicit sequential dot product (the CPU order of ds4)."""
    y = np.array(y, dtype=np.float32, copy=True)
    rows = y.reshape(-1, y.shape[-1])
    for r in rows:
        dot = np.float32(0.0)
        for a, b in zip(r, v):
            dot = np.float32(dot + np.float32(a) * np.float32(b))
        r -= np.float32(scale) * dot * np.asarray(v, np.float32)
    return y


@dataclass
class SteeringDirection:
    directions: DirectionSet
    attn_scale: float = 0.0
    ffn_scale: float = 1.0

    def scale(self, kind: str) -> float:
        return self.attn_scale if kind == ATTN else self.ffn_scale


class Steering:
    """A stack of directions with scales; `edit(layer, kind, y)` applies them in order."""

    def __init__(self, stack: list[SteeringDirection]):
        if len(stack) > MAX_DIRECTIONS:
            raise ValueError(f"at most {MAX_DIRECTIONS} steering directions, got {len(stack)}")
        self.stack = stack

    def active(self, kind: str | None = None) -> bool:
        kinds = (ATTN, FFN) if kind is None else (kind,)
        return any(d.scale(k) != 0.0 for d in self.stack for k in kinds)

    def edit(self, layer: int, kind: str, y: np.ndarray) -> np.ndarray | None:
        """The steered rows, or None when nothing applies to this layer and sublayer."""
        out = None
        for d in self.stack:
            s = d.scale(kind)
            if s == 0.0 or layer >= d.directions.n_layer:
                continue
            v = d.directions.vectors[layer]
            out = project_out(y if out is None else out, v, s)
        return out


class SteeringHooks(Hooks):
    """Engine hooks that steer attention and/or FFN outputs (combine with others via HookList)."""

    def __init__(self, steering: Steering):
        self.steering = steering

    def sublayer_output(self, layer, kind, y):
        return self.steering.edit(layer, _kind(kind), y)


def make_hooks(steering: Steering, base: Hooks | None = None) -> Hooks:
    """SteeringHooks, chained after `base` (its sublayer edit first) when one is given."""
    hooks = SteeringHooks(steering)
    return hooks if base is None else HookList(base, hooks)


def _kind(kind) -> str:
    """Accept the engine's sublayer names ('attn'/'ffn', 'attn_out'/'ffn_out', or an enum of those)."""
    k = getattr(kind, "value", kind)
    k = str(k).lower()
    return ATTN if k.startswith("attn") else FFN


# ---- command-line flags ----------------------------------------------------------------------------

def _scale(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not -SCALE_LIMIT <= s <= SCALE_LIMIT:
        raise argparse.ArgumentTypeError(f"steering scale must be in [-{SCALE_LIMIT:g}, {SCALE_LIMIT:g}], got {s:g}")
    return s


def add_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add --dir-steering-file/--dir-steering-attn/--dir-steering-ffn (each repeatable) to a parser."""
    g = parser.add_argument_group(
        "directional steering",
        "y ← y − s·v·(v·y) on attention and/or FFN outputs (positive s suppresses the direction, negative "
        f"amplifies). Repeat the three flags to stack up to {MAX_DIRECTIONS} directions; the n-th scale goes "
        "with the n-th file, and a single scale applies to all files.")
    g.add_argument("--dir-steering-file", action="append", default=None, metavar="F",
                   help="direction file: raw layers×hidden float32 (.f32) or control-vector GGUF")
    g.add_argument("--dir-steering-attn", action="append", type=_scale, default=None, metavar="S",
                   help="scale on attention outputs (default 0)")
    g.add_argument("--dir-steering-ffn", action="append", type=_scale, default=None, metavar="S",
                   help="scale on FFN outputs (default 1 when neither scale is given, else 0)")
    return g


def _per_file(values: list[float] | None, n: int, default: float, flag: str) -> list[float]:
    if not values:
        return [default] * n
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise SteeringFileError(f"{flag} given {len(values)} times for {n} steering files (give 1 or {n})")
    return list(values)


def steering_from_args(args: argparse.Namespace, n_layer: int, n_embd: int) -> Steering | None:
    """Parse the flags into a Steering, or None when no file is given or every scale is 0 (then the
    files are not even read, as in ds4). Raises SteeringFileError with a one-line message."""
    files = getattr(args, "dir_steering_file", None) or []
    attn, ffn = getattr(args, "dir_steering_attn", None), getattr(args, "dir_steering_ffn", None)
    if not files:
        if attn or ffn:
            raise SteeringFileError("--dir-steering-attn/--dir-steering-ffn need --dir-steering-file")
        return None
    if len(files) > MAX_DIRECTIONS:
        raise SteeringFileError(f"at most {MAX_DIRECTIONS} --dir-steering-file, got {len(files)}")
    ffn_default = 1.0 if not attn and not ffn else 0.0
    attn_s = _per_file(attn, len(files), 0.0, "--dir-steering-attn")
    ffn_s = _per_file(ffn, len(files), ffn_default, "--dir-steering-ffn")
    stack = [SteeringDirection(load_directions(f, n_layer, n_embd), a, s)
             for f, a, s in zip(files, attn_s, ffn_s) if a != 0.0 or s != 0.0]
    return Steering(stack) if stack else None


def hooks_from_args(args: argparse.Namespace, config, base: object | None = None):
    """Hooks for the steering flags in `args` (combined with `base`), or `base` when no steering."""
    steering = steering_from_args(args, config.n_layer, config.n_embd)
    if steering is None:
        return base
    return make_hooks(steering, base)
