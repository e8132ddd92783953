"""The elementwise CUDA kernels run on the host (csrc/cuda/elementwise_kernel.cuh through
tests/cuda_emulation/elementwise_kernels.cpp, launched as csrc/cuda/elementwise.cu launches them): SwiGLU
forward and backward and RMSNorm's elementwise end against the CPU kernels bit for bit, and OffloadAdam's
delay_correction against its formula in float32 torch ops. None of them has run on a GPU yet; here their 16-byte
and per-element paths, tails, rows and grid-stride loops are checked on every commit. (The GPU's bf16/fp16
conversion instructions are replaced by the portable rounding here, as in tests/test_cuda_emulated.py.)"""
from pathlib import Path

import pytest
import torch

from effmem.reference import sqrt32
from test_cuda_emulated import CODES, build, run
from test_cuda_emulated_adam import raw, read

# sizes: a part pack, whole packs of every dtype, tails, and more elements than one pass of the grid's threads
SIZES = [3, 64, 1000, 4099]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory) -> Path:
    return build(tmp_path_factory, "elementwise_kernels")


def run_op(emulator, tmp_path, op, dtype, n, h, offset, inputs, outputs):
    for name, t in inputs.items():
        raw(t).tofile(tmp_path / name)
    run(emulator, op, CODES[dtype], n, h, offset, tmp_path)
    return [read(tmp_path / name, like) for name, like in outputs.items()]


def values(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 4
    if n > 10:   # the special values the shared math handles apart
        x[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 88.0])
    return x.to(dtype)


def same(a, b):
    """Bit for bit, NaNs too (the kernels store one NaN on both devices)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", list(CODES))
def test_swiglu_kernels_match_the_cpu_bit_for_bit(emulator, tmp_path, dtype):
    for n in SIZES:
        for offset in (0, 1):
            g, u, dy = values(n, dtype, 1), values(n, dtype, 2).flip(0), values(n, dtype, 3)
            (o,) = run_op(emulator, tmp_path, "swiglu", dtype, n, 1, offset, dict(g=g, u=u), dict(o=g))
            assert same(o, torch.ops.effmem.swiglu(g, u)), (n, offset)
            dg, du = run_op(emulator, tmp_path, "swiglu_backward", dtype, n, 1, offset, dict(dy=dy, g=g, u=u),
                         dict(dg=g, du=g))
            want = torch.ops.effmem.swiglu_backward(dy, g, u)
            assert same(dg, want[0]) and same(du, want[1]), (n, offset)


@pytest.mark.parametrize("dtype", list(CODES))
def test_rms_norm_apply_kernel_matches_the_cpu_bit_for_bit(emulator, tmp_path, dtype):
    """Rows of whole 16-byte packs (the vector path), of a part pack, and misaligned."""
    for rows, h in ((5, 64), (3, 100), (40, 24)):
        for offset in (0, 1):
            x = values(rows * h, dtype, 4).view(rows, h)
            rstd = torch.rand(rows, generator=torch.Generator().manual_seed(5)) + 0.5
            w = values(h, dtype, 6)
            (y,) = run_op(emulator, tmp_path, "rms_norm_apply", dtype, rows * h, h, offset, dict(x=x, rstd=rstd, w=w),
                       dict(y=x))
            assert same(y, torch.ops.effmem.rms_norm_apply(x, rstd, w)), (rows, h, offset)


@pytest.mark.parametrize("dtype", list(CODES))
def test_delay_correction_kernel_matches_its_formula(emulator, tmp_path, dtype):
    """w = pred - step * gs / (sqrt(r^2 + g2 * gs^2) + eps), gs = g * grad_scale (0 where not finite), rounded
    to the weights' dtype; r of float16 weights is bf16 (common/delay_correction_math.h)."""
    f = lambda v: torch.tensor(v, dtype=torch.float32)   # noqa: E731
    c = dict(grad_scale=0.5, step=1e-3, g2_scale=1e-3, eps=1e-8)
    r_dtype = torch.bfloat16 if dtype == torch.float16 else dtype
    for n in SIZES:
        for offset in (0, 1):
            w = values(n, dtype, 7)
            r = (values(n, torch.float32, 8).abs() * 1e-2).to(r_dtype)
            g = values(n, dtype, 9)
            (tmp_path / "c").write_text(" ".join(repr(v) for v in c.values()))
            (got,) = run_op(emulator, tmp_path, "delay_correction", dtype, n, 1, offset, dict(w=w, r=r, g=g), dict(w=w))
            gs = g.float() * f(c["grad_scale"])
            gs = torch.where(gs.abs() <= torch.finfo(torch.float32).max, gs, torch.zeros_like(gs))
            rf = r.float()
            d = sqrt32(rf * rf + f(c["g2_scale"]) * (gs * gs)) + f(c["eps"])
            want = (w.float() - f(c["step"]) * gs / d).to(dtype)
            # torch keeps an input NaN's bits, the kernel stores its one NaN: NaN where torch has NaN
            assert torch.equal(got.isnan(), want.isnan()) and same(got.nan_to_num(), want.nan_to_num()), (n, offset)
