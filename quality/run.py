"""The engine-facing half of ds4-quality: collect continuations, score them, run KLD chunks.

Data layout of a continuation set (tooling-spec §4.2, as collect_official.py writes it):
    DIR/manifest.tsv               "# id\tprompt_file\tcontinuation_file\tresponse_file", one row per case
    DIR/prompts/case_NNN.txt       the prompt
    DIR/continuations/case_NNN.txt the reference continuation (official API, or a local base model)
Paths in the manifest are taken relative to the manifest's directory, else to the working directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds4.engine import power
from ds4.test_vectors.formats import write_text_atomic
from ds4.test_vectors.runtime import ToolError, eos_id, open_session, render_nothink

from .kld import KldAccumulator, LogitsWriter, SavedLogits
from .metrics import CaseScore, TeacherForcedScorer, log_softmax

MANIFEST_HEADER = "# id\tprompt_file\tcontinuation_file\tresponse_file"


@dataclass
class QualityCase:
    id: str
    prompt: str
    continuation: str


def read_prompts_jsonl(path: str | os.PathLike) -> list[tuple[str, str]]:
    """(case id by position, prompt) from prompts.jsonl; ids in the file are not used (§4.2)."""
    out = []
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ToolError(f"{path}: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            prompt = rec["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ToolError(f"{path}:{n}: expected a JSON object with a 'prompt'") from None
        out.append((f"case_{len(out):03d}", str(prompt)))
    return out


def _resolve(base: Path, rel: str) -> Path:
    p = Path(rel)
    if p.is_absolute():
        return p
    for cand in (base / p, Path.cwd() / p, base / p.name):
        if cand.exists():
            return cand
    return base / p


def read_manifest_tsv(path: str | os.PathLike) -> list[QualityCase]:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ToolError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ToolError(f"{path}: not UTF-8 text") from None
    cases = []
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("#"):
            continue
        f = line.split("\t")
        if len(f) < 3:
            raise ToolError(f"{path}:{n}: expected id, prompt_file, continuation_file (tab-separated)")
        pf, cf = _resolve(path.parent, f[1]), _resolve(path.parent, f[2])
        try:
            cases.append(QualityCase(f[0], pf.read_text(encoding="utf-8"), cf.read_text(encoding="utf-8")))
        except OSError as e:
            raise ToolError(f"{path}:{n}: {e.filename}: {e.strerror}") from None
    if not cases:
        raise ToolError(f"{path}: no cases")
    return cases


def write_collection(out_dir: str | os.PathLike, items: list[tuple[str, str, str, dict]]) -> None:
    """items: (id, prompt, continuation, response-json)."""
    out = Path(out_dir)
    rows = [MANIFEST_HEADER]
    for cid, prompt, cont, resp in items:
        pf, cf, rf = f"prompts/{cid}.txt", f"continuations/{cid}.txt", f"responses/{cid}.json"
        write_text_atomic(out / pf, prompt)
        write_text_atomic(out / cf, cont)
        write_text_atomic(out / rf, json.dumps(resp, indent=2, ensure_ascii=False) + "\n")
        rows.append(f"{cid}\t{pf}\t{cf}\t{rf}")
    write_text_atomic(out / "manifest.tsv", "\n".join(rows) + "\n")


def greedy_continuation(model, prompt: str, max_tokens: int, ctx: int, backend: str = "cpu") -> tuple[str, list[int]]:
    """The local stand-in for the official API: greedy, thinking disabled, stop at EOS."""
    tok = model.tokenizer
    ids = render_nothink(tok, prompt)
    if len(ids) + max_tokens + 1 >= ctx:
        raise ToolError(f"prompt of {len(ids)} tokens does not fit ctx {ctx}")
    eos = eos_id(model)
    sess = open_session(model, ctx, backend)
    logits = np.asarray(sess.sync(ids))
    out: list[int] = []
    for _ in range(max_tokens):
        t = int(np.argmax(logits))
        if t == eos:
            break
        out.append(t)
        if len(out) < max_tokens:
            logits = np.asarray(sess.decode(t))
        power.step()
    return tok.decode(out).decode("utf-8", errors="replace"), out


def score_case(model, case: QualityCase, ctx: int, backend: str = "cpu") -> tuple[CaseScore, list[float]]:
    """Teacher-forced scoring of one case (§4.3)."""
    tok = model.tokenizer
    prompt_ids = render_nothink(tok, case.prompt)
    target = tok.encode(case.continuation)
    if not target:
        return CaseScore(case.id, len(prompt_ids), 0, 0.0, 0, 0), []
    if len(prompt_ids) + len(target) + 1 >= ctx:
        raise ToolError(f"{case.id}: {len(prompt_ids)} prompt + {len(target)} target tokens do not fit ctx {ctx}")
    sess = open_session(model, ctx, backend)
    rows = all_position_logits(sess, prompt_ids, target)
    sc = TeacherForcedScorer()
    for row, t in zip(rows, target):
        sc.step(row, t)
    return sc.result(case.id, len(prompt_ids)), sc.token_nll


def all_position_logits(sess, prefix: list[int], continuation: list[int]) -> list[np.ndarray]:
    """The logits predicting continuation[0], continuation[1], …: after the prefix, then after each
    fed continuation token (the last one is not fed). One batched prefill with every position's
    logits when the session offers it, else token by token."""
    logits = np.asarray(sess.sync(list(prefix)))
    power.step()
    rows = [logits]
    rest = [int(t) for t in continuation[:-1]]
    if not rest:
        return rows
    try:
        more = sess.prefill(rest, all_logits=True)
    except TypeError:  # a session without all-logits prefill
        more = []
        for t in rest:
            more.append(np.asarray(sess.decode(t)))
            power.step()
    rows.extend(np.asarray(r) for r in more)
    return rows


# ----------------------------------------------------------------------------------------------
# Collect from an OpenAI-compatible endpoint (collect_official.py's request, any server)


def api_continuation(client, model_name: str, prompt: str, max_tokens: int, attempts: int = 6,
                     sleep=None) -> dict:
    """One chat completion as collect_official.py asks for it (greedy, thinking disabled, top-5
    logprobs); retries 429 / 5xx / connection errors with 1 s × 1.7^k pauses, fails at once on
    other 4xx. Returns the full response as a dict."""
    import time

    import openai

    sleep = sleep or time.sleep
    last: Exception | None = None
    for k in range(attempts):
        try:
            resp = client.chat.completions.create(
                model=model_name, messages=[{"role": "user", "content": prompt}], temperature=0,
                max_tokens=max_tokens, logprobs=True, top_logprobs=5, stream=False,
                extra_body={"thinking": {"type": "disabled"}})
            return resp.model_dump()
        except openai.APIStatusError as e:
            if 400 <= e.status_code < 500 and e.status_code != 429:
                raise ToolError(f"the endpoint refused the request: HTTP {e.status_code} {e.message}") from None
            last = e
        except openai.APIConnectionError as e:
            last = e
        if k + 1 < attempts:
            sleep(1.0 * 1.7 ** k)
    raise ToolError(f"the endpoint failed {attempts} times: {type(last).__name__}: {last}")


# ----------------------------------------------------------------------------------------------
# KLD


def text_chunks(tok, text: str, ctx: int, n_chunks: int | None) -> np.ndarray:
    """[n, ctx] token chunks: BOS + ctx-1 consecutive tokens of the text each. Only as much text as
    needed is tokenized (BPE of a whole novel in Python takes a while)."""
    from ds4.gguf_tools.constants import BOS_TEXT
    from ds4.test_vectors.runtime import special_id

    bos = special_id(tok, BOS_TEXT)
    per = ctx - 1
    want = None if n_chunks is None else n_chunks * per
    n_chars = len(text) if want is None else min(len(text), want * 6 + 1024)
    while True:
        ids = tok.encode(text[:n_chars])
        if want is None or len(ids) >= want or n_chars >= len(text):
            break
        n_chars = min(len(text), n_chars * 2)
    have = len(ids) // per
    if have == 0:
        raise ToolError(f"the text has {len(ids)} tokens, fewer than one chunk of {per}")
    n = have if n_chunks is None else min(n_chunks, have)
    arr = np.asarray(ids[: n * per], dtype=np.int64).reshape(n, per)
    return np.concatenate([np.full((n, 1), bos, dtype=np.int64), arr], axis=1)


def chunk_logprobs(model, chunk: np.ndarray, score_start: int, backend: str = "cpu") -> np.ndarray:
    """Log-probs [ctx-1-score_start, V] at positions score_start … ctx-2 of one chunk (fresh session)."""
    ctx = len(chunk)
    sess = open_session(model, ctx + 1, backend)
    rows = all_position_logits(sess, list(chunk[: score_start + 1]), list(chunk[score_start + 1:]))
    return np.stack([log_softmax(r) for r in rows])


def run_kld(base_model, test_model, chunks: np.ndarray, score_start: int, backend: str = "cpu",
            saved: SavedLogits | None = None, save: LogitsWriter | None = None, progress=None) -> KldAccumulator | None:
    """Compare per chunk; any of (base_model | saved) gives the base, test_model may be None when
    only saving base logits."""
    acc = KldAccumulator() if test_model is not None else None
    for i, chunk in enumerate(chunks):
        if saved is not None:
            base_lp = saved.chunk_logprobs(i)
        else:
            base_lp = chunk_logprobs(base_model, chunk, score_start, backend)
        if save is not None:
            save.add_chunk(chunk, base_lp)
        if acc is not None:
            test_lp = chunk_logprobs(test_model, chunk, score_start, backend)
            acc.add(base_lp, test_lp, chunk[score_start + 1:], test_is_logits=False)
        if progress is not None:
            progress(i)
    return acc
