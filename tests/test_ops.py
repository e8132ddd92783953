"""Op registration: schemas, fake kernels, opcheck and torch.compile tracing."""
import pytest
import torch

import effmem  # noqa: F401  (loads the extension and the fake kernels)
from effmem import ops
from conftest import DEVICES



def adam_args(device, dtype):
    n = [5, 4097]
    params = [torch.randn(k, device=device).to(dtype) for k in n]
    masters = [p.float() for p in params] if dtype != torch.float32 else []
    return (params, [torch.randn(k, device=device).to(dtype) for k in n],
            [torch.zeros(k, device=device) for k in n], [torch.zeros(k, device=device) for k in n], masters,
            [torch.ones((), device=device) for _ in n], 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_adam_step(device, dtype):
    torch.library.opcheck(torch.ops.effmem.adam_step_.default, adam_args(device, dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_l2norm(device):
    tensors = [torch.randn(7, device=device), torch.randn(3, 4, device=device).bfloat16()]
    torch.library.opcheck(torch.ops.effmem.l2norm.default, (tensors,))


def test_ops_trace_under_torch_compile():
    def norm_then_step(params, grads, m, v, steps):
        total = ops.l2norm(grads)
        ops.adam_step_(params, grads, m, v, [], steps, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.0, decoupled=True)
        return total

    args = adam_args("cpu", torch.float32)
    eager_args = [[t.clone() for t in lst] for lst in args[:4]] + [[t.clone() for t in args[5]]]
    compiled_args = [[t.clone() for t in lst] for lst in args[:4]] + [[t.clone() for t in args[5]]]
    expected = norm_then_step(*eager_args)
    got = torch.compile(norm_then_step, backend="aot_eager", fullgraph=True)(*compiled_args)
    assert torch.equal(expected, got)
    for a, b in zip(eager_args[0], compiled_args[0]):
        assert torch.equal(a, b)


def _backward_through(name):
    """A backward through effmem::name called on inputs that require grad."""
    x = torch.randn(4, 128, requires_grad=True)
    if name == "quantize":
        out = torch.ops.effmem.quantize(x, 8, 128, 0, False)[1]
    elif name == "dequantize":
        codes, stats = torch.ops.effmem.quantize(x.detach(), 8, 128, 0, False)
        out = torch.ops.effmem.dequantize(codes, stats.requires_grad_(), 8, 128, 128, torch.float32)
    elif name == "swiglu":
        out = torch.ops.effmem.swiglu(x, torch.randn(4, 128))
    elif name == "rms_norm_apply":
        out = torch.ops.effmem.rms_norm_apply(x, torch.ones(4, 1), torch.ones(128))
    else:
        out = torch.ops.effmem.l2norm([x])
    out.sum().backward()


@pytest.mark.parametrize("name", ["quantize", "dequantize", "swiglu", "rms_norm_apply", "l2norm"])
def test_ops_without_a_derivative_raise_in_backward(name):
    """Called directly on a tensor that requires grad, these ops' outputs had torch's deprecated fallback: a
    warning, and a backward that silently left x.grad None. Backward through them now raises, naming the op."""
    with pytest.raises(RuntimeError, match=f"derivative for effmem::{name} is not implemented"):
        _backward_through(name)


@pytest.mark.parametrize("case", ["int_x", "strided_x", "float_codes", "double_stats", "rows_differ"])
def test_fake_kernels_refuse_what_the_kernels_refuse(case):
    """Compiled, the fake kernels run at trace time: they accepted an int64 or non-contiguous x and codes or
    stats of the wrong dtype or rows, which the real kernels refuse, so the error came only when run. Called
    on fake tensors here, so that only the fake kernel runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    codes, stats = torch.ops.effmem.quantize(torch.randn(4, 128), 8, 128, 0, False)
    with FakeTensorMode() as mode:
        codes, stats = mode.from_tensor(codes), mode.from_tensor(stats)
        calls = {"int_x": (lambda: torch.ops.effmem.quantize(torch.ones(4, 128, dtype=torch.int64), 8, 128, 0, False),
                           "x must be float32"),
                 "strided_x": (lambda: torch.ops.effmem.quantize(torch.randn(128, 4).t(), 8, 128, 0, False),
                               "x must be contiguous"),
                 "float_codes": (lambda: torch.ops.effmem.dequantize(codes.float(), stats, 8, 128, 128, torch.float32),
                                 "codes must be uint8"),
                 "double_stats": (lambda: torch.ops.effmem.dequantize(codes, stats.double(), 8, 128, 128,
                                                                      torch.float32), "stats must be float32"),
                 "rows_differ": (lambda: torch.ops.effmem.dequantize(codes, stats[:2], 8, 128, 128, torch.float32),
                                 r"stats must be 3-D \[rows, groups, 2\] with codes")}
        call, match = calls[case]
        with pytest.raises(RuntimeError, match=match):
            call()
        torch.ops.effmem.dequantize(codes, stats, 8, 128, 128, torch.float32)   # what the kernel takes passes
