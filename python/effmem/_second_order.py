"""Gradients that cannot be differentiated again, marked so that trying raises instead of dropping terms.

A backward that computes from something it does not keep as autograd's graph (linear_cross_entropy's logits,
never held; compressed_linear's and compressed_gelu's input, kept only quantised) makes gradients that, under
create_graph=True, would be constants to autograd: a second derivative through them (a gradient penalty, a
Hessian-vector product) would silently lack their part. first_order hands them on through _NoSecondDerivative,
whose backward raises the caller's reason.
"""
from typing import Optional, Sequence

import torch
from torch import Tensor


class _NoSecondDerivative(torch.autograd.Function):
    """The gradients, as they are; differentiating them raises `why`. Its inputs are the reason, the count of
    gradients, the gradients and then the tensors they depend on (`links`): a derivative asked for an input of
    the loss only (torch.autograd.grad(penalty, x)) runs the nodes on a path to x alone, and this one must be
    on that path."""
    generate_vmap_rule = True   # torch.func.vmap over grad (per-sample gradients) runs it

    @staticmethod
    def forward(why, count, *tensors):
        return tuple(g.detach() for g in tensors[:count])

    @staticmethod
    def setup_context(ctx, inputs, output):
        """The reason only; declared apart from forward so torch.func's transforms accept the function."""
        ctx.why = inputs[0]

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(ctx.why)


def first_order(grads: Sequence[Optional[Tensor]], links: Sequence[Optional[Tensor]], why: str) -> list:
    """grads unchanged, or under create_graph=True (grad mode on in backward) made by _NoSecondDerivative from
    the tensors in `links` that require gradients (those grads depend on); none: they are constants."""
    links = [t for t in links if t is not None and t.requires_grad]
    if not torch.is_grad_enabled() or not links:
        return list(grads)
    given = [g for g in grads if g is not None]
    marked = iter(_NoSecondDerivative.apply(why, len(given), *given, *links))
    return [None if g is None else next(marked) for g in grads]


def graph_handle(h: Tensor) -> Optional[Tensor]:
    """One element of h copied: a tensor whose graph reaches h's without keeping h's memory alive (select and
    clone save no tensor), a link for first_order where h itself is not kept. None where no graph is made."""
    if not (torch.is_grad_enabled() and h.requires_grad and h.numel()):
        return None
    return h[(0,) * h.dim()].clone()
