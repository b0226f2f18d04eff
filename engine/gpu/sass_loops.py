"""`python -m ds4.engine.gpu.sass_loops OBJ --kernel REGEX`: the loops of compiled kernels, read off their SASS.

For each kernel whose (mangled) name matches REGEX, every loop (a backward branch and its target) is printed with its
instruction count and its most frequent opcodes. Why: a kernel bound by instruction issue (the decode gate/up in v16's
ncu) is made faster by fewer instructions in its inner loop, and the histogram says which ones to remove (v21: four
per shared-memory table lookup, 459 -> 398 per step by byte offsets from a uniform base).

OBJ is an object file of engine/gpu/build (e.g. engine/gpu/build/moe.cu.o) or the built extension. cuobjdump comes with
the CUDA toolkit or the `nvidia-cuda-cuobjdump` wheel; --cuobjdump names it where it is not on PATH.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

_FUNC = re.compile(r"^\s*Function : (\S+)")
_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)")


@dataclass
class Loop:
    start: int  # address of the branch target
    end: int    # address of the backward branch
    ops: list[str]

    def histogram(self, top: int) -> list[tuple[str, int]]:
        return Counter(self.ops).most_common(top)


def parse_functions(sass: str) -> dict[str, list[tuple[int, str, str]]]:
    """Function name -> its instructions as (address, opcode, operands)."""
    funcs: dict[str, list[tuple[int, str, str]]] = {}
    cur: list[tuple[int, str, str]] | None = None
    for line in sass.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = _INSN.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return funcs


def loops_of(insns: list[tuple[int, str, str]]) -> list[Loop]:
    """Every backward branch as a loop, innermost (fewest instructions) first."""
    found = []
    for addr, op, args in insns:
        if not op.startswith("BRA"):
            continue
        t = _TARGET.search(args)
        if t and int(t.group(1), 16) < addr:
            start = int(t.group(1), 16)
            found.append(Loop(start, addr, [o for a, o, _ in insns if start <= a <= addr]))
    return sorted(found, key=lambda lp: len(lp.ops))


def find_cuobjdump(given: str | None) -> str | None:
    if given:
        return given if shutil.which(given) else None
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:  # the nvidia-cuda-cuobjdump wheel
        import nvidia  # noqa: F401

        for root in nvidia.__path__:
            for sub in ("cu13/bin/cuobjdump", "cuda_cuobjdump/bin/cuobjdump"):
                cand = f"{root}/{sub}"
                if shutil.which(cand):
                    return cand
    except ImportError:
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("obj", help="object file or shared library with sm_90 code")
    ap.add_argument("--kernel", default=".", help="regex on the mangled kernel names (default: all)")
    ap.add_argument("--top", type=int, default=12, help="opcodes shown per loop")
    ap.add_argument("--loops", type=int, default=4, help="loops shown per kernel, innermost first")
    ap.add_argument("--with", dest="with_op", metavar="OPCODE",
                    help="only loops holding an instruction whose opcode starts so (e.g. IDP, IMMA, HMMA)")
    ap.add_argument("--cuobjdump", help="the cuobjdump binary (default: PATH, then the nvidia-cuda-cuobjdump wheel)")
    args = ap.parse_args(argv)
    try:
        pattern = re.compile(args.kernel)
    except re.error as e:
        print(f"sass_loops: bad --kernel regex: {e}", file=sys.stderr)
        return 2
    if args.top < 1 or args.loops < 1:
        print("sass_loops: --top and --loops must be positive", file=sys.stderr)
        return 2
    tool = find_cuobjdump(args.cuobjdump)
    if tool is None:
        print("sass_loops: cuobjdump not found; install the CUDA toolkit or `pip install nvidia-cuda-cuobjdump`, "
              "or name it with --cuobjdump", file=sys.stderr)
        return 2
    done = subprocess.run([tool, "-sass", args.obj], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"sass_loops: cuobjdump failed on {args.obj}: {done.stderr.strip().splitlines()[-1:] or ['?']}",
              file=sys.stderr)
        return 2
    funcs = {k: v for k, v in parse_functions(done.stdout).items() if pattern.search(k)}
    if not funcs:
        print(f"sass_loops: no kernel in {args.obj} matches {args.kernel!r}", file=sys.stderr)
        return 2
    for name, insns in funcs.items():
        print(f"{name}: {len(insns)} instructions")
        loops = [lp for lp in loops_of(insns) if not args.with_op or any(o.startswith(args.with_op) for o in lp.ops)]
        for lp in loops[:args.loops]:
            hist = ", ".join(f"{op} {n}" for op, n in lp.histogram(args.top))
            print(f"  loop {lp.start:#x}..{lp.end:#x}: {len(lp.ops)} instructions: {hist}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
