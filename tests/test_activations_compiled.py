"""Activation policies inside torch.compile: evaluation without gradients stays in the model's graph, and
fullgraph=True names why "fast" leaves it."""
import warnings

import pytest
import torch

from effmem import apply_activation_policy
from activation_helpers import tiny_llama

X = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("policy", ["checkpoint", "selective", "min"])
def test_evaluation_under_compile_does_not_break_the_graph(policy):
    """Without gradients nothing is saved, so the layer runs as it is: "checkpoint" and "selective" wrapped it
    in torch's checkpoint all the same (a graph break per layer: the layer's cache update inside it), "min"
    left the graph at every layer."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    model = apply_activation_policy(tiny_llama(), policy)
    compiled = torch.compile(model, backend="aot_eager")
    compiled(input_ids=X, labels=X).loss.backward()
    model.eval()
    counters.clear()
    with torch.no_grad():   # with a key/value cache, as generation's first step
        got = compiled(input_ids=X, labels=X, use_cache=True).loss
        want = model(input_ids=X, labels=X, use_cache=True).loss
    assert torch.equal(got, want)
    # one frame for the model (and none per layer: a break there starts frames of its own)
    assert not counters["graph_break"] and counters["frames"]["total"] <= 2, dict(counters["frames"])
    torch._dynamo.reset()


def test_fullgraph_names_why_fast_leaves_the_graph():
    torch._dynamo.reset()
    model = apply_activation_policy(tiny_llama(), "fast")
    with pytest.raises(Exception, match="Compile without fullgraph, or use policy 'selective' or 'checkpoint'"):
        torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=X, labels=X)
    torch._dynamo.reset()


@pytest.mark.parametrize("policy", ["fast", "min"])
def test_compiled_layers_with_dropout_keep_the_gradients_of_their_loss(policy):
    """A compiled layer's backward drew dropout masks anew where the policy recomputes: a tiny GPT-2 with
    dropout 0.1 got gradients 10-12% off the loss it computed along their own direction (a reviewer's finite
    differences), 0.9-1.4 relative norm off eager. Such layers run eagerly now: their gradients are eager's."""
    import copy
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32)
    base = transformers.GPT2LMHeadModel(cfg).train()
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def grads(model):
        torch.manual_seed(5)   # the same dropout masks in each run
        model(input_ids=x, labels=x).loss.backward()
        return [p.grad for p in model.parameters() if p.grad is not None]
    eager = grads(apply_activation_policy(copy.deepcopy(base), policy))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiled = grads(torch.compile(apply_activation_policy(copy.deepcopy(base), policy), backend="aot_eager"))
    # torch 2.14: the hooks' saves inside selective checkpointing are kept as they are, by choice, not by default
    assert not [w for w in seen if "respect_saved_tensors_hooks" in str(w.message)]
    worst = max(((a - b).norm() / a.norm()).item() for a, b in zip(eager, compiled))
    assert worst < 0.05, worst   # "fast" runs as selective checkpointing there: exact where eager is 8-bit
