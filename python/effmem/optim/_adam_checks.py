"""FusedAdam's checks of what changed in place since the last step, run over every group's buckets before any
is stepped: a refused step changes nothing (the kernel refuses these too, but only after the buckets before its
own were updated and their step counts advanced)."""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from effmem.optim import _validate


def cpu_steps(opt, buckets: List) -> None:
    """Step counts written in place into opt.state, on the CPU. A CUDA count is the kernel's to check: reading
    it here would cost a host sync per step; so are all under torch.compile (a value read would break the
    graph)."""
    if torch.compiler.is_compiling():
        return
    steps = [s for group in buckets for b in group.values() for s in b["steps"] if not s.is_cuda]
    i = _validate.first_bad_count(torch.stack(steps)) if steps else None
    if i is not None:
        n = next(n for n, p in enumerate(p for g in opt.param_groups for p in g["params"])
                 if opt.state.get(p, {}).get("step") is steps[i])
        raise ValueError(f"FusedAdam: opt.state[p]['step'] of parameter {n} holds {float(steps[i])!r}; "
                         "expected a whole number >= 0 (a step count)")


def memory(buckets: List, checked: Optional[Tuple]) -> Optional[Tuple]:
    """Parameters given other memory since the last step (p.data = ...), checked as at construction: an
    expanded one was refused by the kernel after the buckets before its own were stepped (step counts
    advanced), and one sharing another group's memory was stepped twice. `checked`: the stepped parameters'
    (data_ptr, strides) when last checked; returns those of this step."""
    if torch.compiler.is_compiling():   # (fake tensors have no data_ptr)
        return checked
    params: List[Tensor] = [w for group in buckets for b in group.values() for w in b["params"]]
    now = tuple((w.data_ptr(), w.stride()) for w in params)
    if now == checked:
        return checked
    for w in params:
        if w.is_sparse or not _validate.is_dense(w):
            raise ValueError(f"FusedAdam: a parameter of shape {tuple(w.shape)} (strides {w.stride()}) is not "
                             "a dense tensor whose elements do not overlap (p.data = an expanded tensor?)")
    try:
        _validate.params([], params)
    except ValueError as err:
        raise ValueError(f"FusedAdam: {err} (p.data = another parameter's data?)") from None
    return now
