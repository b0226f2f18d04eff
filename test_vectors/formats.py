"""Logprob test-vector formats (tooling-spec §5.2): one reader and one writer per format.

* `manifest.json`                     — schema "ds4-test-vector-manifest-v1": which prompts exist.
* `official/<id>.official.json`       — schema "ds4-official-logprobs-v1": one captured API answer.
* `official.vec`                      — the compact text fixture the engine test reads.

The in-memory form every checker works on is `VectorCase` (id, ctx, prompt, steps), each step a
`VectorStep` (selected token bytes, and the alternatives worth checking with their logprobs).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ds4.atomic import write_text_atomic  # also imported from here by quality and ds4-bench

MANIFEST_SCHEMA = "ds4-test-vector-manifest-v1"
OFFICIAL_SCHEMA = "ds4-official-logprobs-v1"
VEC_MAGIC = "# ds4-official-logprob-vectors-v1"

# The API reports alternatives it did not really score with this logprob; .vec drops them.
MISSING_LOGPROB = -1000.0


class VectorFormatError(ValueError):
    """A vector file is malformed (the CLI turns this into a one-line error)."""


@dataclass
class TopEntry:
    token: bytes
    logprob: float
    text: str | None = None  # display spelling, as the API or the local tokenizer wrote it


@dataclass
class VectorStep:
    index: int
    selected: bytes
    top: list[TopEntry] = field(default_factory=list)
    selected_text: str | None = None
    logprob: float = 0.0  # logprob of the selected token (0.0 in the official captures)


@dataclass
class VectorCase:
    id: str
    ctx: int
    prompt_file: str  # as recorded (relative to the repo root in .vec, to the vector dir in the manifest)
    steps: list[VectorStep]
    kind: str = ""
    prompt: str | None = None  # the prompt text, when known


# ----------------------------------------------------------------------------------------------
# Atomic writes


def _load_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise VectorFormatError(f"{path}: malformed JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise VectorFormatError(f"{path}: not UTF-8 text") from None
    if not isinstance(data, dict):
        raise VectorFormatError(f"{path}: expected a JSON object")
    return data


# ----------------------------------------------------------------------------------------------
# manifest.json


@dataclass
class ManifestEntry:
    id: str
    kind: str
    prompt_file: str
    official_file: str
    prompt_chars: int
    steps: int


@dataclass
class Manifest:
    source: str
    model: str
    endpoint: str
    top_logprobs: int
    max_tokens: int
    prompts: list[ManifestEntry]


def read_manifest(path: str | os.PathLike) -> Manifest:
    path = Path(path)
    data = _load_json(path)
    if data.get("schema") != MANIFEST_SCHEMA:
        raise VectorFormatError(f"{path}: schema is {data.get('schema')!r}, expected {MANIFEST_SCHEMA!r}")
    try:
        prompts = [
            ManifestEntry(id=str(p["id"]), kind=str(p.get("kind", "")), prompt_file=str(p["prompt_file"]),
                          official_file=str(p["official_file"]), prompt_chars=int(p["prompt_chars"]),
                          steps=int(p["steps"]))
            for p in data["prompts"]
        ]
        return Manifest(source=str(data.get("source", "")), model=str(data.get("model", "")),
                        endpoint=str(data.get("endpoint", "")), top_logprobs=int(data["top_logprobs"]),
                        max_tokens=int(data["max_tokens"]), prompts=prompts)
    except (KeyError, TypeError, ValueError) as e:
        raise VectorFormatError(f"{path}: bad manifest field ({e})") from None


def manifest_to_json(m: Manifest) -> dict:
    return {
        "schema": MANIFEST_SCHEMA, "source": m.source, "model": m.model, "endpoint": m.endpoint,
        "top_logprobs": m.top_logprobs, "max_tokens": m.max_tokens,
        "prompts": [
            {"id": p.id, "kind": p.kind, "prompt_file": p.prompt_file, "official_file": p.official_file,
             "prompt_chars": p.prompt_chars, "steps": p.steps}
            for p in m.prompts
        ],
    }


def write_manifest(path: str | os.PathLike, m: Manifest) -> None:
    write_text_atomic(path, json.dumps(manifest_to_json(m), indent=2, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------------------
# <id>.official.json


def _token_bytes(tok: dict, where: str) -> tuple[bytes, str]:
    try:
        raw = tok["bytes"]
        text = str(tok.get("text", ""))
        if raw is None:  # the API omits bytes for some tokens: fall back to the text's UTF-8
            return text.encode("utf-8"), text
        return bytes(int(b) for b in raw), text
    except (KeyError, TypeError, ValueError) as e:
        raise VectorFormatError(f"{where}: bad token ({e})") from None


def read_official(path: str | os.PathLike) -> dict:
    """The raw capture, validated: a dict with the official schema and a well-formed `steps` list."""
    path = Path(path)
    data = _load_json(path)
    if data.get("schema") != OFFICIAL_SCHEMA:
        raise VectorFormatError(f"{path}: schema is {data.get('schema')!r}, expected {OFFICIAL_SCHEMA!r}")
    if not isinstance(data.get("steps"), list) or "id" not in data:
        raise VectorFormatError(f"{path}: missing 'id' or 'steps'")
    for i, st in enumerate(data["steps"]):
        _token_bytes(st.get("token", {}), f"{path}: step {i}")
    return data


def write_official(path: str | os.PathLike, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def case_from_official(data: dict, ctx: int, prompt_file: str, where: str = "official") -> VectorCase:
    """Reduce a capture to the checkable case, applying the same filter as the .vec writer:
    alternatives with logprob ≤ -1000 or empty bytes are dropped."""
    steps = []
    for i, st in enumerate(data["steps"]):
        sel, sel_text = _token_bytes(st["token"], f"{where}: step {i}")
        top = []
        for alt in st.get("top_logprobs", []):
            tb, tt = _token_bytes(alt["token"], f"{where}: step {i} top")
            lp = float(alt["logprob"])
            if lp <= MISSING_LOGPROB or not tb:
                continue
            top.append(TopEntry(tb, lp, tt))
        steps.append(VectorStep(index=int(st.get("step", i)), selected=sel, top=top, selected_text=sel_text,
                                logprob=float(st.get("logprob", 0.0))))
    return VectorCase(id=str(data["id"]), ctx=ctx, prompt_file=prompt_file, steps=steps,
                      kind=str(data.get("kind", "")), prompt=data.get("prompt"))


# ----------------------------------------------------------------------------------------------
# official.vec (text)


def _hex_bytes(text: str, where: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise VectorFormatError(f"{where}: bad hex {text!r}") from None


def read_vec(path: str | os.PathLike) -> list[VectorCase]:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise VectorFormatError(f"{path}: not UTF-8 text") from None
    cases: list[VectorCase] = []
    case: VectorCase | None = None
    step: VectorStep | None = None
    want_top = 0
    for n, line in enumerate(lines, 1):
        where = f"{path}:{n}"
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        f = line.split()
        try:
            if f[0] == "case":
                if case is not None:
                    raise VectorFormatError(f"{where}: 'case' before 'end'")
                if len(f) != 5:
                    raise VectorFormatError(f"{where}: expected 'case <id> <ctx> <steps> <prompt-file>'")
                case = VectorCase(id=f[1], ctx=int(f[2]), prompt_file=f[4], steps=[])
                declared_steps = int(f[3])
            elif f[0] == "step":
                if case is None or want_top:
                    raise VectorFormatError(f"{where}: unexpected 'step'")
                if len(f) != 4:
                    raise VectorFormatError(f"{where}: expected 'step <index> <hex> <top-count>'")
                step = VectorStep(index=int(f[1]), selected=_hex_bytes(f[2], where))
                want_top = int(f[3])
                case.steps.append(step)
            elif f[0] == "top":
                if step is None or want_top <= 0 or len(f) != 3:
                    raise VectorFormatError(f"{where}: unexpected 'top'")
                step.top.append(TopEntry(_hex_bytes(f[1], where), float(f[2])))
                want_top -= 1
            elif f[0] == "end":
                if case is None or want_top:
                    raise VectorFormatError(f"{where}: unexpected 'end'")
                if len(case.steps) != declared_steps:
                    raise VectorFormatError(
                        f"{where}: case {case.id} declares {declared_steps} steps, has {len(case.steps)}")
                cases.append(case)
                case, step = None, None
            else:
                raise VectorFormatError(f"{where}: unknown record {f[0]!r}")
        except (ValueError, IndexError) as e:
            if isinstance(e, VectorFormatError):
                raise
            raise VectorFormatError(f"{where}: {e}") from None
    if case is not None:
        raise VectorFormatError(f"{path}: case {case.id} has no 'end' (truncated file?)")
    return cases


def format_vec(cases: list[VectorCase]) -> str:
    out = [VEC_MAGIC,
           "# case <id> <ctx> <steps> <prompt-file>",
           "# step <index> <selected-hex> <top-count>",
           "# top <token-hex> <official-logprob>"]
    for c in cases:
        out.append("")
        out.append(f"case {c.id} {c.ctx} {len(c.steps)} {c.prompt_file}")
        for st in c.steps:
            tops = [t for t in st.top if t.logprob > MISSING_LOGPROB and t.token]
            out.append(f"step {st.index} {st.selected.hex()} {len(tops)}")
            for t in tops:
                out.append(f"top {t.token.hex()} {t.logprob:.9g}")
        out.append("end")
    return "\n".join(out) + "\n"


def write_vec(path: str | os.PathLike, cases: list[VectorCase]) -> None:
    write_text_atomic(path, format_vec(cases))


# ----------------------------------------------------------------------------------------------
# A whole vector directory


@dataclass
class VectorSet:
    root: Path
    manifest: Manifest
    cases: list[VectorCase]  # in manifest order, prompts loaded


def load_vector_dir(root: str | os.PathLike, ctx_from_vec: bool = True) -> VectorSet:
    """Read manifest + official JSONs + prompt texts; the per-case ctx comes from official.vec
    (the manifest does not record it) when present, else a default by kind."""
    root = Path(root)
    if not root.is_dir():
        raise VectorFormatError(f"{root}: not a directory")
    man_path = root / "manifest.json"
    if not man_path.exists():
        raise VectorFormatError(f"{root}: no manifest.json")
    manifest = read_manifest(man_path)
    vec_ctx: dict[str, int] = {}
    vec_path = root / "official.vec"
    if ctx_from_vec and vec_path.exists():
        vec_ctx = {c.id: c.ctx for c in read_vec(vec_path)}
    cases = []
    for p in manifest.prompts:
        off_path = root / p.official_file
        prompt_path = root / p.prompt_file
        if not off_path.exists():
            raise VectorFormatError(f"{off_path}: missing (listed in {man_path})")
        if not prompt_path.exists():
            raise VectorFormatError(f"{prompt_path}: missing (listed in {man_path})")
        data = read_official(off_path)
        ctx = vec_ctx.get(p.id, 16384 if p.kind == "long" else 4096)
        case = case_from_official(data, ctx, p.prompt_file, where=str(off_path))
        case.kind = p.kind
        case.prompt = prompt_path.read_text(encoding="utf-8")
        if len(case.steps) != p.steps:
            raise VectorFormatError(f"{off_path}: {len(case.steps)} steps, manifest says {p.steps}")
        cases.append(case)
    return VectorSet(root=root, manifest=manifest, cases=cases)
