"""fuse_linear_cross_entropy with what other libraries put around a model: a wrapper on its forward
(accelerate), its own forward on lm_head, an output layer replaced after fusing, PEFT's PeftModel."""
import copy

import pytest
import torch

import effmem
from effmem import linear_ce_hf

pytest.importorskip("transformers")
from test_linear_ce_hf import FAMILIES, _quiet, batch  # noqa: E402,F401 (_quiet: the autouse fixture)


def test_unfusing_keeps_a_wrapper_put_on_the_model_after_fusing():
    """accelerate wraps model.forward (autocast, outputs to float32) when the Trainer prepares a fused model:
    unfusing then dropped that wrapper with ours. Now the wrapper stays and the fused layer inside does
    nothing (the model's own loss, logits made); fusing again works."""
    model = effmem.fuse_linear_cross_entropy(FAMILIES["llama"]())
    calls, inner = [], model.forward

    def wrapper(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)
    model.forward = wrapper
    x, y = batch()
    assert model(input_ids=x, labels=y).logits is None and calls == [1]
    effmem.unfuse_linear_cross_entropy(model)
    assert model.__dict__["forward"] is wrapper
    out = model(input_ids=x, labels=y)
    assert calls == [1, 1] and out.logits is not None and out.logits.shape[-1] == 512
    effmem.fuse_linear_cross_entropy(model)
    assert model(input_ids=x, labels=y).logits is None and calls == [1, 1, 1]


def test_a_forward_another_library_put_on_the_head_or_model_is_kept():
    """An instance forward already on lm_head (or the model), as accelerate's hooks put there, runs while
    fused (without labels) and is back after unfusing."""
    model = FAMILIES["llama"]()
    calls = []

    def head_wrapper(x, _own=model.lm_head.forward):
        calls.append("head")
        return _own(x)
    model.lm_head.forward = head_wrapper
    model_forward = model.forward
    model.forward = model_forward   # an instance attribute, as a wrapper would leave
    x, y = batch()
    effmem.fuse_linear_cross_entropy(model)
    logits = model(input_ids=x).logits
    assert calls == ["head"] and logits.shape[-1] == 512
    effmem.unfuse_linear_cross_entropy(model)
    assert model.lm_head.__dict__["forward"] is head_wrapper and model.__dict__["forward"] is model_forward
    assert not any(k.startswith("_effmem") for k in list(model.__dict__) + list(model.lm_head.__dict__))


def test_an_output_layer_replaced_after_fusing_is_named():
    """PEFT's modules_to_save or a LoRA on lm_head wrap the output layer: fused first, the loss got logits
    where it expected hidden states ("weight has hidden size 64 but hidden has 512"); wrapped first, the
    refusal blamed the model's class."""
    x, y = batch()

    class LoraLike(torch.nn.Module):   # PEFT's lora.Linear: the base layer's output plus a low-rank delta
        def __init__(self, base):
            super().__init__()
            self.base_layer, self.a, self.b = base, torch.nn.Linear(64, 4), torch.nn.Linear(4, 512)

        def forward(self, h):
            return self.base_layer(h) + self.b(self.a(h))

    model = effmem.fuse_linear_cross_entropy(FAMILIES["llama"]())
    model.lm_head = LoraLike(model.lm_head)
    # (it suggested fusing after wrapping, where the TypeError below suggested fusing before: a loop)
    with pytest.raises(RuntimeError, match="no longer the lm_head it fused but a LoraLike .* supports a plain "
                                           "lm_head only"):
        model(input_ids=x, labels=y)
    wrapped = FAMILIES["llama"]()
    wrapped.lm_head = torch.nn.Sequential(wrapped.lm_head)
    with pytest.raises(TypeError, match="output layer is a torch.nn.modules.container.Sequential, not a plain "
                                        "torch.nn.Linear .* effmem.linear_cross_entropy"):
        effmem.fuse_linear_cross_entropy(wrapped)
    with pytest.raises(TypeError, match=r"got _Peft; _Peft wraps a Sequential \(get_base_model\(\)\), not one"):
        effmem.fuse_linear_cross_entropy(_Peft(torch.nn.Sequential()))
    # DDP's wrapper, and the class fully_shard makes (FSDPLlamaForCausalLM): named, with the way out
    ddp_like = type("DistributedDataParallel", (torch.nn.Module,), {})()
    ddp_like.module = FAMILIES["llama"]()
    with pytest.raises(TypeError, match=r"got DistributedDataParallel; .* \(fuse_linear_cross_entropy\(model.module"):
        effmem.fuse_linear_cross_entropy(ddp_like)
    from torch.distributed.fsdp import FSDPModule
    sharded = FAMILIES["llama"]()
    sharded.__class__ = type("FSDPLlamaForCausalLM", (FSDPModule, type(sharded)), {})
    with pytest.raises(TypeError, match="FSDPLlamaForCausalLM is a LlamaForCausalLM made another class since "
                                        r"\(fully_shard\): fuse before sharding"):
        effmem.fuse_linear_cross_entropy(sharded)
    mine = FAMILIES["llama"]()
    mine.__class__ = type("MyLlama", (type(mine),), {})   # a user's subclass: not told about sharding
    with pytest.raises(TypeError, match="MyLlama subclasses LlamaForCausalLM, whose forward it may change"):
        effmem.fuse_linear_cross_entropy(mine)


@pytest.mark.parametrize("refuse", [False, True])
def test_a_plain_output_layer_put_in_after_fusing_is_followed(refuse):
    """resize_token_embeddings gives an untied head a new nn.Linear: the fused loss refused it, blaming a
    wrapper, and fusing again did nothing. The fusing moves to the new layer (at the next forward with labels,
    or when fused again), the old one is left as it was, and the loss is the unfused model's."""
    x, y = batch()
    model = effmem.fuse_linear_cross_entropy(FAMILIES["llama"]())
    old = model.lm_head
    model.resize_token_embeddings(520, mean_resizing=False)
    assert model.lm_head is not old and "forward" not in model.lm_head.__dict__
    if refuse:
        effmem.fuse_linear_cross_entropy(model, grad_in_forward=False)
        assert "forward" not in old.__dict__ and "forward" in model.lm_head.__dict__
    out = model(input_ids=x, labels=y)
    assert out.logits is None and "forward" not in old.__dict__ and not linear_ce_hf._passing()
    out.loss.backward()
    plain = copy.deepcopy(effmem.unfuse_linear_cross_entropy(model))
    assert not any("_effmem" in k or k == "forward" for k in plain.lm_head.__dict__)
    plain.zero_grad()
    ref = plain(input_ids=x, labels=y)
    ref.loss.backward()
    assert torch.allclose(out.loss, ref.loss, rtol=1e-6)
    assert torch.allclose(model.lm_head.weight.grad, plain.lm_head.weight.grad, rtol=1e-5, atol=1e-7)


class _Peft(torch.nn.Module):
    """PEFT's PeftModel, as far as fusing sees it: a wrapper with get_base_model() whose forward calls it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def get_base_model(self):
        return self.inner

    def forward(self, **kwargs):
        return self.inner(**kwargs)


def test_a_peft_wrapper_fuses_the_model_it_wraps():
    """PEFT's PeftModel (a LoRA fine-tune, where the logits are most of what is saved) was refused with a hint
    to fuse get_base_model() instead, though apply_activation_policy takes the wrapper: the wrapper's model
    is fused now, the same loss and gradients as unfused, and unfusing through the wrapper undoes it."""
    x, y = torch.randint(0, 256, (2, 24)), torch.randint(0, 256, (2, 24))
    plain, inner = FAMILIES["llama"](), FAMILIES["llama"]()
    inner.load_state_dict(plain.state_dict())
    peft = _Peft(inner)
    assert effmem.fuse_linear_cross_entropy(peft) is peft
    out = peft(input_ids=x, labels=y)
    ref = plain(input_ids=x, labels=y)
    assert out.logits is None and torch.allclose(out.loss, ref.loss, rtol=1e-6)
    out.loss.backward()
    ref.loss.backward()
    assert torch.allclose(inner.lm_head.weight.grad, plain.lm_head.weight.grad, rtol=1e-5, atol=1e-7)
    assert effmem.unfuse_linear_cross_entropy(peft) is peft
    assert "forward" not in inner.__dict__ and peft(input_ids=x, labels=y).logits is not None
