"""Removing an activation policy through another object than the one it was applied to, and copies of a model
under one: the use_cache hooks the policy put on every module that takes use_cache go with it."""
import copy
import io
import warnings

import pytest
import torch

from effmem.activations import apply_activation_policy, remove_activation_policy
from test_activations import _effmem_hooks, ids, llama

pytest.importorskip("transformers")


@pytest.mark.parametrize("policy", ["fast", "min", "budget"])
def test_removed_through_the_model_inside_the_one_applied_to(policy):
    """Applied to a LlamaForCausalLM, removed through its LlamaModel: the outer model's use_cache hook stayed,
    and every forward with gradients turned the cache off, warning of a policy no longer there."""
    m, x = llama(use_cache=True), ids()
    apply_activation_policy(m, memory_budget=0.5) if policy == "budget" else apply_activation_policy(m, policy)
    m(input_ids=x, labels=x).loss.backward()
    remove_activation_policy(m.model)
    assert _effmem_hooks(m) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert m(input_ids=x, use_cache=True).past_key_values is not None


def test_one_layer_of_a_model_under_a_policy_pickles_without_the_models_hooks():
    """The layers share the list of the model's use_cache hooks (for a removal through the model inside): a
    pickle or copy of one layer carried every hooked module's hooks, and a user's lambda among them failed it."""
    m = apply_activation_policy(llama(), "fast")
    m.register_forward_pre_hook(lambda module, args: None)
    torch.save(m.model.layers[0], io.BytesIO())   # PicklingError before
    twin = copy.deepcopy(m)
    remove_activation_policy(twin.model)   # through the model inside, on a copy: the copy's outer hook goes too
    assert _effmem_hooks(twin) == 0 and _effmem_hooks(m) > 0


@pytest.mark.parametrize("policy", ["fast", "min", "checkpoint"])
def test_removed_under_torchs_checkpoint_wrapper_applied_since(policy):
    """torch's apply_activation_checkpointing (FSDP's and accelerate's) wrapped the layers after the policy: the
    wrapper passes attribute reads on to its layer, so the removal took it for a layer under the policy and failed
    deleting its forward (AttributeError from inside torch, the policy left on: a reviewer's repro). The layers
    inside it are restored now, and train as under the wrapper alone."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                             checkpoint_wrapper)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    def wrapped(m):
        apply_activation_checkpointing(m, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda mod: isinstance(mod, LlamaDecoderLayer))
        return m
    x = ids()
    plain, m = wrapped(llama()), wrapped(apply_activation_policy(llama(), policy))
    m(input_ids=x, labels=x).loss.backward()
    m.zero_grad()
    remove_activation_policy(m)
    inner = [layer._checkpoint_wrapped_module for layer in m.model.layers]
    assert all("forward" not in layer.__dict__ and "_effmem_policy" not in layer.__dict__ for layer in inner)
    for model in (plain, m):
        model(input_ids=x, labels=x).loss.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), m.parameters()))
