"""effmem.plan.meta_ops against torch's own meta functions: the same shape, dtype and memory order (strides of
dimensions longer than 1; a size-1 dimension's stride changes no view, contiguity or byte count)."""
import itertools
import random

import pytest
import torch

from effmem.plan import meta_ops
from effmem.plan.meta_ops import fast_meta

aten = torch.ops.aten
META = torch.device("meta")


def same_layout(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device
    assert [s for s, n in zip(got.stride(), got.shape) if n != 1] == \
        [s for s, n in zip(want.stride(), want.shape) if n != 1], (got.stride(), want.stride(), got.shape)
    assert got.untyped_storage().nbytes() == want.untyped_storage().nbytes()


def layouts(shape, dtype, rng):
    """A meta tensor of `shape` in several memory layouts: contiguous, permuted, a slice of a wider one,
    expanded from size 1, channels_last."""
    yield torch.empty(shape, dtype=dtype, device=META)
    order = list(range(len(shape)))
    rng.shuffle(order)
    base = torch.empty([shape[i] for i in order], dtype=dtype, device=META)
    yield base.permute([order.index(i) for i in range(len(shape))])
    wide = torch.empty(*shape[:-1], shape[-1] + 3, dtype=dtype, device=META) if shape else None
    if wide is not None:
        yield wide[..., 1:shape[-1] + 1]
    if shape:
        yield torch.empty(*shape[:-1], 1, dtype=dtype, device=META).expand(shape)
    if len(shape) == 4:
        yield torch.empty(shape, dtype=dtype, device=META).to(memory_format=torch.channels_last)


SHAPES = [(), (5,), (1, 7), (3, 1, 6), (2, 4, 6), (1, 3, 1, 5), (2, 3, 4, 5), (2, 1, 4, 1), (0, 3)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# one dtype, and mixes where the reference computes in float32 and copies the inputs first
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
               (torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("op", [aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor])
def test_binary_ops_match_torch(op):
    rng = random.Random(0)
    checked = 0
    for shape in SHAPES:
        # the other operand: the same shape, a trailing slice of it (broadcast), a size-1 version, a number
        others = [shape, shape[-1:], tuple(1 if rng.random() < 0.5 else n for n in shape)]
        for da, db in DTYPE_PAIRS:
            for a in layouts(shape, da, rng):
                for oshape in others:
                    for b in layouts(oshape, db, rng):
                        for x, y in ((a, b), (b, a)):
                            got = fast_meta(op, (x, y), {})
                            assert got is not None
                            same_layout(got, op(x, y))
                            checked += 1
                for number in (2, 0.5):
                    same_layout(fast_meta(op, (a, number), {}), op(a, number))
                wrapped = torch.tensor(1.5)   # a 0-d CPU tensor meeting a meta tensor
                same_layout(fast_meta(op, (a, wrapped), {}), op(a, wrapped))
    assert checked > 3000


@pytest.mark.parametrize("op", [aten.neg.default, aten.rsqrt.default, aten.silu.default, aten.cos.default,
                                aten.sin.default])
def test_unary_ops_match_torch(op):
    rng = random.Random(1)
    for shape, dtype in itertools.product(SHAPES, DTYPES):
        for a in layouts(shape, dtype, rng):
            same_layout(fast_meta(op, (a,), {}), op(a))


def test_pow_mm_and_mean_match_torch():
    rng = random.Random(2)
    for shape, dtype in itertools.product(SHAPES, DTYPES):
        for a in layouts(shape, dtype, rng):
            for e in (2, 0.5, -1.0):
                same_layout(fast_meta(aten.pow.Tensor_Scalar, (a, e), {}), aten.pow.Tensor_Scalar(a, e))
            if a.dim() == 0:
                continue
            for dims, keep in itertools.product([[-1], [0], list(range(a.dim())), []], [False, True]):
                for kw in ({}, {"dtype": torch.float32}):
                    same_layout(fast_meta(aten.mean.dim, (a, dims, keep), kw), aten.mean.dim(a, dims, keep, **kw))
    for dtype in DTYPES:
        a = torch.empty(6, 4, dtype=dtype, device=META)
        for b in (torch.empty(4, 5, dtype=dtype, device=META), torch.empty(5, 4, dtype=dtype, device=META).t()):
            same_layout(fast_meta(aten.mm.default, (a, b), {}), aten.mm.default(a, b))


def test_what_it_does_not_know_goes_to_torch():
    """None (torch's function runs) for integer and bool results, tensors off the meta device, mismatched
    sizes (torch's own error), repeated dimensions, and ops outside the list."""
    f = torch.empty(3, 4, device=META)
    i = torch.empty(3, 4, dtype=torch.int64, device=META)
    assert fast_meta(aten.add.Tensor, (i, i), {}) is None
    assert fast_meta(aten.add.Tensor, (i, 2), {}) is None
    assert fast_meta(aten.mul.Tensor, (torch.empty(3, 4), torch.empty(3, 4)), {}) is None
    assert fast_meta(aten.mul.Tensor, (f, torch.empty(5, device=META)), {}) is None
    assert fast_meta(aten.mm.default, (f, f), {}) is None
    assert fast_meta(aten.mm.default, (f, torch.empty(4, 2, dtype=torch.bfloat16, device=META)), {}) is None
    assert fast_meta(aten.mean.dim, (f, [0, -2]), {}) is None
    assert fast_meta(aten.mean.dim, (f, [2]), {}) is None
    assert fast_meta(aten.mul_.Tensor, (f, f), {}) is None
    assert fast_meta(aten.div.Tensor, (f, f), {}) is None


def outputs(x):
    return x if isinstance(x, tuple) else (x,)


@pytest.mark.parametrize("channels_last_test", ["torch's", "contiguity"])
def test_loss_mask_and_rotary_ops_match_torch(channels_last_test, monkeypatch):
    """log_softmax, nll_loss, cumsum, all and cat (a loss's, Hugging Face's packed-sequence check's and
    rotate_half's): torch's shapes, dtypes and row-major outputs, in every layout it gives them; channels-last
    inputs go to torch's function (found by torch's suggest_memory_format, or without it by contiguity)."""
    if channels_last_test == "contiguity":
        monkeypatch.setattr(meta_ops, "_suggest_memory_format", None)
    rng = random.Random(3)
    checked = 0
    for shape, dtype in itertools.product(SHAPES, DTYPES + [torch.int64, torch.bool, torch.uint8]):
        for a in layouts(shape, dtype, rng):
            cases = [(aten.all.default, (a,))]
            for dim in range(-a.dim(), max(a.dim(), 1)):
                cases.append((aten.cumsum.default, (a, dim)))
                if dtype.is_floating_point:
                    cases += [(aten._log_softmax.default, (a, dim, dtype == torch.float16))]
                if a.dim() > 0:
                    cases += [(aten.cat.default, ([a, a.clone()], dim)), (aten.cat.default, ([a[..., :1], a], dim))]
            for op, args in cases:
                try:
                    want = op(*args)
                except RuntimeError:   # shapes torch refuses: nothing to compare
                    continue
                got = fast_meta(op, args, {})
                if got is None:
                    assert a.dim() in (4, 5), (op, a.shape, a.stride())
                    continue
                for g, w in zip(outputs(got), outputs(want), strict=True):
                    same_layout(g, w)
                checked += 1
    for n, c, dtype, reduction in itertools.product((1, 7), (1, 5), DTYPES, (0, 1, 2)):
        target = torch.empty(n, dtype=torch.long, device=META)
        for x in layouts((n, c), dtype, rng):
            args = (x, target, None, reduction, -100)
            for g, w in zip(fast_meta(aten.nll_loss_forward.default, args, {}),
                            aten.nll_loss_forward.default(*args), strict=True):
                same_layout(g, w)
                checked += 1
        x1 = torch.empty(c, dtype=dtype, device=META)
        args = (x1, torch.empty((), dtype=torch.long, device=META), None, reduction, -100)
        for g, w in zip(fast_meta(aten.nll_loss_forward.default, args, {}), aten.nll_loss_forward.default(*args)):
            same_layout(g, w)
    assert checked > 1500, checked
    # what it leaves to torch: a channels-last input, mixed dtypes, a class weight, a CPU tensor
    cl = torch.empty(2, 3, 4, 5, device=META).to(memory_format=torch.channels_last)
    assert fast_meta(aten.cat.default, ([cl, cl], 1), {}) is None
    assert fast_meta(aten._log_softmax.default, (cl, 1, False), {}) is None
    f = torch.empty(3, 4, device=META)
    assert fast_meta(aten.cat.default, ([f, f.bfloat16()], 0), {}) is None
    assert fast_meta(aten.nll_loss_forward.default, (f, torch.empty(3, dtype=torch.long, device=META),
                                                     torch.empty(4, device=META), 1, -100), {}) is None
    assert fast_meta(aten.cumsum.default, (torch.empty(3, 4), 0), {}) is None
