"""Norms and activations whose outputs backward rebuilds instead of keeping.

Each Function saves only its inputs and, under the "fast" activation policy
(effmem.activations.fast), tells the policy how to rebuild its output from
them (``recompute_output``). The output's consumers, which save it (q, k and
v's projections after a norm, the down projection after SwiGLU), then keep
nothing of their own: backward rebuilds the output once, from the inputs the
policy holds in 8 bits, for all of them. Without the policy they save their
inputs and behave like the code they replace.

Forwards compute with the same operations as the modules they replace
(Hugging Face's RMSNorm, torch's layer norm, SiLU times up, the module's own
GELU), so the forward and the loss are unchanged; backwards use the
derivative formulas autograd would (aten's silu/gelu/layer-norm backward, the
RMSNorm gradient written out), evaluated at the restored inputs. On CUDA
RMSNorm and SwiGLU run as single kernels, since in eager mode each elementwise
pass reads and writes whole activations (float32 temporaries among them): RMSNorm's
backward is aten's fused kernel (about 10 bytes moved per element, against 88
for the formula in torch ops and 96 for autograd of Hugging Face's module),
its forward's end and backward's rebuild, weight * (x * rstd), are
effmem::rms_norm_apply (4 bytes against 24, the same bits; on the CPU too,
where it is faster than the torch ops), and SwiGLU's rebuild and its two
gradients are effmem::swiglu and effmem::swiglu_backward (6 and 10 bytes per
element in bf16, against 10 and 22).
"""
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from effmem import ops
from effmem.activations.fast import recompute_output


def _has_cuda_kernel(op: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    except RuntimeError:   # a torch without the op
        return False


_ATEN_RMS_BACKWARD = _has_cuda_kernel("aten::_fused_rms_norm_backward")


def _rms_apply_kernel_applies(x: Tensor, weight: Tensor) -> bool:
    """CPU or CUDA tensors of one float32/bf16/fp16 dtype (on the CPU too: 0.17x the torch ops' time for a
    bf16 8192 x 1024 on this project's 2-core VM, the same bits)."""
    return (x.device.type in ("cpu", "cuda") and x.dtype in ops.ELEMENTWISE_DTYPES and weight.dtype == x.dtype
            and weight.dim() == 1)


def _check_present(*weights: Optional[Tensor]) -> None:
    """A rebuild's weights still in memory. FSDP2 frees a unit's gathered parameters after its forward and
    gathers them again at its backward: a norm inside a unit nested in the layer (not one of its own, which
    paths.py runs unfused) had its weight freed before the projections after it rebuilt its output (SIGSEGV
    in the kernel, a reviewer's two-rank run)."""
    if any(w is not None and w.untyped_storage().nbytes() == 0 and w.numel() > 0 for w in weights):
        raise RuntimeError(
            "apply_activation_policy('fast'): a norm's output is rebuilt in backward from its weight, which FSDP2 "
            "has freed (the norm is inside a unit nested in the layer, which gathers it again only at its own "
            "backward, after the layers that read the norm's output): shard the module holding the norm with its "
            "layer, or make the norm itself the unit (fully_shard(norm)), which 'fast' leaves unfused")


def _rms_norm_out(x: Tensor, rstd: Tensor, weight: Tensor, xf: Optional[Tensor] = None) -> Tensor:
    """weight * (x.float() * rstd).to(x.dtype): one pass of effmem::rms_norm_apply, the same bits (4 bytes
    moved per element in bf16 against 24); the forward's end (xf: its float32 x) and backward's rebuild."""
    if xf is None:   # the rebuild
        _check_present(weight)
    if _rms_apply_kernel_applies(x, weight):
        return ops.rms_norm_apply(x, rstd, weight)
    return weight * ((x.float() if xf is None else xf) * rstd).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        # Hugging Face's LlamaRMSNorm, operation for operation (its end in one kernel, same bits)
        xf = x.to(torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = _rms_norm_out(x, rstd, weight, xf)
        ctx.eps = eps
        ctx.save_for_backward(x, rstd, weight)
        recompute_output(y, _rms_norm_out, x, rstd, weight, node=ctx)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
        if torch.is_grad_enabled():
            return (*_graph_backward(_rms_norm_reference, (x, weight, ctx.eps), mask, grad), None)
        if _aten_rms_backward_applies(x, grad, weight):
            return (*_aten_rms_backward(grad, x, rstd, weight, mask), None)
        return _rms_norm_backward(mask, grad, x, rstd, weight)


def _aten_rms_backward_applies(x: Tensor, grad: Tensor, weight: Tensor) -> bool:
    """Whether aten's fused RMSNorm backward takes these: CUDA tensors of one floating dtype that keeps its
    statistics in float32, as the forward computed rstd (aten's kernel is CUDA-only in torch 2.11-2.14)."""
    return (x.is_cuda and _ATEN_RMS_BACKWARD and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and grad.dtype == weight.dtype == x.dtype and weight.dim() == 1 and x.shape[-1] == weight.numel())


def _aten_rms_backward(grad: Tensor, x: Tensor, rstd: Tensor, weight: Tensor, mask, op=None):
    """(grad_x, grad_w) by aten's fused kernel: one pass over grad and x where the written-out formula below runs
    about a dozen kernels over float32 temporaries (about 10 bytes moved per element against 88, counted from
    the ops on a CPU). The same gradient up to rounding: grad_w from the float32 x * rstd, not its bf16
    rounding (which autograd, too, differentiates as the identity). `op`: the tests pass torch's decomposition
    of it, which runs on a CPU."""
    op = op or torch.ops.aten._fused_rms_norm_backward
    return op(grad.contiguous(), x.contiguous(), list(weight.shape), rstd, weight, mask)


def _rms_norm_backward(mask, grad: Tensor, x: Tensor, rstd: Tensor, weight: Tensor):
    """The RMSNorm gradient written out in torch ops (CPU, mixed dtypes, a torch without the fused kernel)."""
    n = x.float() * rstd
    grad_w = None
    if mask[1]:
        gw = grad * n.to(x.dtype)
        grad_w = gw.sum(dim=tuple(range(gw.dim() - weight.dim()))).to(weight.dtype)
    gn = (grad * weight).to(x.dtype).float()
    # d/dx of x * rstd(x): rstd * (g - n * mean(g * n)), with n = x * rstd
    grad_x = (rstd * (gn - n * (gn * n).mean(-1, keepdim=True))).to(x.dtype)
    return grad_x, grad_w, None


def _rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.to(torch.float32)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _graph_backward(fn: Callable, inputs, needs, grad: Tensor) -> list:
    """Under create_graph=True (a gradient penalty, a Hessian-vector product): the gradients as autograd's own
    of `fn`, the same math, so that they can be differentiated again. The fused backwards cannot be: aten's
    silu_backward has no derivative, and to autograd RMSNorm's saved rstd is a constant (a gradient penalty's
    second derivative through it was 80% off, with no error). `inputs`: the saved tensors, which autograd
    hands back joined to the graph they came from; the tensors wanted (`needs`) come first."""
    with torch.enable_grad():
        out = fn(*inputs)
        wanted = [t for t, n in zip(inputs, needs) if n]
        got = iter(torch.autograd.grad(out, wanted, grad, create_graph=True, allow_unused=True) if wanted else ())
    return [next(got) if n else None for n in needs]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) computed as Hugging Face's Llama-family RMSNorm computes it."""
    return _RMSNorm.apply(x, weight, eps)


def _layer_norm_out(x: Tensor, mean: Tensor, rstd: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]):
    _check_present(weight, bias)   # (the rebuild's only: the forward runs native_layer_norm)
    y = (x.float() - mean.float()) * rstd.float()
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _autocast_to_float(x: Tensor) -> bool:
    """Whether autocast runs layer norm in float32 here: CUDA's autocast casts its inputs (the CPU's
    leaves them as they are)."""
    return x.device.type == "cuda" and torch.is_autocast_enabled("cuda")


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps):
        # what F.layer_norm runs, keeping the statistics for backward. Under CUDA autocast that is layer
        # norm over float32 copies of its inputs: made here, so that backward gets the tensors it ran on
        # (the op would cast them itself, and leave backward the low-precision ones).
        ctx.dtypes = [t.dtype if t is not None else None for t in (x, weight, bias)]
        if _autocast_to_float(x):
            x, weight, bias = (t.float() if t is not None else None for t in (x, weight, bias))
        y, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.shape = shape
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        recompute_output(y, _layer_norm_out, x, mean, rstd, weight, bias, node=ctx)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, mean, rstd, weight, bias = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2]]
        grads = torch.ops.aten.native_layer_norm_backward(grad.to(x.dtype), x, ctx.shape, mean, rstd, weight, bias,
                                                          mask)
        # each gradient in its input's own dtype (float32 ones where autocast made the copies)
        gx, gw, gb = (g.to(d) if g is not None and d is not None else g for g, d in zip(grads, ctx.dtypes))
        return gx, gw, gb, None, None


def layer_norm(x: Tensor, shape, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:
    """F.layer_norm(x, shape, weight, bias, eps)."""
    return _LayerNorm.apply(x, weight, bias, tuple(shape), eps)


def _swiglu_kernel_applies(*tensors: Tensor) -> bool:
    """Whether effmem's SwiGLU kernels take these: CUDA tensors of one shape and float32/bf16/fp16 dtype. On a
    CPU the torch ops stay: with its kernels vectorised for the CPU's vector unit (cpu/kernels.inc), a bf16
    rebuild and both gradients at TinyLlama's MLP width took 35.6 ms against the torch ops' 30.7 (the
    kernels' exponential is a polynomial without FMA, for the CUDA kernel's bits; `bench/bench_elementwise.py
    --device cpu --tokens 2048 --hidden 1024`, this idle 2-core machine). The CPU kernel is the CUDA kernel's
    bit-exact reference in the tests."""
    first = tensors[0]
    return first.is_cuda and first.dtype in ops.ELEMENTWISE_DTYPES and all(
        t.dtype == first.dtype and t.shape == first.shape for t in tensors[1:])


def _swiglu_out(gate: Tensor, up: Tensor) -> Tensor:
    # backward's rebuild: one pass (6 bytes per element in bf16) instead of silu then the product (10)
    if _swiglu_kernel_applies(gate, up):
        return ops.swiglu(gate, up)
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        out = F.silu(gate) * up   # the module's own operations, so the forward keeps its bits
        ctx.save_for_backward(gate, up)
        recompute_output(out, _swiglu_out, gate, up, node=ctx)
        return out

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        if torch.is_grad_enabled():
            return tuple(_graph_backward(lambda g, u: F.silu(g) * u, (gate, up), ctx.needs_input_grad[:2], grad))
        if _swiglu_kernel_applies(grad, gate, up):
            # both gradients in one pass: 10 bytes per element in bf16, where the ops below move 22
            grad_gate, grad_up = ops.swiglu_backward(grad, gate, up)
            return grad_gate if ctx.needs_input_grad[0] else None, grad_up if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up: the gated MLP of Llama-family models."""
    return _SwiGLU.apply(gate, up)


class _GELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, act: Callable[[Tensor], Tensor], approximate: str) -> Tensor:
        y = act(x)  # the model's own GELU, so the forward keeps its bits
        ctx.approximate = approximate
        ctx.save_for_backward(x)
        recompute_output(y, act, x, node=ctx)
        return y

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.ops.aten.gelu_backward(grad, x, approximate=ctx.approximate), None, None


def gelu(x: Tensor, act: Callable[[Tensor], Tensor], approximate: str) -> Tensor:
    """act(x), where act computes GELU (exact for approximate="none", the tanh form for "tanh");
    backward differentiates GELU in that form."""
    return _GELU.apply(x, act, approximate)
