"""CUDA kernels run on the host: the flat dequantize kernel (csrc/cuda/dequantize_flat_kernel.cuh) compiled
as ordinary C++ with tests/cuda_emulation/host_shim.h and called once per thread of the launch that
csrc/cuda/quantize.cu makes. Its threads share nothing, so running them one after another gives what the
GPU gives; this checks its indexing (windows, groups, part warps and blocks) and special groups bit for bit
against the CPU kernel on a machine without a GPU, and, built with AddressSanitizer and UBSan, that every
load and store stays inside its tensor and is aligned. (The GPU's bf16/fp16 rounding instruction is
replaced by the portable rounding, which gives the same bits for the finite values it is used for;
tests/test_quantize.py compares the real kernel on a GPU.) The quantize and group-mapped dequantize kernels
combine lanes with warp shuffles and cannot be emulated one thread at a time."""
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from effmem import ops
from conftest import same

HERE = Path(__file__).parent
ROOT = HERE.parent
CODES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# Rows of whole groups and of a multiple of 32 elements (the flat kernel's case): one part warp (7 x 32),
# a part block (3 x 2048: 6,144 of a block's 8,192 values), several blocks (40 x 4096), rows of 5 warps and a
# half (33 x 160, group size 32 only).
SHAPES = [(7, 32), (64, 128), (33, 160), (1, 256), (3, 2048), (40, 4096)]


def cuda_include() -> Path:
    """The CUDA toolkit's include folder (cuda_fp16.h and vector_types.h compile as host C++)."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(str(Path(nvcc).resolve().parent.parent))
    for home in filter(None, homes):
        if (Path(home) / "include" / "cuda_fp16.h").exists():
            return Path(home) / "include"
    pytest.skip("no CUDA toolkit headers (cuda_fp16.h) to compile the kernel against")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    exe = tmp_path_factory.mktemp("emu") / "dequantize_flat"
    cmd = [cxx, "-std=c++20", "-O1", "-g", f"-I{ROOT / 'csrc'}", f"-I{cuda_include()}",
           str(HERE / "cuda_emulation" / "dequantize_flat.cpp"), "-o", str(exe)]
    sanitized = subprocess.run(cmd[:1] + ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"] + cmd[1:],
                               capture_output=True, text=True)
    if sanitized.returncode != 0:  # a compiler without the sanitizer runtimes: the bit-for-bit check still runs
        plain = subprocess.run(cmd, capture_output=True, text=True)
        assert plain.returncode == 0, plain.stderr[-4000:]
    return exe


def sample(shape, dtype, group_size):
    x = torch.randn(shape) * torch.rand(shape[-1]) * 5 + torch.randn(shape[-1])
    flat = x.view(-1)
    # the groups that leave the plain path: NaN (a NaN group), +inf and -inf alone (kept exactly), both
    # infinities (NaN), signed zeros only
    specials = [[float("nan")], [float("inf")], [-float("inf")], [float("inf"), -float("inf")]]
    for g, values in enumerate(specials):
        start = (3 * g + 1) * group_size
        if start + group_size <= flat.numel():
            flat[start + 1:start + 1 + len(values)] = torch.tensor(values)
    if flat.numel() >= 20 * group_size:
        flat[19 * group_size:20 * group_size] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", list(CODES))
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128, 256])
def test_flat_dequantize_kernel_matches_the_cpu_bit_for_bit(emulator, tmp_path, dtype, bits, group_size):
    ran = 0
    for shape in SHAPES:
        if shape[-1] % group_size:
            continue
        x = sample(shape, dtype, group_size)
        codes, stats = ops.quantize(x, bits=bits, group_size=group_size, seed=7)
        want = ops.dequantize(codes, stats, bits=bits, group_size=group_size, shape=shape, dtype=dtype)
        codes.numpy().tofile(tmp_path / "codes")
        stats.numpy().tofile(tmp_path / "stats")
        r = subprocess.run([str(emulator), CODES[dtype], str(bits), str(x.numel()), str(group_size.bit_length() - 1),
                            str(tmp_path / "codes"), str(tmp_path / "stats"), str(tmp_path / "out")],
                           capture_output=True, text=True, env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0"})
        assert r.returncode == 0, f"{shape}: {r.stderr[-4000:]}"
        raw = torch.from_numpy(np.fromfile(tmp_path / "out", dtype=np.uint8))
        got = raw.view(dtype).reshape(shape)
        assert same(got, want), shape
        ran += 1
    assert ran >= 3
