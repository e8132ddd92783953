"""The fused global L2 norm and gradient clipping.

Tolerance: float32 result vs. float64 reference, 1e-6 relative (blocks of
1024 squares sum in float, blocks add in double: a few float ulps).
"""
import pytest
import torch

import effmem
from effmem import ops, reference
from conftest import DEVICES, cpu_isa, cpu_isas



@pytest.mark.parametrize("device", DEVICES)
def test_matches_float64_over_dtypes_and_sizes(device):
    tensors = [torch.randn(s, device=device).to(d) for s, d in [
        ((1,), torch.float32), ((7,), torch.bfloat16), ((4097,), torch.float16), ((300, 301), torch.float32),
        ((200_003,), torch.bfloat16), ((0,), torch.float32), ((3, 5, 7), torch.float16)]]
    got = ops.l2norm(tensors)
    assert got.dtype == torch.float32 and got.shape == () and got.device.type == device
    expected = reference.l2norm(tensors)
    assert abs(got.item() - expected.item()) <= 1e-6 * expected.item()


@pytest.mark.parametrize("isa", cpu_isas())
def test_every_cpu_isa_matches_float64(isa):
    """Each vector unit's own sum-of-squares kernel (the test above runs the machine's widest only)."""
    tensors = [torch.randn(s).to(d) for s, d in [((7,), torch.bfloat16), ((4097,), torch.float16),
                                                   ((300, 301), torch.float32), ((200_003,), torch.bfloat16)]]
    with cpu_isa(isa):
        got = ops.l2norm(tensors)
    expected = reference.l2norm(tensors)
    assert abs(got.item() - expected.item()) <= 1e-6 * expected.item()


def test_permuted_tensors_and_non_dense_rejection():
    t = torch.randn(40, 50).t()
    assert ops.l2norm([t]).item() == pytest.approx(reference.l2norm([t]).item(), rel=1e-6)
    with pytest.raises(ValueError, match=r"tensors\[0\] must be dense"):
        ops.l2norm([torch.randn(10)[::2]])
    with pytest.raises(TypeError, match="tensors must be float32, bfloat16 or float16"):
        ops.l2norm([torch.ones(3, dtype=torch.int64)])


def test_inf_and_nan_propagate():
    assert ops.l2norm([torch.tensor([1.0, float("inf")])]).item() == float("inf")
    assert ops.l2norm([torch.tensor([1.0, float("nan")])]).isnan().item()


@pytest.mark.parametrize("isa", cpu_isas())
def test_float_overflow_does_not_depend_on_where_the_elements_lie(isa):
    """Four squares of 1e19 in one float lane overflow (4e38), in four lanes they do not: the same answer in a
    whole block of 1024 and in the tail after it. The tail summed in double, so its huge gradients had a finite
    norm where a block's had an infinite one (error_if_nonfinite and the clip's zero factor turned on the
    tensor's size)."""
    with cpu_isa(isa):
        for n, start in [(1224, 0), (1224, 1024), (1000, 0), (2048, 1024)]:
            same_lane, own_lanes = torch.zeros(n), torch.zeros(n)
            same_lane[start:start + 128:32] = 1e19
            own_lanes[start:start + 4] = 1e19
            assert ops.l2norm([same_lane]).item() == float("inf"), (n, start)
            assert ops.l2norm([own_lanes]).item() == pytest.approx(2e19, rel=1e-6), (n, start)


def test_every_cpu_isa_gives_identical_bits():
    """The lanes were the vector's (16, 8 or 1), so a bf16 norm differed in its last bits between vector units,
    and through the clip every weight of a step (a reviewer's resume across machines); 32 lanes on every unit.
    The clip's optimizers too: FusedAdam and OffloadAdam, a step clipped, each unit's weights bit for bit."""
    torch.manual_seed(0)
    tensors = [torch.randn(s).to(d) * 3 for s, d in [((7,), torch.bfloat16), ((4097,), torch.float16),
                                                       ((300, 301), torch.float32), ((200_003,), torch.bfloat16)]]
    norms, weights = [], []
    for isa in cpu_isas():
        with cpu_isa(isa):
            norms.append(ops.l2norm(tensors).item())
            run = []
            for cls in (effmem.FusedAdam, effmem.OffloadAdam):
                ps = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
                opt = cls(ps, lr=1e-2)
                for p, t in zip(ps, tensors):
                    p.grad = t.clone()
                opt.clip_grad_norm_(1.0)
                opt.step()
                run += [p.detach().clone() for p in ps]
                if cls is effmem.OffloadAdam:
                    opt.close()
            weights.append(run)
    assert len(set(norms)) == 1, norms
    assert all(torch.equal(a, b) for w in weights[1:] for a, b in zip(w, weights[0]))


def test_does_not_depend_on_thread_count():
    t = [torch.randn(1_000_003)]
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.l2norm(t)
        torch.set_num_threads(2)
        two = ops.l2norm(t)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


def make_grads(dtype=torch.float32):
    params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in [(33, 17), (5,), (1000,)]]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    params[0].grad = torch.randn(17, 33).to(dtype).t()  # non-contiguous grad
    return params


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clip_grad_norm_matches_torch(max_norm):
    ours = make_grads()
    theirs = reference.clone_params(ours)
    for p, q in zip(ours, theirs):
        q.grad = p.grad.clone()
    total = effmem.clip_grad_norm_(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert total.item() == pytest.approx(expected.item(), rel=1e-6)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_clip_grad_norm_arguments():
    params = make_grads()
    with pytest.raises(ValueError, match="max_norm"):
        effmem.clip_grad_norm_(params, -1.0)
    with pytest.raises(ValueError, match="norm_type"):
        effmem.clip_grad_norm_(params, 1.0, norm_type=float("inf"))
    params[1].grad[0] = float("nan")
    with pytest.raises(RuntimeError, match="error_if_nonfinite"):
        effmem.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    assert effmem.clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0).item() == 0.0
    # torch's signature: foreach= is taken (a TypeError before), and checked
    torch.manual_seed(0)
    a = make_grads()
    torch.manual_seed(0)
    b = make_grads()
    assert torch.equal(effmem.clip_grad_norm_(a, 1.0, foreach=None), effmem.clip_grad_norm_(b, 1.0, foreach=True))
    with pytest.raises(ValueError, match="foreach: expected None, True or False"):
        effmem.clip_grad_norm_(make_grads(), 1.0, foreach="yes")


def test_optimizer_clip_is_folded_into_the_step():
    """opt.clip_grad_norm_ scales inside the next step: same result as clipping first, grads untouched."""
    a = make_grads()
    b = reference.clone_params(a)
    for p, q in zip(a, b):
        q.grad = p.grad.clone()
    opt_a, opt_b = effmem.FusedAdam(a, lr=1e-2), effmem.FusedAdam(b, lr=1e-2)
    grads_before = [p.grad.clone() for p in a]
    norm_a = opt_a.clip_grad_norm_(0.5)
    norm_b = effmem.clip_grad_norm_(b, 0.5)
    assert torch.equal(norm_a, norm_b)
    for p, g in zip(a, grads_before):
        assert torch.equal(p.grad, g)
    opt_a.step()
    opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p.detach(), q.detach())
        # Adam's first step is nearly scale-free: the moments are what show the clip factor was applied
        assert torch.equal(opt_a.state[p]["exp_avg"], opt_b.state[q]["exp_avg"])
        assert not torch.equal(opt_a.state[p]["exp_avg"], (1 - 0.9) * p.grad.float())
    # the clip applies to one step only
    opt_a.step()
    opt_b.step()
    for p, q in zip(a, b):
        assert not torch.equal(p.detach(), q.detach())


def test_clip_takes_float64_and_complex_gradients_as_torch_does():
    """effmem.clip_grad_norm_ refused float64 gradients ("tensors must be float32, bfloat16 or float16"), which
    torch's clip takes; their norm is torch's, combined with the fused kernel's for the rest."""
    grads = [torch.tensor([3.0, 4.0, 12.0], dtype=torch.float64), torch.tensor([1.0, 2.0]),
             torch.tensor([1 + 1j, 2.0], dtype=torch.complex64)]
    mine = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, q, g in zip(mine, ref, grads):
        p.grad, q.grad = g.clone(), g.clone()
    norm, expected = effmem.clip_grad_norm_(mine, 1.0), torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert norm.dtype == torch.float32 and torch.allclose(norm.double(), expected.double(), rtol=1e-6)
    for p, q in zip(mine, ref):
        assert p.grad.dtype == q.grad.dtype and torch.allclose(p.grad, q.grad, rtol=1e-6)
