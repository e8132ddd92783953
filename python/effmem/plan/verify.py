"""effmem plan --verify: run a few steps of a candidate and put what it measured beside what was predicted.

CUDA: the peak is torch.cuda.max_memory_allocated over the steps, compared
with the prediction's allocated bytes (the peak less the reserve the
allocator cannot see). Everywhere: model states are the bytes of the
parameters, their gradients and the optimizer's state tensors; activations
are the bytes a training forward leaves alive, measured as the allocator's
bytes in use after forward minus before (glibc's mallinfo2 on the CPU,
torch.cuda.memory_allocated on a GPU).
"""
import copy
import ctypes
import gc
import time
from typing import Callable, List, Optional

import torch
from torch import nn

from effmem.optim._validate import whole
from effmem.plan.apply import check_device, micro_batch
from effmem.plan.costs import under_autocast
from effmem.plan.report import size_text
from effmem.plan.trace import model_inputs


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _host_in_use() -> Optional[int]:
    """Bytes malloc has handed out and not taken back (heap plus mmap'd blocks), or None off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd


def bytes_in_use(device: torch.device) -> Optional[int]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    gc.collect()
    return _host_in_use()


def _loss_of(out) -> torch.Tensor:
    if hasattr(out, "loss"):
        return out.loss
    if isinstance(out, (tuple, list)):
        return next(t for t in out if torch.is_tensor(t) and t.dim() == 0)
    return out


def model_for(plan, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """A randomly initialised model of the plan's config (no download), or the plan's own module.

    Built where it trains and, given ``dtype``, in that dtype from the start: a 1B model's random init
    takes seconds on a GPU, minutes on two cores, and a 13B one built in float32 and cast afterwards
    would hold 52 + 26 GB on the way."""
    spec = plan.spec
    if spec.module is not None:
        return spec.module
    import transformers
    cfg = dict(spec.config)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.use_cache = False
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)  # what from_config builds in, whatever its keyword is called
    try:
        with torch.device("cuda" if plan.device == "cuda" else "cpu"):
            return transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)


def verify(plan, model: Optional[nn.Module] = None, candidates: Optional[List[str]] = None, steps: int = 3,
           make_model: Optional[Callable[[], nn.Module]] = None, inputs=None, warmup: int = 1) -> List[dict]:
    """Train `warmup` + `steps` + 1 steps of each named candidate (default: the pick) and measure it: the step
    time as the median of the `steps` after the warm-up (the first steps make the optimizer's state and grow
    the allocator's cache; on the H200 of 2026-11-27 a first configuration timed with its first step counted
    measured 1.16x slower than one doing more work), the memory in the last, untimed, and the peak over all.
    One dict per candidate. Each trains a model of its own: make_model's, a copy of `model` (or of the module
    the plan was made from), or one built from the plan's config; the model given is left as it was (applied
    to it, the second candidate found the first one's policy in place, and its weights trained). A copy needs
    room beside the model given; on a GPU what was allocated before it is left out of the measured peak."""
    steps, warmup = whole(steps, "steps", 1), whole(warmup, "warmup", 0)
    names = candidates or ([plan.best] if plan.best else [])
    check_device(plan)   # before a model is built on a missing GPU (torch's "no NVIDIA driver")
    given = model if model is not None else plan.spec.module
    rows = []
    cuda = plan.device == "cuda"
    for name in names:
        c = plan.candidate(name)
        # what the device holds before the candidate's model exists (the model given, kept as it was) is not
        # the candidate's: left out of its measured peak
        held = torch.cuda.memory_allocated() if cuda else 0
        if make_model:
            m = make_model()
        elif given is not None:
            m = copy.deepcopy(given)
        else:
            m = model_for(plan, torch.bfloat16 if c.config.precision == "bf16" else torch.float32)
        m, opt = plan.apply(m, name)
        try:
            rows.append(_measure(c, m, opt, steps, plan.seq, inputs, warmup, held))
        finally:   # an OffloadAdam left open would refuse the next candidate over the same model
            if hasattr(opt, "close"):
                opt.close()
            # gone before the next candidate's `held` is read (else its peak left out this one's model and state)
            del m, opt
            gc.collect()
    return rows


def _measure(c, m: nn.Module, opt, steps: int, seq: int, inputs, warmup: int = 0, held: int = 0) -> dict:
    """`steps` training steps of candidate c, applied as m and opt: what they measured beside what c predicted.
    held: bytes the GPU held before the candidate's model was made, left out of its peak."""
    device = next(m.parameters()).device
    cfg = c.config
    args, kwargs = model_inputs(m, inputs, cfg.micro_batch, seq, device, next(m.parameters()).dtype)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=under_autocast(cfg.precision, device.type))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    measured_act = None
    t_steps = []
    total = warmup + steps
    # One more step after the timed ones measures memory (activations alive after forward, model states),
    # untimed: bytes_in_use synchronizes the GPU (so the host could not issue backward while the device ran
    # forward) and, on a CPU, runs the garbage collector (about 0.2 s with transformers imported, where the
    # step it timed took 5 ms).
    for step in range(total + 1):
        measuring = step == total
        t0 = time.perf_counter()
        for micro in range(cfg.accumulation):
            with micro_batch(opt, micro, cfg.accumulation):
                before = bytes_in_use(device) if measuring and micro == cfg.accumulation - 1 else None
                with autocast:
                    out = m(*args, **kwargs)
                if before is not None:
                    measured_act = bytes_in_use(device) - before
                _loss_of(out).backward()
                del out
        grads = _state_bytes(m, opt, device)["grads"] if measuring else None   # alive until zero_grad
        opt.step()
        if measuring:   # the optimizer's state as the step leaves it (the first step makes it)
            measured_states = dict(_state_bytes(m, opt, device), grads=grads)
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if warmup <= step < total:
            t_steps.append(time.perf_counter() - t0)
    row = {"name": c.name, "device": str(device), "steps": steps, "warmup": warmup,
           "predicted_activation_bytes": c.cost.forward_alive,
           "measured_activation_bytes": measured_act,
           "predicted_state_bytes": c.cost.states, "measured_state_bytes": measured_states,
           "predicted_step_s": c.step_time_s, "measured_step_s": sorted(t_steps)[len(t_steps) // 2]}
    if device.type == "cuda":
        row["predicted_allocated_bytes"] = c.cost.allocated_bytes
        row["measured_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device) - held
    return row


def _state_bytes(model: nn.Module, opt, device: torch.device) -> dict:
    """Model states as allocated on the training device: weights, gradients (p.grad), optimizer state."""
    params = list(model.parameters())
    master = optimizer = 0
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.device == device:
                if k == "master":
                    master += v.nbytes
                else:
                    optimizer += v.nbytes
    return {"weights": sum(p.nbytes for p in params),
            "grads": sum(p.grad.nbytes for p in params if p.grad is not None),
            "master": master, "optimizer": optimizer}


def format_verify(rows: List[dict]) -> str:
    def gb(n):
        return "n/a" if n is None else size_text(n, 3)
    lines = ["verify: predicted against measured (GB = 1e9 bytes; the measured activations include autograd's "
             "own graph)"]
    for r in rows:
        lines.append(f"  {r['name']} on {r['device']}, {r['steps']} steps timed after {r.get('warmup', 0)} more:")
        lines.append(f"    activations alive after forward: predicted {gb(r['predicted_activation_bytes'])}, "
                     f"measured {gb(r['measured_activation_bytes'])}")
        for k, v in r["predicted_state_bytes"].items():
            lines.append(f"    {k:<12} predicted {gb(v)}, measured {gb(r['measured_state_bytes'].get(k))}")
        if "measured_max_allocated_bytes" in r:
            lines.append(f"    peak allocated: predicted {gb(r['predicted_allocated_bytes'])}, measured "
                         f"{gb(r['measured_max_allocated_bytes'])}")
        lines.append(f"    step: predicted {r['predicted_step_s'] * 1e3:.0f} ms, measured "
                     f"{r['measured_step_s'] * 1e3:.0f} ms (median)")
    return "\n".join(lines)
