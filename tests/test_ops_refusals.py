"""The raw ops refuse what their kernels cannot take, on real tensors and on meta ones (their fake kernels, which
torch.compile traces and a meta-device plan runs): the fakes accepted several calls the kernels refuse, so a
trace succeeded for a call that could never run. And a None given for a tensor argument names the argument."""
import pytest
import torch

import effmem  # noqa: F401  (loads the extension and the fake kernels)
from effmem import ops

E = torch.ops.effmem


def _codes(rows=2, last_dim=128):
    return E.quantize(torch.randn(rows, last_dim), 8, 128, 0, False)


CASES = {   # name: (call on tensors moved by `to`, what the message says)
    "adam8_encode v short": (lambda to: E.adam8_encode(to(torch.zeros(300)), to(torch.zeros(200)), 1.0, 0),
                             "v must be"),
    "adam8_decode scales": (lambda to: E.adam8_decode(to(torch.zeros(300, dtype=torch.uint8)), to(torch.ones(7)),
                                                      False), "scales must be"),
    "dequantize row bytes": (lambda to: E.dequantize(to(_codes()[0][:, :100].contiguous()), to(_codes()[1]), 8, 128,
                                                     128, torch.float32), "bytes"),
    "dequantize groups": (lambda to: E.dequantize(to(_codes()[0]), to(torch.ones(2, 7, 2)), 8, 128, 128,
                                                  torch.float32), "groups"),
    "dequantize strided codes": (lambda to: E.dequantize(to(torch.zeros(256, 2, dtype=torch.uint8)).t(),
                                                         to(_codes()[1]), 8, 128, 256, torch.float32), "contiguous"),
    "l2norm int64": (lambda to: E.l2norm([to(torch.ones(4, dtype=torch.int64))]), "float32"),
    "l2norm expanded": (lambda to: E.l2norm([to(torch.ones(1)).expand(8)]), "dense"),
    "rms_norm_apply empty rows": (lambda to: E.rms_norm_apply(to(torch.ones(3, 0)), to(torch.ones(3)),
                                                              to(torch.ones(0))), "last dimension of at least 1"),
    "adam lr": (lambda to: E.adam_step_([to(torch.zeros(8))], [to(torch.zeros(8))], [to(torch.zeros(8))],
                                        [to(torch.zeros(8))], [], [to(torch.zeros(()))], -1.0, 0.9, 0.999, 1e-8,
                                        0.0, True, True), "lr must be"),
    "adam beta1": (lambda to: E.adam_step_([to(torch.zeros(8))], [to(torch.zeros(8))], [to(torch.zeros(8))],
                                           [to(torch.zeros(8))], [], [to(torch.zeros(()))], 1e-3, 2.0, 0.999, 1e-8,
                                           0.0, True, True), "beta1"),
    "adam grads shape": (lambda to: E.adam_step_([to(torch.zeros(8))], [to(torch.zeros(9))], [to(torch.zeros(8))],
                                                 [to(torch.zeros(8))], [], [to(torch.zeros(()))], 1e-3, 0.9, 0.999,
                                                 1e-8, 0.0, True, True), "grads"),
}


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_call_the_kernel_refuses_is_refused_on_meta_tensors_too(case, device):
    call, match = CASES[case]
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        call(lambda t: t.to(device))


@pytest.mark.parametrize("call, name", [
    (lambda x: E.swiglu(x, None), "up"),
    (lambda x: E.swiglu_backward(None, x, x), "grad"),
    (lambda x: E.rms_norm_apply(x, None, torch.ones(8)), "rstd"),
    (lambda x: E.quantize(None, 8, 128, 0, False), "x"),
    (lambda x: E.dequantize(None, torch.ones(4, 1, 2), 8, 128, 8, torch.float32), "codes"),
    (lambda x: E.adam8_encode(x.flatten(), None, 1.0, 0), "v"),
    (lambda x: E.linear_ce_forward(x, x, None, None, -100, 0.0, 0.0, 0), "target"),
    (lambda x: E.linear_ce_backward(torch.ones(4), x, x, None, torch.zeros(4, dtype=torch.long), None, -100, 0.0,
                                    0.0, 0, [True] * 3), "lse"),
])
def test_none_for_a_tensor_names_the_argument(call, name):
    """It read the missing tensor's device first: "tensor does not have a device", naming nothing."""
    with pytest.raises(TypeError, match=f"^{name} must be a tensor, got None"):
        call(torch.ones(4, 8))


def test_linear_ce_backward_refuses_a_complex_or_integer_grad_loss():
    """A complex grad_loss lost its imaginary part with a warning only; bool and int64 went through too."""
    hidden, weight, target = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    lse = E.linear_ce_forward(hidden, weight, None, target, -100, 0.0, 0.0, 0)[1]
    for bad in (torch.full((4,), 1 + 5j), torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.long)):
        with pytest.raises(ValueError, match="grad_loss must be a floating"):
            E.linear_ce_backward(bad, hidden, weight, None, target, lse, -100, 0.0, 0.0, 0, [True] * 3)
    E.linear_ce_backward(torch.ones(4), hidden, weight, None, target, lse, -100, 0.0, 0.0, 0, [True] * 3)


def test_the_adam_ops_refuse_to_write_a_leaf_that_requires_grad_under_grad_mode():
    """As torch's in-place ops do ("a leaf Variable that requires grad is being used in an in-place operation");
    under torch.no_grad(), as torch's optimizers and FusedAdam step, it is written."""
    p = torch.zeros(8, requires_grad=True)
    args = ([p], [torch.ones(8)], [torch.zeros(8)], [torch.zeros(8)], [], [torch.ones(())], 1e-3, 0.9, 0.999, 1e-8,
            0.0, True, True)
    with pytest.raises(RuntimeError, match="adam_step_: writes a leaf tensor that requires grad in place"):
        E.adam_step_(*args)
    assert torch.equal(p.detach(), torch.zeros(8))
    with torch.no_grad():
        E.adam_step_(*args)
    assert p.detach().abs().min() > 0


def test_dequantize_names_a_shape_that_is_not_a_sequence_of_ints():
    codes, stats = _codes(1, 128)
    for shape in (None, 128, (1, 128.0)):
        with pytest.raises(TypeError, match="shape: expected a sequence of ints"):
            ops.dequantize(codes, stats, bits=8, group_size=128, shape=shape, dtype=torch.float32)
    assert ops.dequantize(codes, stats, bits=8, group_size=128, shape=(1, 128), dtype=torch.float32).shape == (1, 128)
