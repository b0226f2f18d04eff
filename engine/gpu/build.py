"""Build the CUDA extension ds4.engine.gpu._ext (run by `make cuda`).

Compiles each .cu with nvcc for CUDA_ARCH (default sm_90a; a comma list is allowed), the binding files
(bindings.cpp, the module, bindings_fused.cpp and bindings_prefill.cpp; also through nvcc, so one host compiler builds everything)
against pybind11 and Python, and links them
with the shared CUDA runtime (rpath to the toolkit) into
engine/gpu/_ext<EXT_SUFFIX>. No GPU is needed to build. Objects go to engine/gpu/build/ and are
rebuilt when a source or header is newer.

    python engine/gpu/build.py [--arch sm_90a] [--jobs N] [--verbose]

Build switches (environment, 0 or 1; a change rebuilds everything): DS4_GPU_L2_EVICT_FIRST (default 1: decode's weight
streams with L2's evict_first policy; 0 the v41 kernels).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD = HERE / "build"
CU_SOURCES = ["repack.cu", "matvec.cu", "matvec_stream.cu", "matvec_tma.cu", "matvec_chain.cu", "moe.cu", "moe_mma.cu", "fused.cu", "attn_decode.cu", "hc.cu", "hc_cluster.cu", "hc_mix.cu", "topk.cu", "dequant.cu", "router.cu", "attn_prefill.cu", "attn_prefill_bf16.cu", "mmq.cu", "mmf.cu", "mmw.cu", "barrier.cu", "indexer.cu", "read_stream.cu", "compress_prefill.cu", "step_edges.cu"]
CPP_SOURCES = ["bindings.cpp", "bindings_fused.cpp", "bindings_prefill.cpp"]  # the module (host code, pybind11)
HEADERS = ["common.cuh", "mbarrier.cuh", "mv_core.cuh", "mv_stream.cuh", "block_ops.cuh", "iq2_tables.inc", "moe_mma.cuh", "router.cuh", "grid_barrier.cuh", "mma_ops.cuh", "attn_prefill.cuh"]


def find_cuda() -> Path:
    """The CUDA install: $CUDA_HOME, else the folder above nvcc on PATH, else /usr/local/cuda.

    A candidate counts only if it has bin/nvcc and include/cuda_runtime.h (nvcc on PATH may be a
    wrapper script outside the toolkit)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    candidates += ["/usr/local/cuda", *sorted(map(str, Path("/usr/local").glob("cuda-*")), reverse=True)]
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").exists() and (Path(c) / "include" / "cuda_runtime.h").exists():
            return Path(c)
    raise SystemExit("build.py: no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)")


def gencode_flags(arch: str) -> list[str]:
    """sm_90a -> -gencode=arch=compute_90a,code=[sm_90a,compute_90a] (PTX kept for newer GPUs)."""
    flags = []
    for a in arch.split(","):
        a = a.strip()
        if not a.startswith("sm_"):
            raise SystemExit(f"build.py: CUDA_ARCH entries look like sm_90a, got {a!r}")
        num = a[3:]
        flags.append(f"-gencode=arch=compute_{num},code=[sm_{num},compute_{num}]")
    return flags


def stale(obj: Path, deps: list[Path]) -> bool:
    return not obj.exists() or any(d.stat().st_mtime > obj.stat().st_mtime for d in deps)


def run(cmd: list[str], verbose: bool) -> None:
    if verbose:
        print(" ".join(cmd), flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stderr.write(res.stdout + res.stderr)
        raise SystemExit(f"build.py: command failed: {' '.join(cmd[:2])} ... ({res.returncode})")
    out = (res.stdout + res.stderr).strip()
    if out and verbose:
        print(out)


def undefined_own_symbols(lib: Path) -> list[str]:
    """The module's undefined symbols of namespace ds4gpu (nm -D; [] where nm is missing): the dynamic linker would
    only report them when Python imports the module."""
    try:
        res = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True, text=True)
    except OSError:
        return []
    return [ln.split()[-1] for ln in res.stdout.splitlines() if "_ZN6ds4gpu" in ln]


# Build-time switches: environment variable -> (the preprocessor define it sets, its default); values 0 or 1.
BUILD_SWITCHES = {
    # decode's weight loads with L2's evict_first policy (common.cuh kStreamEvictFirst; NOTES v42: +3.1% decode)
    "DS4_GPU_L2_EVICT_FIRST": ("DS4_L2_EVICT_FIRST", "1"),
}


def build_defines(env: dict[str, str] | None = None) -> list[str]:
    """The nvcc -D flags of the build switches: each one's value from env (os.environ by default), else its default."""
    env = os.environ if env is None else env
    flags = []
    for var, (define, default) in BUILD_SWITCHES.items():
        val = env.get(var, "").strip() or default
        if val not in ("0", "1"):
            raise SystemExit(f"build.py: {var}={val!r}: use 0 or 1")
        flags.append(f"-D{define}={val}")
    return flags


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default=os.environ.get("CUDA_ARCH", "sm_90a"), help="CUDA_ARCH, e.g. sm_90a or sm_80,sm_90a")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--verbose", "-v", action="store_true")
    ap.add_argument("--ptxas-info", action="store_true", help="print registers/spills per kernel")
    args = ap.parse_args(argv)

    import pybind11

    cuda = find_cuda()
    nvcc = str(cuda / "bin" / "nvcc")
    defines = build_defines()
    BUILD.mkdir(exist_ok=True)
    arch_stamp = BUILD / "arch.txt"  # the arch and the defines: a change rebuilds every object
    stamp = " ".join([args.arch, *defines])
    if not arch_stamp.exists() or arch_stamp.read_text() != stamp:
        for o in BUILD.glob("*.o"):
            o.unlink()
        arch_stamp.write_text(stamp)
    headers = [HERE / h for h in HEADERS]
    py_inc = sysconfig.get_paths()["include"]

    jobs = []
    for src in CU_SOURCES:
        obj = BUILD / (src + ".o")
        if stale(obj, [HERE / src, *headers, arch_stamp]):
            cmd = [nvcc, "-std=c++17", "-O3", "-Xcompiler", "-fPIC", *gencode_flags(args.arch), *defines,
                   "-c", str(HERE / src), "-o", str(obj)]
            if args.ptxas_info:
                cmd.insert(3, "-Xptxas=-v")
            jobs.append(cmd)
    bobjs = []
    for src in CPP_SOURCES:
        bobj = BUILD / (src + ".o")
        bobjs.append(bobj)
        if stale(bobj, [HERE / src, HERE / "bindings.h", HERE / "common.cuh", HERE / "moe_mma.cuh", HERE / "router.cuh",
                        arch_stamp]):
            # through nvcc too, so one host compiler builds every object
            jobs.append([nvcc, "-std=c++17", "-O2", "-Xcompiler", "-fPIC,-fvisibility=hidden", *defines,
                         f"-I{pybind11.get_include()}", f"-I{py_inc}", "-c", str(HERE / src), "-o", str(bobj)])
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(lambda c: run(c, args.verbose or args.ptxas_info), jobs))

    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = HERE / f"_ext{suffix}"
    libdir = next((d for d in (cuda / "lib64", cuda / "targets" / "x86_64-linux" / "lib") if d.exists()), cuda / "lib64")
    # shared CUDA runtime found through an rpath to the toolkit that built us
    link = [nvcc, "-shared", "-cudart=shared", "-o", str(target) + ".tmp",
            *[str(BUILD / (s + ".o")) for s in CU_SOURCES], *map(str, bobjs), f"-Xlinker=-rpath,{libdir}"]
    run(link, args.verbose)
    missing = undefined_own_symbols(Path(str(target) + ".tmp"))
    if missing:  # a function the bindings call but no object defines (e.g. left in an anonymous namespace)
        os.unlink(str(target) + ".tmp")
        raise SystemExit(f"build.py: undefined ds4gpu symbols in the module: {', '.join(missing[:5])}")
    os.replace(str(target) + ".tmp", target)
    print(f"built {target.relative_to(HERE.parent.parent)} for {args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
