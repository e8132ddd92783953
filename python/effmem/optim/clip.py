"""Gradient clipping by global L2 norm, with one fused norm kernel per device."""
from collections import defaultdict
from typing import Iterable, List, Optional, Union

import torch
from torch import Tensor

from effmem import ops
from effmem.optim import _clip_route, _validate


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
    """Global L2 norm of the given gradients, as a float32 scalar (no host sync).

    FSDP2's (DTensor) gradients: the norm of this rank's shards, squared and summed over the ranks
    holding the other shards (an all-reduce per mesh; replicas, as in HSDP, counted once), so every
    rank gets the global norm. The fused kernel has no DTensor rule; it runs on the local shards."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    plain, sharded = [], {}
    for g in grads:
        if g.is_sparse:
            raise TypeError("grads: sparse gradients are not supported by the fused norm")
        if _validate.is_dtensor(g):
            dims, g = _shard_dims(g)
            if dims:
                sharded.setdefault((id(g.device_mesh), dims), (g.device_mesh, dims, []))[2].append(g.to_local())
                continue
            g = g.to_local()
        plain.append(g)
    norms = [_norm(plain)] if plain else []
    for mesh, dims, local in sharded.values():
        # summed in float64, as OffloadAdam sums its engine's (_offload_distributed.global_sq_sum): in float32
        # the two norms of the same gradients differed in their last bit in 3 of 20 sets (a reviewer's run)
        sq = _norm(local).double().square()
        for d in dims:
            torch.distributed.all_reduce(sq, group=mesh.get_group(d))
        norms.append(sq.sqrt().float())
    return _combined(norms)


def _norm(grads: List[Tensor]) -> Tensor:
    """L2 norm of plain tensors: one fused kernel per device."""
    by_device, other = defaultdict(list), []
    for g in grads:
        if g.dtype in (torch.float32, torch.bfloat16, torch.float16):
            by_device[g.device].append(g if _validate.is_dense(g) else g.contiguous())
        else:   # float64 or complex (torch's clip takes them): torch's norm, then float32 as the kernel's
            other.append(torch.linalg.vector_norm(g).double())
    norms = [ops.l2norm(gs) for gs in by_device.values()]
    if other:
        norms.append(torch.linalg.vector_norm(torch.stack([n.to(other[0].device) for n in other])).float())
    return _combined(norms)


def _combined(norms: List[Tensor]) -> Tensor:
    """The L2 norm of several partial norms (on the first one's device); one alone as it is."""
    if len(norms) == 1:
        return norms[0]
    first = norms[0].device
    return torch.stack([n.to(first) for n in norms]).norm()


def _shard_dims(g: Tensor):
    """The mesh dimensions a DTensor is sharded on, and the DTensor with any Partial (pending-sum)
    placement reduced first: the norm of a sum is not the sum of the norms."""
    from torch.distributed.tensor import Replicate

    from effmem.optim._offload_distributed import shard_dims
    if any(pl.is_partial() for pl in g.placements):
        g = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
    return shard_dims(g), g


@torch.no_grad()
def clip_grad_norm_(parameters: Union[Tensor, Iterable[Tensor]], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> Tensor:
    """Clips gradients in place so their global L2 norm is at most ``max_norm``.

    Drop-in for ``torch.nn.utils.clip_grad_norm_`` (L2 only): one fused norm
    kernel per device and one foreach multiply, with no host synchronisation
    unless ``error_if_nonfinite`` is set (then exactly one). Returns the total
    norm before clipping, in float32 whatever the gradients' dtype (torch's is
    in theirs: a bf16 norm for bf16 gradients). ``foreach`` is accepted for
    torch's signature; the kernels are fused either way. Parameters whose
    gradients an OffloadAdam took off during backward are clipped by that
    optimizer (``_clip_route``), as ``torch.nn.utils.clip_grad_norm_`` clips
    them once effmem is imported.
    """
    if foreach is not None and not isinstance(foreach, bool):
        raise ValueError(f"foreach: expected None, True or False, got {foreach!r}")
    parameters = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    _validate.max_norm(max_norm)
    _clip_route.check_l2(norm_type, "effmem.clip_grad_norm_ (use torch.nn.utils.clip_grad_norm_ for other norms)")
    routed = _clip_route.offloaded_clip(parameters, max_norm, norm_type, error_if_nonfinite)
    if routed is not None:   # an OffloadAdam took these gradients off during backward: it clips them
        return routed
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
        # a DTensor's local shard: DTensor has no rule for a plain-tensor factor
        torch._foreach_mul_([_validate.local_tensor(g) for g in gs], _to_device(coef, device))
    return total
