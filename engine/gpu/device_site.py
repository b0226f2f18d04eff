"""Make `ds4` importable from the working tree without installing it (the device scripts' setup).

    python3 engine/gpu/device_site.py /tmp/site      # then PYTHONPATH=/tmp/site

Builds TARGET/ds4 from pyproject's package-dir: links to the files of the root package and one
link per top-level subpackage folder (ds4.engine -> engine/, ...). Run from the repository root.
Existing entries are kept, so it can run again."""

from __future__ import annotations

import os
import sys
import tomllib


def build_site(target: str, root: str = ".") -> str:
    root = os.path.abspath(root)
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    pkg = os.path.join(target, "ds4")
    os.makedirs(pkg, exist_ok=True)
    base = os.path.join(root, dirs["ds4"])
    for name in os.listdir(base):
        if name.endswith(".py") and not os.path.exists(os.path.join(pkg, name)):
            os.symlink(os.path.join(base, name), os.path.join(pkg, name))
    for name, folder in dirs.items():
        parts = name.split(".")
        if len(parts) == 2 and not os.path.exists(os.path.join(pkg, parts[1])):
            os.symlink(os.path.join(root, folder), os.path.join(pkg, parts[1]))
    return pkg


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 engine/gpu/device_site.py TARGET_DIR")
    build_site(sys.argv[1])
