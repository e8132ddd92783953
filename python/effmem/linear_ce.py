"""Fused linear cross-entropy: the loss of ``cross_entropy(hidden @ weight.T + bias, target)`` and
its gradients without ever holding the ``[tokens, vocab]`` logits.

Two ways, one op family (C++/CUDA, formulas in csrc/common/linear_ce_math.h):

* ``linear_ce_forward`` / ``linear_ce_backward``: logits are made one vocabulary chunk at a time in
  float32 (1/64 of the vocabulary by default, at most 128 MB), the forward keeps only each token's
  log-sum-exp, and the backward makes each chunk again and turns it into gradients at once: one
  more matrix product than the unfused computation, for every byte of logits saved.
* ``linear_ce_forward_backward``: for a mean or a sum (each token's incoming gradient known before
  backward) the forward makes whole rows of logits for a chunk of tokens at a time and turns them
  into the loss and all gradients at once: three products (two for a frozen weight), no recompute;
  backward only scales what it made. The weight gradient is summed over the chunks in float32: in
  its own memory for a float32 weight, so this is the default for a float32 weight or a frozen one;
  a bf16 weight's sum costs a float32 buffer (grad_in_forward=True asks for it).
"""
import numbers
from typing import Optional

import torch
from torch import Tensor

from effmem._second_order import first_order, graph_handle
from effmem.optim._validate import F32_MAX, F32_TINY

_lib = torch.ops.effmem
REDUCTIONS = ("mean", "sum", "none")


def _real(x) -> bool:
    """A Python or NumPy number, not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _fake_checks(op: str, options, hidden, weight, bias, target, **per_token) -> None:
    """The kernels' checks of shapes, devices and options (csrc/common/linear_ce.cpp check_args; options:
    label_smoothing, softcap and (the chunk argument's name, its value)) for the fake kernels,
    which run for meta tensors, also when real ones come with them (the dispatcher picks Meta for the whole
    call): refused as there, not answered with a tensor of garbage."""
    from effmem.ops import _one_device
    _one_device(op, [("hidden", hidden), ("weight", weight), ("bias", bias), ("target", target),
                     *per_token.items()])
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"effmem::{op}: expected hidden [N, H] and weight [V, H], got shapes "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    n = hidden.shape[0]
    label_smoothing, softcap, (chunk_name, chunk) = options
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"effmem::{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    # the logits are divided by it in float32: past its range, or below its normal numbers, came NaN
    if not (softcap == 0.0 or F32_TINY <= softcap <= F32_MAX):
        raise ValueError(f"effmem::{op}: softcap must be 0 (none) or a number in float32's normal range "
                         f"[1.175e-38, 3.403e+38], got {softcap}")
    if chunk < 0:
        raise ValueError(f"effmem::{op}: {chunk_name} must be >= 0 (0: automatic), got {chunk}")
    for name, t, want in (("target", target, (n,)), ("bias", bias, (weight.shape[0],)),
                          *((name, t, (n,)) for name, t in per_token.items())):
        if t is not None and tuple(t.shape) != want:
            raise ValueError(f"effmem::{op}: {name} must have shape {want}, got {tuple(t.shape)}")


@torch.library.register_fake("effmem::linear_ce_forward")
def _forward_fake(hidden, weight, bias, target, ignore_index, label_smoothing, softcap, vocab_chunk):
    _fake_checks("linear_ce_forward", (label_smoothing, softcap, ("vocab_chunk", vocab_chunk)), hidden, weight,
                 bias, target)
    n = hidden.shape[0]
    return hidden.new_empty((n,), dtype=torch.float32), hidden.new_empty((n,), dtype=torch.float32)


@torch.library.register_fake("effmem::linear_ce_backward")
def _backward_fake(grad_loss, hidden, weight, bias, target, lse, ignore_index, label_smoothing, softcap,
                   vocab_chunk, output_mask):
    _fake_checks("linear_ce_backward", (label_smoothing, softcap, ("vocab_chunk", vocab_chunk)), hidden, weight,
                 bias, target, grad_loss=grad_loss, lse=lse)
    # the kernels write both gradients row-major whatever the inputs' strides (a transposed hidden too)
    row_major = torch.contiguous_format
    grad_h = torch.empty_like(hidden, memory_format=row_major) if output_mask[0] else hidden.new_empty((0,))
    grad_w = torch.empty_like(weight, memory_format=row_major) if output_mask[1] else weight.new_empty((0,))
    grad_b = torch.empty_like(bias) if output_mask[2] and bias is not None else weight.new_empty((0,))
    return grad_h, grad_w, grad_b


@torch.library.register_fake("effmem::linear_ce_forward_backward")
def _forward_backward_fake(hidden, weight, bias, target, grad_scale, ignore_index, label_smoothing, softcap,
                           token_chunk, output_mask):
    _fake_checks("linear_ce_forward_backward", (label_smoothing, softcap, ("token_chunk", token_chunk)), hidden,
                 weight, bias, target, grad_scale=grad_scale)
    loss = hidden.new_empty((hidden.shape[0],), dtype=torch.float32)
    return (loss, *_backward_fake(None, hidden, weight, bias, target, None, ignore_index, label_smoothing, softcap,
                                  token_chunk, output_mask))


class _GradInForward(torch.autograd.Function):
    """The reduced loss with its gradients made by the forward pass (linear_ce_forward_backward, for
    incoming gradients `scale` per token); backward multiplies them by the loss's incoming gradient.

    They are kept as an attribute (``_effmem_held``, which effmem plan's trace counts), not as saved
    tensors: saved-tensor hooks (compress_activations) must not quantise gradients. Backward hands them
    over and lets go (scaled in place, so autograd can take them as .grad without a copy): a second
    backward through the same loss (retain_graph) raises."""

    @staticmethod
    def forward(ctx, h, weight, bias, target, scale, n_valid, options, handle, versions):
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]]
        loss, gh, gw, gb = _lib.linear_ce_forward_backward(h, weight, bias, target, scale, *options, mask)
        ctx._effmem_held = [g if m else None for g, m in zip((gh, gw, gb), mask)]
        ctx.links = (handle, weight, bias)   # parameters and h's graph_handle: no activation kept alive
        ctx.versions = versions   # the caller's weight and bias, with their versions (_versions)
        total = loss.sum()
        return total if n_valid is None else total / n_valid

    @staticmethod
    def backward(ctx, grad_out):
        grads, ctx._effmem_held = ctx._effmem_held, None
        if grads is None:
            raise RuntimeError("linear_cross_entropy: this loss's gradients were made by its forward pass and "
                               "handed to the first backward through it; to backward twice (retain_graph=True) "
                               "call it with grad_in_forward=False")
        links, ctx.links = ctx.links, None
        versions, ctx.versions = ctx.versions, ()
        for name, t, version in versions:
            if t._version != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: linear_cross_entropy's {name} (version {t._version}; its gradients were made in "
                    f"the forward pass, at version {version}), as torch raises for a tensor saved for backward")
        return (*_first_order([None if g is None else g.mul_(grad_out) for g in grads], links + (grad_out,)),
                None, None, None, None, None, None)


def _versions(weight: Tensor, bias: Optional[Tensor]) -> list:
    """What autograd would check of the weight and bias if saved: the gradients made in forward are those of
    their values then. The caller's parameters (leaves, alive anyway), not autocast's copies of them, which
    nothing changes in place and which would stay alive until backward; a weight made by an op (W * s), the
    tensor the kernel took, as torch's saved tensor would be. Not hidden, which holding would keep the
    activation alive; not in a compiled graph, where a version is a symbol backward cannot compare."""
    if torch.compiler.is_compiling():
        return []
    return [(name, t, t._version) for name, t in (("weight", weight), ("bias", bias)) if t is not None]


_NO_SECOND = ("linear_cross_entropy: its gradients were made with create_graph=True and cannot be differentiated "
              "again (a second derivative needs the logits it never keeps); compute this loss unfused for "
              "higher-order gradients")


def _first_order(grads, links):
    return first_order(grads, links, _NO_SECOND)


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target, ignore_index, label_smoothing, softcap, vocab_chunk = inputs
    ctx.save_for_backward(hidden, weight, bias, target, output[1])
    ctx.options = (ignore_index, label_smoothing, softcap, vocab_chunk)


def _backward(ctx, grad_loss, grad_lse):
    hidden, weight, bias, target, lse = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]]
    if grad_loss is None or not any(mask):
        return None, None, None, None, None, None, None, None
    with torch.no_grad():  # under create_graph=True too: the op is not differentiable (see _first_order)
        grad_h, grad_w, grad_b = _lib.linear_ce_backward(grad_loss.contiguous(), hidden, weight, bias, target, lse,
                                                         *ctx.options, mask)
    return (*_first_order([grad_h if mask[0] else None, grad_w if mask[1] else None, grad_b if mask[2] else None],
                          (hidden, weight, bias, grad_loss)), None, None, None, None, None)


torch.library.register_autograd("effmem::linear_ce_forward", _backward, setup_context=_setup_context)


class _Recompute(torch.autograd.Function):
    """The op with the same autograd formula, as a function torch.func's transforms (grad, vmap, jacrev) can
    run: they do not take the op's registered autograd (torch.library makes an old-style function of it)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(*args):
        return _lib.linear_ce_forward(*args)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)

    @staticmethod
    def jvp(ctx, *_):
        raise RuntimeError("linear_cross_entropy: has no forward-mode derivative (torch.func.jvp, jacfwd, hessian); "
                           "use reverse mode (torch.func.grad, vjp, jacrev), or compute this loss unfused")


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         logit_softcap: Optional[float] = None, vocab_chunk: int = 0,
                         grad_in_forward: Optional[bool] = None, token_chunk: int = 0) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, target, ...)`` without the logits tensor.

    Args:
        hidden: ``[..., H]`` float32, bfloat16 or float16 (the last hidden states).
        weight: ``[V, H]``, the output projection (e.g. ``lm_head.weight``), same dtype.
        target: ``[...]`` int64 (or, as torch, uint8) class indices in ``[0, V)``, or ``ignore_index``.
        bias: optional ``[V]``.
        ignore_index: targets with this value contribute neither loss nor gradient.
        reduction: "mean" (over the targets not ignored, as torch), "sum" or "none".
        label_smoothing: in [0, 1], as in ``torch.nn.functional.cross_entropy``.
        logit_softcap: ``cap * tanh(logits / cap)`` before the softmax (Gemma-style); None: none.
        vocab_chunk: vocabulary entries per chunk; 0 chooses 1/64 of the vocabulary (at least 256), and
            never more than 128 MB of float32 logits (past 256k tokens, fewer than 128 entries).
        grad_in_forward: make the gradients in the forward pass (three matrix products, or two for a
            frozen weight, instead of four; reduction "mean" or "sum"; see the module docstring).
            None (default): when a gradient is wanted and the weight is float32, or frozen on a GPU,
            where it costs no memory beyond the gradients themselves (not for float16 on a GPU under a
            mean: made before backward brings the loss scale, its logits' gradient would flush to zero;
            True raises there). True also for a trained bf16/fp16
            weight, whose gradient is then summed in a float32 buffer while the loss runs (4 bytes per
            weight element, 2 more than the gradient) for one product fewer: on an H200 at 16k tokens x
            128k x 4096 in bf16, 0.92x the unfused path's time (recomputing: 1.25x) for 0.11x of its
            extra memory (recomputing: 0.013x). False: always recompute.
        token_chunk: with gradients made in forward, tokens per chunk of whole rows of logits; 0 chooses
            1/32 of the tokens (at least 128 on CUDA, 256 on the CPU, where thinner products run poorly; at
            most 128 MB of float32 logits; on CUDA, for a trained
            bf16/fp16 weight, at least min(2048, H / 2): each chunk reads and writes its float32 buffer).

    Logits and their softmax are computed in float32 from products that accumulate in float32
    (bf16/fp16 products on CUDA round once, to float32; bf16 ones on a CPU with bf16 dot products round
    once to bf16, as the unfused logits are, and run faster there); the loss is float32. Under autocast the
    inputs are cast as ``F.linear`` would cast them. The gradients of ``hidden``, ``weight`` and
    ``bias`` are those of the unfused computation. On the CPU a target outside ``[0, V)`` raises;
    on CUDA (where checking would cost a host sync) that token's loss is NaN.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if not _real(label_smoothing) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing: expected a number in [0, 1], got {label_smoothing!r}")
    if logit_softcap is not None and not (_real(logit_softcap) and F32_TINY <= logit_softcap <= F32_MAX):
        raise ValueError(f"logit_softcap: expected None or a number > 0 in float32's normal range "
                         f"[1.175e-38, 3.403e+38] (the logits are divided by it in float32), got {logit_softcap!r}")
    for name, n in (("vocab_chunk", vocab_chunk), ("token_chunk", token_chunk)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 0 <= n < 2 ** 63:
            raise ValueError(f"{name}: expected an int in [0, 2**63) (0: automatic), got {n!r}")
    check_grad_in_forward(grad_in_forward)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
    if not -2 ** 63 <= ignore_index < 2 ** 63:
        raise ValueError(f"ignore_index: expected an int64 (target's dtype), got {ignore_index}")
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target), ("bias", bias)):
        if not isinstance(t, Tensor) and not (name == "bias" and t is None):
            raise TypeError(f"{name}: expected a tensor{' or None' if name == 'bias' else ''}, got "
                            f"{type(t).__name__}")
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name}: expected a tensor on {hidden.device} (hidden's device), got one on {t.device}")
        if t is not None and t.layout != torch.strided:
            raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if weight.dim() != 2 or weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"weight: expected [V, H] with V >= 1 vocabulary rows and a hidden size H >= 1, got shape "
                         f"{tuple(weight.shape)}")
    if hidden.dim() < 1:
        raise ValueError("hidden: expected [..., H], at least one dimension, got a 0-dimensional tensor")
    if target.dtype not in (torch.int64, torch.uint8):
        raise TypeError(f"target: expected int64 (or uint8) class indices, got {target.dtype}"
                        + (" (class probabilities, which torch's cross_entropy also takes, are not supported)"
                           if target.is_floating_point() else ""))
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target: expected shape {tuple(hidden.shape[:-1])} (hidden's without its last "
                         f"dimension), got {tuple(target.shape)}")
    device_type = hidden.device.type
    # Autocast exists for real devices only; on meta tensors effmem plan's trace says whether it models one.
    dtype = _TRACE_TARGET[1] if device_type == "meta" else (
        torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None)
    given = (weight, bias)
    if dtype is not None:   # as autocast casts F.linear's inputs: floating ones but float64
        hidden, weight, bias = (t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64
                                else t for t in (hidden, weight, bias))
    h = hidden.reshape(-1, hidden.shape[-1])
    # torch takes uint8 class indices too (a vocabulary of at most 256); the kernels read int64
    t = target.reshape(-1).long() if target.dtype == torch.uint8 else target.reshape(-1)
    if _grad_in_forward(grad_in_forward, reduction, hidden, weight, bias):
        valid = t != ignore_index
        # no host sync: mean divides by the count of targets kept (NaN when there is none, as torch)
        n_valid = valid.sum() if reduction == "mean" else None
        # float32 whatever torch's default dtype (the kernel reads float32)
        scale = valid.float() if n_valid is None else torch.where(valid, 1.0 / n_valid.float(), 0.0)
        checked = [g if g is not None and g.is_leaf else c for g, c in zip(given, (weight, bias))]
        return _GradInForward.apply(h, weight, bias, t, scale, n_valid, (
            int(ignore_index), float(label_smoothing), float(logit_softcap or 0.0), int(token_chunk)),
            graph_handle(h), _versions(*checked))
    loss, _ = (_Recompute.apply if _under_torch_func() else _lib.linear_ce_forward)(
        h, weight, bias, t, int(ignore_index), float(label_smoothing), float(logit_softcap or 0.0), int(vocab_chunk))
    if reduction == "none":
        return loss.reshape(target.shape)
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (t != ignore_index).sum()  # no host sync; NaN when every target is ignored, as torch


def check_grad_in_forward(choice) -> None:
    """linear_cross_entropy's (and fuse_linear_cross_entropy's) grad_in_forward: None, True or False."""
    if choice is not None and not isinstance(choice, bool):   # (1 == True: `in` let 0 and 1 through)
        raise ValueError(f"grad_in_forward: expected None, True or False, got {choice!r}")


def _grad_in_forward(choice: Optional[bool], reduction: str, hidden: Tensor, weight: Tensor,
                     bias: Optional[Tensor]) -> bool:
    """Whether to make the gradients in the forward pass (see linear_cross_entropy's grad_in_forward)."""
    wanted = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    if choice is False or not wanted:
        return False
    if _under_torch_func():
        # the gradients made in forward are held on the autograd node, out of the transforms' sight
        if choice:
            raise ValueError("grad_in_forward=True: not under a torch.func transform (grad, vmap, jacrev...); "
                             "use grad_in_forward=None or False there (the gradients are then made in backward)")
        return False
    if reduction == "none":
        if choice:
            raise ValueError("grad_in_forward=True: needs reduction 'mean' or 'sum' (each token's incoming "
                             "gradient known before backward), got 'none'")
        return False
    trained_low = weight.requires_grad and weight.dtype != torch.float32
    # effmem plan's trace runs on meta tensors and chooses as the device it plans for would
    device = _TRACE_TARGET[0] if hidden.device.type == "meta" else hidden.device.type
    # On CUDA the logits' gradient is made in hidden's dtype. Under a mean it is divided by the token count
    # before backward brings GradScaler's loss scale: in float16 most of it would fall below the smallest
    # subnormal (p / 4096 tokens is about 1e-8) and flush to zero. bfloat16 has float32's range.
    flushes = device == "cuda" and hidden.dtype == torch.float16 and reduction == "mean"
    if choice:
        if flushes:
            raise ValueError("grad_in_forward=True: not with float16 on CUDA and reduction 'mean' (the logits' "
                             "gradient, divided by the token count before the loss scale arrives, would flush "
                             "to zero in float16); use bfloat16, reduction 'sum', or grad_in_forward=None")
        return True
    if torch.compiler.is_compiling():
        return False  # compiled graphs keep the recompute path: their autograd saves tensors the usual way
    return not trained_low and not flushes and (weight.dtype == torch.float32 or device == "cuda")


def _under_torch_func() -> bool:
    """Whether a torch.func transform (grad, vmap, jacrev) runs this call eagerly (compiled code keeps the op:
    Dynamo sees a transform's interpreter while tracing, and cannot trace _Recompute's jvp)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None


# What effmem plan's trace stands for while it runs a model on meta tensors (plan/trace.py): the device, and
# the autocast dtype it models (None: none).
_TRACE_TARGET = ["cpu", None]
