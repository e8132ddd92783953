"""Activation policies across what changes between calls: the model replicated by nn.DataParallel, its train/eval
mode between forward and backward, and what a forward asks its layers for (a budget's choice per shape)."""
import contextlib
import copy

import pytest
import torch

import effmem
from effmem.activations import apply_activation_policy, remove_activation_policy
from compress_helpers import rel_err
from test_activations import gpt2, ids, llama, mixtral

pytest.importorskip("transformers")


@pytest.mark.parametrize("policy", ["fast", "min", "selective", "budget"])
def test_nn_data_parallel_replication_is_refused_and_allowed_again_once_removed(policy):
    """Each layer's policy forward is bound to the original layer, and nn.DataParallel's replicas copy the layer's
    __dict__: every replica would run the original (another GPU's inputs on the first GPU's weights). torch's
    replicate calls _replicate_for_data_parallel on every module, as here."""
    m = llama()
    m = apply_activation_policy(m, memory_budget=0.5) if policy == "budget" else apply_activation_policy(m, policy)
    with pytest.raises(RuntimeError, match="cannot be replicated by torch.nn.DataParallel"):
        for module in m.modules():
            module._replicate_for_data_parallel()
    copied = copy.deepcopy(m)   # its refusals are copies: an identity test left them on (a reviewer's repro)
    for model in (m, copied):
        remove_activation_policy(model)
        replicas = [module._replicate_for_data_parallel() for module in model.modules()]
        assert all("forward" not in r.__dict__ for r in replicas)


@pytest.mark.parametrize("policy", ["min", "budget", "checkpoint", "selective"])
def test_a_mode_switch_between_forward_and_backward_recomputes_the_forwards_dropout(policy):
    """model.eval() between a training forward and its backward (a validation pass in between): the recompute ran
    the layer in eval mode, without the forward's dropout, and the gradients were those of another function (33%
    off, a reviewer's repro; torch's checkpoint, under "checkpoint" and "selective", raised a CheckpointError
    naming no cause). It now runs each module in its forward's mode."""
    plain, x = llama(attention_dropout=0.3), ids(seq=24)
    ours = copy.deepcopy(plain)
    ours = (apply_activation_policy(ours, memory_budget=0.05) if policy == "budget"
            else apply_activation_policy(ours, policy))
    got = []
    for m in (plain, ours):
        torch.manual_seed(3)
        loss = m(input_ids=x, labels=x).loss
        m.eval()
        loss.backward()
        got.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    if policy == "budget":
        (choice,) = ours._effmem_budget.choices.values()
        assert "min" in choice["modes"]
    assert rel_err(got[1], got[0]) < (0.02 if policy in ("min", "budget") else 1e-6)
    assert all(not m.training for m in ours.modules())   # the modes as the user set them after the recompute


def test_a_budget_chooses_again_for_router_logits_asked_at_the_forward_and_for_eval_mode():
    """The budget's choice per shape ignored what a forward asks for: output_router_logits=True passed to the
    forward (not in the config) reused a choice with "min" layers, and backward then failed inside them; and a
    first forward in eval mode (no dropout masks) measured bytes that training then exceeded (1.57x of a byte
    budget, a reviewer's repro). Both are now part of the shape's key."""
    x = ids()
    m = mixtral()
    m.config.output_router_logits = False   # asked for at the forward only
    m = apply_activation_policy(m, memory_budget=0.2)
    m(input_ids=x, labels=x).loss.backward()
    assert "min" in effmem.activations.budget_choice(m)["modes"]
    with pytest.raises(ValueError, match="'min' is left out"):   # a choice of its own, without "min"
        m(input_ids=x, labels=x, output_router_logits=True)
    g = apply_activation_policy(gpt2(), memory_budget=0.5)
    g.eval()
    g(input_ids=x, labels=x).loss.backward()
    g.train()
    g(input_ids=x, labels=x).loss.backward()
    assert len(g._effmem_budget.choices) == 2


@pytest.mark.parametrize("outer", ["user", "compress"])
def test_selective_under_saved_tensor_hooks_keeps_its_saves_by_choice(outer):
    """Under the user's saved-tensor hooks or compress_activations, torch 2.14 warned at every kept output (16 a
    step here) that a later release routes them through the hooks: torch sets checkpoint's choice only on a
    caching mode handed to it as it is, and the eager "selective" policy hands it wrapped. The choice is now the
    policy's (kept as they are, as before); the gradients stay exactly the plain model's under the user's hooks."""
    import warnings
    plain, x = llama(), ids(seq=32)
    ours = apply_activation_policy(copy.deepcopy(plain), "selective")
    packed = []
    hooks = (torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t)
             if outer == "user" else contextlib.nullcontext())
    model = ours if outer == "user" else effmem.compress_activations(ours)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with hooks:
            model(input_ids=x, labels=x).loss.backward()
    assert not [w for w in seen if "respect_saved_tensors_hooks" in str(w.message)]
    if outer == "user":
        assert packed   # the hooks were active around the layers
        plain(input_ids=x, labels=x).loss.backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ours.parameters()))
