"""The CUDA Adam kernels run on the host: adam_kernel (float32 moments) and adam8_kernel (8-bit moments), compiled
as ordinary C++ with tests/cuda_emulation/host_shim.h and launched as csrc/cuda/adam.cu launches them
(tests/cuda_emulation/adam_kernels.cpp). No GPU had run adam8_kernel, whose warps reduce each block's scales
with shuffles and whose launches hand each tensor its rounding salt. Here both are compared with the CPU
kernels bit for bit on what a GPU run would meet first: more tensors than one launch's table holds (56 and
36), tensors of several chunks and of odd sizes, empty ones, tensors one element off the vector path's
alignment, bf16 and fp16 parameters and gradients, a gradient scale, and moments that overflow. Built with
AddressSanitizer and UBSan where the compiler has them: every load and store inside its tensor."""
from pathlib import Path

import numpy as np
import pytest
import torch

from effmem import ops
from effmem.optim import _adam8
from test_cuda_emulated import CODES, build, run

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True, bias_correction=True)
# sizes: one element, a part block, whole 256-blocks, a part warp's share, two chunks of 32768 and a part one
# (the first time round only: the emulator's shuffles cost about 10 us each), and an empty tensor (left out
# of the launch, as adam.cu leaves it)
SIZES = [1, 255, 256, 257, 0, 4097, 70001, 31, 1000]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory) -> Path:
    return build(tmp_path_factory, "adam_kernels")


def raw(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()


def read(path: Path, like: torch.Tensor) -> torch.Tensor:
    if like.numel() == 0:
        return like.clone()
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8)).view(like.dtype).reshape(like.shape)


def tensors(count, pdtype, gdtype, eight, seed):
    """count tensors of the SIZES in turn, with moments of a few steps' making (8-bit: encoded from them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = SIZES[i % len(SIZES)] if i < len(SIZES) else SIZES[i % len(SIZES)] % 5000
        w = torch.randn(n, generator=g)
        m = torch.randn(n, generator=g) * 1e-2
        v = torch.rand(n, generator=g) * 1e-4
        t = dict(p=w.to(pdtype), g=(torch.randn(n, generator=g) * 3).to(gdtype), w=w.clone(), step=float(3 + i % 4),
                 salt=5 * i + 1)
        if i == 3 and n:   # overflowing moments (8-bit: the block's scale from its finite ones, m dropped)
            t["g"][7 % n] = float("inf") if gdtype != torch.float32 else 1e21
        if eight:
            enc = _adam8.to_8bit({"exp_avg": m, "exp_avg_sq": v}, w, t["step"] - 1, t["salt"])
            t.update(m=enc["exp_avg"], v=enc["exp_avg_sq"], ms=enc["exp_avg_scale"], vs=enc["exp_avg_sq_scale"])
        else:
            t.update(m=m, v=v)
        out.append(t)
    return out


def cpu_step(ts, pdtype, eight, inv_scale):
    """The CPU kernel on copies."""
    got = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in t.items()} for t in ts]
    kw = dict(HYPER, inv_scale=torch.tensor(inv_scale) if inv_scale else None)
    if eight:
        kw.update(exp_avg_scales=[t["ms"] for t in got], exp_avg_sq_scales=[t["vs"] for t in got],
                  salts=[t["salt"] for t in got])
    ops.adam_step_([t["p"] for t in got], [t["g"] for t in got], [t["m"] for t in got], [t["v"] for t in got],
                   [t["w"] for t in got] if pdtype != torch.float32 else [],
                   [torch.tensor(t["step"]) for t in got], **kw)
    return got


def emulated_step(emulator, tmp_path, ts, pdtype, gdtype, eight, inv_scale, offsets):
    keys = ["p", "g", "m", "v"] + (["w"] if pdtype != torch.float32 else []) + (["ms", "vs"] if eight else [])
    lines = [" ".join(str(float(HYPER[k])) for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
             + f" {int(HYPER['decoupled'])} {int(HYPER['bias_correction'])} {inv_scale!r}", str(len(ts))]
    for i, (t, offset) in enumerate(zip(ts, offsets)):
        lines.append(f"{t['p'].numel()} {offset} {t['step']!r} {t['salt']}")
        for k in keys:
            raw(t[k]).tofile(tmp_path / f"{k}{i}")
    (tmp_path / "spec").write_text("\n".join(lines) + "\n")
    run(emulator, "adam8" if eight else "adam", CODES[pdtype], CODES[gdtype], tmp_path)
    return [{k: read(tmp_path / f"{k}{i}", t[k]) for k in keys if k != "g"} for i, t in enumerate(ts)]


def same(a, b):
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("pdtype,gdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.float16, torch.float32), (torch.bfloat16, torch.float16)],
                         ids=["f32", "bf16", "f16-f32grad", "bf16-f16grad"])
@pytest.mark.parametrize("eight", [False, True], ids=["fp32_moments", "8bit"])
def test_adam_kernels_match_the_cpu_bit_for_bit(emulator, tmp_path, pdtype, gdtype, eight):
    """Two launches' worth of tensors (60 for the float32-moment kernel's 56 slots, 40 for the 8-bit one's 36),
    every other one one element off the 16-byte alignment, with and without a gradient scale."""
    count = 40 if eight else 60
    for inv_scale, seed in ((0.0, 1), (0.25, 2)):
        ts = tensors(count, pdtype, gdtype, eight, seed)
        want = cpu_step(ts, pdtype, eight, inv_scale)
        got = emulated_step(emulator, tmp_path, ts, pdtype, gdtype, eight, inv_scale, [i % 2 for i in range(count)])
        for i, (a, b) in enumerate(zip(got, want)):
            for k in a:
                assert same(a[k], b[k]), (i, k, inv_scale)
        assert any(not torch.equal(a["p"], t["p"]) for a, t in zip(got, ts) if t["p"].numel())   # it stepped
