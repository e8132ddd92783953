"""Typed wrappers around the effmem torch ops, and their fake kernels.

The ops themselves are registered in C++ (csrc/ops.cpp) under torch.ops.effmem;
the fake kernels here let torch.compile and FakeTensor trace them.
"""
import math
from typing import List, Optional, Sequence, Tuple

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
    status: Optional[Tensor] = None,
    exp_avg_scales: Optional[Sequence[Tensor]] = None,
    exp_avg_sq_scales: Optional[Sequence[Tensor]] = None,
    salts: Optional[Sequence[int]] = None,
) -> None:
    """One fused Adam/AdamW step over same-dtype tensors on one device.

    Updates params, exp_avgs, exp_avg_sqs and masters in place. For bf16/fp16
    params, ``masters`` holds their fp32 master weights and the params receive
    master rounded to nearest even; for fp32 params pass ``masters=[]``.
    ``steps[i]`` is param i's step count after this step (float32 tensor on the
    params' device). See csrc/common/adam_math.h for the formula.

    A step count that is not a whole number in [1, 2^63), or an ``lr_tensor``
    that is negative or not finite, is refused: on the CPU with a ValueError,
    before anything is written; on CUDA (where reading them would cost a host
    sync) the tensors concerned are left unchanged (a bad step count: that
    tensor alone, the others are updated) and ``status`` (int32, one element,
    when given) gets 1 (lr) or 2 (step count) ORed in. Every tensor written
    must have memory of its own.

    8-bit moments (``torch.ops.effmem.adam8_step_``, csrc/common/adam8_math.h):
    give ``exp_avg_scales``, ``exp_avg_sq_scales`` (float32 [ceil(numel/256)]
    each) and ``salts`` (one int per tensor, its place in the optimizer);
    exp_avgs and exp_avg_sqs are then uint8 codes laid out as the params.
    """
    lr, beta1, beta2, eps, weight_decay = (_number(n, v) for n, v in (
        ("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps), ("weight_decay", weight_decay)))
    if exp_avg_scales is not None or exp_avg_sq_scales is not None or salts is not None:
        if exp_avg_scales is None or exp_avg_sq_scales is None or salts is None:
            raise ValueError("exp_avg_scales, exp_avg_sq_scales and salts: 8-bit moments need all three")
        _lib.adam8_step_(
            list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(exp_avg_scales),
            list(exp_avg_sq_scales), list(masters), list(steps), [int(s) for s in salts], lr, beta1,
            beta2, eps, weight_decay, bool(decoupled), bool(bias_correction), lr_tensor,
            inv_scale, found_inf, status,
        )
        return
    _lib.adam_step_(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(masters), list(steps),
        lr, beta1, beta2, eps, weight_decay, bool(decoupled),
        bool(bias_correction), lr_tensor, inv_scale, found_inf, status,
    )


def _number(name: str, value) -> float:
    """A hyper-parameter as the op's float; float()'s own error named no argument ('could not convert string to
    float', 'only one element tensors can be converted'), so it is said again naming it. Nothing is checked on
    the way that float() does not check: this runs at every step."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)
        raise TypeError(f"{name}: expected a real number (or a one-element tensor), got {got}") from None


def adam_check(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
               exp_avg_sqs: Sequence[Tensor], masters: Sequence[Tensor], steps: Sequence[Tensor],
               exp_avg_scales: Sequence[Tensor] = (), exp_avg_sq_scales: Sequence[Tensor] = ()) -> None:
    """adam_step_'s checks of its lists (adam8_step_'s, given the block scales), writing nothing: raises what
    the step would."""
    _lib.adam_check(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(masters), list(steps),
                    list(exp_avg_scales), list(exp_avg_sq_scales))


def l2norm(tensors: Sequence[Tensor]) -> Tensor:
    """Global L2 norm of float32/bf16/fp16 tensors on one device, as a float32 scalar there."""
    return _lib.l2norm(list(tensors))


def _one_device(op: str, named) -> None:
    """The fake kernels run for meta tensors, also when real ones come with them (the dispatcher
    picks Meta for the whole call): refuse such a mix rather than silently doing nothing."""
    devices = {}
    for name, t in named:
        if t is not None:
            devices.setdefault(str(t.device), name)
    if len(devices) > 1:
        found = ", ".join(f"{name} on {dev}" for dev, name in devices.items())
        raise ValueError(f"effmem::{op}: all tensors must be on one device, got {found}")


# masters (float32 parameters have none) and adam_check's block scales (float32 moments have none)
OPTIONAL_LISTS = ("masters", "exp_avg_scales", "exp_avg_sq_scales")


def _adam_fake(op: str, lists, lr_tensor, inv_scale, found_inf, status, hyper=None) -> None:
    """What both Adam ops' fake kernels check (a few of check_adam_args', csrc/common/checks.cpp, so that a call
    traced or run on meta tensors is not accepted where the kernel refuses it): every tensor on one device, one
    of each list per parameter (OPTIONAL_LISTS: none or one) of its size, the hyper-parameters' ranges. They
    return nothing."""
    _one_device(op, [(f"{n}[{i}]", t) for n, ts in lists for i, t in enumerate(ts)] +
                [("lr_tensor", lr_tensor), ("inv_scale", inv_scale), ("found_inf", found_inf), ("status", status)])
    params = lists[0][1]
    for name, ts in lists[1:]:
        torch._check(len(ts) == len(params) or (name in OPTIONAL_LISTS and not ts),
                     lambda: f"{name} must hold one tensor per parameter ({len(params)}), got {len(ts)}")
        if name in ("grads", "masters", "exp_avgs", "exp_avg_sqs"):
            for i, (t, p) in enumerate(zip(ts, params)):
                torch._check(t.shape == p.shape, lambda: f"{name}[{i}] has shape {tuple(t.shape)} but params[{i}] "
                                                         f"{tuple(p.shape)}")
    if hyper is not None:
        lr, beta1, beta2, eps, weight_decay = hyper
        torch._check(0 <= lr < math.inf, lambda: f"lr must be a finite number >= 0, got {lr}")
        torch._check(0 <= beta1 < 1 and 0 <= beta2 < 1, lambda: f"beta1 and beta2 must be in [0, 1), got {beta1}, "
                                                                f"{beta2}")
        torch._check(0 < eps < math.inf, lambda: f"eps must be a finite number > 0, got {eps}")
        torch._check(0 <= weight_decay < math.inf, lambda: f"weight_decay must be a finite number >= 0, got "
                                                           f"{weight_decay}")


@torch.library.register_fake("effmem::adam_step_")
def _adam_step_fake(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps,
                    weight_decay, decoupled, bias_correction, lr_tensor=None, inv_scale=None,
                    found_inf=None, status=None) -> None:
    _adam_fake("adam_step_", (("params", params), ("grads", grads), ("exp_avgs", exp_avgs),
                              ("exp_avg_sqs", exp_avg_sqs), ("masters", masters), ("steps", steps)),
               lr_tensor, inv_scale, found_inf, status, (lr, beta1, beta2, eps, weight_decay))


@torch.library.register_fake("effmem::adam8_step_")
def _adam8_step_fake(params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, masters, steps,
                     salts, lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction, lr_tensor=None,
                     inv_scale=None, found_inf=None, status=None) -> None:
    _adam_fake("adam8_step_", (("params", params), ("grads", grads), ("exp_avgs", exp_avgs),
                               ("exp_avg_sqs", exp_avg_sqs), ("exp_avg_scales", exp_avg_scales),
                               ("exp_avg_sq_scales", exp_avg_sq_scales), ("masters", masters), ("steps", steps)),
               lr_tensor, inv_scale, found_inf, status, (lr, beta1, beta2, eps, weight_decay))


@torch.library.register_fake("effmem::adam_check")
def _adam_check_fake(params, grads, exp_avgs, exp_avg_sqs, masters, steps, exp_avg_scales,
                     exp_avg_sq_scales) -> None:
    _adam_fake("adam_check", (("params", params), ("grads", grads), ("exp_avgs", exp_avgs),
                              ("exp_avg_sqs", exp_avg_sqs), ("masters", masters), ("steps", steps),
                              ("exp_avg_scales", exp_avg_scales), ("exp_avg_sq_scales", exp_avg_sq_scales)),
               None, None, None, None)


@torch.library.register_fake("effmem::adam8_encode")
def _adam8_encode_fake(m, v, step, salt):
    from effmem.optim._adam8 import blocks as count_blocks
    _one_device("adam8_encode", [("m", m), ("v", v)])
    n, blocks = m.numel(), count_blocks(m.numel())
    for name, t in (("m", m), ("v", v)):   # check_flat's (csrc/cpu/adam.cpp)
        torch._check(t.dtype == torch.float32 and t.dim() == 1 and t.is_contiguous() and t.numel() == n,
                     lambda: f"{name} must be a contiguous 1-D float32 tensor of {n} elements, got {t.dtype} "
                             f"{tuple(t.shape)}")
    return (m.new_empty((n,), dtype=torch.uint8), m.new_empty((n,), dtype=torch.uint8),
            m.new_empty((blocks,), dtype=torch.float32), m.new_empty((blocks,), dtype=torch.float32))


@torch.library.register_fake("effmem::adam8_decode")
def _adam8_decode_fake(codes, scales, second):
    from effmem.optim._adam8 import blocks as count_blocks
    _one_device("adam8_decode", [("codes", codes), ("scales", scales)])
    for name, t, dtype, n in (("codes", codes, torch.uint8, codes.numel()),
                              ("scales", scales, torch.float32, count_blocks(codes.numel()))):
        torch._check(t.dtype == dtype and t.dim() == 1 and t.is_contiguous() and t.numel() == n,
                     lambda: f"{name} must be a contiguous 1-D {dtype} tensor of {n} elements, got {t.dtype} "
                             f"{tuple(t.shape)}")
    return scales.new_empty((codes.numel(),), dtype=torch.float32)


def _dense(t: Tensor) -> bool:
    """C++'s is_non_overlapping_and_dense (no Python method has it): its dims ordered by stride tile its
    memory exactly, with no gap and no element twice (an expanded view's stride 0)."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return t.numel() == 0
        expected *= size
    return True


@torch.library.register_fake("effmem::l2norm")
def _l2norm_fake(tensors: List[Tensor]) -> Tensor:
    _one_device("l2norm", [(f"tensors[{i}]", t) for i, t in enumerate(tensors)])
    for i, t in enumerate(tensors):   # check_norm_args' (csrc/common/checks.cpp)
        torch._check(t.dtype in ELEMENTWISE_DTYPES, lambda: f"tensors[{i}] must be float32, bfloat16 or float16, "
                                                            f"got {t.dtype}")
        torch._check(_dense(t), lambda: f"tensors[{i}] must be dense and non-overlapping; pass t.contiguous()")
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    return tensors[0].new_empty((), dtype=torch.float32)


QUANT_BITS = (4, 8)
QUANT_GROUP_SIZES = (32, 64, 128, 256)
# the dtypes of the quantize and elementwise kernels (swiglu, rms_norm_apply)
ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_quant_config(bits: int, group_size: int) -> None:
    """ValueError naming the argument when bits or group_size is not one the kernels support."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in QUANT_BITS:
        raise ValueError(f"bits: expected one of {QUANT_BITS}, got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in QUANT_GROUP_SIZES:
        raise ValueError(f"group_size: expected one of {QUANT_GROUP_SIZES}, got {group_size!r}")


def quantize(x: Tensor, *, bits: int = 8, group_size: int = 128, seed: int = 0,
             stochastic: bool = True) -> Tuple[Tensor, Tensor]:
    """Group-wise quantisation of ``x`` along its last dimension.

    Returns ``(codes, stats)``: codes uint8 ``[rows, ceil(D * bits / 8)]`` (at 4
    bits two per byte, low nibble first), stats float32 ``[rows, groups, 2]``
    holding each group's (min, scale), or (v, -step) for a group whose one
    extreme value v (a mask, -inf, +inf) is kept exactly while the others are
    stored symmetrically (csrc/common/quant_math.h); rows = numel / D,
    D = x.shape[-1]. ``stochastic`` rounding draws from a counter-based hash of
    (seed, element index), so it is unbiased and gives the same codes on CPU
    and CUDA. A group holding NaN, or both -inf and +inf, dequantises to NaN.
    """
    check_quant_config(bits, group_size)
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x: expected a float32, bfloat16 or float16 tensor, got {x.dtype}")
    # the overload itself, not the packet: resolving the packet costs about 7 us a call, as much as the op's
    # own dispatch (these run once per saved activation)
    if not isinstance(stochastic, bool):   # bool("False") is True
        raise TypeError(f"stochastic: expected True or False, got {stochastic!r}")
    return _lib.quantize.default(x.contiguous(), int(bits), int(group_size), _seed_int64(seed), stochastic)


def _seed_int64(seed) -> int:
    """A seed in [0, 2**64) as the int64 the op takes (the kernels read its 64 bits unsigned)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed: expected an int in [0, 2**64), got {seed!r}")
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def dequantize(codes: Tensor, stats: Tensor, *, bits: int, group_size: int, shape: Sequence[int],
               dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`quantize`: a contiguous tensor of ``shape`` and ``dtype``."""
    check_quant_config(bits, group_size)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype (torch.float32, torch.bfloat16, torch.float16), got {dtype!r}")
    if not isinstance(shape, (tuple, list, torch.Size)) or not all(isinstance(d, int) for d in shape):
        raise TypeError(f"shape: expected a sequence of ints (the quantised tensor's shape), got {shape!r}")
    shape = tuple(shape)
    last_dim = shape[-1] if shape else 1
    out = _lib.dequantize.default(codes, stats, int(bits), int(group_size), int(last_dim), dtype)
    if out.numel() != math.prod(shape):
        raise ValueError(f"shape: {shape} holds {math.prod(shape)} elements, but the codes hold {out.shape[0]} "
                         f"rows of {last_dim} (quantize's input had as many rows as elements / shape[-1])")
    return out.reshape(shape)


@torch.library.register_fake("effmem::quantize")
def _quantize_fake(x, bits, group_size, seed, stochastic):
    # the kernels' checks (csrc/common/checks.cpp), so that a compiled call is refused when traced
    check_quant_config(bits, group_size)
    torch._check(x.dtype in ELEMENTWISE_DTYPES, lambda: f"x must be float32, bfloat16 or float16, got {x.dtype}")
    torch._check(x.is_contiguous(), lambda: "x must be contiguous; pass x.contiguous()")
    last_dim = x.shape[-1] if x.dim() > 0 else 1
    rows = x.numel() // last_dim if last_dim > 0 else 0  # as quant_layout: no rows when D = 0
    codes = x.new_empty((rows, (last_dim * bits + 7) // 8), dtype=torch.uint8)
    stats = x.new_empty((rows, (last_dim + group_size - 1) // group_size, 2), dtype=torch.float32)
    return codes, stats


@torch.library.register_fake("effmem::dequantize")
def _dequantize_fake(codes, stats, bits, group_size, last_dim, dtype):
    check_quant_config(bits, group_size)
    _one_device("dequantize", [("codes", codes), ("stats", stats)])
    torch._check(dtype in ELEMENTWISE_DTYPES, lambda: f"dtype must be float32, bfloat16 or float16, got {dtype}")
    torch._check(codes.dtype == torch.uint8, lambda: f"codes must be uint8, got {codes.dtype}")
    torch._check(stats.dtype == torch.float32, lambda: f"stats must be float32, got {stats.dtype}")
    torch._check(last_dim >= 0, lambda: f"last_dim must be >= 0, got {last_dim}")
    torch._check(codes.dim() == 2, lambda: f"codes must be 2-D [rows, bytes per row], got shape {tuple(codes.shape)}")
    torch._check(stats.dim() == 3 and stats.shape[-1] == 2 and stats.shape[0] == codes.shape[0],
                 lambda: f"stats must be 3-D [rows, groups, 2] with codes' rows, got shape {tuple(stats.shape)}")
    torch._check(codes.is_contiguous() and stats.is_contiguous(), lambda: "codes and stats must be contiguous")
    row_bytes, groups = (last_dim * bits + 7) // 8, (last_dim + group_size - 1) // group_size   # quant_layout's
    torch._check(codes.shape[1] == row_bytes and stats.shape[1] == groups,
                 lambda: f"codes has {codes.shape[1]} bytes and stats {stats.shape[1]} groups per row, but "
                         f"last_dim={last_dim} at {bits} bits in groups of {group_size} needs {row_bytes} and {groups}")
    return codes.new_empty((codes.shape[0], last_dim), dtype=dtype)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up in one pass, rounded as ``F.silu(gate) * up`` rounds, within a unit in the last place
    (csrc/common/swiglu_math.h): float32, bfloat16 or float16 tensors of one shape, dtype and device; the same
    bits on CPU and CUDA."""
    return _lib.swiglu.default(gate, up)


def swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    """(grad_gate, grad_up) of silu(gate) * up for the incoming gradient ``grad``, in one pass."""
    return _lib.swiglu_backward.default(grad, gate, up)


def _swiglu_fake_check(op: str, named) -> Tensor:
    """The fake kernels' checks of swiglu's and swiglu_backward's tensors (named: [("grad", t)], gate, up)."""
    _one_device(op, named)
    gate = dict(named)["gate"]
    torch._check(gate.dtype in ELEMENTWISE_DTYPES,
                 lambda: f"gate must be float32, bfloat16 or float16, got {gate.dtype}")
    for name, t in named:
        torch._check(t.dtype == gate.dtype and t.shape == gate.shape,
                     lambda: f"{name} must match gate ({gate.dtype} {tuple(gate.shape)}), got {t.dtype} "
                             f"{tuple(t.shape)}")
    return gate


@torch.library.register_fake("effmem::swiglu")
def _swiglu_fake(gate, up):
    return torch.empty_like(_swiglu_fake_check("swiglu", [("gate", gate), ("up", up)]),
                            memory_format=torch.contiguous_format)


@torch.library.register_fake("effmem::swiglu_backward")
def _swiglu_backward_fake(grad, gate, up):
    g = _swiglu_fake_check("swiglu_backward", [("grad", grad), ("gate", gate), ("up", up)])
    return (torch.empty_like(g, memory_format=torch.contiguous_format),
            torch.empty_like(g, memory_format=torch.contiguous_format))


def rms_norm_apply(x: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    """weight * (x * rstd) in one pass, rounded as ``weight * (x.float() * rstd).to(x.dtype)`` rounds (Hugging
    Face's Llama-family RMSNorm after its statistics; csrc/common/rms_norm_math.h): x float32, bfloat16 or
    float16; weight 1-D of x's last size and dtype; rstd float32, one value per row of x. Same bits on CPU
    and CUDA."""
    return _lib.rms_norm_apply.default(x, rstd, weight)


@torch.library.register_fake("effmem::rms_norm_apply")
def _rms_norm_apply_fake(x, rstd, weight):
    _one_device("rms_norm_apply", [("x", x), ("rstd", rstd), ("weight", weight)])
    torch._check(x.dtype in ELEMENTWISE_DTYPES, lambda: f"x must be float32, bfloat16 or float16, got {x.dtype}")
    torch._check(x.dim() >= 1 and x.shape[-1] >= 1, lambda: f"x must have a last dimension of at least 1, got shape "
                                                             f"{tuple(x.shape)}")
    torch._check(x.dim() >= 1 and weight.dim() == 1 and weight.shape[0] == x.shape[-1] and weight.dtype == x.dtype,
                 lambda: f"weight must be a 1-D tensor of x's last size and dtype, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    rows = tuple(x.shape[:-1])
    torch._check(rstd.dtype == torch.float32 and tuple(rstd.shape) in (rows, rows + (1,)),
                 lambda: f"rstd must be float32 with one value per row of x (shape {rows} or {rows} + (1,)), got "
                         f"{rstd.dtype} {tuple(rstd.shape)}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)
