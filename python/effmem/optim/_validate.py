"""Argument checks shared by effmem's optimizers: clear errors naming the argument."""
import math
import numbers
import warnings
from typing import Any, Dict, List, Optional, Tuple

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


def whole(value: Any, name: str, minimum: int, unit: str = "") -> int:
    """An int (not a bool; a NumPy integer taken as one) >= minimum, as an int, or a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}{f' ({unit})' if unit else ''}, got {value!r}")
    return int(value)


# The kernels compute in float32: a hyper-parameter past its range became inf there (every weight NaN), and an
# eps below its normal range 0 or a denormal (a zero gradient's element NaN).
F32_MAX = 3.4028234663852886e38
F32_TINY = 1.1754943508222875e-38


def in_f32(x: float) -> bool:
    return math.isfinite(x) and abs(x) <= F32_MAX


def lr_tensor_shape(lr: Tensor, where: str = "lr") -> None:
    """A one-element floating tensor (its value not read), or a ValueError naming the argument."""
    if lr.numel() != 1 or not lr.is_floating_point():
        raise ValueError(f"{where}: expected a float or a one-element floating tensor, got a tensor of shape "
                         f"{tuple(lr.shape)} and dtype {lr.dtype}")


def lr_value(lr: Any, where: str = "lr") -> None:
    """A float or one-element floating tensor holding a finite number >= 0. A tensor's value is
    read, which for a CUDA tensor is one host sync: call this when an lr is given or assigned,
    not per step (the CUDA kernel refuses a bad value that appears on the device later)."""
    if isinstance(lr, Tensor):
        lr_tensor_shape(lr, where)
        value = float(lr)
        if not (value >= 0.0 and in_f32(value)):
            raise ValueError(f"{where}: expected a finite number >= 0, got a tensor holding {value!r}")
    elif isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not (lr >= 0.0 and in_f32(lr)):
        past = (" (past float32's range: the update runs in float32)"
                if isinstance(lr, numbers.Real) and not isinstance(lr, bool) and math.isfinite(lr) and lr > 0 else "")
        raise ValueError(f"{where}: expected a finite number >= 0, got {lr!r}{past}")


GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "bias_correction")


def hyperparameters(group: Dict[str, Any], check_lr: bool = True, state_bits: Optional[int] = None) -> None:
    """A param group's Adam settings, or a ValueError naming the one that is wrong. check_lr=False leaves
    the lr to the caller (a CUDA tensor's value costs a host sync to read); state_bits: the optimizer's, which
    a group's own must equal (ZeroRedundancyOptimizer puts its keyword arguments into every group)."""
    missing = [k for k in GROUP_KEYS if k not in group]
    if missing:   # a group edited by hand (add_param_group fills them from the defaults)
        raise ValueError(f"{missing[0]}: missing from the group (each param group holds {', '.join(GROUP_KEYS)})")
    if check_lr:
        lr_value(group["lr"])
    eps = group["eps"]
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (eps >= F32_TINY and in_f32(eps)):
        raise ValueError(f"eps: expected a finite number > 0 in float32's normal range [{F32_TINY:.4g}, "
                         f"{F32_MAX:.4g}] (the update divides by it in float32), got {eps!r}")
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas: expected a pair (beta1, beta2), got {betas!r}")
    for name, beta in zip(("betas[0]", "betas[1]"), betas):
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0.0 <= beta < 1.0:
            raise ValueError(f"{name}: expected a number in [0, 1), got {beta!r}"
                             + (" (tensor betas, which torch's Adam takes, are not supported: pass float(beta))"
                                if isinstance(beta, torch.Tensor) else ""))
    wd = group["weight_decay"]
    if isinstance(wd, bool) or not isinstance(wd, numbers.Real) or not (wd >= 0.0 and in_f32(wd)):
        raise ValueError(f"weight_decay: expected a finite number >= 0 within float32's range, got {wd!r}")
    for flag in ("decoupled_weight_decay", "bias_correction"):
        if not isinstance(group[flag], bool):
            raise ValueError(f"{flag}: expected True or False, got {group[flag]!r}")
    # torch.optim.Adam's options that change the update: a group (or a loaded state_dict) asking for one
    # must not be stepped with plain Adam's math instead
    for flag in ("amsgrad", "maximize"):
        if group.get(flag, False):
            raise ValueError(f"{flag}: {flag}=True is not implemented by effmem's Adam; stepping this group "
                             "would silently change the math")
    if state_bits is not None and group.get("state_bits", state_bits) != state_bits:   # was kept, never read
        raise ValueError(f"state_bits: a param group's own ({group['state_bits']!r}) is not supported; the "
                         f"optimizer's state_bits={state_bits} applies to all of its parameters. For float32 "
                         "moments on some (embeddings, norms), give those parameters an optimizer of their own")
    if group.get("differentiable", False):   # torch's flag for a step autograd records (meta-learning)
        raise ValueError("differentiable: differentiable=True is not implemented by effmem's Adam (its step is "
                         "not recorded by autograd); stepping this group would silently cut the graph")


# torch's Adam/AdamW flags, in every group of theirs: refused where True (hyperparameters) or dropped at a load
TORCH_ONLY_FLAGS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused")


def groups(param_groups: List[Dict[str, Any]], check_lr: bool = True, state_bits: Optional[int] = None) -> None:
    """Every group's settings (hyperparameters), the error naming the group: checked before any is used."""
    for gi, group in enumerate(param_groups):
        try:
            hyperparameters(group, check_lr, state_bits)
        except ValueError as err:
            raise ValueError(f"param_groups[{gi}]: {err}") from None


def max_norm(value: Any) -> None:
    """A number >= 0, or a one-element floating tensor as torch's clip_grad_norm_ takes (checked for sign
    only on the CPU: reading a GPU tensor would wait for the GPU)."""
    if isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point():
        if value.device.type == "cpu" and not bool(value >= 0.0):
            raise ValueError(f"max_norm: expected a value >= 0, got {value.item()!r}")
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0.0:
        raise ValueError(f"max_norm: expected a number >= 0 (or a one-element floating tensor), got {value!r}")


def is_dense(t: Tensor) -> bool:
    """True when t's elements fill one block of memory without overlap (any dim order)."""
    if t.numel() == 0:
        return True  # as torch's is_non_overlapping_and_dense: nothing to walk
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
    given, new, existing = existing + new, [local_tensor(p) for p in new], [local_tensor(p) for p in existing]
    for i, p in enumerate(new):
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"params[{i}]: expected float32, bfloat16 or float16, got {p.dtype}")
        if p.is_sparse or not is_dense(p):
            raise ValueError(f"params[{i}]: expected a dense tensor whose elements do not overlap "
                             f"(shape {tuple(p.shape)}, strides {p.stride()})")
    # (meta tensors have no memory: every data_ptr is 0, and they all "overlapped")
    spans = sorted((_span(p) + (i,) for i, p in enumerate(existing + new) if p.numel() > 0 and not p.is_meta))
    for (_, end_a, i), (start_b, _, j) in zip(spans, spans[1:]):
        if start_b < end_a:   # (a tensor listed twice: torch warns, and steps it twice)
            why = ("are one tensor listed twice: each parameter may appear once in an optimizer" if given[i] is given[j]
                   else "share memory (views of one tensor?); each element may be updated by only one parameter")
            raise ValueError(f"params: parameters {min(i, j)} and {max(i, j)} {why}")


def listed_once(groups) -> None:
    """Each parameter in one place of the param groups' lists (add_param_group refuses a repeat, a list
    changed by hand does not): listed twice in one group, the step advanced the step counts before the kernel
    refused it; in two groups, the parameter was stepped twice, silently."""
    listed = [p for g in groups for p in g["params"]]
    if len({id(p) for p in listed}) == len(listed):
        return
    where: Dict[int, Tuple[int, int]] = {}
    for gi, g in enumerate(groups):
        for i, p in enumerate(g["params"]):
            if id(p) in where:
                raise ValueError(f"param_groups[{gi}]['params'][{i}] (shape {tuple(p.shape)}) is also "
                                 f"param_groups[{where[id(p)][0]}]['params'][{where[id(p)][1]}]: each parameter "
                                 "may appear once in an optimizer")
            where[id(p)] = (gi, i)


def grad(p: Tensor) -> Tensor:
    """The gradient of p, checked, in p's memory layout (the kernels walk both as one flat span)."""
    return grad_like(p, p.grad)


def grad_like(p: Tensor, g: Tensor) -> Tensor:
    """g checked as a gradient of p (named by its shape: which of a model's parameters), in p's memory layout."""
    if g.is_sparse or g.is_complex() or g.dtype not in SUPPORTED_DTYPES:
        got = "a sparse one (use a dense embedding or torch.optim.SparseAdam)" if g.is_sparse else str(g.dtype)
        raise TypeError(f"grad of the parameter of shape {tuple(p.shape)}: expected a dense float32, bfloat16 or "
                        f"float16 gradient, got {got}")
    # both contiguous first: compiled, the strides of a view gradient (DDP's bucket views, a flat buffer's
    # pieces) are symbolic, and dynamo failed on comparing them; there another layout is copied without asking
    if not (g.is_contiguous() and p.is_contiguous()) and (torch.compiler.is_compiling() or g.stride() != p.stride()):
        g = torch.empty_like(p, dtype=g.dtype).copy_(g)
    return g


def step_value(step: Any, where: str) -> float:
    """A saved step count: a whole number in [0, 2**63) (0: a state whose steps were all skipped by
    a grad scaler), as a float. Beyond, the bias corrections divide by zero or are undefined."""
    if isinstance(step, Tensor):
        if step.numel() != 1 or step.is_complex():
            raise ValueError(f"{where}: expected a number or a one-element tensor, got a tensor of shape "
                             f"{tuple(step.shape)} and dtype {step.dtype}")
        value = float(step)
    elif isinstance(step, numbers.Real) and not isinstance(step, bool):
        value = float(step)
    else:
        raise ValueError(f"{where}: expected a step count, got {step!r}")
    if not (math.isfinite(value) and 0.0 <= value < 2.0 ** 63 and value == math.floor(value)):
        raise ValueError(f"{where}: expected a whole number in [0, 2**63), got {value!r}")
    return value


def first_bad_count(steps: Tensor) -> Optional[int]:
    """The index of the first entry of a float32 tensor of step counts (written in place into opt.state)
    that is not a whole number in [0, 2**63), or None. `steps` is read once (the caller's copy, or its own
    stack): OffloadAdam's workers may advance the counts meanwhile."""
    bad = ~(torch.isfinite(steps) & (steps >= 0) & (steps < 2.0 ** 63) & (steps == steps.floor()))
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None


def _state_tensor(saved: Dict[str, Any], key: str, where: str, shape, required: bool, codes: bool = False,
                  sharded: bool = False, shown: str = "") -> None:
    """saved[key] checked, and made this rank's shard (saved: the caller's copy). shown: the key as the
    checkpoint names it (8-bit codes: _adam8.CODE_KEYS), for the messages."""
    at = f"{where}[{shown or key!r}]"
    if key not in saved:
        if required:
            raise ValueError(f"{where}: missing {key!r} (an Adam checkpoint holds 'step', 'exp_avg' and "
                             "'exp_avg_sq' for every parameter it has state for)")
        return
    t = saved[key]
    if not isinstance(t, Tensor) or not (t.dtype == torch.uint8 if codes else t.is_floating_point()):
        got = f"a {t.dtype} tensor" if isinstance(t, Tensor) else type(t).__name__
        if isinstance(t, Tensor) and t.dtype == torch.uint8:
            got += f" (8-bit codes without their block scales, {key + '_scale'!r})"
        want = "a uint8 tensor of 8-bit codes (the checkpoint has block scales)" if codes else \
            "a floating-point tensor"
        raise TypeError(f"{at}: expected {want}, got {got}")
    t = saved[key] = local_tensor(t)
    if t.is_meta:
        raise ValueError(f"{at}: a meta tensor, which holds no values (a checkpoint loaded with "
                         "device='meta', or a template never filled)")
    if tuple(t.shape) != tuple(shape):
        whose = ("this rank's shard of the parameter (FSDP2): a checkpoint of whole tensors loads through "
                 "torch.distributed.checkpoint's set_optimizer_state_dict") if sharded else "the parameter's"
        raise ValueError(f"{at}: expected shape {tuple(shape)} ({whose}), got {tuple(t.shape)}")


def _scales(saved: Dict[str, Any], key: str, where: str, p: Tensor, codes: Tensor) -> Optional[Tensor]:
    """saved[key], block scales, checked and made this rank's (saved: the caller's copy; p and codes: this
    rank's). Scales by rows (_adam8.rows_out, a checkpoint's) become p's block scales where their blocks are p's
    (saved on the same shards) and the codes lie in row-major order; otherwise they are returned (this
    rank's rows), for the caller to decode the moments with."""
    from effmem.optim import _adam8
    if isinstance(saved.get(key), Tensor) and saved[key].dim() == 2:
        t, row = local_tensor(saved[key]), int(p.shape[1:].numel())
        want = (p.shape[0] if p.dim() else 0, 1 + _adam8.row_width(row))
        bad = (_adam8.offsets_problem(t[:, 0], row) if p.dim() and t.is_floating_point() and not t.is_meta
               and tuple(t.shape) == want else f"a {t.dtype} tensor of shape {tuple(t.shape)}")
        if bad is not None:
            raise ValueError(f"{where}[{key!r}]: expected block scales by rows, float, of shape {want} (each "
                             "row's offset in its first block, where the row before it ended or 0, then the scales "
                             f"of the blocks it overlaps), got {bad}")
        _scale_values(t[:, 1:], where, key)
        own = _adam8.rows_in(t, row)
        if own is None or not codes.is_contiguous():
            return t
        saved[key] = own
        return None
    t = saved[key] = _adam8.local_scales(saved.get(key), p.numel())
    blocks = _adam8.blocks(p.numel())
    if not isinstance(t, Tensor) or not t.is_floating_point() or t.is_meta or tuple(t.shape) != (blocks,):
        got = (f"a {t.dtype} tensor of shape {tuple(t.shape)}{' on the meta device (no values)' if t.is_meta else ''}"
               if isinstance(t, Tensor) else type(t).__name__)
        raise ValueError(f"{where}[{key!r}]: expected {blocks} float block scales (one per 256 elements of the "
                         f"parameter), got {got}")
    _scale_values(t, where, key)
    return None


def _scale_values(t: Tensor, where: str, key: str) -> None:
    """Block scales are maxima of finite |m| and sqrt(v): a NaN or inf one made the next step's weights NaN or
    inf, and a negative exp_avg_scale turned the momentum around, silently (read once, at a load)."""
    bad = ~((t >= 0) & (t <= F32_MAX))   # NaN fails both
    if bool(bad.any()):
        raise ValueError(f"{where}[{key!r}]: block scales are each block's largest moment, finite and >= 0; got "
                         f"{float(t[bad][0])!r} (a corrupted checkpoint?)")


def entry(saved: Any, p: Tensor, where: str, by_torch: bool = False) -> Tuple[Dict[str, Any], float, bool]:
    """One parameter's checkpoint entry (or an opt.state entry assigned by hand) checked against p: a copy
    with its 8-bit codes under torch's names and this rank's shards, its step count, and whether it held a
    float32 master that p (float32, holding other weights) leaves unused (taken out). by_torch: torch's Adam/AdamW
    wrote it (a master there is FusedAdam's, carried along and stale)."""
    if not isinstance(saved, dict):
        raise TypeError(f"{where}: expected a dict of state tensors, got {type(saved).__name__}")
    from effmem.optim import _adam8
    shape, sharded = local_tensor(p).shape, is_dtensor(p)
    eight = "exp_avg_scale" in saved or "exp_avg_sq_scale" in saved
    original = saved
    # a copy (scales and masters are taken out or narrowed below: not in the caller's), its 8-bit codes
    # under torch's names
    saved = _adam8.checkpoint_in(saved, where)
    by_rows = {}
    for key in ("exp_avg", "exp_avg_sq"):
        shown = _adam8.CODE_KEYS[key] if _adam8.CODE_KEYS[key] in original else key
        _state_tensor(saved, key, where, shape, True, codes=eight, sharded=sharded, shown=shown)
        if eight:   # the blocks of this rank's shard (FSDP2)
            by_rows[key] = _scales(saved, key + "_scale", where, local_tensor(p), saved[key])
    if any(s is not None for s in by_rows.values()):
        # saved by rows on other shards (FSDP2 on another mesh; a whole-tensor checkpoint of FSDP2's loaded
        # without it): the blocks are not p's, so the moments load decoded, as a float32 checkpoint's do (an
        # 8-bit optimizer encodes them anew)
        saved = _adam8.decoded(saved, by_rows)
    _state_tensor(saved, "master", where, shape, False, sharded=sharded)
    # torch's optimizers carry FusedAdam's master along cast to the parameter's dtype (float32 for a model made
    # float32 meanwhile), never updated: not a master any more, the parameter is
    stale = "master" in saved and (by_torch or saved["master"].dtype != torch.float32)
    master_unused = not stale and "master" in saved and p.dtype == torch.float32 and not _rounds_to(saved["master"], p)
    if stale or master_unused:
        saved = {k: v for k, v in saved.items() if k != "master"}
    if "step" not in saved:   # taken for 0, the next step corrected saved moments as first ones
        raise ValueError(f"{where}: missing 'step' (an Adam checkpoint holds 'step', 'exp_avg' and "
                         "'exp_avg_sq' for every parameter it has state for)")
    return saved, step_value(saved["step"], f"{where}['step']"), master_unused


def state_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (32, 8):
        raise ValueError(f"state_bits: expected 32 (float32 moments) or 8 (8-bit moments), got {bits!r}")
    return bits


def checkpoint(optimizer: torch.optim.Optimizer, state_dict: Any, name: str, warn: bool = True):
    """Checks a whole checkpoint before anything of it is loaded, so that a refused one changes
    nothing. Returns [(param, saved state or None, step)] in the optimizer's parameter order, the saved
    tensors this rank's shards (a DTensor's local tensor, as a parameter's: both optimizers load those)."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(f"state_dict: expected a dict with 'state' and 'param_groups' (from "
                         f"optimizer.state_dict()), got {type(state_dict).__name__}"
                         + (f" with keys {sorted(map(str, state_dict))}" if isinstance(state_dict, dict) else ""))
    groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(saved_state, dict):
        raise TypeError(f"state_dict['state']: expected a dict from parameter id to its state, got "
                        f"{type(saved_state).__name__}")
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) and isinstance(g.get("params"), (
            list, tuple)) for g in groups):
        raise TypeError("state_dict['param_groups']: expected a list of dicts, each with a list 'params', got "
                        f"{type(groups).__name__}" + (f" of {[type(g).__name__ for g in groups]}"
                                                      if isinstance(groups, (list, tuple)) else ""))
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"state_dict: has {len(groups)} param groups but this {name} has "
                         f"{len(optimizer.param_groups)}")
    for gi, (group, mine) in enumerate(zip(groups, optimizer.param_groups)):
        if len(group["params"]) != len(mine["params"]):
            raise ValueError(f"state_dict: param_groups[{gi}] has {len(group['params'])} parameters but this "
                             f"{name}'s group {gi} has {len(mine['params'])}")
        merged = dict(optimizer.defaults)
        merged.update({k: v for k, v in group.items() if k != "params"})
        try:
            hyperparameters(merged)
        except (TypeError, ValueError) as err:
            raise type(err)(f"state_dict: param_groups[{gi}]: {err}") from None
    listed = {saved_id for group in groups for saved_id in group["params"]}
    stray = [k for k in saved_state if k not in listed]
    if stray:   # torch's loader keeps them under those keys, unused: those parameters' moments would start afresh
        hint = (" (string keys: a JSON or YAML round trip turns the integer ids into strings)"
                if any(isinstance(k, str) for k in stray) else "")
        raise ValueError(f"state_dict['state']: entries {stray[:5]!r}{' ...' if len(stray) > 5 else ''} belong to "
                         f"no parameter of state_dict['param_groups'] (ids {sorted(listed, key=str)[:5]!r}"
                         f"{' ...' if len(listed) > 5 else ''}){hint}")
    plan, unused = [], []
    by_torch = any("amsgrad" in group for group in groups)   # TORCH_ONLY_FLAGS: our loads drop them
    for gi, (group, mine) in enumerate(zip(groups, optimizer.param_groups)):
        for saved_id, p in zip(group["params"], mine["params"]):
            saved = saved_state.get(saved_id)
            step = 0.0
            if isinstance(saved, dict) and not saved:
                saved = None   # an empty entry, left by a read of opt.state[p] (a defaultdict): no state, as torch
            if saved is not None:
                saved, step, master_unused = entry(saved, p, f"state_dict['state'][{saved_id!r}]", by_torch)
                if master_unused:
                    unused.append(saved_id)
            plan.append((p, saved, step))
    if unused and warn:
        warnings.warn(f"{name}.load_state_dict: state_dict['state'] entries {unused[:5]!r}"
                      f"{' ...' if len(unused) > 5 else ''} hold a bf16/fp16 run's float32 master weights, and "
                      "their float32 parameters do not hold those weights rounded, so each keeps its own values "
                      "and the masters go unused. To go on from the exact weights, load the model's weights "
                      "first, then the optimizer's.", stacklevel=_caller_level())
    return plan


def _rounds_to(master: Tensor, p: Tensor) -> bool:
    """A float32 parameter holds the weights of the bf16/fp16 run whose master this is, rounded (the model's
    checkpoint, loaded first) or exactly (consolidated float32 weights): the optimizer's load puts the exact
    master in, so that the run goes on from it and not from its rounding. Otherwise the parameter holds other
    weights, which the load keeps."""
    local = local_tensor(p).detach()
    master = master.to(local.device)
    return torch.equal(master, local) or any(torch.equal(master.to(d).float(), local)
                                             for d in (torch.bfloat16, torch.float16))


def _caller_level() -> int:
    """warnings.warn's stacklevel for the first frame outside effmem and torch (the user's load_state_dict
    call, or theirs into torch.distributed.checkpoint), however deep the loaders and decorators run."""
    import os
    import sys
    roots = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["effmem"]))   # not torchtune
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(roots):
        level, frame = level + 1, frame.f_back
    return level


def complete_groups(optimizer: torch.optim.Optimizer) -> None:
    """After loading: keys a torch.optim checkpoint lacks take the optimizer's defaults."""
    for group in optimizer.param_groups:
        for key, value in optimizer.defaults.items():
            group.setdefault(key, value)


def offload_modes(*, overlap, delay, async_step, pin_state, delay_correction, stream_grads) -> None:
    """OffloadAdam's mode flags: booleans (a string "False" would be taken for True), one mode at most, and
    delay_correction only on top of delay."""
    for flag, value in (("overlap", overlap), ("delay", delay), ("async_step", async_step),
                        ("pin_state", pin_state), ("delay_correction", delay_correction)):
        if not isinstance(value, bool):
            raise ValueError(f"{flag}: expected True or False, got {value!r}")
    if stream_grads is not None and not isinstance(stream_grads, bool):
        raise ValueError(f"stream_grads: expected True, False or None (the default), got {stream_grads!r}")
    if sum((overlap, delay, async_step)) > 1:
        raise ValueError("overlap, delay, async_step: choose one (overlap updates during backward, delay and "
                         "async_step during the next forward; delay with stale gradients)")
    if delay_correction and not delay:
        raise ValueError("delay_correction: corrects delay=True's stale gradients; pass delay=True too "
                         "(async_step and the default are exact already)")
