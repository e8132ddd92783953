"""torch.distributed.checkpoint's optimizer helpers and an OffloadAdam that holds a backward's gradients.

get_optimizer_state_dict, set_optimizer_state_dict and get_state_dict (the checkpoints of torchtitan, torchtune
and accelerate's FSDP2) make an optimizer's state, where it has none yet, by a step() at lr 0 with zero
gradients, unless some p.grad is set. An OffloadAdam whose first backward had streamed its gradients off p.grad
looked as if it held none: that step took them at lr 0, counted a step, and the loop's own step() found nothing to
do (a run that saved between its first backward and first step ended with weights 0.042 off the uninterrupted
run's, silently: a reviewer's run). ``import effmem`` wraps the helper that decides, so that gradients an
optimizer holds count as a set p.grad does (torch's returns then, the state made by the step to come).
"""
import functools

import torch


def _holds_gradients(optim) -> bool:
    for o in (optim, getattr(optim, "optimizer", None)):   # accelerate's AcceleratedOptimizer holds it there
        holds = getattr(o, "_holds_gradients", None)
        if callable(holds) and holds():
            return True
    return False


def install() -> None:
    """Wraps torch.distributed.checkpoint.state_dict._init_optim_state once (imported here, 40 ms, so that an
    import of it after effmem's is covered)."""
    if not torch.distributed.is_available():
        return
    try:
        from torch.distributed.checkpoint import state_dict as module
    except ImportError:   # a torch without it: nothing to route
        return
    original = getattr(module, "_init_optim_state", None)
    if original is None or getattr(original, "_effmem_routes_offload", False):
        return

    @functools.wraps(original)
    def _init_optim_state(optim):
        if _holds_gradients(optim):
            return
        return original(optim)

    _init_optim_state._effmem_routes_offload = True
    module._init_optim_state = _init_optim_state
