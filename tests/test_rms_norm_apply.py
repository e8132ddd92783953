"""effmem::rms_norm_apply (csrc/common/rms_norm_math.h): weight * (x * rstd) with Hugging Face's RMSNorm
roundings in one pass, used by the "fast" policy's RMSNorm on CUDA (its forward's end and backward's
rebuild). On the CPU: equal bit for bit to `weight * (x.float() * rstd).to(x.dtype)` (NaN payloads
aside), in any layout;
bad arguments refused with messages naming them; opcheck. With a GPU: CUDA equals CPU bit for bit on the
16-byte path and the element path, and the policy's RMSNorm keeps the module's forward bits.
"""
import pytest
import torch

from effmem import ops
from effmem.activations import fused

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def inputs(dtype, shape=(3, 7, 96), device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    return x.to(device), rstd.to(device), w.to(device)


def torch_ops(x, rstd, w):
    return w * (x.float() * rstd).to(x.dtype)


def same_bits(a, b):
    """Equal bit for bit, NaN payloads aside (torch's vectorised bf16 product leaves some NaNs negative)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0).contiguous().view(torch.uint8),
                                                       b.masked_fill(nan, 0).contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_the_torch_ops_bit_for_bit(dtype):
    x, rstd, w = inputs(dtype)
    x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0]).to(dtype)
    out = ops.rms_norm_apply(x, rstd, w)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    assert same_bits(out, torch_ops(x, rstd, w))
    xt = x.transpose(0, 1)                   # any layout: the rows are still the last dimension
    rt = rstd.transpose(0, 1)
    assert same_bits(ops.rms_norm_apply(xt, rt, w), torch_ops(xt, rt, w))
    e = torch.empty(0, 96, dtype=dtype)
    assert ops.rms_norm_apply(e, torch.empty(0, 1), w).shape == (0, 96)


def test_bad_arguments_are_named():
    x, rstd, w = inputs(torch.float32)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        ops.rms_norm_apply(x.double(), rstd, w.double())
    with pytest.raises(ValueError, match="weight must be a 1-D tensor of x's last size"):
        ops.rms_norm_apply(x, rstd, w[:5])
    with pytest.raises(ValueError, match="weight must be a 1-D tensor of x's last size"):
        ops.rms_norm_apply(x, rstd, w.bfloat16())
    with pytest.raises(ValueError, match="rstd must be float32 with one value per row of x"):
        ops.rms_norm_apply(x, rstd[:1], w)
    with pytest.raises(ValueError, match="rstd must be float32 with one value per row of x"):
        ops.rms_norm_apply(x, rstd.double(), w)
    # as many values as rows, in another shape: they scaled x's rows in another order
    with pytest.raises(ValueError, match="rstd must be float32 with one value per row of x"):
        ops.rms_norm_apply(x, rstd.reshape(x.shape[1], x.shape[0]), w)
    assert torch.equal(ops.rms_norm_apply(x, rstd.squeeze(-1), w), ops.rms_norm_apply(x, rstd, w))
    with pytest.raises(ValueError, match="last dimension of at least 1"):
        ops.rms_norm_apply(torch.empty(3, 0), torch.empty(3, 1), torch.empty(0))
    with pytest.raises(ValueError, match="one device"):
        ops.rms_norm_apply(x, rstd, w.to("meta"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    torch.library.opcheck(torch.ops.effmem.rms_norm_apply.default, inputs(dtype, (4, 64)))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, offset", [((4, 512, 2048), 0), ((33, 100), 0), ((5, 64), 1)])
def test_cuda_equals_cpu_bit_for_bit(dtype, shape, offset):
    """(33, 100): rows not a whole number of 16-byte packs; offset 1: x one element into its storage."""
    x, rstd, w = inputs(dtype, shape, seed=shape[-1])
    x.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")]).to(dtype)
    flat = torch.cat([x.new_zeros(offset), x.reshape(-1)])
    xc = flat.cuda()[offset:].view(shape)
    got = ops.rms_norm_apply(xc, rstd.cuda(), w.cuda())
    assert torch.equal(got.cpu().view(torch.uint8), ops.rms_norm_apply(x, rstd, w).view(torch.uint8))


@pytest.mark.cuda
def test_policy_rms_norm_keeps_the_module_forward_on_cuda():
    transformers = pytest.importorskip("transformers")
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(2048, eps=1e-5).cuda().bfloat16()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 256, 2048, device="cuda", dtype=torch.bfloat16) * 3
    assert torch.equal(fused.rms_norm(x, norm.weight, 1e-5), norm(x))
