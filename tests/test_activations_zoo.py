"""Cases from a sweep of transformers' causal LMs under every policy (a reviewer's): a layer that returns a list,
a decoder whose own layers are fewer than its vision tower's, two equal stacks."""
import copy
import warnings

import pytest
import torch
from torch import nn

import effmem
from effmem.plan.model import find_blocks

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("policy", ["min", "tight_budget"])
def test_a_layer_that_returns_a_list_is_checkpointed_and_gets_a_list_back(policy):
    """OpenAI GPT's Block returns [h, ...]: "min" (and a tight memory budget, which picks it) refused it with
    a TypeError at the first forward."""
    cfg = transformers.OpenAIGPTConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    plain = transformers.OpenAIGPTLMHeadModel(cfg).train()
    ours = copy.deepcopy(plain)
    if policy == "min":
        effmem.apply_activation_policy(ours, "min")
    else:
        effmem.apply_activation_policy(ours, memory_budget=0.05)
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    grads = []
    for m in (plain, ours):
        m(input_ids=x, labels=x).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert ((grads[1] - grads[0]).norm() / grads[0].norm()).item() < 0.03
    assert isinstance(ours.transformer.h[0](torch.randn(1, 8, 64)), list)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.proj(x)


class _Decoder(nn.Module):
    """A language model's own two layers beside a vision tower of five, in one module (Phi-4-multimodal's)."""

    def __init__(self, tower: int = 5):
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(2))
        self.vision = nn.Module()
        self.vision.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(tower))


class _LM(nn.Module):
    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.model, self.head = decoder, nn.Linear(8, 4)

    def get_decoder(self):
        return self.model

    def get_output_embeddings(self):
        return self.head


def test_a_decoder_s_own_layers_come_before_a_longer_list_beside_them():
    """A small Phi-4-multimodal: every policy went on the vision tower's 27 layers, the language model's 2
    left plain, without a word."""
    name, layers = find_blocks(_LM(_Decoder()))
    assert name == "model.layers" and len(layers) == 2 and isinstance(layers[0], _Block)


def test_two_equal_stacks_warn_that_one_is_left_as_it_is():
    """HRM's H and L modules, two lists of the same decoder layers: only one got the policy, silently."""
    m = nn.Module()
    m.h_module, m.l_module = nn.Module(), nn.Module()
    m.h_module.layers = nn.ModuleList(_Block() for _ in range(2))
    m.l_module.layers = nn.ModuleList(_Block() for _ in range(2))
    with pytest.warns(UserWarning, match=r"2 lists of 2 _Block \(h_module.layers, l_module.layers\)"):
        name, _ = find_blocks(m)
    assert name == "h_module.layers"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        find_blocks(_LM(_Decoder(tower=2)))   # a list of another type of the same length is no second stack
