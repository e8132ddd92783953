"""linear_cross_entropy under torch.func's transforms (grad, vmap over grad for per-sample gradients, jacrev).

They do not run the op's autograd as torch.library registers it, so under a transform the loss goes through
an autograd.Function with the same formula (linear_ce.py, _Recompute); gradients made in forward
(grad_in_forward) are held outside the transforms' sight and are not made there.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jacrev, vmap

from effmem import linear_cross_entropy

H, V, N = 16, 40, 12


def setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=torch.float64).float()
    w = torch.randn(V, H, generator=g, dtype=torch.float64).float()
    b = torch.randn(V, generator=g, dtype=torch.float64).float()
    t = torch.randint(0, V, (N,), generator=g)
    t[3] = -100
    return h, w, b, t


def unfused(h, w, b, t, cap=None, **kw):
    logits = h @ w.T + b
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    return F.cross_entropy(logits, t, **kw)


@pytest.mark.parametrize("grad_in_forward", [None, False])
@pytest.mark.parametrize("options", [{}, dict(label_smoothing=0.1), dict(reduction="sum", logit_softcap=3.0)])
def test_torch_func_grad_matches_the_unfused_gradients(grad_in_forward, options):
    h, w, b, t = setup()
    cap = options.get("logit_softcap")
    kw = {k: v for k, v in options.items() if k != "logit_softcap"}
    got = grad(lambda h, w, b: linear_cross_entropy(h, w, t, b, grad_in_forward=grad_in_forward, **options),
               argnums=(0, 1, 2))(h, w, b)
    want = grad(lambda h, w, b: unfused(h, w, b, t, cap, **kw), argnums=(0, 1, 2))(h, w, b)
    for name, a, e in zip(("hidden", "weight", "bias"), got, want):
        assert torch.allclose(a, e, rtol=1e-5, atol=1e-6), (name, (a - e).abs().max().item())


def test_per_sample_gradients_with_vmap_over_grad():
    h, w, b, t = setup(1)
    hs, ts = h.reshape(3, 4, H), t.reshape(3, 4)
    got = vmap(grad(lambda h, w, t: linear_cross_entropy(h, w, t, b), argnums=1), in_dims=(0, None, 0))(hs, w, ts)
    want = vmap(grad(lambda h, w, t: unfused(h, w, b, t), argnums=1), in_dims=(0, None, 0))(hs, w, ts)
    assert got.shape == (3, V, H)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max().item()


def test_jacrev_of_the_per_token_losses():
    h, w, b, t = setup(2)
    got = jacrev(lambda h: linear_cross_entropy(h, w, t, b, reduction="none"))(h)
    want = jacrev(lambda h: unfused(h, w, b, t, reduction="none"))(h)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max().item()


def test_what_the_transforms_cannot_take_is_refused_by_name():
    h, w, b, t = setup(3)
    with pytest.raises(ValueError, match="grad_in_forward=True: not under a torch.func transform"):
        grad(lambda h: linear_cross_entropy(h, w, t, b, grad_in_forward=True))(h)
    with pytest.raises(RuntimeError, match="no forward-mode derivative"):
        torch.func.hessian(lambda h: linear_cross_entropy(h, w, t, b))(h)
    # outside a transform grad_in_forward=True still works as before
    linear_cross_entropy(h.requires_grad_(), w, t, b, grad_in_forward=True).backward()
    assert h.grad is not None
