"""`python -m ds4.engine.gpu.sass_loops`: loops read off SASS text (a listing in cuobjdump's format written here), the
CLI's errors, and, where cuobjdump and a built object exist, a real kernel's loops."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ds4.engine.gpu.sass_loops as sass_loops

LISTING = """
	code for sm_90a
		Function : _Z6kernelPf
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
        /*0010*/                   MOV R2, RZ ;                            /* 0x000000ff00027202 */
        /*0020*/                   IDP.4A.S8.S8 R3, R4, R5, R3 ;           /* 0x0000000504037226 */
        /*0030*/                   LOP3.LUT R6, R6, 0xff, RZ, 0xc0, !PT ;  /* 0x000000ff06067812 */
        /*0040*/                   IDP.4A.S8.S8 R3, R4, R6, R3 ;           /* 0x0000000604037226 */
        /*0050*/               @P0 BRA 0x20 ;                              /* 0xfffffffc00000947 */
        /*0060*/                   FADD R7, R7, R3 ;                       /* 0x0000000307077221 */
        /*0070*/              @!P1 BRA 0x10 ;                              /* 0xfffffffc00009947 */
        /*0080*/                   EXIT ;                                  /* 0x000000000000794d */
        /*0090*/                   BRA 0x90;                               /* 0xfffffff000007947 */
		Function : _Z5otherv
        /*0000*/                   EXIT ;                                  /* 0x000000000000794d */
"""


def test_loops_are_the_backward_branches_innermost_first() -> None:
    funcs = sass_loops.parse_functions(LISTING)
    assert list(funcs) == ["_Z6kernelPf", "_Z5otherv"]
    loops = sass_loops.loops_of(funcs["_Z6kernelPf"])
    assert [(lp.start, lp.end, len(lp.ops)) for lp in loops] == [(0x20, 0x50, 4), (0x10, 0x70, 7)]
    assert loops[0].histogram(2) == [("IDP.4A.S8.S8", 2), ("LOP3.LUT", 1)]
    assert sass_loops.loops_of(funcs["_Z5otherv"]) == []


def _fake_cuobjdump(tmp_path: Path) -> Path:
    """An executable that prints LISTING as cuobjdump -sass would (cuobjdump itself is not on the CI machines)."""
    listing = tmp_path / "listing.txt"
    listing.write_text(LISTING)
    tool = tmp_path / "cuobjdump"
    tool.write_text(f"#!/bin/sh\ncat {listing}\n")
    tool.chmod(0o755)
    return tool


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds4.engine.gpu.sass_loops", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_prints_each_matching_kernels_loops(tmp_path) -> None:
    r = _run("any.o", "--kernel", "kernel", "--cuobjdump", str(_fake_cuobjdump(tmp_path)))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "_Z6kernelPf: 10 instructions"
    assert lines[1].startswith("  loop 0x20..0x50: 4 instructions: IDP.4A.S8.S8 2")
    assert "_Z5otherv" not in r.stdout
    only = _run("any.o", "--kernel", "kernel", "--with", "FADD", "--cuobjdump", str(_fake_cuobjdump(tmp_path)))
    assert [ln for ln in only.stdout.splitlines() if "loop" in ln] == [
        "  loop 0x10..0x70: 7 instructions: IDP.4A.S8.S8 2, BRA 2, MOV 1, LOP3.LUT 1, FADD 1"]


@pytest.mark.parametrize("args,msg", [(("--kernel", "nothing_like_this"), "no kernel"), (("--kernel", "("), "regex"),
                                      (("--top", "0"), "positive")])
def test_cli_errors_are_one_line_exit_2(tmp_path, args, msg) -> None:
    r = _run("any.o", *args, "--cuobjdump", str(_fake_cuobjdump(tmp_path)))
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr


def test_missing_cuobjdump_says_how_to_get_it(tmp_path) -> None:
    r = _run("any.o", "--cuobjdump", str(tmp_path / "no-such-tool"))
    assert r.returncode == 2 and "nvidia-cuda-cuobjdump" in r.stderr


OBJ = Path(__file__).resolve().parents[1] / "engine" / "gpu" / "build" / "moe.cu.o"


@pytest.mark.skipif(sass_loops.find_cuobjdump(os.environ.get("CUOBJDUMP")) is None or not OBJ.exists(),
                    reason="needs cuobjdump and a built engine/gpu (make cuda)")
def test_real_gateup_kernel_has_an_idp_loop() -> None:
    r = _run(str(OBJ), "--kernel", "moe_gateup_rows_kernel", "--with", "IDP", *(["--cuobjdump", os.environ["CUOBJDUMP"]]
                                                              if os.environ.get("CUOBJDUMP") else []))
    assert r.returncode == 0, r.stderr
    assert "IDP.4A" in r.stdout
