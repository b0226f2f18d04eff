"""Every console script declared in pyproject.toml: `--help` works and exits 0, and a user mistake
(missing or foreign file, malformed JSON) gives one line on stderr and exit code 2, no traceback.

Each tool runs in a subprocess exactly as its installed entry point would (`main()` with sys.argv
set), so a script added to pyproject.toml is covered without editing this file.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from ds4_tool_util import REPO

SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def run_script(name: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    module, func = SCRIPTS[name].split(":")
    code = (f"import sys; from {module} import {func} as main; "
            f"sys.argv = [{name!r}] + sys.argv[1:]; sys.exit(main())")
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_exits_zero(name):
    r = run_script(name, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: ") and "Traceback" not in r.stderr


def _bad_files(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"garbage\n")
    (tmp_path / "junk.jsonl").write_text("not json\n")
    (tmp_path / "junk.tsv").write_text("a\tb\n1\t2\n")
    return tmp_path


# (script, arguments with {d} = a folder holding junk.gguf / junk.jsonl / junk.tsv, part of the message)
MISTAKES = [
    ("ds4", ["-m", "{d}/missing.gguf", "-p", "hi"], "missing.gguf"),
    ("ds4", ["-m", "{d}/junk.gguf", "-p", "hi"], "junk.gguf"),
    ("ds4-quantize", ["info", "{d}/missing.gguf"], "missing.gguf"),
    ("ds4-quantize", ["info", "{d}/junk.gguf"], "truncated"),
    ("ds4-imatrix", ["stats", "{d}/missing.dat"], "missing.dat"),
    ("ds4-imatrix", ["build-dataset", "{d}/junk.jsonl", "-o", "{d}/out.txt"], "malformed JSON"),
    ("ds4-quality", ["diff", "{d}/missing.tsv", "{d}/junk.tsv"], "missing.tsv"),
    ("ds4-quality", ["diff", "{d}/junk.tsv", "{d}/junk.tsv"], "not a score file"),
    ("ds4-quality", ["kld", "{d}/junk.gguf", "{d}/junk.gguf"], "junk.gguf"),
    ("ds4-vectors", ["--vectors", "{d}/missing"], "missing"),
    ("ds4-eval", ["--questions-file", "{d}/junk.jsonl"], "malformed JSON"),
    ("ds4-bench", ["compare", "{d}/missing.csv", "{d}/junk.tsv"], "missing.csv"),
    ("ds4-bench", ["plot", "{d}/junk.tsv"], "not a ds4-bench CSV"),
    ("ds4-steer", ["info", "{d}/missing.f32"], "missing.f32"),
    ("ds4-server", ["-m", "{d}/missing.gguf"], "missing.gguf"),
    ("ds4-dist", ["-m", "{d}/missing.gguf"], "missing.gguf"),
]


@pytest.mark.parametrize("name,args,needle", MISTAKES, ids=[f"{m[0]}-{i}" for i, m in enumerate(MISTAKES)])
def test_user_mistake_is_one_line_and_exit_2(name, args, needle, tmp_path):
    d = _bad_files(tmp_path)
    r = run_script(name, *[a.format(d=d) for a in args])
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{name}: ") and needle in lines[0], r.stderr


def test_every_script_has_a_mistake_case():
    assert {m[0] for m in MISTAKES} >= set(SCRIPTS)
