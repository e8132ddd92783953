"""The quantize / dequantize op family against the pure-PyTorch reference.

Tolerances: the kernels and python/effmem/reference.py do the same float32
operations in the same order (no FMA contraction), so codes, stats and
dequantised values must be equal bit for bit; round-to-nearest error is at
most half a step (scale / 2) per element, plus float rounding of lo + q * scale.
"""
import pytest
import torch

import effmem
from effmem import ops, reference
from conftest import DEVICES

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1,), (3,), (5, 300), (2, 3, 257), (4097,), (64, 128)]


def unpack(codes, bits, last_dim):
    if bits == 8:
        return codes.long()
    pairs = torch.stack([(codes & 15).long(), (codes >> 4).long()], dim=-1)
    return pairs.reshape(codes.shape[0], -1)[:, :last_dim]


def sample(shape, dtype, device="cpu"):
    # rows with different ranges, so groups get different scales
    return (torch.randn(shape) * torch.rand(shape[-1]) * 5 + torch.randn(shape[-1])).to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128, 256])
@pytest.mark.parametrize("stochastic", [True, False])
def test_matches_reference_bit_for_bit(device, dtype, bits, group_size, stochastic):
    for shape in SHAPES:
        x = sample(shape, dtype, device)
        codes, stats = ops.quantize(x, bits=bits, group_size=group_size, seed=1234, stochastic=stochastic)
        ref_codes, ref_stats = reference.quantize(x.cpu(), bits, group_size, 1234, stochastic)
        assert codes.dtype == torch.uint8 and codes.shape == (ref_codes.shape[0], (shape[-1] * bits + 7) // 8)
        assert torch.equal(stats.cpu(), ref_stats)
        assert torch.equal(unpack(codes.cpu(), bits, shape[-1]), ref_codes)
        y = ops.dequantize(codes, stats, bits=bits, group_size=group_size, shape=shape, dtype=dtype)
        assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
        assert torch.equal(y.cpu(), reference.dequantize(ref_codes, ref_stats, group_size, shape, dtype))


@pytest.mark.parametrize("bits", [4, 8])
def test_round_to_nearest_error_is_half_a_step(bits):
    x = sample((16, 1000), torch.float32)
    codes, stats = ops.quantize(x, bits=bits, group_size=64, stochastic=False)
    y = ops.dequantize(codes, stats, bits=bits, group_size=64, shape=x.shape, dtype=x.dtype)
    step = stats[..., 1].repeat_interleave(64, dim=1)[:, :1000]
    assert ((y - x).abs() <= step / 2 * (1 + 1e-5) + 1e-6).all()


def test_stochastic_rounding_is_unbiased():
    """Over 1000 seeds the mean of the dequantised values is within 3 standard errors of x.

    The standard error is the exact one of stochastic rounding: an element at
    fraction f between two grid points moves by scale with probability f, so
    its sd is scale * sqrt(f * (1 - f)). Estimating it from the draws fails
    for elements with f near 0 or 1, which rarely move in 1000 draws.
    """
    n = 1000
    x = sample((2, 300), torch.float32)
    codes, stats = ops.quantize(x, bits=4, group_size=64, seed=0)
    lo = stats[..., 0].repeat_interleave(64, dim=1)[:, :300].double()
    scale = stats[..., 1].repeat_interleave(64, dim=1)[:, :300].double()
    y = (x.double() - lo) / scale
    frac = y - y.floor()
    se = scale * (frac * (1 - frac)).sqrt() / n ** 0.5
    draws = torch.stack([
        ops.dequantize(*ops.quantize(x, bits=4, group_size=64, seed=s), bits=4, group_size=64, shape=x.shape,
                       dtype=x.dtype) for s in range(n)]).double()
    err = draws.mean(0) - x.double()
    slack = 1e-6 * x.abs().max().item()  # float rounding of lo + q * scale
    assert ((err.abs() <= 3 * se + slack).double().mean() >= 0.99), "more than 1% of elements beyond 3 SE"
    # no systematic bias: the standardised errors average to ~0 over 600 elements
    z = err / (se + slack)
    assert abs(z.mean().item()) * z.numel() ** 0.5 < 4


def test_seeds_differ_and_repeat():
    x = sample((4, 256), torch.float32)
    a = ops.quantize(x, seed=1)[0]
    assert torch.equal(a, ops.quantize(x, seed=1)[0])
    assert not torch.equal(a, ops.quantize(x, seed=2)[0])
    assert not torch.equal(a, ops.quantize(x, seed=1 << 40)[0]), "the seed's high bits must matter"


@pytest.mark.parametrize("isa", effmem._C.supported_cpu_isas().split(","))
def test_every_cpu_isa_gives_identical_codes(isa):
    x = sample((33, 1000), torch.bfloat16)
    previous = effmem._C.cpu_isa()
    try:
        effmem._C.set_cpu_isa("scalar")
        expected = ops.quantize(x, bits=4, group_size=128, seed=9)
        effmem._C.set_cpu_isa(isa)
        got = ops.quantize(x, bits=4, group_size=128, seed=9)
    finally:
        effmem._C.set_cpu_isa(previous)
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_stay_non_finite(device):
    x = torch.randn(3, 128, device=device)
    x[0, 5] = float("nan")
    x[1, 100] = float("inf")
    x[2, 7] = -float("inf")
    y = ops.dequantize(*ops.quantize(x, group_size=64), bits=8, group_size=64, shape=x.shape, dtype=x.dtype)
    assert not torch.isfinite(y[0, 5]) and not torch.isfinite(y[1, 100]) and not torch.isfinite(y[2, 7])
    assert torch.isfinite(y[0, 64:]).all() and torch.isfinite(y[1, :64]).all()


def test_empty_and_scalar_tensors():
    for x in (torch.empty(0, 16), torch.tensor(3.5)):
        codes, stats = ops.quantize(x)
        y = ops.dequantize(codes, stats, bits=8, group_size=128, shape=x.shape, dtype=x.dtype)
        assert y.shape == x.shape
    assert ops.dequantize(*ops.quantize(torch.tensor(3.5)), bits=8, group_size=128, shape=(), dtype=torch.float32) == 3.5


def test_bad_arguments():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="bits"):
        ops.quantize(x, bits=3)
    with pytest.raises(ValueError, match="group_size"):
        ops.quantize(x, group_size=100)
    with pytest.raises(TypeError, match="x: expected a float32"):
        ops.quantize(torch.ones(4, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        torch.ops.effmem.quantize(x, 2, 64, 0, True)
    codes, stats = ops.quantize(x, bits=8, group_size=64)
    with pytest.raises(ValueError, match="bytes per row"):
        ops.dequantize(codes, stats, bits=4, group_size=64, shape=x.shape, dtype=x.dtype)
    with pytest.raises(ValueError, match="stats must be"):
        ops.dequantize(codes, stats[:, :0], bits=8, group_size=64, shape=x.shape, dtype=x.dtype)
    with pytest.raises(TypeError, match="dtype must be"):
        torch.ops.effmem.dequantize(codes, stats, 8, 64, 64, torch.int32)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(5, 300, device=device).bfloat16()
    torch.library.opcheck(torch.ops.effmem.quantize.default, (x, 8, 64, 7, True))
    codes, stats = torch.ops.effmem.quantize(x, 4, 64, 7, True)
    torch.library.opcheck(torch.ops.effmem.dequantize.default, (codes, stats, 4, 64, 300, torch.bfloat16))
