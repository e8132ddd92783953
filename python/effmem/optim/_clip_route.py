"""Clipping by global norm when an OffloadAdam holds the gradients, whichever clip the training loop calls.

OffloadAdam takes each gradient off its parameter during backward, so p.grad is None by the time a loop clips:
torch.nn.utils.clip_grad_norm_ would find no gradients, return 0 and clip nothing, silently. Hugging Face's
Trainer calls it (through accelerate) at every step, max_grad_norm=1.0 by default, and so does nearly every
hand-written loop. So ``import effmem`` wraps ``torch.nn.utils.clip_grad_norm_``: parameters whose gradients an
OffloadAdam holds are clipped by that optimizer (its clip_grad_norm_: the same global L2 norm, the factor applied
inside its next step), and every other call is torch's own function, unchanged (the wrapper hands it straight on
while no OffloadAdam is open; while one is, torch.compile breaks its graph there to route the call eagerly).
effmem.clip_grad_norm_ routes the same way.

accelerate's ``Accelerator.clip_grad_norm_`` (the Trainer's clip) stopped calling torch's function in accelerate
1.16: it sums the norms of p.grad itself (get_total_norm, clip_grads_with_norm_), found none, logged grad_norm 0
and clipped nothing. It is wrapped the same way, once accelerate is imported (checked at ``import effmem`` and at
each OffloadAdam's backward, before any clip of its gradients can come).

``torch.nn.utils.clip_grad_value_`` over those parameters is refused with the reason (the engine does not clip by
value; torch's found no gradients and failed unreadably, or clipped only device_state's).

What it cannot reach: a name bound before ``import effmem`` (``from torch.nn.utils import clip_grad_norm_``
first) keeps torch's function, and torch.nn.utils.get_total_norm takes gradients, not parameters.
"""
import functools
import math
import numbers
import sys
from typing import Any, List, Optional

import torch
from torch import Tensor


def check_l2(norm_type: Any, who: str) -> None:
    if isinstance(norm_type, (str, bool)) or not isinstance(norm_type, numbers.Real) or float(norm_type) != 2.0:
        raise ValueError(f"norm_type: only the L2 norm (2.0) is supported by {who}, got {norm_type!r}")


def _holders(parameters: List[Tensor]):
    """(index, parameter, optimizer) for each parameter whose gradient an open OffloadAdam took off during
    backward."""
    from effmem.optim._offload_lifetime import _owner

    for i, p in enumerate(parameters):
        opt = _owner(p) if isinstance(p, Tensor) else None
        if opt is not None and opt._in_backward:
            yield i, p, opt


def offloaded_clip(parameters: List[Tensor], max_norm, norm_type, error_if_nonfinite: bool) -> Optional[Tensor]:
    """None when no OffloadAdam holds any of these parameters' gradients (clip p.grad as usual); otherwise that
    optimizer's clip_grad_norm_(max_norm) and the norm it returns (float32, on the CPU)."""
    owners = {id(opt): opt for _, _, opt in _holders(parameters)}
    if not owners:
        return None
    if len(owners) > 1:
        raise RuntimeError(f"parameters: {len(owners)} OffloadAdam optimizers hold these parameters' gradients, each "
                           "clipping by the norm of its own; call each one's clip_grad_norm_(max_norm)")
    (opt,) = owners.values()
    check_l2(norm_type, "OffloadAdam")
    if opt._overlap and error_if_nonfinite:   # its norm-only answer, NaN, is no statement about the gradients
        raise RuntimeError("OffloadAdam(overlap=True) updates each bucket during backward, so there is no global "
                           "norm to check (error_if_nonfinite=True) or clip by; use overlap=False")
    given = {id(p) for p in parameters}
    missing = [p for p in opt._all_params if p.requires_grad and id(p) not in given]
    if missing:
        raise RuntimeError(f"parameters: {len(missing)} parameters of the OffloadAdam holding these gradients are not "
                           f"among them (the first of shape {tuple(missing[0].shape)}); it clips by the norm of every "
                           "gradient it holds: pass all of its parameters (model.parameters()), or call "
                           "opt.clip_grad_norm_(max_norm)")
    mine = {id(p) for p in opt._all_params}
    extra = [p for p in parameters if id(p) not in mine and p.grad is not None]
    if extra:
        raise RuntimeError(f"parameters: {len(extra)} of them (the first of shape {tuple(extra[0].shape)}) have "
                           "gradients in p.grad but are not stepped by the OffloadAdam holding the others' gradients, "
                           "so one norm over both cannot be applied; clip them apart: opt.clip_grad_norm_(max_norm) "
                           "for the OffloadAdam's, torch.nn.utils.clip_grad_norm_ for the rest")
    before, norms = opt._clip_scale, opt._clip_norms
    total = opt.clip_grad_norm_(max_norm)
    if before != 1.0:
        # torch's clip scales p.grad, so a second call in the same step (the user's, then accelerate's) sees
        # the clipped gradients: their norm, and a factor on top of the first
        from effmem.optim.clip import clip_coefficient   # clip.py imports this module
        total = total * before
        opt._clip_scale = before * float(clip_coefficient(total, float(max_norm)))
        opt._clip_norms = (norms[0], norms[1] + [float(max_norm)])
    if error_if_nonfinite and not math.isfinite(float(total)):
        # nothing clipped, as torch leaves the gradients when it raises
        opt._clip_scale, opt._clip_norms = before, norms
        raise RuntimeError(f"The total norm of the gradients is {float(total)}; "
                           "set error_if_nonfinite=False to clip anyway")
    opt._note_torch_clip()   # torch's clip scaled p.grad in place: a later gradient is refused (_check_clip_order)
    return total


@torch.compiler.disable
def refuse_value_clip(parameters: List[Tensor]) -> None:
    """clip_grad_value_ over gradients an OffloadAdam took off: torch's found no p.grad (an unreadable error
    from its foreach kernel, or, with device_state, a clip of the few gradients left on the device only)."""
    for i, p, _ in _holders(parameters):
        raise RuntimeError(f"parameters: parameter {i} (shape {tuple(p.shape)}) is stepped by an OffloadAdam that "
                           "took its gradient off the device during backward; it does not clip by value. Clip by "
                           "the global norm instead: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) "
                           "or opt.clip_grad_norm_(max_norm)")


def install() -> None:
    """Wraps torch.nn.utils.clip_grad_norm_ and clip_grad_value_ (and clip_grad's, the same functions) once."""
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad

    from effmem.optim import _offload_lifetime

    original = nn_utils.clip_grad_norm_
    if getattr(original, "_effmem_routes_offload", False):
        return

    @torch.compiler.disable   # the engine's clip is host work: under torch.compile a graph break runs it
    def routed(parameters, max_norm, norm_type, error_if_nonfinite, foreach):
        params = [parameters] if isinstance(parameters, Tensor) else list(parameters)   # a generator, read once
        total = offloaded_clip(params, max_norm, norm_type, error_if_nonfinite)
        if total is not None:
            return total
        return original(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                        foreach=foreach)

    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        if not _offload_lifetime._OWNERS:   # no OffloadAdam open: torch's own, traced as ever under compile
            return original(parameters, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                            foreach=foreach)
        return routed(parameters, max_norm, norm_type, error_if_nonfinite, foreach)

    clip_grad_norm_._effmem_routes_offload = True
    nn_utils.clip_grad_norm_ = clip_grad_norm_
    if clip_grad.clip_grad_norm_ is original:
        clip_grad.clip_grad_norm_ = clip_grad_norm_

    original_value = nn_utils.clip_grad_value_

    @functools.wraps(original_value)
    def clip_grad_value_(parameters, clip_value, foreach=None):
        if _offload_lifetime._OWNERS:
            parameters = [parameters] if isinstance(parameters, Tensor) else list(parameters)
            refuse_value_clip(parameters)
        return original_value(parameters, clip_value, foreach=foreach)

    nn_utils.clip_grad_value_ = clip_grad_value_
    if clip_grad.clip_grad_value_ is original_value:
        clip_grad.clip_grad_value_ = clip_grad_value_
    install_accelerate()


def install_accelerate() -> None:
    """Wraps accelerate's Accelerator.clip_grad_norm_ once, if accelerate is imported (never imports it)."""
    module = sys.modules.get("accelerate.accelerator")
    original = getattr(getattr(module, "Accelerator", None), "clip_grad_norm_", None)
    if original is None or getattr(original, "_effmem_routes_offload", False):
        return

    from effmem.optim import _offload_lifetime
    routed = torch.compiler.disable(offloaded_clip)

    @functools.wraps(original)
    def clip_grad_norm_(self, parameters, max_norm, norm_type=2, *args, **kwargs):
        if _offload_lifetime._OWNERS:
            parameters = [parameters] if isinstance(parameters, Tensor) else list(parameters)
            # GradScaler's unscale_ is accelerate's first move; it is refused by a streaming OffloadAdam's step()
            # either way, and with stream_grads=False the gradients are in p.grad and take accelerate's path
            total = routed(parameters, max_norm, norm_type, False)
            if total is not None:
                return total
        return original(self, parameters, max_norm, norm_type, *args, **kwargs)

    clip_grad_norm_._effmem_routes_offload = True
    module.Accelerator.clip_grad_norm_ = clip_grad_norm_
