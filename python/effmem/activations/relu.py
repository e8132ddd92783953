"""ReLU under the activation policies: its backward from the forward's exact on/off mask, 1 bit per element.

Autograd's ReLU keeps its output, which the "fast" policy stores in 8 bits: a small positive value rounded to
code 0 lost its whole gradient (a tiny OPT's first gradients 4.7% off plain's, against 0.4% with GELU). "min"
recomputes a layer in backward from its input rounded to 8 bits, where a mask worked out again flipped near 0
(OPT 5%, T5 4%). So the mask is made once, in the forward, and kept:

* "fast" saves it (inside a compiled layer as the output of the op effmem::relu, which the selective rule
  keeps: activations.selective);
* "min"'s checkpoint records each layer's masks in forward (relu_masks) and its recompute takes them again,
  in the same order. The journal is read when the op runs, so a compiled layer's recompute takes the
  forward's masks as an eager one does.

The policies give a layer's nn.ReLU modules this class (MaskedReLU) rather than a forward of their own: a
compiled graph guards on the class, one for every layer, where torch 2.11 guarded a per-module forward by
identity and compiled every layer's graph again (seen on an H100; activations.compiled).
"""
import contextlib
import functools
import threading
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from effmem.compress import _codec

_journal = threading.local()


@contextlib.contextmanager
def relu_masks(masks: list, replay: bool):
    """Within: each ReLU appends its exact mask to masks (replay=False), or takes the next one (replay=True:
    from the first again at each entry, as a second backward with retain_graph recomputes again)."""
    before = getattr(_journal, "state", None)
    _journal.state = (iter(masks), True) if replay else (masks, False)
    try:
        yield
    finally:
        _journal.state = before


def pack_bits(mask: Tensor) -> Tensor:
    """A bool tensor as uint8 bytes of 8 flags each (compress._codec's packing); unpack_bits reverses it."""
    return _codec.pack_bool(mask.reshape(-1))


def unpack_bits(packed: Tensor, shape) -> Tensor:
    return _codec.unpack_bool(packed, torch.Size(shape).numel()).view(shape)


def _relu_on(y: Tensor) -> Tensor:
    return ~(y <= 0)   # where y > 0, or y is NaN, as threshold_backward passes a gradient


def mask(y: Tensor, on=_relu_on) -> Tensor:
    """The on/off mask of an activation's output y (on(y): where its slope is 1), packed (pack_bits). Inside
    relu_masks(replay=True), the recorded mask of the same shape instead."""
    journal, replay = getattr(_journal, "state", None) or (None, False)
    if replay:
        recorded = next(journal, None)
        if recorded is not None and recorded[0] == tuple(y.shape):
            return recorded[1]
    packed = pack_bits(on(y))
    if journal is not None and not replay:
        journal.append((tuple(y.shape), packed))
    return packed


def _backward(packed: Tensor, grad: Tensor, slope: float = 0.0) -> Tensor:
    """grad where the mask is on; elsewhere grad times the activation's other slope (0: ReLU, ReLU6, Hardtanh;
    LeakyReLU's negative_slope)."""
    on = unpack_bits(packed, grad.shape)
    # where, not a product by the mask: an inf gradient (fp16 overflow) where the slope is 0 gives 0, as in
    # torch's threshold/hardtanh backward, not inf * 0 = NaN
    return torch.where(on, grad, 0.0 if slope == 0.0 else grad * slope)


class _ReLU(torch.autograd.Function):
    """act(x) (the module's own forward, in place too), its backward from the packed mask."""

    @staticmethod
    def forward(ctx, x: Tensor, act, on, slope: float):
        y = act(x)
        if y is x:   # nn.ReLU(inplace=True) overwrote its input: autograd moves x's history onto this function
            ctx.mark_dirty(x)
        ctx.save_for_backward(mask(y, on))
        ctx.slope = slope
        return y

    @staticmethod
    def backward(ctx, grad):
        return _backward(ctx.saved_tensors[0], grad, ctx.slope), None, None, None


# Inside a compiled graph: one opaque op making the output and the mask, so that the compiler cannot make the
# mask again in backward from a rounded input (traced as torch ops, or as an op inside an autograd.Function,
# the partitioner moved it into backward), and the journal is read when the graph runs, not when it is traced.
@torch.library.custom_op("effmem::relu", mutates_args=())
def _relu_op(x: Tensor) -> Tuple[Tensor, Tensor]:
    y = torch.relu(x)
    packed = mask(y)
    # one the journal holds too ("min"): a copy, since a compiled graph may reuse an op's output buffers
    return y, packed if getattr(_journal, "state", None) is None else packed.clone()


@_relu_op.register_fake
def _(x: Tensor) -> Tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty(((x.numel() + 7) // 8,), dtype=torch.uint8)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


_relu_op.register_autograd(lambda ctx, grad, _: _backward(ctx.saved_tensors[0], grad), setup_context=_setup)


def relu(x: Tensor, act, inplace: bool = False, on=None, slope: float = 0.0) -> Tensor:
    """act(x) for a module computing ReLU (in place for inplace=True), its backward from an exact 1-bit mask.
    on, slope: another piecewise-linear activation's mask of its output and its slope off the mask (eager
    only: in a compiled graph it keeps autograd's backward, as before)."""
    if not (torch.is_grad_enabled() and x.requires_grad):   # no backward (evaluation): no mask to make
        return act(x)
    if torch.compiler.is_compiling():
        if on is not None:
            return act(x)
        y = torch.ops.effmem.relu(x)[0]
        # in place as the module is: a layer may read its input after it (or call it for that alone), and the
        # op's output alone left x as it was there (the layer's output 26-40% off)
        return x.copy_(y) if inplace else y
    return _ReLU.apply(x, act, on or _relu_on, slope)


class MaskedReLU(nn.ReLU):
    """nn.ReLU with relu's backward; the policies give a layer's nn.ReLU modules this class (patch) and take it
    back (unpatch)."""

    def forward(self, x: Tensor) -> Tensor:
        return relu(x, functools.partial(nn.ReLU.forward, self), self.inplace)


# The other piecewise-linear activations, whose backward switched on the 8-bit input near their kinks too
# (a reviewer's 2-layer net: weight gradients 2-4% off plain, against 0.4% for ReLU): their exact mask, eager.

def _inside(m: nn.Hardtanh, y: Tensor) -> Tensor:
    # hardtanh_backward's slope-1 region (y = x there); a NaN off, as its vectorised CPU loop has it (its scalar
    # tail lets one through)
    return (y > m.min_val) & (y < m.max_val)


def _positive(y: Tensor) -> Tensor:
    return y > 0   # leaky_relu_backward's slope-1 region: x > 0, where y > 0 (a slope >= 0: patch); NaN off


class MaskedLeakyReLU(nn.LeakyReLU):
    def forward(self, x: Tensor) -> Tensor:
        return relu(x, functools.partial(nn.LeakyReLU.forward, self), self.inplace, _positive, self.negative_slope)


class MaskedHardtanh(nn.Hardtanh):
    def forward(self, x: Tensor) -> Tensor:
        return relu(x, functools.partial(nn.Hardtanh.forward, self), self.inplace, functools.partial(_inside, self))


class MaskedReLU6(nn.ReLU6):
    forward = MaskedHardtanh.forward   # nn.ReLU6 is a Hardtanh(0, 6), its forward Hardtanh's


class _PReLU(torch.autograd.Function):
    """F.prelu with its slope-1 region (x > 0) kept as an exact mask; x is saved as any tensor is (8 bits under
    "fast"), for the slope's gradient alone, which rounding moves no more than any weight's."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(mask(x, _positive), x, weight)   # the mask of x: a negative slope flips y's sign
        return F.prelu(x, weight)

    @staticmethod
    def backward(ctx, grad):
        packed, x, weight = ctx.saved_tensors
        on = unpack_bits(packed, grad.shape)
        # one slope, or one per channel (dim 1; F.prelu takes one slope for a 1-D x), broadcast over the others
        per_channel = weight.numel() > 1
        w = weight.reshape([-1 if d == 1 and per_channel else 1 for d in range(grad.dim())])
        grad_x = torch.where(on, grad, grad * w) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            off = torch.where(on, grad.new_zeros(()), grad * x)
            summed = [d for d in range(grad.dim()) if not (d == 1 and per_channel)]
            grad_w = off.sum(dim=summed).reshape(weight.shape)
        return grad_x, grad_w


class MaskedPReLU(nn.PReLU):
    def forward(self, x: Tensor) -> Tensor:
        if not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)) \
                or torch.compiler.is_compiling():   # no backward, or a compiled graph's own (as relu())
            return F.prelu(x, self.weight)
        return _PReLU.apply(x, self.weight)


MASKED = {nn.ReLU: MaskedReLU, nn.LeakyReLU: MaskedLeakyReLU, nn.Hardtanh: MaskedHardtanh, nn.ReLU6: MaskedReLU6,
          nn.PReLU: MaskedPReLU}
PLAIN = {masked: plain for plain, masked in MASKED.items()}


def patchable(m: nn.Module) -> bool:
    """Whether patch gives m a masked class (a LeakyReLU with a negative slope has no mask of its output)."""
    return type(m) in MASKED and not (type(m) is nn.LeakyReLU and not m.negative_slope >= 0)


def patch(m: nn.Module) -> bool:
    """Give m its masked class; True where m is masked for the caller, who undoes it with unpatch. A module
    masked already (compress_activations and a policy both mask a LeakyReLU) counts its maskers: the class
    goes back at the last unpatch (remove_compression had taken it from under a policy still on)."""
    if type(m) in PLAIN:
        m.__dict__["_effmem_masked"] = m.__dict__.get("_effmem_masked", 1) + 1
        return True
    if not patchable(m):
        return False
    m.__class__ = MASKED[type(m)]
    m.__dict__["_effmem_masked"] = 1
    return True


def functional_relu(x: Tensor, inplace: bool = False) -> Tensor:
    """F.relu with relu's backward (its exact mask): what patch_functional puts in place of F.relu."""
    return relu(x, torch.relu_ if inplace else torch.relu, inplace)


_FUNCTIONAL = (F.relu, torch.relu)


def patch_functional(m: nn.Module) -> bool:
    """A module holding F.relu or torch.relu as an attribute it calls (nn.TransformerEncoderLayer's and
    DecoderLayer's default activation) gets functional_relu there: its mask came from the 8-bit output,
    6-8% off. Only attributes: a forward calling F.relu in its code keeps autograd's ReLU."""
    found = {k: v for k, v in m.__dict__.items() if any(v is f for f in _FUNCTIONAL)}
    if not found:
        return False
    m.__dict__.setdefault("_effmem_relu_attrs", {}).update(found)
    m.__dict__.update(dict.fromkeys(found, functional_relu))
    return True


def unpatch(m: nn.Module) -> None:
    if type(m) in PLAIN:
        left = m.__dict__.pop("_effmem_masked", 1) - 1
        if left > 0:
            m.__dict__["_effmem_masked"] = left
        else:
            m.__class__ = PLAIN[type(m)]
    m.__dict__.update(m.__dict__.pop("_effmem_relu_attrs", {}))
