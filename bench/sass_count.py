"""SASS instructions per element of the quantize / dequantize kernels, without a GPU.

A kernel moving 3 bytes per element (bf16 in, 8-bit codes out) stays
bandwidth-bound on an H100 only under roughly 20 instructions per element
(about 30 T thread-instructions/s against 1.1 T elements/s at 3.3 TB/s, at
the issue rates a real kernel reaches). This compiles csrc/cuda/quantize.cu
for sm_90 with EFFMEM_SASS_COMMON_PATH (the branches for rare groups compile
away, so a kernel's static count is its common path's dynamic count per
thread), disassembles it with cuobjdump (shipped in torch's triton wheel) and
divides each kernel's instruction count by the elements a thread owns.

    python bench/sass_count.py [--arch sm_90] [--json bench/results/sass_quantize.json]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def elements_per_thread() -> int:
    """kQuantPerThread, read from the kernel header."""
    with open(os.path.join(ROOT, "csrc", "cuda", "quantize_kernel.cuh")) as f:
        return int(re.search(r"constexpr int kQuantPerThread = (\d+);", f.read()).group(1))


def find_nvcc() -> Optional[str]:
    home = os.environ.get("CUDA_HOME")
    candidates = [os.path.join(home, "bin", "nvcc")] if home else []
    candidates += ["/usr/local/cuda/bin/nvcc", shutil.which("nvcc") or ""]
    return next((c for c in candidates if c and os.path.exists(c)), None)


def find_cuobjdump() -> Optional[str]:
    try:
        import triton
        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    nvcc = find_nvcc()
    local = os.path.join(os.path.dirname(nvcc), "cuobjdump") if nvcc else ""
    return local if os.path.exists(local) else shutil.which("cuobjdump")


def compile_cubin(arch: str, out: str, source: str = "csrc/cuda/quantize.cu") -> None:
    import sysconfig

    from torch.utils.cpp_extension import include_paths
    import torch

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [find_nvcc(), "-cubin", f"-arch={arch}", "-O3", "-DNDEBUG", "-std=c++20", "--fmad=false",
           "--expt-relaxed-constexpr", "-DEFFMEM_WITH_CUDA", "-DEFFMEM_SASS_COMMON_PATH",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I" + os.path.join(ROOT, "csrc"),
           "-isystem", sysconfig.get_paths()["include"]]
    cmd += ["-I" + p for p in include_paths()]
    cmd += [os.path.join(ROOT, source), "-o", out]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _parse(listing: List[str]):
    """(address, text) of each instruction of one kernel."""
    out = []
    for line in listing:
        m = re.match(r"^\s+/\*([0-9a-f]{4,})\*/\s+(\S.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def longest_path(instrs) -> int:
    """Instructions on the longest path from the kernel's entry to an EXIT.

    Code reached only by CALL (the IEEE division's slow path) is left out; a
    loop would make the count meaningless, so one raises. The kernels run one
    branch of each if (the stochastic or the round-to-nearest element loop, a
    full or an empty chunk), so the longest path bounds the common path."""
    index = {addr: i for i, (addr, _) in enumerate(instrs)}

    def target(text):
        found = re.findall(r"0x[0-9a-f]+", text)
        return index.get(int(found[-1], 16)) if found else None

    best = {}
    # Kernels branch only forward once loops are unrolled: relax edges in address order.
    best[0] = 0
    longest = 0
    for i, (addr, text) in enumerate(instrs):
        if i not in best:
            continue
        here = best[i] + (0 if text == "NOP" else 1)
        op = text.split()[1] if text.startswith("@") else text.split()[0]
        guarded = text.startswith("@")
        if op.startswith("EXIT"):
            longest = max(longest, here)
            if not guarded:
                continue
        if op.startswith("BRA"):
            t = target(text)
            if t is None:
                raise ValueError(f"unresolved branch: {text}")
            if t <= i:
                if t == i and not guarded:
                    continue  # the branch-to-self after the last EXIT
                raise ValueError(f"a loop in the kernel ({hex(addr)}: {text}); unroll it to count")
            best[t] = max(best.get(t, 0), here)
            # "@P0 BRA", or "BRA P1, target" (a predicate operand): either may fall through
            if not guarded and not re.match(r"!?P\d", text.split(op, 1)[1].strip()):
                continue
        if op.startswith("RET"):
            continue
        if i + 1 < len(instrs):
            best[i + 1] = max(best.get(i + 1, 0), here)
    return longest


def count_instructions(sass: str) -> Dict[str, int]:
    """Kernel (mangled name) -> instructions on its longest path."""
    kernels: Dict[str, List[str]] = {}
    name = None
    for line in sass.splitlines():
        if "Function :" in line:
            name = line.split("Function :", 1)[1].strip()
            kernels[name] = []
        elif name is not None:
            kernels[name].append(line)
    return {k: longest_path(_parse(v)) for k, v in kernels.items()}


def describe(mangled: str) -> Optional[dict]:
    """quantize_kernel<bf16_t, 8, true> -> {"kernel": "quantize", "dtype": "bf16", "bits": 8, "vector": True,
    "path": "groups"}; dequantize_flat_kernel<bf16_t, 8> (whole groups, split by stores) -> path "flat", vector."""
    m = re.search(r"(de)?quantize_(flat_)?kernelI(f|NS_5f16_tE|NS_6bf16_tE)Li(\d)E(?:Lb(\d)E)?(?:Li(\d+)E)?",
                  mangled)
    if m is None:
        return None
    dtype = {"f": "fp32", "NS_5f16_tE": "fp16", "NS_6bf16_tE": "bf16"}[m.group(3)]
    flat = m.group(2) is not None
    return {"kernel": "dequantize" if m.group(1) else "quantize", "dtype": dtype, "bits": int(m.group(4)),
            "vector": flat or m.group(5) == "1", "path": "flat" if flat else "groups",
            "per_thread": int(m.group(6)) if m.group(6) else elements_per_thread()}


def measure(arch: str = "sm_90") -> List[dict]:
    if find_nvcc() is None or find_cuobjdump() is None:
        raise RuntimeError("needs nvcc (CUDA_HOME or /usr/local/cuda) and cuobjdump (torch's triton wheel)")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "quantize.cubin")
        compile_cubin(arch, cubin)
        sass = subprocess.run([find_cuobjdump(), "-sass", cubin], check=True, capture_output=True,
                              text=True).stdout
    rows = []
    for mangled, n in count_instructions(sass).items():
        info = describe(mangled)
        if info is not None:
            rows.append({**info, "instructions": n, "per_element": round(n / info["per_thread"], 2)})
    return sorted(rows, key=lambda r: (r["kernel"], r["dtype"], r["bits"], r["vector"], r["path"], r["per_thread"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    try:
        rows = measure(args.arch)
    except subprocess.CalledProcessError as e:   # nvcc's or cuobjdump's own reason, not a traceback
        why = (e.stderr or "").strip().splitlines()
        ap.error(f"--arch {args.arch}: {os.path.basename(e.cmd[0])} failed: {why[-1] if why else e}")
    except RuntimeError as e:
        ap.error(str(e))
    print(f"{'kernel':<11}{'dtype':<6}{'bits':>5}{'path':>8}{'values':>7}{'instr/thread':>14}{'instr/element':>15}")
    for r in rows:
        path = ("flat" if r["path"] == "flat" else "16-byte") if r["vector"] else "scalar"
        print(f"{r['kernel']:<11}{r['dtype']:<6}{r['bits']:>5}{path:>8}{r['per_thread']:>7}{r['instructions']:>14}"
              f"{r['per_element']:>15}")
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from common import git_commit
        import torch
        payload = {"arch": args.arch, "torch": torch.__version__, **git_commit(),
                   "note": "instructions on the longest path of the common-path build (EFFMEM_SASS_COMMON_PATH) "
                           "/ the elements a thread takes (per_thread)",
                   "rows": rows}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
