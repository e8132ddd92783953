"""A forward with gradients under an activation policy and the key/value cache: asked for, it is turned off (a
recomputed layer would add its keys and values again); one handed in is refused by the policies that run a layer
again and filled and returned under "fast" (split from test_activations.py)."""
import inspect

import pytest
import torch

from effmem.activations import apply_activation_policy
from test_activations import gpt2, ids, llama

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("policy", ["checkpoint", "selective", "min", "budget"])
@pytest.mark.parametrize("training", [True, False])
def test_a_cache_with_gradients_is_turned_off_or_refused(policy, training):
    """A checkpointed layer given a key/value cache would add its keys and values twice (recompute), and so
    would memory_budget's probes at a new shape: a forward with gradients asked for one runs without (a warning
    says so, as transformers' own gradient checkpointing does), in training mode or in eval mode (dropout off,
    gradients on: refused with "got a key/value cache" before); a cache passed in is refused."""
    m = llama(use_cache=True).train(training)
    m = apply_activation_policy(m, memory_budget=0.5) if policy == "budget" else apply_activation_policy(m, policy)
    x = ids()
    plain = llama(use_cache=True).train(training)
    want = plain(input_ids=x, labels=x, use_cache=False).loss
    out = m(input_ids=x, labels=x)   # the config's use_cache=True
    assert out.past_key_values is None and torch.equal(out.loss, want)
    out.loss.backward()
    with pytest.warns(UserWarning, match="use_cache=True in a forward with gradients"):
        out = m(input_ids=x, labels=x, use_cache=True)
    assert out.past_key_values is None and torch.equal(out.loss, want)
    # transformers 5.24 renamed past_key_values to cache
    name = "cache" if "cache" in inspect.signature(m.forward).parameters else "past_key_values"
    cache = transformers.DynamicCache(config=m.config)
    with pytest.raises(TypeError, match="got a key/value cache"):
        m(input_ids=ids(seed=1), labels=x, **{name: cache})
    assert cache.get_seq_length() == 0   # refused before any layer (or probe) wrote to it
    with torch.no_grad():   # inference keeps its cache
        assert m(input_ids=x).past_key_values.get_seq_length() == x.shape[1]


def test_a_cache_handed_in_with_gradients_under_fast_is_filled_and_returned():
    """'fast' runs each layer once, so a cache the caller hands in (scoring a continuation with gradients) is
    theirs to fill: use_cache was turned off all the same, the layers filled the cache while GPT-2's forward
    returned none, and a call chained on its past_key_values ran without the prefix (logits 0.54 off, a
    reviewer's repro)."""
    m, plain = gpt2().eval(), gpt2().eval()
    apply_activation_policy(m, "fast")
    x = ids(seq=10)
    name = "cache" if "cache" in inspect.signature(m.forward).parameters else "past_key_values"
    logits = []
    for model in (m, plain):
        first = model(input_ids=x[:, :8], use_cache=True, **{name: transformers.DynamicCache(config=model.config)})
        assert first.past_key_values is not None and first.past_key_values.get_seq_length() == 8
        logits.append(model(input_ids=x[:, 8:], **{name: first.past_key_values}).logits)
    assert torch.equal(*logits)
