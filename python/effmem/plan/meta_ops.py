"""Meta outputs for the commonest ops of a transformer's forward, made without torch's Python meta functions.

torch registers Python meta functions (torch._meta_registrations, from the
_refs decompositions) over the C++ ones for elementwise ops, reductions and
mm: on the meta device a mul costs about 300 us, against a few for the op
itself. effmem plan traces a model 32 times (two dtypes, two losses, one
and two layers, micro-batch 1 and 2 (and 3 where 1 saves other tensors), with and without the "fast" policy),
about 7,000 ops, and those functions took most of its time: a 70B preset
planned in 2.6 s on a 2-core machine instead of the 2 s it must.

The trace reads shapes, dtypes and storages only. Here the output is made
by torch's own rules, with plain integers instead of symbolic shapes: the
broadcast shape, the promoted dtype, and for elementwise ops the memory
order torch._prims_common.compute_elementwise_output_logical_to_physical_perm
picks (the inputs' order of strides, the first input deciding). Where torch
computes in float32 for a bf16 result, its intermediate copies can order a
size-1 dimension differently; a size-1 dimension's stride changes no view,
contiguity or byte count. Integer and bool results, out= and in-place
overloads, and tensors off the meta device run torch's function.
tests/test_plan_meta_ops.py checks each op against torch's function.
"""
from numbers import Number
from typing import List, Optional, Sequence

import torch
from torch import Tensor

aten = torch.ops.aten
_BINARY = frozenset({aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor})
# unary ops whose output has the input's floating dtype
_UNARY = frozenset({aten.neg.default, aten.rsqrt.default, aten.silu.default, aten.cos.default, aten.sin.default})
_META = torch.device("meta")


def fast_meta(func, args, kwargs) -> Optional[Tensor]:
    """The output `func(*args, **kwargs)` would give on meta tensors, or None where this does not know it."""
    if func in _BINARY:
        if len(args) != 2 or set(kwargs) - {"alpha"}:
            return None
        return _elementwise(args)
    if func in _UNARY:
        return None if kwargs or len(args) != 1 else _elementwise(args)
    if func is aten.pow.Tensor_Scalar:
        a, exponent = args
        if kwargs or not isinstance(a, Tensor) or not isinstance(exponent, Number):
            return None
        return _elementwise((a,), torch.result_type(a, exponent))
    if func is aten.mm.default:
        a, b = args
        if (kwargs or a.device != _META or b.device != _META or a.dim() != 2 or b.dim() != 2
                or a.dtype != b.dtype or a.shape[1] != b.shape[0]):
            return None   # torch's function raises its own error
        return _empty((a.shape[0], b.shape[1]), a.dtype)   # a new row-major matrix, whatever the inputs' strides
    if func is aten.mean.dim:
        return _mean(*args, **kwargs)
    if func in _OTHER:
        return _OTHER[func](*args, **kwargs)
    return None


def _empty(shape, dtype) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=_META)


def _elementwise(args: Sequence, dtype: Optional[torch.dtype] = None) -> Optional[Tensor]:
    tensors = [a for a in args if isinstance(a, Tensor)]
    if any(not isinstance(a, (Tensor, Number)) for a in args) or not tensors:
        return None
    # a 0-d CPU tensor (a wrapped number) may meet meta tensors; any other device runs torch's function
    ranked = [t for t in tensors if not (t.dim() == 0 and t.device.type == "cpu")]
    if not ranked or any(t.device != _META for t in ranked):
        return None
    if dtype is None:
        dtype = torch.result_type(*args) if len(args) == 2 else tensors[0].dtype
    if not dtype.is_floating_point:
        return None
    shape = _broadcast([t.shape for t in ranked])
    if shape is None:
        return None
    # torch's reference computes bf16/fp16 in float32: each input of another dtype is first copied in its own
    # memory order, the result copied back to `dtype` in the order computed
    compute = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    strides = []
    for t in ranked:
        st = tuple(t.stride())
        if t.dtype != compute:
            st = _strides(t.shape, _perm(t.shape, [st]))
        strides.append(_expanded(t.shape, st, shape))
    perm = _perm(shape, strides)
    if dtype != compute:
        perm = _perm(shape, [_strides(shape, perm)])
    return torch.empty_permuted(shape, perm, dtype=dtype, device=_META)


def _broadcast(shapes) -> Optional[tuple]:
    """The broadcast shape, or None where the shapes do not broadcast (torch's function raises)."""
    out = [1] * max(len(s) for s in shapes)
    for s in shapes:
        for i, n in enumerate(s, len(out) - len(s)):
            if n != out[i]:
                if out[i] != 1 and n != 1:
                    return None
                out[i] = n if out[i] == 1 else out[i]
    return tuple(out)


def _strides(shape, perm) -> tuple:
    """The strides of torch.empty_permuted(shape, perm)."""
    out = [0] * len(shape)
    step = 1
    for d in reversed(perm):
        out[d] = step
        step *= max(shape[d], 1)
    return tuple(out)


def _expanded(shape, strides, target) -> tuple:
    """The strides of a tensor of `shape` and `strides` after .expand(target) (ATen's inferExpandGeometry)."""
    out = [0] * len(target)
    for i in range(len(target) - 1, -1, -1):
        d = i - (len(target) - len(shape))
        size = shape[d] if d >= 0 else 1
        stride = strides[d] if d >= 0 else out[i + 1] * target[i + 1] if i + 1 < len(target) else 1
        out[i] = 0 if size != target[i] else stride
    return tuple(out)


def _dense(shape, strides, inner_to_outer) -> bool:
    """Dense in the given order of dimensions (innermost first), size-1 dimensions ignored, an empty tensor
    dense in every order (torch's rule)."""
    if 0 in shape:
        return True
    expected = 1
    for d in inner_to_outer:
        if shape[d] != 1:
            if strides[d] != expected:
                return False
            expected *= shape[d]
    return True


def _ge(a: int, b: int) -> bool:
    return b == 0 or (a != 0 and (a >= b or a % b == 0))


def _perm(shape, strides: List[tuple]) -> List[int]:
    """Logical-to-physical order of an elementwise output: compute_elementwise_output_logical_to_physical_perm
    on integers."""
    ndim = len(shape)
    if ndim < 2:
        return list(range(ndim))
    contiguous = all(_dense(shape, s, range(ndim - 1, -1, -1)) for s in strides)
    channels_last = ndim == 4 and all(_dense(shape, s, (1, 3, 2, 0)) for s in strides)
    if contiguous and not channels_last:
        return list(range(ndim))
    if channels_last and not contiguous:
        return [0, 2, 3, 1]

    def swap(i: int, j: int) -> int:
        for s in strides:
            a, b = s[i], s[j]
            if a == 0 or b == 0:
                continue
            if a == b:
                if _ge(shape[j], shape[i]):
                    continue
                return 1
            if _ge(b, a):
                return -1
            if _ge(a, b):
                return 1
        return 0

    perm = list(range(ndim - 1, -1, -1))   # sorted back to front, as torch does (insertion sort, ties kept)
    for i in range(1, ndim):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            c = swap(perm[dim0], perm[dim1])
            if c > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif c < 0:
                break
    return perm[::-1]


def _mean(a, dim=None, keepdim=False, *, dtype=None) -> Optional[Tensor]:
    """torch's reduction meta: the reduced shape, contiguous."""
    if not (isinstance(a, Tensor) and a.device == _META and a.dim() > 0 and a.dtype.is_floating_point):
        return None
    if dtype is not None and not dtype.is_floating_point:
        return None
    dims = list(range(a.dim())) if dim is None or len(dim) == 0 else list(dim)
    if not all(isinstance(d, int) and -a.dim() <= d < a.dim() for d in dims):
        return None   # torch's function says what is wrong
    reduced = {d % a.dim() for d in dims}
    if len(reduced) != len(dims):
        return None
    shape = [1 if i in reduced else n for i, n in enumerate(a.shape) if keepdim or i not in reduced]
    return _empty(shape, dtype or a.dtype)


try:
    from torch._prims_common import suggest_memory_format as _suggest_memory_format
except ImportError:   # a torch without it: the channels-last test is left to torch's functions
    _suggest_memory_format = None

# The ops of a loss and of Hugging Face's mask and rotary code whose Python meta functions cost 0.4-2 ms a call
# (a cross-entropy's log_softmax and nll_loss, the packed-sequence check's cumsum and all, rotate_half's cat).
# Their outputs are contiguous whatever the inputs' order, except in channels-last order, which runs torch's.
def _plain(*tensors) -> bool:
    """Meta tensors that torch's functions treat as row-major: no 4-D or 5-D one laid out channels-last (by
    torch's own test, where this torch has it; else only those contiguous in row-major order alone)."""
    for t in tensors:
        if not isinstance(t, Tensor) or t.device != _META:
            return False
        if t.dim() not in (4, 5):
            continue
        if _suggest_memory_format is not None:
            if _suggest_memory_format(t) != torch.contiguous_format:   # a contiguous (2, 1, 4, 1) is channels-last too
                return False
        elif not t.is_contiguous() or t.is_contiguous(
                memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d):
            return False
    return True


def _dim_ok(t: Tensor, dim) -> bool:
    return isinstance(dim, int) and -max(t.dim(), 1) <= dim < max(t.dim(), 1)


def _log_softmax(x, dim, half_to_float) -> Optional[Tensor]:
    if not _plain(x) or not x.dtype.is_floating_point or not _dim_ok(x, dim):
        return None
    if half_to_float and x.dtype != torch.float16:
        return None   # torch's function raises
    return _empty(x.shape, torch.float32 if half_to_float else x.dtype)


def _nll_loss_forward(x, target, weight, reduction, ignore_index):
    if weight is not None or not _plain(x, target) or not x.dtype.is_floating_point or target.dtype != torch.long:
        return None
    if not ((x.dim() == 2 and target.shape == x.shape[:1]) or (x.dim() == 1 and target.dim() == 0)):
        return None
    out_shape = x.shape[:1] if reduction == 0 and x.dim() == 2 else ()
    return _empty(out_shape, x.dtype), _empty((), x.dtype)


def _cumsum(x, dim, *, dtype=None) -> Optional[Tensor]:
    if not _plain(x) or not _dim_ok(x, dim) or x.is_complex():
        return None
    if dtype is None:
        dtype = x.dtype if x.dtype.is_floating_point else torch.long
    return _empty(x.shape, dtype)


def _all(x) -> Optional[Tensor]:
    if not _plain(x):
        return None
    return _empty((), torch.uint8 if x.dtype == torch.uint8 else torch.bool)


def _cat(tensors, dim=0) -> Optional[Tensor]:
    if not isinstance(tensors, (list, tuple)) or not tensors or not _plain(*tensors):
        return None
    first = tensors[0]
    if (first.dim() == 0 or not _dim_ok(first, dim)
            or any(t.dtype != first.dtype or t.dim() != first.dim() for t in tensors)):
        return None   # promotion, legacy empty 1-D inputs and errors: torch's function
    d = dim % first.dim()
    if any(t.shape[:d] != first.shape[:d] or t.shape[d + 1:] != first.shape[d + 1:] for t in tensors):
        return None
    shape = list(first.shape)
    shape[d] = sum(t.shape[d] for t in tensors)
    return _empty(shape, first.dtype)


_OTHER = {aten._log_softmax.default: _log_softmax, aten.nll_loss_forward.default: _nll_loss_forward,
          aten.cumsum.default: _cumsum, aten.all.default: _all, aten.cat.default: _cat}
