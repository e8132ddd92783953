"""linear_cross_entropy takes the class-index targets torch's cross_entropy takes (int64 and uint8) and
refuses the others by name, as torch does (class probabilities are not supported); and what it takes of torch:
its default dtype, autocast's casts, the check of a weight changed in place before backward."""
import pytest
import torch
import torch.nn.functional as F

from effmem import linear_cross_entropy


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_uint8_targets_give_what_torch_gives(grad_in_forward):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 24, generator=g, requires_grad=True)
    weight = torch.randn(200, 24, generator=g, requires_grad=True)
    target = torch.randint(0, 200, (40,), generator=g, dtype=torch.uint8)
    target[5] = 255   # an ignore_index in uint8's range
    got = linear_cross_entropy(hidden, weight, target, ignore_index=255, grad_in_forward=grad_in_forward)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    want = F.cross_entropy(hidden @ weight.T, target, ignore_index=255)
    want_grads = torch.autograd.grad(want, (hidden, weight))
    assert torch.allclose(got, want, rtol=1e-6), (got.item(), want.item())
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max().item()


def test_other_target_dtypes_are_refused_by_name():
    hidden, weight = torch.randn(8, 16), torch.randn(32, 16)
    for dtype in (torch.int32, torch.int8, torch.bool):
        with pytest.raises(TypeError, match=f"target: expected int64 \\(or uint8\\) class indices, got {dtype}"):
            linear_cross_entropy(hidden, weight, torch.zeros(8, dtype=dtype))
    with pytest.raises(TypeError, match=r"class probabilities, .* are not supported"):
        linear_cross_entropy(hidden, weight, torch.softmax(torch.randn(8, 32), -1))


@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16])
def test_the_mean_is_taken_whatever_torchs_default_dtype(default):
    """Its per-token scale was made in the default dtype, which the kernel refused ('grad_scale must be
    float32', an argument the caller never gave)."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 8, generator=g, requires_grad=True)
    weight = torch.randn(20, 8, generator=g, requires_grad=True)
    target = torch.randint(0, 20, (6,), generator=g)
    want = F.cross_entropy(hidden @ weight.T, target)
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = [linear_cross_entropy(hidden, weight, target, grad_in_forward=way) for way in (True, False)]
    finally:
        torch.set_default_dtype(before)
    for loss in got:
        assert loss.dtype == torch.float32 and torch.allclose(loss, want, rtol=1e-6)


def test_autocast_leaves_float64_as_f_linear_does():
    hidden, weight = torch.randn(10, 8, dtype=torch.float64), torch.randn(50, 8, dtype=torch.float64)
    target = torch.randint(0, 50, (10,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.linear(hidden, weight).dtype == torch.float64
        with pytest.raises(TypeError, match="hidden must be float32, bfloat16 or float16, got Double"):
            linear_cross_entropy(hidden, weight, target)   # was cast to bf16: a loss other than F.linear's
        fused = linear_cross_entropy(hidden.float(), weight.half(), target)   # others are cast, as F.linear's
        unfused = F.cross_entropy(F.linear(hidden.float(), weight.half()), target)
    assert torch.allclose(fused, unfused.float(), rtol=1e-2)


@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_a_weight_changed_in_place_before_backward_raises_as_torch_does(grad_in_forward):
    hidden = torch.randn(12, 8, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(40, 8))
    loss = linear_cross_entropy(hidden, weight, torch.randint(0, 40, (12,)), grad_in_forward=grad_in_forward)
    with torch.no_grad():
        weight.mul_(2)   # a step taken between forward and backward: the gradients would be the old weight's
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_under_autocast_the_weights_copy_is_not_kept_past_backward_and_the_weight_is_checked():
    import gc
    import weakref
    hidden = torch.randn(16, 32, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(512, 32))
    target = torch.randint(0, 512, (16,))
    copies = []
    real_to = torch.Tensor.to

    def spy(t, *args, **kwargs):   # the bf16 copies autocast's cast makes of the weight
        out = real_to(t, *args, **kwargs)
        if t is weight and out.dtype == torch.bfloat16:
            copies.append(weakref.ref(out))
        return out
    torch.Tensor.to = spy
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = linear_cross_entropy(hidden, weight, target, grad_in_forward=True)
    finally:
        torch.Tensor.to = real_to
    loss.backward()
    gc.collect()
    assert copies and all(c() is None for c in copies)   # the loss (and its graph) still alive
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, target, grad_in_forward=True)
    with torch.no_grad():
        weight.mul_(2)
    with pytest.raises(RuntimeError, match="linear_cross_entropy's weight"):
        loss.backward()


def test_a_float32_weight_made_by_an_op_is_not_kept_past_its_cast_under_autocast():
    import gc
    import weakref
    hidden = torch.randn(16, 32, requires_grad=True)
    param = torch.nn.Parameter(torch.randn(512, 32))
    made = param * 1.0   # a scaled head: not a leaf; autocast's bf16 copy of it is what the kernel takes
    alive = weakref.ref(made)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, made, torch.randint(0, 512, (16,)), grad_in_forward=True)
    del made
    gc.collect()
    assert alive() is None   # held until backward by the in-place check (512 x 32 float32)
    loss.backward()
    assert param.grad is not None


def test_the_ops_check_arguments_before_values_and_keep_ignored_tokens_out():
    """torch.ops.effmem's linear_ce ops called directly (a fuzzing reviewer's finds): a target of the wrong shape
    holding an out-of-range index got an internal error ("a Tensor with 2 elements cannot be converted to
    Scalar"), a sparse bias or target an error describing hidden, linear_ce_backward took an index past the
    vocabulary, and forward_backward gave an ignored token a gradient where its caller's grad_scale was not 0."""
    L = torch.ops.effmem
    g = torch.Generator().manual_seed(0)
    h, w, b = torch.randn(4, 8, generator=g), torch.randn(50, 8, generator=g), torch.randn(50, generator=g)
    with pytest.raises(ValueError, match=r"target must be \[4\] \(one class index per token\), got shape \[4, 2\]"):
        L.linear_ce_forward(h, w, b, torch.full((4, 2), 5000), -100, 0.0, 0.0, 0)
    for name, args in (("bias", (h, w, b.to_sparse(), torch.tensor([3, 5, 7, 9]))),
                       ("target", (h, w, b, torch.tensor([3, 5, 7, 9]).to_sparse()))):
        with pytest.raises(ValueError, match=f"{name} must be .*layout Sparse"):
            L.linear_ce_forward(*args, -100, 0.0, 0.0, 0)
    lse = L.linear_ce_forward(h, w, b, torch.tensor([3, 5, 7, 9]), -100, 0.0, 0.0, 0)[1]
    with pytest.raises(IndexError, match=r"target\[1\] = 5000 is not a class index in \[0, 50\)"):
        L.linear_ce_backward(torch.ones(4), h, w, b, torch.tensor([3, 5000, 7, 9]), lse, -100, 0.0, 0.0, 0, [True] * 3)
    t = torch.tensor([3, -100, 7, 9])
    loss, gh, gw, gb = L.linear_ce_forward_backward(h, w, b, t, torch.full((4,), 0.25), -100, 0.0, 0.0, 0, [True] * 3)
    hd, wd, bd = (x.double().requires_grad_() for x in (h, w, b))
    want = F.cross_entropy(hd @ wd.T + bd, t, ignore_index=-100, reduction="none")
    (want * 0.25).sum().backward()
    assert loss[1] == 0 and torch.equal(gh[1], torch.zeros(8))
    for got, ref in ((gh, hd.grad), (gw, wd.grad), (gb, bd.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
