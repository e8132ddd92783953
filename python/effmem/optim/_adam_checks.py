"""FusedAdam's checks of what changed in place since the last step, run over every group's buckets before any
is stepped: a refused step changes nothing (the kernel refuses these too, but only after the buckets before its
own were updated and their step counts advanced); and step()'s inv_scale and found_inf numbers (one_value)."""
import math
import numbers
import re
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from effmem import ops
from effmem.optim import _adam8, _validate


def cpu_steps(opt, buckets: List) -> None:
    """Step counts written in place into opt.state, on the CPU. A CUDA count is the kernel's to check: reading
    it here would cost a host sync per step; so are all under torch.compile (a value read would break the
    graph). A meta one has no value (a meta model steps as torch's optimizers step it: nothing happens)."""
    if torch.compiler.is_compiling():
        return
    steps = [s for group in buckets for b in group.values() for s in b["steps"] if s.device.type == "cpu"]
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


def kernels(opt, buckets: List) -> None:
    """The kernels' own checks (strides, memory shared by what a step writes and what it reads) over every call
    of the step but the first, before the first: the kernel refused a later call's tensors only after the calls
    before had stepped (their groups updated, step counts advanced; each retry stepped them again, in a
    reviewer's run). The first call's kernel refuses before it writes (the step undoes that call's step-count
    advance and names the tensor: named); one bucket, the usual case, costs no second check."""
    if torch.compiler.is_compiling():   # the kernel checks when the graph runs
        return
    first, skip = 0, True   # the number of the group's first parameter; the step's first call
    for group, group_buckets in zip(opt.param_groups, buckets):
        for key, b in group_buckets.items():
            if skip:
                skip = False
                continue
            try:
                ops.adam_check(b["params"], b["grads"], b["exp_avgs"], b["exp_avg_sqs"], b["masters"], b["steps"],
                               b.get("exp_avg_scales", ()), b.get("exp_avg_sq_scales", ()))
            except (ValueError, TypeError) as err:
                raise named(err, first, group, key, opt.state_bits) from None
        first += len(group["params"])


def named(err: Exception, first: int, group, key, bits: int) -> Exception:
    """The kernel's error with the tensor named as the optimizer's other errors name it (parameter n counts
    over all groups; opt.state's keys of state_bits `bits`), not by the kernel's lists. group, key: the call's
    (FusedAdam._buckets made its lists of the group's parameters with a gradient and that key, in order)."""
    where = [first + j for j, p in enumerate(group["params"])
             if p.grad is not None and (p.device, p.dtype, p.grad.dtype) == key]

    def name(m) -> str:
        listed, n = m.group(1), where[int(m.group(2))]
        if listed in ("params", "grads"):
            return f"parameter {n}" if listed == "params" else f"the .grad of parameter {n}"
        entry = listed[:-1]   # exp_avgs: opt.state[p]['exp_avg'], or its codes at 8 bits
        return f"opt.state[p]['{_adam8.CODE_KEYS.get(entry, entry) if bits == 8 else entry}'] of parameter {n}"
    return type(err)("FusedAdam: " + _LIST_ENTRY.sub(name, str(err).split("\n")[0]))


# The kernel's lists, named in its messages as exp_avgs[i]
_LIST_ENTRY = re.compile(r"\b(params|grads|exp_avg_sq_scales|exp_avg_scales|exp_avg_sqs|exp_avgs|masters|steps)"
                         r"\[(\d+)\]")


def one_value(t, name: str) -> Optional[Tensor]:
    """inv_scale / found_inf as step() takes them: None, a number, or a one-element floating tensor. A number's
    value is read here at no cost (a tensor's is the caller's: a read would sync): an inv_scale of -1 was
    gradient ascent, NaN every weight NaN, silently."""
    if t is None or isinstance(t, Tensor) and t.numel() == 1 and t.is_floating_point():
        return t
    if isinstance(t, numbers.Real) and not isinstance(t, bool):   # numpy's scalars too (np.float32 is no float)
        # an int past float's range is inf (numpy's floats not compared with 2**1000: it overflowed, with a warning)
        v = float(t) if not isinstance(t, numbers.Integral) or abs(t) < 2 ** 1000 else math.inf
        if not 0 <= v <= torch.finfo(torch.float32).max:   # (NaN fails too; float32's range: it is stored so)
            raise ValueError(f"{name}: expected a finite number >= 0, got {t!r}")
        return torch.tensor(v, dtype=torch.float32)
    got = f"a {tuple(t.shape)} {t.dtype} tensor" if isinstance(t, Tensor) else repr(t)
    raise TypeError(f"{name}: expected a one-element floating tensor (or a number), got {got}")
