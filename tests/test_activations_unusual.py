"""Activation policies and compression on models other than transformer blocks: recurrent layers, ReLU nets,
reentrant checkpoints inside a layer (a reviewer's cases)."""
import copy
import types

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import effmem
from effmem.activations.selective import SEES_OUTPUTS, KeptOutputChanged, checked_policy

aten = torch.ops.aten


class _Recurrent(nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.rnn = cls(32, 32)

    def forward(self, x):
        out = self.rnn(x)
        return x + (out[0] if isinstance(out, tuple) else out)


class _Stack(nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.layers = nn.ModuleList([_Recurrent(cls), _Recurrent(cls)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("cls", [nn.GRU, nn.GRUCell, nn.LSTM])
def test_selective_on_recurrent_layers_is_exact_or_refused(cls):
    """The CPU's GRU cell splits a kept product's output with unsafe_split and adds into a piece in place; the
    view shares no version counter with its base, so torch's check of the cache missed it and the gradients came
    out 32% off without a word. Such a write is refused in the forward now; nn.LSTM stays exact."""
    torch.manual_seed(0)
    plain = _Stack(cls)
    x = torch.randn(6, 32) if cls is nn.GRUCell else torch.randn(5, 3, 32)
    net = copy.deepcopy(plain)
    plain(x).square().mean().backward()
    effmem.apply_activation_policy(net, "selective")
    if cls is nn.LSTM:
        net(x).square().mean().backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), net.parameters()))
        return
    with pytest.raises(RuntimeError, match="_Recurrent under effmem's 'selective' policy changes the output of a "
                                           "matrix product in place .*nn.GRU.* Use policy='checkpoint'"):
        net(x).square().mean().backward()


class _WritesThroughAViewOfAProduct(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 32) / 32 ** 0.5)

    def forward(self, x):
        y = torch.matmul(x, self.w)   # 3-D by 2-D: an _unsafe_view of the kept mm output
        y[..., :16] += 1.0            # through a slice of it, as Gemma3n's AltUp adds through a permute
        return x + torch.tanh(y)


def test_selective_refuses_a_write_through_a_view_of_an_unsafe_view_of_a_kept_product():
    """matmul's _unsafe_view shares no version counter with the kept mm output, and a write through a view of it
    was let through as torch's to check: the recompute added again, gradients 50% off without a word (84% on a
    transformers Gemma3n, a reviewer's runs). Refused in the forward now, as a write into the unsafe view."""
    torch.manual_seed(0)
    net = nn.Module()
    net.layers = nn.ModuleList([_WritesThroughAViewOfAProduct(), _WritesThroughAViewOfAProduct()])
    net.forward = lambda x: net.layers[1](net.layers[0](x))
    effmem.apply_activation_policy(net, "selective")
    with pytest.raises(RuntimeError, match="changes the output of a matrix product in place"):
        net.forward(torch.randn(2, 8, 32)).square().mean().backward()


def test_without_the_op_output_the_bases_of_unsafe_views_are_watched():
    """A torch whose policy context has no op_output: the base of an unsafe view stands in for the kept output."""
    check = checked_policy()
    ctx = types.SimpleNamespace()
    base = torch.randn(4, 6)
    pieces = base.unsafe_split(2, 1)
    check(ctx, aten.addmm.default, torch.zeros(6), torch.randn(4, 3), torch.randn(3, 6))
    check(ctx, aten.add_.Tensor, torch.randn(4, 2), torch.randn(4, 2))   # another storage: allowed
    check(ctx, aten.unsafe_split.Tensor, base, 2, 1)
    check(ctx, aten.sigmoid.default, pieces[0])                           # out of place: allowed
    check(ctx, aten.add_.Tensor, base, torch.randn(4, 6))                 # the base itself: torch sees it
    with pytest.raises(KeptOutputChanged, match="aten.add_.Tensor writes into"):
        check(ctx, aten.add_.Tensor, pieces[1], torch.randn(4, 2))
    # matmul of 3-D by 2-D: mm, then an _unsafe_view of its kept product, written through a slice (Falcon's
    # in-place residual add: torch 2.11 gave gradients 51% off, without a word); an _unsafe_view of a tensor no
    # kept op made (reshape's copy) is not watched, and the recompute is not checked (its addresses are reused)
    a, b = torch.randn(4, 3), torch.randn(3, 6)
    product = a @ b
    check(ctx, aten.mm.default, a, b)
    viewed = aten._unsafe_view.default(product, [2, 2, 6])
    check(ctx, aten._unsafe_view.default, product, [2, 2, 6])
    copied = torch.randn(4, 6)
    check(ctx, aten.clone.default, copied)
    check(ctx, aten._unsafe_view.default, copied, [2, 2, 6])
    check(ctx, aten.add_.Tensor, aten._unsafe_view.default(copied, [2, 2, 6])[..., :2], torch.randn(2, 2, 2))
    assert check(types.SimpleNamespace(is_recompute=True), aten.add_.Tensor, viewed[..., :2],
                 torch.randn(2, 2, 2)) is CheckpointPolicy.PREFER_RECOMPUTE
    with pytest.raises(KeptOutputChanged, match="aten.add_.Tensor writes into"):
        check(ctx, aten.add_.Tensor, viewed[..., :2], torch.randn(2, 2, 2))


class _AddsInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        out = self.b(torch.relu(self.a(x)))
        out += x   # into the last product's kept output: torch's check sees it, and its recompute never gets there
        return out


class _ForeachInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        a, b = h * 1.0, h + 1.0
        torch._foreach_mul_([a, b], 0.5)   # writes a list of tensors (as FSDP2's split_with_sizes_copy does)
        return x + a * b


def test_selective_checks_each_tensor_of_a_written_list():
    """An op writing into a list of tensors (torch._foreach_mul_; FSDP2's split_with_sizes_copy when a unit
    sits inside a layer) raised AttributeError in the check ('list' object has no attribute '_is_view': a
    reviewer's repro); each tensor is checked: gradients plain autograd's, bit for bit."""
    torch.manual_seed(0)
    plain = nn.Module()
    plain.layers = nn.ModuleList([_ForeachInPlace(), _ForeachInPlace()])
    net = copy.deepcopy(plain)
    x = torch.randn(4, 16)
    plain.layers[1](plain.layers[0](x)).sum().backward()
    effmem.apply_activation_policy(net, "selective")
    net.layers[1](net.layers[0](x)).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), net.parameters()))


def test_selective_leaves_writes_torch_sees_to_torch():
    """The first form of the check refused every write into a kept output's memory, this one too, which torch's
    selective checkpointing computes exactly (a reviewer's find); and tensor subclasses (DTensor, TwoTensor),
    whose storages have no data pointer, raised in it."""
    from torch.testing._internal.two_tensor import TwoTensor
    torch.manual_seed(0)
    plain = nn.Module()
    plain.layers = nn.ModuleList([_AddsInPlace(), _AddsInPlace()])
    plain.forward = lambda x: plain.layers[1](plain.layers[0](x))
    net = copy.deepcopy(plain)
    net.forward = lambda x: net.layers[1](net.layers[0](x))
    x = torch.randn(4, 32)
    plain.forward(x).square().mean().backward()
    effmem.apply_activation_policy(net, "selective")
    net.forward(x).square().mean().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), net.parameters()))
    sub = nn.Module()
    sub.layers = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 32)])
    sub.forward = lambda x: sub.layers[1](torch.nn.functional.gelu(sub.layers[0](x)))
    effmem.apply_activation_policy(sub, "selective")
    sub.forward(TwoTensor(torch.randn(4, 32), torch.randn(4, 32)).requires_grad_()).sum().backward()
    assert sub.layers[0].weight.grad is not None


class _ReentrantInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return x + torch.utils.checkpoint.checkpoint(lambda z: torch.tanh(self.lin(z)), x, use_reentrant=True)


def test_min_names_a_reentrant_checkpoint_inside_a_layer():
    """torch's own refusal blamed a .grad() or backward(inputs=) that the user never called."""
    net = nn.Module()
    net.layers = nn.ModuleList([_ReentrantInside(), _ReentrantInside()])
    net.forward = lambda x: net.layers[1](net.layers[0](x))
    effmem.apply_activation_policy(net, "min")
    with pytest.raises(RuntimeError, match="calls torch.utils.checkpoint\\(use_reentrant=True\\) inside it.*"
                                           "use_reentrant=False"):
        net.forward(torch.randn(8, 32, requires_grad=True)).square().sum().backward()


class _WritesThroughData(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.a, self.b, self.how = nn.Linear(32, 32), nn.Linear(32, 32), how

    def forward(self, x):
        y = self.a(x)
        if self.how == "data":
            y.data.mul_(2)     # its own version counter: neither torch's check nor a layout sees it
            return self.b(torch.tanh(y))
        y = self.b(torch.tanh(y))
        y.unsqueeze_(0)        # the kept output itself, reshaped: torch sees it, and the recompute stops before
        return y[0]


@pytest.mark.parametrize("how", ["data", "unsqueeze_"])
def test_selective_knows_the_kept_output_by_identity(how):
    """By address and layout, a write through `.data` passed (wrong gradients, silently, as torch's own selective
    checkpointing gives) and an in-place reshape of the output itself was refused (a reviewer's finds)."""
    if how == "data" and not SEES_OUTPUTS:
        pytest.skip("this torch hands the policy no op_output: a write through .data goes unseen "
                    "(docs/activation_policies.md)")
    torch.manual_seed(0)
    plain = nn.Module()
    plain.layers = nn.ModuleList([_WritesThroughData(how), _WritesThroughData(how)])
    net = copy.deepcopy(plain)
    for m in (plain, net):
        m.forward = (lambda m: lambda x: m.layers[1](m.layers[0](x)))(m)
    x = torch.randn(4, 32)
    plain.forward(x).square().mean().backward()
    effmem.apply_activation_policy(net, "selective")
    if how == "data":
        with pytest.raises(RuntimeError, match="changes the output of a matrix product in place"):
            net.forward(x).square().mean().backward()
        return
    net.forward(x).square().mean().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), net.parameters()))


def test_compress_activations_keeps_a_relu_s_mask_exact():
    """ReLU's backward passes a gradient where its saved output is positive; a small positive output rounded to
    code 0 lost it: 283 of 65,413 positive values in a reviewer's net, weight gradients 9.4% off at 8 bits. The
    output's own save carries its exact mask now (1 bit per element, in the statistics as bool bytes)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    x, y = torch.randn(256, 256), torch.randint(0, 10, (256,))
    net = effmem.compress_activations(copy.deepcopy(plain), bits=8)
    torch.nn.functional.cross_entropy(plain(x), y).backward()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    worst = max(((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in zip(net.parameters(), plain.parameters()))
    assert worst < 0.02, worst
    stats = net.compress_stats
    assert stats.by_dtype["bool"].bytes_after == 2 * 256 * 512 // 8   # the two ReLUs' masks, packed


@pytest.mark.parametrize("act", [lambda: nn.LeakyReLU(0.01), lambda: nn.LeakyReLU(0.2, inplace=True), nn.ReLU6,
                                 lambda: nn.Hardtanh(-0.5, 0.5)])
def test_compress_activations_masks_kinked_activations(act):
    """LeakyReLU, ReLU6 and Hardtanh keep their input, whose 8-bit codes moved values near a kink across it: a
    reviewer's 3-layer net's first weight gradient 5.7% off plain's (LeakyReLU; 6.0% ReLU6, 3.9% Hardtanh), where
    GELU's is 0.5%. compress_activations(model) gives those modules a backward from their exact mask, 1 bit per
    element (the policies' classes, activations.relu), and remove_compression gives the classes back."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 256), act(), nn.Linear(256, 256), act(), nn.Linear(256, 10))
    kinds = [type(m) for m in plain]
    x = torch.randn(512, 64)
    net = effmem.compress_activations(copy.deepcopy(plain), bits=8)
    plain(x).square().mean().backward()
    net(x).square().mean().backward()
    worst = max(((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in zip(net.parameters(), plain.parameters()))
    assert worst < 0.008, worst
    kept = net.compress_stats.skipped["integer"]
    assert kept.bytes_after == 2 * 512 * 256 // 8   # the two masks, packed; the inputs are not saved
    effmem.compress.remove_compression(net)
    assert [type(m) for m in net] == kinds


@pytest.mark.parametrize("seen", [True, False])
def test_an_error_in_a_checkpointed_forward_leaves_torch_s_hooks_at_once(monkeypatch, seen):
    """torch 2.11's checkpoint left its generator at the forward's yield when the forward raised: effmem's
    refusal came unnamed, and torch's saved-tensor hooks stayed pushed while the error lived, so a later
    backward of another model ran the failed layer again (a reviewer's run). Below the torch that hands the
    error to its generator, effmem drives it so (seen=False runs that path here)."""
    import effmem.activations.torch_checkpoint as tc
    if seen and not tc._FORWARD_ERRORS_SEEN:
        pytest.skip("this torch's checkpoint hands the forward's error to nothing: effmem drives it (seen=False)")
    monkeypatch.setattr(tc, "_FORWARD_ERRORS_SEEN", seen)
    torch.manual_seed(0)
    plain = _Stack(nn.GRUCell)
    net = copy.deepcopy(plain)
    effmem.apply_activation_policy(net, "selective")
    calls = []
    net.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        net(torch.randn(6, 32)).sum()
    except RuntimeError as err:
        kept = err   # alive, as a caller that logs and retries keeps it
    assert "under effmem's 'selective' policy changes the output" in str(kept)
    w = torch.randn(8, requires_grad=True)
    (w.exp() * 2).sum().backward()   # another graph: no checkpoint hook may see it
    assert torch.equal(w.grad, 2 * w.detach().exp()) and len(calls) == 1
    lstm, ref = _Stack(nn.LSTM), None
    ref = copy.deepcopy(lstm)
    effmem.apply_activation_policy(lstm, "selective")
    x = torch.randn(5, 3, 32)
    lstm(x).square().mean().backward()
    ref(x).square().mean().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(lstm.parameters(), ref.parameters()))


class _KinkBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act, self.fc2 = nn.Linear(64, 64), nn.LeakyReLU(0.01), nn.Linear(64, 64)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc(x)))


@pytest.mark.parametrize("first", ["compress", "policy"])
def test_a_masked_activation_stays_masked_while_either_masker_is_on(first):
    """compress_activations and a policy both give a LeakyReLU its masked class; remove_compression took it
    back from under a policy still on ("fast": its gradients 4.7% off plain's instead of 0.5%, a reviewer's
    find). Each masker counts: the class goes back when the last is removed."""
    net = nn.Module()
    net.layers = nn.ModuleList([_KinkBlock(), _KinkBlock()])
    net.forward = lambda x: net.layers[1](net.layers[0](x))
    kinds = lambda: {type(b.act).__name__ for b in net.layers}   # noqa: E731
    steps = [lambda: effmem.compress_activations(net), lambda: effmem.apply_activation_policy(net, "fast")]
    undo = [lambda: effmem.compress.remove_compression(net), lambda: effmem.remove_activation_policy(net)]
    order = [0, 1] if first == "compress" else [1, 0]
    for i in order:
        steps[i]()
    for i in order:
        assert kinds() == {"MaskedLeakyReLU"}
        undo[i]()
    assert kinds() == {"LeakyReLU"} and all("_effmem_masked" not in b.act.__dict__ for b in net.layers)


def test_the_driven_checkpoint_is_for_eager_forwards_alone(monkeypatch):
    """Where torch's checkpoint hands the forward's error to nothing (torch 2.11), effmem drives its generator,
    in eager forwards only: compiled, it was taken too (a KeyError for "checkpoint", whose compiled form has no
    context_fn, and a CheckpointError at backward under both policies; a reviewer's find)."""
    import effmem.activations.torch_checkpoint as tc
    monkeypatch.setattr(tc, "_FORWARD_ERRORS_SEEN", False)
    torch.manual_seed(0)
    plain = nn.Module()
    plain.layers = nn.ModuleList([_KinkBlock(), _KinkBlock()])
    plain.forward = lambda x: plain.layers[1](plain.layers[0](x))
    x = torch.randn(8, 64)
    plain.forward(x).square().mean().backward()
    for policy in ("checkpoint", "selective"):
        net = copy.deepcopy(plain)
        net.forward = lambda x, net=net: net.layers[1](net.layers[0](x))
        net.zero_grad()
        effmem.apply_activation_policy(net, policy)
        torch._dynamo.reset()
        torch.compile(net.forward, backend="aot_eager")(x).square().mean().backward()
        assert all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
                   for p, q in zip(net.parameters(), plain.parameters())), policy
