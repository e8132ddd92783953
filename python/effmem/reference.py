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
