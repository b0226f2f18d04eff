"""engine/gpu/device_site.py: the device scripts' way to import ds4 from the working tree (no
install) builds a package tree that a fresh interpreter imports from, again and again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_site_tree_imports_ds4_from_the_working_tree(tmp_path):
    script = ROOT / "engine" / "gpu" / "device_site.py"
    for _ in range(2):  # a second run keeps the links it finds
        subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=ROOT, check=True)
    pkg = tmp_path / "ds4"
    assert os.path.realpath(pkg / "engine") == str(ROOT / "engine")
    assert os.path.realpath(pkg / "paths.py") == str(ROOT / "ds4pkg" / "paths.py")
    code = "import ds4, ds4.engine.config as c, ds4.gguf_tools.constants; print(c.__file__)"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout.strip()
    assert out == str(pkg / "engine" / "config.py")


def test_site_needs_a_target():
    r = subprocess.run([sys.executable, str(ROOT / "engine" / "gpu" / "device_site.py")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "usage" in r.stderr
