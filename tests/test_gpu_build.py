"""The CUDA extension's build inputs and its behaviour where it cannot run (no GPU needed)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ds4.engine import gpu

GPU_DIR = Path(__file__).resolve().parent.parent / "engine" / "gpu"


def test_iq2_grid_table_matches_the_reference_quantizer() -> None:
    sys.path.insert(0, str(GPU_DIR))
    try:
        import gen_tables
    finally:
        sys.path.pop(0)
    assert (GPU_DIR / "iq2_tables.inc").read_text() == gen_tables.render(), "run engine/gpu/gen_tables.py"
    # spot-check against the gguf package's independent decoder table
    import gguf.quants as gq
    import numpy as np

    gq.IQ2_XXS.init_grid()
    grid = np.asarray(gq.IQ2_XXS.grid).reshape(256, 8).astype(np.uint8)
    words = gen_tables.grid_words()
    for n in (0, 1, 77, 255):
        assert words[n] == int.from_bytes(grid[n].tobytes(), "little")


def test_import_reports_why_it_cannot_run() -> None:
    if gpu.available():
        pytest.skip("a GPU is available here")
    reason = gpu.unavailable_reason()
    assert reason and ("make cuda" in reason or "CUDA" in reason)
    with pytest.raises(gpu.GpuUnavailable, match="CUDA|make cuda"):
        gpu.matvec_host(None, None)
    with pytest.raises(gpu.GpuUnavailable):
        gpu.Array  # noqa: B018 - attribute access loads the extension


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_extension_compiles_without_a_gpu() -> None:
    res = subprocess.run([sys.executable, str(GPU_DIR / "build.py")], capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr
    assert list(GPU_DIR.glob("_ext*.so"))


@pytest.mark.skipif(not (shutil.which("cc") and shutil.which("nm")), reason="needs a C compiler and nm")
def test_build_finds_undefined_own_symbols(tmp_path) -> None:
    """build.py's check after the link: a module that calls a ds4gpu function no object defines (v25: one left in an
    anonymous namespace only failed at import on the device) is named; a complete one passes."""
    sys.path.insert(0, str(GPU_DIR))
    try:
        import build
    finally:
        sys.path.pop(0)
    for name, body, want in (("bad", "void _ZN6ds4gpu3fooEi(int); void f(void) { _ZN6ds4gpu3fooEi(1); }",
                              ["_ZN6ds4gpu3fooEi"]),
                             ("good", "void _ZN6ds4gpu3fooEi(int x) { (void)x; } void f(void) { _ZN6ds4gpu3fooEi(1); }",
                              [])):
        src, lib = tmp_path / f"{name}.c", tmp_path / f"{name}.so"
        src.write_text(body + "\n")
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
        assert build.undefined_own_symbols(lib) == want


def test_build_switches_become_defines_and_bad_values_stop_the_build() -> None:
    """$DS4_GPU_L2_EVICT_FIRST at build time: unset builds the default (1), 0 or 1 that value; anything else is refused
    with a message naming the variable (never a build of an unintended variant)."""
    sys.path.insert(0, str(GPU_DIR))
    try:
        import build
    finally:
        sys.path.pop(0)
    assert build.build_defines({}) == ["-DDS4_L2_EVICT_FIRST=1"]
    assert build.build_defines({"DS4_GPU_L2_EVICT_FIRST": "0"}) == ["-DDS4_L2_EVICT_FIRST=0"]
    assert build.build_defines({"DS4_GPU_L2_EVICT_FIRST": " 1 "}) == ["-DDS4_L2_EVICT_FIRST=1"]
    for bad in ("yes", "2", "-1"):
        with pytest.raises(SystemExit, match="DS4_GPU_L2_EVICT_FIRST"):
            build.build_defines({"DS4_GPU_L2_EVICT_FIRST": bad})
    # every define named there is read by the sources, whose own default (a compile without build.py) is build.py's
    common = (GPU_DIR / "common.cuh").read_text()
    for define, default in build.BUILD_SWITCHES.values():
        assert f"#ifndef {define}\n#define {define} {default}\n#endif" in common


def test_the_module_reports_the_switches_it_was_built_with() -> None:
    """The built module's l2_evict_first() is the define build.py stamped for the objects it linked."""
    import importlib

    stamp = GPU_DIR / "build" / "arch.txt"
    if not stamp.exists() or not list(GPU_DIR.glob("_ext*.so")):
        pytest.skip("the extension is not built here")
    try:
        ext = importlib.import_module("ds4.engine.gpu._ext")
    except ImportError as e:  # a module built elsewhere or for another Python
        pytest.skip(f"the built module does not import here: {e}")
    if not hasattr(ext, "l2_evict_first"):
        pytest.skip("the built module predates the build switches: run make cuda")
    assert ext.l2_evict_first() == ("-DDS4_L2_EVICT_FIRST=1" in stamp.read_text().split())
