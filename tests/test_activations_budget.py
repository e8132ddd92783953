"""apply_activation_policy(model, memory_budget=...): each decoder layer plain, "fast" or "min", the mix of least
time whose saved activations fit (effmem.activations.budget; issue 10, item 1).

The bytes of each mode are measured on the first layer at the first forward of a shape; these tests check
the choice against a brute force, the measured bytes against what the layers then hold, the error for a
budget nothing fits, and that gradients stay those of the policies chosen.
"""
import copy
import itertools

import pytest
import torch

from effmem.activations import apply_activation_policy, budget_choice, remove_activation_policy
from effmem.activations.budget import COST, choose
from effmem.plan.verify import bytes_in_use
from activation_helpers import held_after_forward

transformers = pytest.importorskip("transformers")


def llama(layers=6):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=512, use_cache=False)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).train()


X = torch.randint(0, 256, (4, 256), generator=torch.Generator().manual_seed(1))


def loss_of(m):
    return m(input_ids=X, labels=X).loss


def test_choice_is_the_cheapest_that_fits():
    nbytes = {"plain": 100, "fast": 30, "min": 4}
    for layers, budget in itertools.product((1, 3, 5), (0, 12, 20, 60, 90, 150, 300, 500)):
        got = choose(layers, nbytes, budget)
        fits = [m for m in itertools.product(("plain", "fast", "min"), repeat=layers)
                if sum(nbytes[x] for x in m) <= budget]
        if not fits:
            assert got is None
            continue
        best = min(sum(COST[x] for x in m) for m in fits)
        assert sum(nbytes[x] for x in got) <= budget
        assert sum(COST[x] for x in got) == pytest.approx(best)


def test_budgets_pick_mixes_that_hold_what_they_predict():
    if bytes_in_use(torch.device("cpu")) is None:
        pytest.skip("no glibc mallinfo2 here to count the allocator's bytes")
    base = llama()
    held, choices = {}, {}
    for budget in (1.0, 0.5, 0.25, 0.1):
        m = apply_activation_policy(copy.deepcopy(base), memory_budget=budget)
        held[budget] = held_after_forward(m, X)
        choices[budget] = c = budget_choice(m)
        assert c["predicted_bytes"] <= c["budget_bytes"]
    assert choices[1.0]["modes"] == ["plain"] * 6
    assert set(choices[0.5]["modes"]) == {"plain", "fast"}
    assert "min" in choices[0.1]["modes"]
    # What the layers hold changes with the choice as measured on the first layer: the difference in
    # held bytes between two budgets is the difference in predicted bytes (the rest of the model is equal).
    for a, b in ((1.0, 0.5), (0.5, 0.25), (0.25, 0.1)):
        predicted = choices[a]["predicted_bytes"] - choices[b]["predicted_bytes"]
        assert held[a] - held[b] == pytest.approx(predicted, rel=0.05), (a, b)


def test_gradients_follow_the_chosen_policies():
    plain = llama(3)
    mixed = apply_activation_policy(copy.deepcopy(plain), memory_budget=0.2)
    a, b = loss_of(plain), loss_of(mixed)
    assert torch.equal(a, b)
    a.backward()
    b.backward()
    assert set(budget_choice(mixed)["modes"]) >= {"min"}
    for p, q in zip(plain.parameters(), mixed.parameters()):
        assert (q.grad.float() - p.grad.float()).norm() <= 0.06 * p.grad.float().norm() + 1e-6
    remove_activation_policy(mixed)
    assert budget_choice(mixed) is None and all("forward" not in m.__dict__ for m in mixed.modules())


def test_a_budget_nothing_fits_and_bad_arguments_name_themselves():
    m = apply_activation_policy(llama(2), memory_budget=1000)
    with pytest.raises(ValueError, match=r"memory_budget: 1000 bytes for 2 layers .* every layer under 'min'"):
        loss_of(m)
    with pytest.raises(ValueError, match=r"memory_budget: a fraction .* \(0, 1\], got 1.5"):
        apply_activation_policy(llama(2), memory_budget=1.5)
    with pytest.raises(TypeError, match="memory_budget: expected a fraction"):
        apply_activation_policy(llama(2), memory_budget="1GB")
    with pytest.raises(ValueError, match="policy: memory_budget chooses the policy of each layer"):
        apply_activation_policy(llama(2), "fast", memory_budget=0.5)
