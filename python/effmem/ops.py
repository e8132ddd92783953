"""Typed wrappers around the effmem torch ops, and their fake kernels.

The ops themselves are registered in C++ (csrc/ops.cpp) under torch.ops.effmem;
the fake kernels here let torch.compile and FakeTensor trace them.
"""
from typing import List, Optional, Sequence

import torch
from torch import Tensor

_lib = torch.ops.effmem


def adam_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    masters: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    bias_correction: bool = True,
    lr_tensor: Optional[Tensor] = None,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
) -> None:
    """One fused Adam/AdamW step over same-dtype tensors on one device.

    Updates params, exp_avgs, exp_avg_sqs and masters in place. For bf16/fp16
    params, ``masters`` holds their fp32 master weights and the params receive
    master rounded to nearest even; for fp32 params pass ``masters=[]``.
    ``steps[i]`` is param i's step count after this step (float32 tensor on the
    params' device). See csrc/common/adam_math.h for the formula.
    """
    _lib.adam_step_(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(masters), list(steps),
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(decoupled),
        bool(bias_correction), lr_tensor, inv_scale, found_inf,
    )


def l2norm(tensors: Sequence[Tensor]) -> Tensor:
    """Global L2 norm of float32/bf16/fp16 tensors on one device, as a float32 scalar there."""
    return _lib.l2norm(list(tensors))


@torch.library.register_fake("effmem::adam_step_")
def _adam_step_fake(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps,
                    weight_decay, decoupled, bias_correction, lr_tensor=None, inv_scale=None,
                    found_inf=None) -> None:
    return None


@torch.library.register_fake("effmem::l2norm")
def _l2norm_fake(tensors: List[Tensor]) -> Tensor:
    torch._check(len(tensors) > 0, lambda: "l2norm needs at least one tensor")
    return tensors[0].new_empty((), dtype=torch.float32)
