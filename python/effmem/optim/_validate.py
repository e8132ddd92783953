"""Argument checks shared by effmem's optimizers: clear errors naming the argument."""
import math
import numbers
from typing import Any, Dict, List

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

try:  # DTensor (FSDP2's sharded parameters) exists only in builds with torch.distributed
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None


def is_dtensor(t: Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local_tensor(t: Tensor) -> Tensor:
    """The tensor this rank holds: a DTensor's local shard, else t itself (detached)."""
    return t.to_local().detach() if is_dtensor(t) else t.detach()


def hyperparameters(group: Dict[str, Any]) -> None:
    lr = group["lr"]
    if isinstance(lr, Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise ValueError(f"lr: expected a float or a one-element floating tensor, got a tensor of shape "
                             f"{tuple(lr.shape)} and dtype {lr.dtype}")
    elif not isinstance(lr, numbers.Real) or not (lr >= 0.0 and math.isfinite(lr)):
        raise ValueError(f"lr: expected a finite number >= 0, got {lr!r}")
    eps = group["eps"]
    if not isinstance(eps, numbers.Real) or not eps > 0.0:
        raise ValueError(f"eps: expected a number > 0, got {eps!r}")
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas: expected a pair (beta1, beta2), got {betas!r}")
    for name, beta in zip(("betas[0]", "betas[1]"), betas):
        if not isinstance(beta, numbers.Real) or not 0.0 <= beta < 1.0:
            raise ValueError(f"{name}: expected a number in [0, 1), got {beta!r}")
    wd = group["weight_decay"]
    if not isinstance(wd, numbers.Real) or not wd >= 0.0:
        raise ValueError(f"weight_decay: expected a number >= 0, got {wd!r}")


def max_norm(value: Any) -> None:
    if not isinstance(value, numbers.Real) or not value >= 0.0:
        raise ValueError(f"max_norm: expected a number >= 0, got {value!r}")


def is_dense(t: Tensor) -> bool:
    """True when t's elements fill one block of memory without overlap (any dim order)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _span(p: Tensor):
    start = p.untyped_storage().data_ptr() + p.storage_offset() * p.element_size()
    return start, start + p.numel() * p.element_size()


def params(new: List[Tensor], existing: List[Tensor]) -> None:
    """One device per group, supported dtypes, dense layout, no memory shared between params."""
    devices = {p.device for p in new}
    if len(devices) > 1:
        raise ValueError(f"params: a param group must hold parameters of one device, got {sorted(map(str, devices))}; "
                         "put each device's parameters in its own group")
    new, existing = [local_tensor(p) for p in new], [local_tensor(p) for p in existing]
    for i, p in enumerate(new):
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"params[{i}]: expected float32, bfloat16 or float16, got {p.dtype}")
        if p.is_sparse or not is_dense(p):
            raise ValueError(f"params[{i}]: expected a dense tensor whose elements do not overlap "
                             f"(shape {tuple(p.shape)}, strides {p.stride()})")
    spans = sorted((_span(p) + (i,) for i, p in enumerate(existing + new) if p.numel() > 0))
    for (_, end_a, i), (start_b, _, j) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise ValueError(f"params: parameters {i} and {j} share memory (views of one tensor?); "
                             "each element may be updated by only one parameter")


def grad(p: Tensor) -> Tensor:
    """The gradient of p, checked, in p's memory layout (the kernels walk both as one flat span)."""
    return grad_like(p, p.grad)


def grad_like(p: Tensor, g: Tensor) -> Tensor:
    """g checked as a gradient of p, in p's memory layout."""
    if g.is_sparse:
        raise TypeError("grad: sparse gradients are not supported; use a dense embedding or torch.optim.SparseAdam")
    if g.is_complex() or g.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"grad: expected float32, bfloat16 or float16 gradients, got {g.dtype}")
    if g.stride() != p.stride():
        g = torch.empty_like(p, dtype=g.dtype).copy_(g)
    return g


def loadable_groups(state_dict: Dict[str, Any], name: str) -> List[Dict[str, Any]]:
    """The param groups of a state dict to load into an effmem Adam, refusing flags it would ignore."""
    groups = state_dict["param_groups"]
    for i, group in enumerate(groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag, False):
                raise ValueError(f"state_dict: param_groups[{i}] uses {flag}=True, which {name} "
                                 "does not implement; loading it would silently change the math")
    return groups


def complete_groups(optimizer: torch.optim.Optimizer) -> None:
    """After loading: keys a torch.optim checkpoint lacks take the optimizer's defaults; all are checked."""
    for group in optimizer.param_groups:
        for key, value in optimizer.defaults.items():
            group.setdefault(key, value)
        hyperparameters(group)
