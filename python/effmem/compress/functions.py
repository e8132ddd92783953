"""Layers that save their input compressed, for where a saved-tensor hook cannot do as well.

A hook sees each saved tensor alone; these autograd Functions know what
their backward needs and save exactly that: Linear keeps its input quantised
(plus the weight it already holds), GELU keeps its input quantised and
evaluates GELU's derivative at the dequantised input. They quantise per row
of the input's last dim, work in eager mode and under torch.compile
(fullgraph tracing included), and are usable with or without
compress_activations around them.

Seeds: a given seed is used as it is. Without one, each eager call takes the
next value of a process-wide counter, so successive steps round differently;
under torch.compile a counter would be a new constant at every call and
force a recompile, so compiled code uses seed 0 at every call (the rounding
pattern repeats from step to step while the data changes).
"""
import itertools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from effmem._second_order import first_order, graph_handle
from effmem.compress import _codec

_SEEDS = itertools.count()


def _seed(seed: Optional[int]) -> int:
    if seed is not None:
        return seed
    return 0 if torch.compiler.is_compiling() else next(_SEEDS)


def _check_config(bits: int, group_size: int, stochastic: bool) -> None:
    _codec.check_config(bits, group_size)
    if not isinstance(stochastic, bool):   # bool("False") is True
        raise TypeError(f"stochastic: expected True or False, got {stochastic!r}")


def _as_rows(x: Tensor) -> Tensor:
    # rows counted, not -1: reshape cannot infer them for a last dim of 0 (F.linear takes that input)
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) if x.dim() > 0 else x.reshape(1, 1)


def _check_input(x: Tensor, name: str) -> None:
    if not isinstance(x, Tensor) or x.dtype not in _codec.FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a float32, bfloat16 or float16 tensor, got "
                        f"{x.dtype if isinstance(x, Tensor) else type(x).__name__}")


def _no_second(name: str) -> str:
    return (f"{name}: its backward reads the input as kept, quantised, so its gradients made with "
            f"create_graph=True cannot be differentiated again (the second derivative through the input would be "
            f"missing); use torch.nn.functional.{name.split('_')[1]} for higher-order gradients")


class _CompressedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, bits, group_size, seed, stochastic, handle):
        ctx.handle = handle   # x's graph_handle: the link of grad_weight's first_order, x itself not kept
        out = F.linear(x, weight, bias)
        if not ctx.needs_input_grad[1]:
            # Only grad_weight reads x: without it (evaluation, frozen weight) save just the weight.
            ctx.save_for_backward(None, None, weight)
            ctx.meta = None
            return out
        rows = _as_rows(x)
        codes, stats = _codec.quantize(rows.detach(), bits=bits, group_size=group_size, seed=seed,
                                       stochastic=stochastic)
        ctx.save_for_backward(codes, stats, weight)
        ctx.meta = (tuple(x.shape), tuple(rows.shape), x.dtype, bits, group_size)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        codes, stats, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1]) if grad_out.dim() > 1 else grad_out.reshape(1, -1)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.to(g.dtype)).reshape(grad_out.shape[:-1] + weight.shape[1:])
        if ctx.needs_input_grad[1]:
            _, rows_shape, x_dtype, bits, group_size = ctx.meta
            x_hat = _codec.dequantize(codes, stats, bits=bits, group_size=group_size, shape=rows_shape,
                                      dtype=x_dtype)
            grad_w = g.t() @ x_hat.to(g.dtype)
            if ctx.handle is not None:   # x needs a gradient: the second derivative through it is missing
                grad_w, = first_order([grad_w], (ctx.handle, grad_out), _no_second("compressed_linear"))
        if ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class _CompressedGELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, approximate, bits, group_size, seed, stochastic, handle):
        ctx.handle = handle
        out = F.gelu(x, approximate=approximate)
        if not ctx.needs_input_grad[0]:  # evaluation: backward never runs, nothing to keep
            return out
        rows = _as_rows(x)
        codes, stats = _codec.quantize(rows.detach(), bits=bits, group_size=group_size, seed=seed,
                                       stochastic=stochastic)
        ctx.save_for_backward(codes, stats)
        ctx.meta = (tuple(x.shape), tuple(rows.shape), x.dtype, approximate, bits, group_size)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        codes, stats = ctx.saved_tensors
        x_shape, rows_shape, x_dtype, approximate, bits, group_size = ctx.meta
        x_hat = _codec.dequantize(codes, stats, bits=bits, group_size=group_size, shape=rows_shape,
                                  dtype=x_dtype).reshape(x_shape)
        grad_x = torch.ops.aten.gelu_backward(grad_out, x_hat.to(grad_out.dtype), approximate=approximate)
        if ctx.handle is not None:
            grad_x, = first_order([grad_x], (ctx.handle, grad_out), _no_second("compressed_gelu"))
        return grad_x, None, None, None, None, None, None


def compressed_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, bits: int = 8,
                      group_size: int = 128, stochastic: bool = True, seed: Optional[int] = None) -> Tensor:
    """F.linear(x, weight, bias) whose backward keeps x quantised (bits per element + 8 bytes per group).

    Gradients: grad_input = grad @ weight (exact), grad_weight = grad^T @ x_hat
    (unbiased with stochastic rounding), grad_bias = grad summed over rows. bits (8 or 4), group_size
    (elements per scale: 32, 64, 128 or 256) and stochastic (rounding): x's codes. seed: the rounding's seed
    (default: the next of a per-process counter, so that two calls round independently).
    """
    _check_config(bits, group_size, stochastic)
    _check_input(x, "x")
    return _CompressedLinear.apply(x, weight, bias, bits, group_size, _seed(seed), stochastic, graph_handle(x))


def compressed_gelu(x: Tensor, approximate: str = "none", *, bits: int = 8, group_size: int = 128,
                    stochastic: bool = True, seed: Optional[int] = None) -> Tensor:
    """F.gelu(x, approximate) whose backward keeps x quantised and differentiates GELU at x_hat; bits,
    group_size, stochastic and seed as for compressed_linear."""
    _check_config(bits, group_size, stochastic)
    _check_input(x, "x")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return _CompressedGELU.apply(x, approximate, bits, group_size, _seed(seed), stochastic, graph_handle(x))


class CompressedLinear(nn.Linear):
    """nn.Linear that saves its input compressed; same parameters and state_dict keys as nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 bits: int = 8, group_size: int = 128, stochastic: bool = True):
        _check_config(bits, group_size, stochastic)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.bits, self.group_size, self.stochastic = bits, group_size, stochastic

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options) -> "CompressedLinear":
        """A CompressedLinear sharing `linear`'s parameters (no copy)."""
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta", **options)
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: Tensor) -> Tensor:
        return compressed_linear(x, self.weight, self.bias, bits=self.bits, group_size=self.group_size,
                                 stochastic=self.stochastic)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.bits}, group_size={self.group_size}"


class CompressedGELU(nn.GELU):
    """nn.GELU that saves its input compressed."""

    def __init__(self, approximate: str = "none", *, bits: int = 8, group_size: int = 128,
                 stochastic: bool = True):
        _check_config(bits, group_size, stochastic)
        super().__init__(approximate=approximate)
        self.bits, self.group_size, self.stochastic = bits, group_size, stochastic

    def forward(self, x: Tensor) -> Tensor:
        return compressed_gelu(x, self.approximate, bits=self.bits, group_size=self.group_size,
                               stochastic=self.stochastic)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.bits}, group_size={self.group_size}"
