"""torch.utils.checkpoint (non-reentrant) around what effmem wraps: a module under compress_activations, a layer
under an activation policy. effmem's saved-tensor hooks, pushed inside the checkpointed call, hid checkpoint's:
the region kept every save (in 8 bits) and nothing was recomputed; under a budget the probes' saves broke
checkpoint's count. Inside torch's checkpoint effmem now keeps out of the way: the region runs as it is,
recomputed once in backward."""
import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import effmem
from effmem.activations import apply_activation_policy
from effmem.compress import compress_activations

pytest.importorskip("transformers")
from test_activations import ids, llama  # noqa: E402


def _counting(module: nn.Module, calls: list) -> None:
    module.register_forward_pre_hook(lambda *a: calls.append(1))


def test_checkpoint_around_a_compressed_module_recomputes_and_keeps_nothing():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    ours = compress_activations(copy.deepcopy(plain), bits=8)
    x = torch.randn(64, 256, requires_grad=True)
    grads = []
    for m in (plain, ours):
        calls = []
        _counting(m[0], calls)
        y = checkpoint(m, x, use_reentrant=False)
        if m is ours:
            assert m._effmem_compressor.live_entries() == []   # 2 entries (264 KB) before
        y.square().sum().backward()
        assert len(calls) == 2   # 1 before: nothing recomputed
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)   # nothing inside was rounded


def _checkpointed_layers(model: nn.Module) -> None:
    """The user's own checkpointing of each decoder layer, over whatever forward the layer has now."""
    for layer in model.model.layers:
        layer.forward = functools.partial(
            lambda forward, *a, **k: checkpoint(forward, *a, use_reentrant=False, **k), layer.forward)


@pytest.mark.parametrize("policy", ["fast", "min", "budget"])
def test_a_policy_layer_inside_the_users_checkpoint_runs_once_more_in_backward(policy):
    x = ids()
    plain = llama()
    ours = copy.deepcopy(plain)
    if policy == "budget":
        apply_activation_policy(ours, memory_budget=0.3)
    else:
        apply_activation_policy(ours, policy)
    losses, grads = [], []
    for m in (plain, ours):
        _checkpointed_layers(m)
        calls = []
        for layer in m.model.layers:
            _counting(layer.self_attn, calls)
        loss = m(input_ids=x, labels=x).loss
        loss.backward()   # under a budget: a CheckpointError (saves counted differently in the recompute)
        assert len(calls) == 2 * len(m.model.layers)   # "fast": no recompute; "min": two
        losses.append(loss.detach())
        grads.append([p.grad for p in m.parameters()])
    assert torch.equal(*losses)
    worst = max(((a - b).norm() / b.norm()).item() for a, b in zip(*grads))
    assert worst < 1e-5   # the fused norms and MLP product, in float32
    assert effmem.activations.activation_stats(ours) is None or \
        effmem.activations.activation_stats(ours).num_compressed == 0


@pytest.mark.parametrize("policy", ["fast", "budget"])
def test_statistics_are_a_forwards_own_with_the_first_layer_inside_the_users_checkpoint(policy):
    """The first layer resets the statistics; inside the user's checkpoint it returned before, and they grew
    with every forward (a reviewer's repro: 302080, 422912, 543744 bytes)."""
    x, m = ids(), llama()
    apply_activation_policy(m, memory_budget=0.3) if policy == "budget" else apply_activation_policy(m, policy)
    first = m.model.layers[0]
    first.forward = functools.partial(
        lambda forward, *a, **k: checkpoint(forward, *a, use_reentrant=False, **k), first.forward)
    seen = []
    for _ in range(3):
        m(input_ids=x, labels=x).loss.backward()
        seen.append(effmem.activations.activation_stats(m).total_bytes_after)
    assert seen[0] > 0 and seen == [seen[0]] * 3
