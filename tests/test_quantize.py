"""The quantize / dequantize op family against the pure-PyTorch reference.

Tolerances: the kernels and python/effmem/reference.py do the same float32
operations in the same order (no FMA contraction), so codes, stats and
dequantised values must be equal bit for bit; round-to-nearest error is at
most half a step plus 1/512 of one (codes round on a grid 256 times finer
than the step first, quant_math.h) per element, plus float rounding of
lo + q * scale.
"""
import pytest
import torch

import effmem
from effmem import ops, reference
from conftest import DEVICES, cpu_isa, cpu_isas, same

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Round-to-nearest error bound in steps: half a step, plus 1/512 for the grid 256x finer than the step
# that codes are rounded on first (quant_math.h).
NEAREST = 0.5 + 1 / 512
# (64, 128), (3, 2048), (33, 160): rows of whole groups take CUDA's flat dequantize kernel (33 x 160 ends in
# a part warp and, at group sizes 128 and 256, in part groups: the group-mapped kernel); the rest the others
SHAPES = [(1,), (3,), (5, 300), (2, 3, 257), (4097,), (64, 128), (3, 2048), (33, 160)]


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
        assert torch.equal(y.cpu(), reference.dequantize(ref_codes, ref_stats, group_size, shape, dtype, bits))


@pytest.mark.parametrize("bits", [4, 8])
def test_round_to_nearest_error_is_half_a_step(bits):
    x = sample((16, 1000), torch.float32)
    codes, stats = ops.quantize(x, bits=bits, group_size=64, stochastic=False)
    y = ops.dequantize(codes, stats, bits=bits, group_size=64, shape=x.shape, dtype=x.dtype)
    step = stats[..., 1].repeat_interleave(64, dim=1)[:, :1000]
    err = (y - x).abs()
    assert (err <= step * NEAREST * (1 + 1e-5) + 1e-6).all()
    assert (err > step / 2 * (1 + 1e-5) + 1e-6).float().mean() < 0.01, "the 1/512 grid should rarely matter"


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


@pytest.mark.parametrize("isa", cpu_isas())
def test_every_cpu_isa_matches_reference_bit_for_bit(isa):
    """Each vector unit's own quantize and dequantize kernels (csrc/cpu/isa_*.cpp; the rest of the suite runs
    the machine's widest only): every dtype, width, group size and rounding against the reference."""
    with cpu_isa(isa):
        for dtype in DTYPES:
            for bits in (4, 8):
                for group_size in (32, 128, 256):
                    for stochastic in (True, False):
                        for shape in ((5, 300), (4097,), (33, 160), "special"):
                            x = sample((4, 300), dtype) if shape == "special" else sample(shape, dtype)
                            if shape == "special":   # the groups dequantize's plain path leaves to the general one
                                x[0, 5] = 1e4 if dtype == torch.float16 else 1e30   # one value far out: outlier
                                # a scale past 2^100, halved (float16's values cannot reach it: overflow, inf)
                                x[1] *= 6e3 if dtype == torch.float16 else 1e34
                                x[2, 7] = float("nan")
                                shape = x.shape
                            codes, stats = ops.quantize(x, bits=bits, group_size=group_size, seed=9,
                                                        stochastic=stochastic)
                            ref_codes, ref_stats = reference.quantize(x, bits, group_size, 9, stochastic)
                            where = (isa, dtype, bits, group_size, stochastic, shape)
                            assert same(stats, ref_stats), where
                            assert torch.equal(unpack(codes, bits, shape[-1]), ref_codes), where
                            y = ops.dequantize(codes, stats, bits=bits, group_size=group_size, shape=shape,
                                               dtype=dtype)
                            ref = reference.dequantize(ref_codes, ref_stats, group_size, shape, dtype, bits)
                            assert same(y, ref), where


def roundtrip(x, bits=8, group_size=64, stochastic=False):
    """Quantise and dequantise x, checking codes, stats and result against the reference bit for bit."""
    codes, stats = ops.quantize(x, bits=bits, group_size=group_size, stochastic=stochastic)
    y = ops.dequantize(codes, stats, bits=bits, group_size=group_size, shape=x.shape, dtype=x.dtype)
    ref_codes, ref_stats = reference.quantize(x.cpu(), bits, group_size, 0, stochastic)
    assert same(stats.cpu(), ref_stats) and torch.equal(unpack(codes.cpu(), bits, x.shape[-1]), ref_codes)
    assert same(y.cpu(), reference.dequantize(ref_codes, ref_stats, group_size, x.shape, x.dtype, bits))
    return y, stats


@pytest.mark.parametrize("device", DEVICES)
def test_nan_poisons_its_group_and_a_one_sided_inf_is_kept_exactly(device):
    x = torch.randn(4, 128, device=device)
    x[0, 5] = float("nan")
    x[1, 100] = float("inf")
    x[2, 7] = -float("inf")
    x[3, 3], x[3, 9] = -float("inf"), float("inf")   # both signs: no finite encoding
    y, _ = roundtrip(x)
    assert y[0, :64].isnan().all() and y[3, :64].isnan().all()
    assert torch.isfinite(y[0, 64:]).all() and torch.isfinite(y[3, 64:]).all()
    assert y[1, 100] == float("inf") and y[2, 7] == -float("inf")
    for row, group in ((1, slice(64, 128)), (2, slice(0, 64))):
        ordinary = torch.isfinite(x[row, group])
        bulk = x[row, group][ordinary]
        step = bulk.abs().max() / 127   # the symmetric step of the outlier encoding
        assert ((y[row, group][ordinary] - bulk).abs() <= step * NEAREST * 1.001).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_masked_positions_are_exact_and_the_rest_keeps_its_precision(device, dtype, bits):
    """torch.finfo(dtype).min (a mask) among ordinary values used to set the whole group's step: the
    other values came back with relative errors of 10 (the fuzzer's case). The extreme value is now
    kept exactly and the others are quantised on their own range."""
    x = (torch.randn(6, 256) * 3).to(device=device, dtype=dtype)
    mask = (torch.rand(6, 256) < 0.3).to(device)
    mask[:, ::64] = True               # at least one masked position in every group
    big = torch.finfo(dtype).max
    x[:3][mask[:3]] = -big             # masked_fill(mask, finfo.min)
    x[3:][mask[3:]] = big
    y, stats = roundtrip(x, bits=bits)
    assert torch.equal(y[mask], x[mask])
    h = (2 ** bits - 2) // 2
    bulk = torch.where(mask, 0, x.float()).reshape(6, 4, 64)
    step = bulk.abs().amax(-1, keepdim=True).expand(-1, -1, 64).reshape(6, 256) / h
    err = (y.float() - x.float()).abs()[~mask]
    # half a step, plus rounding of the result to dtype
    assert (err <= (step * NEAREST * 1.001 + x.float().abs() * torch.finfo(dtype).eps)[~mask]).all()
    assert torch.signbit(stats[..., 1]).all()   # every group used the outlier encoding


@pytest.mark.parametrize("device", DEVICES)
def test_a_range_below_float_resolution_of_its_inverse_still_quantises(device):
    """A group whose range is below ~3e-38: 1/scale overflowed and every value came back as the max."""
    base = torch.linspace(0, 1, 128, device=device)
    for span in (1e-36, 1e-39, 1e-43):
        x = (base * span).reshape(2, 64)
        y, stats = roundtrip(x)
        step = span / 255 * (64 / 127)  # each group spans about half of the linspace
        assert stats[..., 1].max() > 0
        assert ((y - x).abs() <= step + 2e-45).all(), span
        assert len(torch.unique(y)) > 64


@pytest.mark.parametrize("device", DEVICES)
def test_values_spanning_more_than_the_float_range_give_no_nan(device):
    x = torch.randn(2, 64, device=device)
    x[:, 0], x[:, 1] = -3e38, 3e38     # hi - lo overflows float32
    y, stats = roundtrip(x)
    assert torch.isfinite(y).all() and torch.isfinite(stats).all()
    step = 6e38 / 255
    assert ((y - x).abs() <= step / 2 * 1.01).all()
    x4 = torch.tensor([[-3.4e38, 3.4e38] + [0.0] * 30], device=device)   # near the float maximum
    y4, _ = roundtrip(x4, bits=4, group_size=32)
    assert torch.isfinite(y4).all()
    assert ((y4.double() - x4.double()).abs() <= 6.8e38 / 15 / 2 * 1.01).all()


def test_ordinary_groups_never_use_the_outlier_encoding():
    x = sample((64, 1024), torch.float32)
    for bits in (4, 8):
        _, stats = roundtrip(x, bits=bits, group_size=128)
        assert not torch.signbit(stats[..., 1]).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group_size", [32, 128])
def test_a_group_of_signed_zeros_gets_one_zero_in_its_stats(device, group_size):
    """min/max over +0 and -0 may give either zero (the CPU keeps the first it meets, CUDA's instructions
    another): the stats hold +0, bit for bit on every device and in the reference, and zeros come back."""
    n = group_size
    rows = [[-0.0] * (n // 2) + [0.0] * (n // 2), [0.0] * (n // 2) + [-0.0] * (n // 2), [-0.0] * n,
            [-0.0] * (n // 2) + [1.0] * (n // 2), [0.0] * (n - 1) + [-2.0]]
    x = torch.tensor(rows, dtype=torch.float32, device=device)
    codes, stats = ops.quantize(x, bits=8, group_size=group_size, seed=3, stochastic=True)
    _, ref_stats = reference.quantize(x.cpu(), bits=8, group_size=group_size, seed=3, stochastic=True)
    assert torch.equal(stats.cpu().view(torch.int32), ref_stats.view(torch.int32))
    assert torch.equal(stats[:3, :, 0].cpu().view(torch.int32), torch.zeros(3, 1, dtype=torch.int32))  # +0
    back = ops.dequantize(codes, stats, bits=8, group_size=group_size, shape=x.shape, dtype=torch.float32)
    assert (back[:3] == 0).all()


def test_empty_and_scalar_tensors():
    # (5, 0): a zero-size last dimension quantised but could not be dequantised ("last_dim must be >= 1")
    for x in (torch.empty(0, 16), torch.empty(5, 0), torch.empty(2, 0, 3), torch.tensor(3.5)):
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
    with pytest.raises(ValueError, match="stats has 0 groups per row"):
        ops.dequantize(codes, stats[:, :0], bits=8, group_size=64, shape=x.shape, dtype=x.dtype)
    with pytest.raises(TypeError, match="dtype must be"):
        torch.ops.effmem.dequantize(codes, stats, 8, 64, 64, torch.int32)
    with pytest.raises(TypeError, match="x: expected a tensor, got list"):
        ops.quantize([[1.0, 2.0]])   # AttributeError: 'list' object has no attribute 'dtype'
    with pytest.raises(TypeError, match=r"dtype: expected a torch.dtype .*got 'float32'"):
        ops.dequantize(codes, stats, bits=8, group_size=64, shape=x.shape, dtype="float32")
    with pytest.raises(ValueError, match=r"shape: \(2, 4, 64\) holds 512 elements, but the codes hold 4 rows of 64"):
        ops.dequantize(codes, stats, bits=8, group_size=64, shape=(2, 4, 64), dtype=x.dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_size_last_dimension_round_trips_and_traces(device):
    x = torch.empty(5, 0, device=device)
    codes, stats = torch.ops.effmem.quantize(x, 8, 128, 0, True)
    torch.library.opcheck(torch.ops.effmem.quantize.default, (x, 8, 128, 0, True))
    torch.library.opcheck(torch.ops.effmem.dequantize.default, (codes, stats, 8, 128, 0, torch.float32))
    assert ops.dequantize(codes, stats, bits=8, group_size=128, shape=(5, 0), dtype=torch.float32).shape == (5, 0)
    # codes of five zero-width rows (made by hand: quantize gives none): five rows back, as the fake kernel says
    rows = torch.empty(5, 0, dtype=torch.uint8, device=device), torch.empty(5, 0, 2, device=device)
    torch.library.opcheck(torch.ops.effmem.dequantize.default, (*rows, 8, 128, 0, torch.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(5, 300, device=device).bfloat16()
    torch.library.opcheck(torch.ops.effmem.quantize.default, (x, 8, 64, 7, True))
    codes, stats = torch.ops.effmem.quantize(x, 4, 64, 7, True)
    torch.library.opcheck(torch.ops.effmem.dequantize.default, (codes, stats, 4, 64, 300, torch.bfloat16))
