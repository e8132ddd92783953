"""CUDA kernels run on the host: the quantize kernel, the group-mapped dequantize kernel
(csrc/cuda/quantize_kernel.cuh) and the flat one (csrc/cuda/dequantize_flat_kernel.cuh), compiled as ordinary
C++ with tests/cuda_emulation/host_shim.h and called for every thread of the launch that csrc/cuda/quantize.cu
makes (its geometry from csrc/cuda/quantize_launch.h). Each warp's 32 lanes run on threads of their own, so
warp shuffles exchange values as on a GPU, and a shuffle whose mask names a lane that never joins it aborts.
This checks their indexing (lanes, groups, part groups, part warps and blocks), shuffles and special groups
(NaN, infinities, outliers, signed zeros) bit for bit against the CPU kernels on a machine without a GPU,
and, built with AddressSanitizer and UBSan, that every load and store stays inside its tensor and is
aligned. (The GPU's min/max and bf16/fp16 rounding instructions are replaced by their portable fallbacks,
which give the same bits for the values they are used on; tests/test_quantize.py compares the real kernels
on a GPU.)"""
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


def build(tmp_path_factory, source: str) -> Path:
    """cuda_emulation/<source>.cpp built as an executable, with AddressSanitizer and UBSan where the
    compiler has their runtimes."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    exe = tmp_path_factory.mktemp("emu") / source
    # no contraction into FMAs, as the CUDA build (--fmad=false) and the CPU kernels
    cmd = [cxx, "-std=c++20", "-O1", "-g", "-pthread", "-ffp-contract=off", f"-I{ROOT / 'csrc'}",
           f"-I{cuda_include()}",
           str(HERE / "cuda_emulation" / f"{source}.cpp"), "-o", str(exe)]
    sanitized = subprocess.run(cmd[:1] + ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"] + cmd[1:],
                               capture_output=True, text=True)
    if sanitized.returncode != 0:  # a compiler without the sanitizer runtimes: the bit-for-bit check still runs
        plain = subprocess.run(cmd, capture_output=True, text=True)
        assert plain.returncode == 0, plain.stderr[-4000:]
    return exe


@pytest.fixture(scope="module")
def emulator(tmp_path_factory) -> Path:
    return build(tmp_path_factory, "kernels")


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
    if flat.numel() >= 15 * group_size:
        flat[14 * group_size + 3] = 5000.0  # one value far out: the outlier encoding, whose lanes shuffle apart
    return x.to(dtype)


def run(emulator, *args):
    """The emulator on args, asserting it succeeded. Niced: its 32 lane threads would crowd the other test
    worker's cores (a timed test there ran 4% over its bound in CI)."""
    r = subprocess.run([str(emulator)] + [str(a) for a in args], capture_output=True, text=True,
                       env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0"}, preexec_fn=lambda: os.nice(10))
    assert r.returncode == 0, f"{args}: exit {r.returncode}: {r.stderr[-4000:]}"


def raw(tensor: torch.Tensor) -> np.ndarray:
    return (tensor if tensor.dtype in (torch.float32, torch.uint8) else tensor.view(torch.int16)).numpy()


def read(path: Path, dtype: torch.dtype, shape) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8)).view(dtype).reshape(shape)


# Rows that end in a part group or in a part chunk of 32 (the guarded per-element path) besides SHAPES.
PART_SHAPES = [(5, 100), (3, 300), (2, 40)]


@pytest.mark.parametrize("dtype", list(CODES))
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_quantize_kernel_matches_the_cpu_bit_for_bit(emulator, tmp_path, dtype, bits, group_size):
    """Codes and stats, stochastic and round-to-nearest, on the 16-byte path (4-bit: 64 values a thread where
    groups and rows allow), on the guarded path that rows of other lengths take, and on the guarded path
    forced where the 16-byte one would run."""
    shapes = [s for s in SHAPES if s != (40, 4096)] + PART_SHAPES
    for i, shape in enumerate(shapes):
        x = sample(shape, dtype, group_size)
        stochastic = i % 2 == 0
        want_codes, want_stats = ops.quantize(x, bits=bits, group_size=group_size, seed=7, stochastic=stochastic)
        raw(x).tofile(tmp_path / "in")
        for scalar in ((0, 1) if shape == (64, 128) else (0,)):
            run(emulator, "quantize", CODES[dtype], bits, *shape, group_size, 7, int(stochastic), scalar,
                tmp_path / "in", tmp_path / "codes", tmp_path / "stats")
            assert same(read(tmp_path / "codes", torch.uint8, want_codes.shape), want_codes), (shape, scalar)
            assert same(read(tmp_path / "stats", torch.float32, want_stats.shape), want_stats), (shape, scalar)


@pytest.mark.parametrize("dtype", list(CODES))
@pytest.mark.parametrize("bits", [4, 8])
def test_group_mapped_dequantize_kernel_matches_the_cpu_bit_for_bit(emulator, tmp_path, dtype, bits):
    """The kernel for rows ending in a part group (and, forced, its guarded path on whole groups)."""
    for shape in PART_SHAPES + [(64, 128)]:
        for group_size in (32, 128):
            x = sample(shape, dtype, group_size)
            codes, stats = ops.quantize(x, bits=bits, group_size=group_size, seed=7)
            want = ops.dequantize(codes, stats, bits=bits, group_size=group_size, shape=shape, dtype=dtype)
            raw(codes).tofile(tmp_path / "codes")
            raw(stats).tofile(tmp_path / "stats")
            for scalar in (0, 1):
                run(emulator, "dequantize", CODES[dtype], bits, *shape, group_size, scalar, tmp_path / "codes",
                    tmp_path / "stats", tmp_path / "out")
                assert same(read(tmp_path / "out", dtype, shape), want), (shape, group_size, scalar)


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
        raw(codes).tofile(tmp_path / "codes")
        raw(stats).tofile(tmp_path / "stats")
        run(emulator, "dequantize_flat", CODES[dtype], bits, *shape, group_size, tmp_path / "codes",
            tmp_path / "stats", tmp_path / "out")
        assert same(read(tmp_path / "out", dtype, shape), want), shape
        ran += 1
    assert ran >= 3
