"""Activation policies inside torch.compile: evaluation without gradients stays in the model's graph, and
fullgraph=True names why "fast" leaves it."""
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
