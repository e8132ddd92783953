"""linear_cross_entropy takes the class-index targets torch's cross_entropy takes (int64 and uint8) and
refuses the others by name, as torch does (class probabilities are not supported)."""
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
