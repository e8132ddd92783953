"""Pure-PyTorch references for effmem's kernels, used by the tests.

They follow the formulas in csrc/common/adam_math.h step by step, in any
dtype (the tests run them in float64), and are deliberately simple and slow.
"""
from typing import List, Sequence

import torch
from torch import Tensor


def adam_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, *, lr: float,
              beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
              bias_correction: bool = True, grad_scale: float = 1.0) -> None:
    """One Adam/AdamW step in place, in the dtype of the given tensors."""
    g = grad.to(param.dtype) * grad_scale
    if weight_decay != 0.0 and not decoupled:
        g = g + weight_decay * param
    if decoupled:
        param.mul_(1.0 - lr * weight_decay)
    exp_avg.mul_(beta1).add_((1.0 - beta1) * g)
    exp_avg_sq.mul_(beta2).add_((1.0 - beta2) * g * g)
    bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
    denom = exp_avg_sq.sqrt() / (bc2 ** 0.5) + eps
    param.sub_((lr / bc1) * exp_avg / denom)


def l2norm(tensors: Sequence[Tensor]) -> Tensor:
    """Global L2 norm in float64."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    return torch.cat([t.detach().double().flatten() for t in tensors]).norm()


def clone_params(params: List[Tensor], dtype=None) -> List[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone().to(dtype or p.dtype)) for p in params]


# ---------------------------------------------------------------------------
# Group-wise quantisation (effmem::quantize / effmem::dequantize); the formula
# is in csrc/common/quant_math.h.

def hash_uniform(seed: int, index: Tensor) -> Tensor:
    """The counter-based uniform in [0, 1) for element `index` (int64) under `seed`."""
    mask = 0xFFFFFFFF
    lo = index & mask
    hi = (index >> 32) & mask
    h = (lo * 0x9E3779B1 + (seed & mask)) & mask
    h = _fmix32(h ^ _fmix32((hi + 0x7F4A7C15 + ((seed >> 32) & mask)) & mask))
    return (h >> 8).double() * (1.0 / (1 << 24))


def _fmix32(h: Tensor) -> Tensor:
    mask = 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & mask
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)


def quantize(x: Tensor, bits: int = 8, group_size: int = 128, seed: int = 0, stochastic: bool = True):
    """Reference: returns (codes as int64 [rows, D], stats float32 [rows, groups, 2] = (min, scale))."""
    d = x.shape[-1] if x.dim() > 0 else 1
    rows = x.reshape(-1, d).float()
    groups = (d + group_size - 1) // group_size
    qmax = (1 << bits) - 1
    codes = torch.empty(rows.shape, dtype=torch.int64)
    stats = torch.empty(rows.shape[0], groups, 2, dtype=torch.float32)
    index = torch.arange(rows.numel(), dtype=torch.int64).reshape(rows.shape)
    for g in range(groups):
        part = rows[:, g * group_size:(g + 1) * group_size]
        finite = torch.isfinite(part).all(dim=1, keepdim=True)
        lo = torch.where(finite, part.amin(dim=1, keepdim=True), float("nan"))
        hi = part.amax(dim=1, keepdim=True)
        scale = torch.where(finite, (hi - lo) / qmax, float("nan"))
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        y = (part - lo) * inv
        u = hash_uniform(seed, index[:, g * group_size:(g + 1) * group_size]).float() if stochastic else 0.5
        q = torch.floor(y + u).clamp(0, qmax)
        codes[:, g * group_size:(g + 1) * group_size] = torch.where(q.isnan(), 0.0, q).long()
        stats[:, g, 0] = lo[:, 0]
        stats[:, g, 1] = scale[:, 0]
    return codes, stats


def dequantize(codes: Tensor, stats: Tensor, group_size: int, shape, dtype) -> Tensor:
    d = codes.shape[-1]
    lo = stats[..., 0].repeat_interleave(group_size, dim=1)[:, :d]
    scale = stats[..., 1].repeat_interleave(group_size, dim=1)[:, :d]
    return (lo + codes.float() * scale).to(dtype).reshape(shape)
