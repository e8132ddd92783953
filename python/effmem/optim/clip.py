"""Gradient clipping by global L2 norm, with one fused norm kernel per device."""
import numbers
from collections import defaultdict
from typing import Iterable, List, Union

import torch
from torch import Tensor

from effmem import ops
from effmem.optim import _validate


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    """t on device, without a host sync where that is safe: a non-blocking copy
    to the CPU could be read before it lands, so copies to the CPU block."""
    return t.to(device, non_blocking=torch.device(device).type != "cpu")


def clip_coefficient(total: Tensor, max_norm: float) -> Tensor:
    """min(1, max_norm / (total + 1e-6)), in float32: the factor every effmem clip applies, computed
    one way so that the optimizers that fold it into their step agree bit for bit."""
    if isinstance(max_norm, Tensor):   # float32 whatever its dtype; a CPU scalar tensor works on any device
        max_norm = max_norm.to(torch.float32).reshape(())
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def grad_norm(grads: List[Tensor]) -> Tensor:
    """Global L2 norm of the given gradients, as a float32 scalar (no host sync)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    by_device = defaultdict(list)
    for g in grads:
        if g.is_sparse:
            raise TypeError("grads: sparse gradients are not supported by the fused norm")
        by_device[g.device].append(g if _validate.is_dense(g) else g.contiguous())
    norms = [ops.l2norm(gs) for gs in by_device.values()]
    if len(norms) == 1:
        return norms[0]
    first = norms[0].device
    return torch.stack([n.to(first) for n in norms]).norm()


@torch.no_grad()
def clip_grad_norm_(parameters: Union[Tensor, Iterable[Tensor]], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> Tensor:
    """Clips gradients in place so their global L2 norm is at most ``max_norm``.

    Drop-in for ``torch.nn.utils.clip_grad_norm_`` (L2 only): one fused norm
    kernel per device and one foreach multiply, with no host synchronisation
    unless ``error_if_nonfinite`` is set (then exactly one). Returns the total
    norm before clipping.
    """
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    _validate.max_norm(max_norm)
    if isinstance(norm_type, (str, bool)) or not isinstance(norm_type, numbers.Real) or float(norm_type) != 2.0:
        raise ValueError(f"norm_type: only the L2 norm (2.0) is fused, got {norm_type!r}; "
                         "use torch.nn.utils.clip_grad_norm_ for other norms")
    grads = [p.grad for p in parameters if p.grad is not None]
    total = grad_norm(grads)
    if not grads:
        return total
    if error_if_nonfinite and not torch.isfinite(total).item():
        raise RuntimeError(f"The total norm of the gradients is {total.item()}; "
                           "set error_if_nonfinite=False to clip anyway")
    coef = clip_coefficient(total, max_norm)
    by_device = defaultdict(list)
    for g in grads:
        by_device[g.device].append(g)
    for device, gs in by_device.items():
        torch._foreach_mul_(gs, _to_device(coef, device))
    return total
