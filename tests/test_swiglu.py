"""effmem::swiglu and effmem::swiglu_backward (csrc/common/swiglu_math.h): silu(gate) * up and its two
gradients in one pass each, used by the "fast" activation policy's SwiGLU on CUDA.

On the CPU: the results equal torch's ops (F.silu, the product, aten's silu_backward) in bf16 and fp16
except, rarely, by one unit in the last place (the exponential is the kernels' own, so that CPU and CUDA
agree), and in float32 within twice torch's own error of a float64 reference; non-finite inputs give what
torch gives; bad arguments are refused with messages naming them; opcheck passes. With a GPU: the CUDA
kernels equal the CPU kernels bit for bit, on the 16-byte path, the element-by-element path (misaligned
views) and the tail, and the policy's SwiGLU takes them.
"""
import pytest
import torch
import torch.nn.functional as F

from effmem import ops
from effmem.activations import fused

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def inputs(dtype, n=1 << 16, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    g, u, dy = (torch.randn(3, n, generator=gen) * torch.tensor([[6.0], [1.0], [1.0]])).to(dtype).unbind(0)
    return dy.to(device), g.to(device), u.to(device)


def torch_ops(dy, g, u):
    return F.silu(g) * u, torch.ops.aten.silu_backward(dy * u, g), dy * F.silu(g)


def reference(dy, g, u):
    dy, g, u = dy.double(), g.double(), u.double()
    sig = torch.sigmoid(g)
    return g * sig * u, dy * u * sig * (1 + g * (1 - sig)), dy * g * sig


def ulps_apart(a, b):
    """How many representable values lie between a and b (same dtype, finite), elementwise."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    ia, ib = a.view(bits).long(), b.view(bits).long()
    sign = {torch.int32: 1 << 31, torch.int16: 1 << 15}[bits]
    # map sign-magnitude to a monotone integer line
    ia = torch.where(ia < 0, -(ia + sign), ia)
    ib = torch.where(ib < 0, -(ib + sign), ib)
    return (ia - ib).abs()


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_ops(dtype):
    dy, g, u = inputs(dtype)
    out = ops.swiglu(g, u)
    dg, du = ops.swiglu_backward(dy, g, u)
    for mine, theirs, exact in zip((out, dg, du), torch_ops(dy, g, u), reference(dy, g, u)):
        assert mine.dtype == dtype and mine.shape == g.shape and mine.is_contiguous()
        if dtype == torch.float32:
            err = lambda t: ((t.double() - exact).abs() / exact.abs().clamp_min(1e-3)).max().item()  # noqa: E731
            assert err(mine) <= 2 * err(theirs) + 1e-7
        else:
            apart = ulps_apart(mine, theirs)
            assert apart.max().item() <= 1 and (apart > 0).float().mean().item() < 1e-3


@pytest.mark.parametrize("big", [1.0, float("inf")])
def test_non_finite_inputs_as_torch(big):
    """Also gates in [-88.72, -88), where e^-g is still a float (e^88.5 = 2.7e38): the kernels' exponential was
    infinite from 88, silu(-88.5) came out -0 instead of -3.2e-37, and 0 * inf NaN where torch gives -inf (a
    reviewer's fuzzing; the tolerance hid the first: every finite value is compared relatively now)."""
    g = torch.tensor([float("nan"), float("inf"), -float("inf"), 100.0, -100.0, 88.5, -88.5, 87.5, -87.5, 0.0,
                      -88.0, -88.3, -88.4, -88.7, -88.72, -88.73, -89.0])
    u, dy = torch.ones_like(g), torch.full_like(g, big)
    for inputs_ in ((dy, g, u), (u, g, dy)):
        mine = (ops.swiglu(inputs_[1], inputs_[2]), *ops.swiglu_backward(*inputs_))
        for a, b in zip(mine, torch_ops(*inputs_)):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf()), (a, b)
            assert torch.equal(a.signbit()[~a.isnan()], b.signbit()[~b.isnan()]), (a, b)   # -0 where torch has -0
            torch.testing.assert_close(a[a.isfinite()], b[b.isfinite()], rtol=1e-5, atol=0)


def test_any_layout_and_empty():
    dy, g, u = inputs(torch.bfloat16, n=6 * 40)
    g2, u2, dy2 = (t.view(6, 40).t() for t in (g, u, dy))     # non-contiguous: results are contiguous
    torch.testing.assert_close(ops.swiglu(g2, u2), ops.swiglu(g2.contiguous(), u2.contiguous()), rtol=0, atol=0)
    for a, b in zip(ops.swiglu_backward(dy2, g2, u2), ops.swiglu_backward(dy2.contiguous(), g2.contiguous(),
                                                                            u2.contiguous())):
        assert torch.equal(a, b)
    e = torch.empty(0, 3)
    assert ops.swiglu(e, e).shape == (0, 3) and ops.swiglu_backward(e, e, e)[0].shape == (0, 3)


def test_bad_arguments_are_named():
    g = torch.randn(4, 8)
    with pytest.raises(TypeError, match="gate must be float32, bfloat16 or float16"):
        ops.swiglu(g.double(), g.double())
    with pytest.raises(ValueError, match="up must match gate"):
        ops.swiglu(g, g[:, :4])
    with pytest.raises(ValueError, match="up must match gate"):
        ops.swiglu(g, g.bfloat16())
    with pytest.raises(ValueError, match="grad must match gate"):
        ops.swiglu_backward(g[:2], g, g)
    with pytest.raises(ValueError, match="one device"):
        ops.swiglu(g, g.to("meta"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    dy, g, u = (t.view(16, 32) for t in inputs(dtype, n=512))
    torch.library.opcheck(torch.ops.effmem.swiglu.default, (g, u))
    torch.library.opcheck(torch.ops.effmem.swiglu_backward.default, (dy, g, u))


def test_policy_swiglu_uses_torch_ops_on_cpu():
    """On a CPU the torch ops are the faster path (see fused._swiglu_kernel_applies); with a GPU the test
    below checks that CUDA tensors take the kernels."""
    dy, g, u = inputs(torch.bfloat16, n=64)
    assert not fused._swiglu_kernel_applies(dy, g, u)


def test_every_vector_unit_gives_the_same_bits():
    """The kernels are compiled per vector unit (cpu/kernels.inc, vectorised by the compiler); each unit this CPU
    runs gives the scalar unit's bits, NaN, infinities and the exponential's clamps included."""
    from effmem import _C
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 100.0, -100.0, 88.5, -88.5, 87.5, -87.5, 0.0])
    units, before = _C.supported_cpu_isas().split(","), _C.cpu_isa()
    for dtype in DTYPES:
        dy, g, u = inputs(dtype, n=4099)
        g[:10] = specials.to(dtype)
        got = {}
        try:
            for unit in units:
                _C.set_cpu_isa(unit)
                got[unit] = [t.view(torch.uint8) for t in (ops.swiglu(g, u), *ops.swiglu_backward(dy, g, u))]
        finally:
            _C.set_cpu_isa(before)
        for unit in units[1:]:
            assert all(torch.equal(a, b) for a, b in zip(got[units[0]], got[unit])), (dtype, unit)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, offset", [(1 << 20, 0), (1000003, 0), (4099, 1)])
def test_cuda_equals_cpu_bit_for_bit(dtype, n, offset):
    """offset 1: views one element into their storage, so the CUDA kernels take the element-by-element path."""
    dy, g, u = inputs(dtype, n=n + offset, seed=n)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 100.0, -100.0, 88.5, -88.5, 0.0])
    g[offset:offset + 8] = specials.to(dtype)
    cpu = (ops.swiglu(g[offset:], u[offset:]), *ops.swiglu_backward(dy[offset:], g[offset:], u[offset:]))
    dyc, gc, uc = (t.cuda()[offset:] for t in (dy, g, u))
    cuda = (ops.swiglu(gc, uc), *ops.swiglu_backward(dyc, gc, uc))
    for a, b in zip(cpu, cuda):
        assert b.is_cuda and b.dtype == dtype
        assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))   # bits, NaNs included


@pytest.mark.cuda
def test_policy_swiglu_takes_the_kernels_on_cuda():
    dy, g, u = (t.cuda() for t in inputs(torch.bfloat16, n=1 << 16))
    assert fused._swiglu_kernel_applies(dy, g, u)
    gr, ur = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
    out = fused.swiglu(gr, ur)
    assert torch.equal(out, F.silu(g) * u)                      # the forward is torch's own
    grads = torch.autograd.grad(out, (gr, ur), dy)
    want = ops.swiglu_backward(dy.cpu(), g.cpu(), u.cpu())
    for a, b in zip(grads, want):
        assert torch.equal(a.cpu(), b)
    assert torch.equal(fused._swiglu_out(g, u).cpu(), ops.swiglu(g.cpu(), u.cpu()))
