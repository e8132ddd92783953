"""What the "fast" and "min" policies' fused paths take and leave: a gated MLP whose forward does more than
down(act(gate(x)) * up(x)) keeps its own (a clamp or FalconH1's multipliers were dropped), an act_fn with
hooks keeps being called, and removing a policy under another library's wrapper is refused before any change."""
import functools

import pytest
import torch
from torch import nn

import effmem

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


class ScaledGatedMLP(nn.Module):
    """gate/up/down and a SiLU, as Llama's, with a clamp and a scale of its own."""

    def __init__(self, d=32):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, 4 * d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x).clamp(max=0.1)) * self.up_proj(x)) * 0.5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = ScaledGatedMLP()

    def forward(self, x):
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


@pytest.mark.parametrize("policy", ["fast", "min"])
def test_a_gated_mlp_that_does_more_keeps_its_forward(policy):
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 16, 32)
    want = net(x)
    effmem.apply_activation_policy(net, policy)
    assert all(not b._effmem_patched for b in net.blocks)
    assert torch.equal(net(x), want)   # 0.70 off before
    model = effmem.apply_activation_policy(llama(), policy)
    assert "LlamaMLP" in {type(m).__name__ for m in model.model.layers[0]._effmem_patched}


def test_hooks_on_act_fn_keep_running():
    model, x = llama(), torch.randint(0, 128, (2, 16))
    calls = []
    for layer in model.model.layers:
        layer.mlp.act_fn.register_forward_hook(lambda m, i, out: calls.append(1))
    effmem.apply_activation_policy(model, "fast")
    model(input_ids=x, labels=x).loss.backward()
    assert len(calls) == 2   # 0: the fused product never called act_fn


@pytest.mark.parametrize("policy", ["fast", "min"])
def test_act_fn_hooks_and_swaps_after_the_policy_are_seen(policy):
    # the fused product was chosen once, at apply: hooks put on act_fn (activation steering, captures), a
    # global module hook or another act_fn set since were skipped and the logits silently differed (0.05)
    x = torch.randint(0, 128, (2, 16))
    plain, model = llama(), effmem.apply_activation_policy(llama(), policy)
    calls = []

    def halve(m, i, out):
        calls.append(1)
        return out * 0.5

    handles = [layer.mlp.act_fn.register_forward_hook(halve) for net in (plain, model) for layer in net.model.layers]
    want = plain(x).logits
    assert torch.equal(model(x).logits, want) and len(calls) == 4
    for h in handles:
        h.remove()
    seen = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, out: seen.append(type(m).__name__))
    try:
        model(x)
    finally:
        handle.remove()
    assert seen.count("SiLU") + seen.count("SiLUActivation") == 2
    for net in (plain, model):
        for layer in net.model.layers:
            layer.mlp.act_fn = nn.GELU()
    with torch.no_grad():
        assert torch.equal(model(x).logits, plain(x).logits)


def _wrapper(inner, *args, **kwargs):   # another library's wrapper of a forward (accelerate's hooks)
    return inner(*args, **kwargs)


def test_removing_a_policy_under_another_wrapper_is_refused_before_any_change():
    model, x = effmem.apply_activation_policy(llama(), "fast"), torch.randint(0, 128, (2, 16))
    layer = model.model.layers[0]
    wrapped = layer.forward = functools.partial(_wrapper, layer.forward)
    with pytest.raises(RuntimeError, match=r"model.layers.0's forward was wrapped after the policy was applied"):
        effmem.remove_activation_policy(model)
    assert layer.forward is wrapped and all(m._effmem_patched for m in model.model.layers)
    del layer.forward
    layer.forward = wrapped.args[0]   # the wrapper taken off: the policy's forward again
    effmem.remove_activation_policy(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_budget_given_in_the_wrong_place_or_form_says_how_to_give_it():
    with pytest.raises(ValueError, match=r"a memory budget goes by name: memory_budget=\.\.\."):
        effmem.apply_activation_policy(llama(), 0.3)
    with pytest.raises(ValueError, match=r"bytes go as an int: memory_budget=2000000000\)"):
        effmem.apply_activation_policy(llama(), memory_budget=2e9)


class DecoratedMLP(ScaledGatedMLP):
    @torch.no_grad()
    def forward(self, x):   # the plain product, but without gradients: fusing it would drop the decorator
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_a_decorated_forward_or_one_replaced_since_is_read_as_it_is_now():
    from effmem.activations.paths import _gated_mlp
    assert _gated_mlp(DecoratedMLP()) is None
    mlp = llama().model.layers[0].mlp
    assert _gated_mlp(mlp) is not None
    cls, plain = type(mlp), type(mlp).forward
    try:
        cls.forward = ScaledGatedMLP.forward   # a library patching the class after a first policy
        assert _gated_mlp(mlp) is None
    finally:
        cls.forward = plain


class _KeywordBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.fc(x))


class _KeywordNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_KeywordBlock() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x=x)   # the hidden state under a keyword of the block's own
        return x.square().mean()


@pytest.mark.parametrize("how", [dict(policy="fast"), dict(memory_budget=0.5), dict(policy="min")],
                         ids=["fast", "budget", "min"])
def test_a_hidden_state_passed_under_another_keyword_is_refused_as_min_refuses_it(how):
    """"fast" and memory_budget ran such a layer plain, with nothing compressed and no word said; "min"
    refused it. All three refuse it now, naming what the layer got."""
    from effmem.activations import apply_activation_policy
    model = apply_activation_policy(_KeywordNet(), **how)
    with pytest.raises(TypeError, match="needs the hidden state as the first argument or as hidden_states="):
        model(torch.randn(2, 8, 32))
    with torch.no_grad():   # nothing saved: run as it is
        model(torch.randn(2, 8, 32))


@pytest.mark.parametrize("first", [None, "tuple"])
def test_a_layer_whose_first_output_is_not_the_hidden_state_is_refused_by_name(first):
    """'min' takes a layer's first output as the hidden state: (None, y) failed with "'NoneType' object has no
    attribute 'detach'" deep in the checkpoint; an empty tuple, with an IndexError."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return (None, self.lin(x)) if first is None else ()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                out = layer(x)
                x = out[1] if out else x
            return x

    net = effmem.apply_activation_policy(Net(), policy="min")
    got = "a tuple whose first entry is NoneType" if first is None else "an empty tuple"
    with pytest.raises(TypeError, match=f"the layer returned {got}; expected a tensor"):
        net(torch.randn(4, 8, requires_grad=True))
