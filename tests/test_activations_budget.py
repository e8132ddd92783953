"""apply_activation_policy(model, memory_budget=...): each decoder layer plain, "fast", "offload" or "min", the
mix of least time whose saved activations fit (effmem.activations.budget; issue 10, item 1).

The bytes of each mode are measured on the first layer at the first forward of a shape; these tests check
the choice against a brute force, the measured bytes against what the layers then hold, the error for a
budget nothing fits, and that gradients stay those of the policies chosen.
"""
import copy
import itertools

import pytest
import torch

from effmem.activations import apply_activation_policy, budget_choice, remove_activation_policy
from effmem.activations import budget as budget_mod
from effmem.activations.budget import COST, choose, hidden_layers
from effmem.plan.verify import bytes_in_use
from activation_helpers import held_after_forward, tiny_llama, without_transformers_packed_check

transformers = pytest.importorskip("transformers")


def llama(layers=6):
    return tiny_llama(torch.bfloat16, num_hidden_layers=layers)


X = torch.randint(0, 256, (4, 256), generator=torch.Generator().manual_seed(1))


def loss_of(m):
    return m(input_ids=X, labels=X).loss


def test_choice_is_the_cheapest_that_fits():
    nbytes = {"plain": 100, "fast": 30, "offload": 2, "min": 4}
    for layers, budget, max_off in itertools.product((1, 3, 5), (0, 8, 12, 20, 60, 90, 150, 300, 500), (0, 2)):
        got = choose(layers, nbytes, budget, max_off)
        fits = [m for m in itertools.product(("plain", "fast", "offload", "min"), repeat=layers)
                if sum(nbytes[x] for x in m) <= budget and m.count("offload") <= max_off]
        if not fits:
            assert got is None
            continue
        best = min(sum(COST[x] for x in m) for m in fits)
        assert sum(nbytes[x] for x in got) <= budget and got.count("offload") <= max_off
        assert sum(COST[x] for x in got) == pytest.approx(best)
        n_off = got.count("offload")
        assert got[:n_off] == ["offload"] * n_off  # the earliest layers: their copies have the most to hide behind


def test_offload_only_as_far_as_the_link_hides_it():
    # 10 layers of 1 ms forward; codes of 1 MB per layer.
    assert hidden_layers(10, 1e-3, 1e6, 10e9) == 9        # 0.1 ms a copy: all but the last
    assert hidden_layers(10, 1e-3, 1e6, 0.5e9) == 4       # 2 ms a copy: 9 ms of forward hides 4
    assert hidden_layers(10, 1e-3, 1e6, 0.4e9) == 0       # 2.5 ms: not even behind one layer's backward
    assert hidden_layers(10, 1e-3, 1e6, 0.0) == 0         # no link (a CPU device)
    assert hidden_layers(1, 1e-3, 1e6, 10e9) == 0         # a single layer is needed first in backward


def test_offloaded_layers_send_their_codes_and_bring_them_back_in_order(monkeypatch):
    """With a link (made up here: the CPU has none), a tight budget offloads the earliest layers: their
    8-bit codes leave the entries at the end of each layer's forward and come back in backward, each
    prefetched before it is needed: the last offloaded layer when backward enters the layer after it, each
    one before when the one after it comes back; the gradients are those of the "fast" policy, bit for
    bit (offload moves codes, it changes none). A deep copy of the model carries no layer in flight."""
    monkeypatch.setattr(budget_mod, "_link_rate", lambda device: 1e15)
    base = llama(4)
    fast = apply_activation_policy(copy.deepcopy(base), "fast")
    off = apply_activation_policy(copy.deepcopy(base), memory_budget=0.16)
    a, b = loss_of(fast), loss_of(off)
    choice = budget_choice(off)
    assert choice["max_offload"] == 3 and choice["modes"] == ["offload"] * 3 + ["fast"], choice
    comp = off._effmem_fast
    away = [e for e in comp.live_entries() if e.offload is not None]
    assert away and all(e.codes is None and e.stats is None for e in away)
    counters = budget_choice(off)["offload_counters"]
    assert counters["layers_sent"] == 3 and counters["layers_back"] == 0
    sent = counters["bytes_sent"]
    assert sent == 3 * (choice["bytes"]["fast"] - choice["bytes"]["offload"])
    assert torch.equal(a, b)
    a.backward()
    b.backward()
    counters = budget_choice(off)["offload_counters"]
    host = counters.pop("host_reserved")
    assert counters == dict(layers_sent=3, bytes_sent=sent, layers_back=3, prefetched=3, fetched_late=0,
                            outside_reserve=0)
    assert sent <= host <= sent + 2 * 512 * len(away)  # one buffer: the codes and statistics at 512-byte alignment
    for p, q in zip(fast.parameters(), off.parameters()):
        assert torch.equal(p.grad, q.grad)
    # A second step sends and brings back again; a copy taken between forward and backward trains alike.
    off.zero_grad()
    loss = loss_of(off)
    twin = copy.deepcopy(off)
    loss.backward()
    assert budget_choice(off)["offload_counters"]["layers_back"] == 6
    loss_of(twin).backward()
    twin_counters = budget_choice(twin)["offload_counters"]
    assert twin_counters["prefetched"] == 3 + 3  # its counters came along
    assert twin_counters["outside_reserve"] == 0  # and it has a buffer of its own


def test_two_forwards_before_a_backward_keep_both_copies(monkeypatch):
    """The host buffer is reused by the next forward, except while a layer of the last one is still out:
    two forwards and then one backward over both give "fast"'s gradients."""
    monkeypatch.setattr(budget_mod, "_link_rate", lambda device: 1e15)
    base = llama(4)
    fast = apply_activation_policy(copy.deepcopy(base), "fast")
    off = apply_activation_policy(copy.deepcopy(base), memory_budget=0.16)
    y = X.flip(0)
    for m in (fast, off):
        (loss_of(m) + m(input_ids=y, labels=y).loss).backward()
    counters = budget_choice(off)["offload_counters"]
    assert (counters["layers_sent"], counters["layers_back"], counters["outside_reserve"]) == (6, 6, 0)
    for p, q in zip(fast.parameters(), off.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_layer_not_prefetched_is_fetched_when_needed(monkeypatch):
    """Without the hook that prefetches the last offloaded layer, its first restore copies it back on the
    spot (and prefetches the one before): the same gradients."""
    from effmem.activations.offload import Offloader
    monkeypatch.setattr(budget_mod, "_link_rate", lambda device: 1e15)
    monkeypatch.setattr(Offloader, "prefetch_on_backward", lambda self, output: None)
    base = llama(4)
    fast = apply_activation_policy(copy.deepcopy(base), "fast")
    off = apply_activation_policy(copy.deepcopy(base), memory_budget=0.16)
    loss_of(fast).backward()
    loss_of(off).backward()
    counters = budget_choice(off)["offload_counters"]
    assert (counters["layers_back"], counters["prefetched"], counters["fetched_late"]) == (3, 2, 1)
    for p, q in zip(fast.parameters(), off.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_without_a_link_nothing_is_offloaded():
    m = apply_activation_policy(llama(3), memory_budget=0.05)
    loss_of(m).backward()
    c = budget_choice(m)
    assert c["max_offload"] == 0 and "offload" not in c["modes"] and c["link_bytes_per_s"] == 0


def test_budgets_pick_mixes_that_hold_what_they_predict():
    if bytes_in_use(torch.device("cpu")) is None:
        pytest.skip("no glibc mallinfo2 here to count the allocator's bytes")
    base = llama()
    held, choices = {}, {}
    for budget in (1.0, 0.55, 0.25, 0.1):
        m = apply_activation_policy(copy.deepcopy(base), memory_budget=budget)
        held[budget] = held_after_forward(m, X)
        choices[budget] = c = budget_choice(m)
        assert c["predicted_bytes"] <= c["budget_bytes"]
    assert choices[1.0]["modes"] == ["plain"] * 6
    assert set(choices[0.55]["modes"]) == {"plain", "fast"}
    assert "min" in choices[0.1]["modes"]
    # What the layers hold changes with the choice as measured on the first layer: the difference in
    # held bytes between two budgets is the difference in predicted bytes (the rest of the model is equal).
    for a, b in ((1.0, 0.55), (0.55, 0.25), (0.25, 0.1)):
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


def test_the_choice_reported_is_the_one_the_latest_forward_ran():
    """budget_choice gave the choice made last (a new shape's), not the one the latest forward ran: after
    shapes A, B, A it reported B's."""
    m = apply_activation_policy(llama(2), memory_budget=0.3)
    shapes = []
    for t in (256, 64, 256):
        m(input_ids=X[:, :t])
        shapes.append(budget_choice(m)["shape"][1])
    assert shapes == [256, 64, 256]


def test_a_budget_nothing_fits_and_bad_arguments_name_themselves():
    m = apply_activation_policy(llama(2), memory_budget=1000)
    with pytest.raises(ValueError, match=r"memory_budget: 1000 bytes for 2 layers .* every layer under 'min'"):
        loss_of(m)
    with pytest.raises(ValueError, match=r"a fraction goes as a float: memory_budget=1.0\)"):
        loss_of(apply_activation_policy(llama(2), memory_budget=1))
    # float64: "min" is left out (its codes take float32, bf16, fp16); the least is the mode of fewest bytes
    m = apply_activation_policy(llama(2).double(), memory_budget=0.5)
    with pytest.raises(ValueError, match=r"with every layer under 'fast' \('min' is left out: .*not torch.float64\)"):
        loss_of(m)
    with pytest.raises(ValueError, match=r"memory_budget: a fraction .* \(0, 1\], got 1.5"):
        apply_activation_policy(llama(2), memory_budget=1.5)
    with pytest.raises(TypeError, match="memory_budget: expected a fraction"):
        apply_activation_policy(llama(2), memory_budget="1GB")
    with pytest.raises(ValueError, match="policy: memory_budget chooses the policy of each layer"):
        apply_activation_policy(llama(2), "fast", memory_budget=0.5)


@pytest.mark.cuda
def test_cuda_offload_frees_the_codes_without_host_syncs(monkeypatch):
    """On a GPU: after forward the offloaded layers' codes are off the device (allocated bytes below the
    "fast" policy's by what was sent), forward and backward make no host synchronisation, and the
    gradients are "fast"'s bit for bit."""
    without_transformers_packed_check(monkeypatch)
    base = llama(6).cuda()
    x = X.cuda()
    fast = apply_activation_policy(copy.deepcopy(base), "fast")
    off = apply_activation_policy(copy.deepcopy(base), memory_budget=0.16)
    for m in (fast, off):  # the same forwards on both (stochastic rounding's seeds follow them)
        m(input_ids=x[:1], labels=x[:1]).loss.backward()  # off: calibrates this shape (it synchronises)
        m(input_ids=x, labels=x).loss.backward()          # and this one; warm-up for both
        m.zero_grad()
    torch.cuda.synchronize()

    def active():
        return torch.cuda.memory_stats()["active_bytes.all.current"]

    def held(m):
        before = active()
        loss = m(input_ids=x, labels=x).loss
        torch.cuda.synchronize()
        # A block freed while a side-stream copy still read it stays active until the allocator sees the
        # copy done, which it checks at its next allocation.
        torch.empty(1, device="cuda")
        return loss, active() - before

    a, held_fast = held(fast)
    a.backward()
    torch.cuda.set_sync_debug_mode("error")
    try:
        off(input_ids=x, labels=x).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    choice = budget_choice(off)
    assert "offload" in choice["modes"], choice
    for p, q in zip(fast.parameters(), off.parameters()):
        assert torch.equal(p.grad, q.grad)
    b, held_off = held(off)
    sent = choice["modes"].count("offload") * (choice["bytes"]["fast"] - choice["bytes"]["offload"])
    assert held_fast - held_off == pytest.approx(sent, rel=0.1), (held_fast, held_off, sent)
    b.backward()
    assert choice["offload_counters"]["fetched_late"] == 0 < choice["offload_counters"]["prefetched"]


def test_calibrating_new_shapes_leaves_no_probe_graph_alive():
    """Each calibration (a new input shape: dynamic padding gives one almost every batch) counted a probe
    forward's saves with a hook that returned each tensor itself; a node saving its own output (attention's,
    the fused RMSNorm's) then held itself through C++, a cycle gc cannot free: one graph of layer 0 per shape
    stayed alive for good (31 shapes: 594 live tensors, against 24 after one)."""
    import gc
    from effmem.activations.fused import _RMSNorm

    def live():
        gc.collect()
        objs = gc.get_objects()
        return (sum(torch.is_tensor(o) and not isinstance(o, torch.nn.Parameter) for o in objs),
                sum(isinstance(o, _RMSNorm._backward_cls) for o in objs))

    m = apply_activation_policy(llama(2), memory_budget=0.5)
    for length in range(32, 40):
        x = torch.randint(0, 128, (2, length))
        m(input_ids=x, labels=x).loss.backward()
        m.zero_grad(set_to_none=True)
        if length == 32:
            first = live()
    assert len(m._effmem_budget.choices) == 8
    tensors, nodes = live()
    budget_mod.MAX_CHOICES = 3   # (restored below) lengths that vary freely: those used longest ago go
    try:
        for length in (40, 38, 41):   # 38 used again: 39 goes, not 38 (made first: past 256 lengths in a cycle,
            m(input_ids=X[:2, :length])   # every forward chose anew)
        assert [k[0][1] for k in m._effmem_budget.choices] == [40, 38, 41]
    finally:
        budget_mod.MAX_CHOICES = 256
    # others' leftovers in a shared test process count in both: what these 7 calibrations added is compared
    assert nodes <= first[1] and tensors <= first[0] + 5, (first, (tensors, nodes))


class _Block(torch.nn.Module):
    def __init__(self, in_place: bool):
        super().__init__()
        self.fc1, self.fc2, self.in_place = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), in_place

    def forward(self, x):
        if self.in_place:
            x.mul_(0.5)   # in place on the layer's input, which plain autograd allows here
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _Net(torch.nn.Module):
    def __init__(self, in_place: bool = False):
        super().__init__()
        self.inp = torch.nn.Linear(16, 64)
        self.layers = torch.nn.ModuleList(_Block(in_place) for _ in range(3))

    def forward(self, x):
        x = self.inp(x) + 0   # + 0: the linear keeps its input, not its output, which the layer may change
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_the_budget_probes_leave_an_input_changed_in_place_as_plain_leaves_it():
    """The probes ran the first layer twice more on the real inputs: an in-place change of the input happened
    three times (inp's gradient 4.3x off). They run on copies now."""
    torch.manual_seed(0)
    base = _Net(in_place=True)
    x = torch.randn(4, 32, 16)

    def run(model):
        loss = model(x)
        loss.backward()
        return loss.detach(), model.inp.weight.grad

    plain = run(copy.deepcopy(base))
    budgeted = run(apply_activation_policy(copy.deepcopy(base), memory_budget=0.5))
    assert torch.equal(budgeted[0], plain[0])
    # 8-bit saves under "fast": the gradient within 2% in norm
    assert float((budgeted[1] - plain[1]).norm() / plain[1].norm()) < 0.02


def test_the_users_hooks_in_the_first_layer_are_warned_of():
    """The probes run the first layer's forward hooks too, which may be what its forward needs (an input cast,
    FSDP's or DeepSpeed's gathers: setting them aside crashed the forward); one of the user's that
    accumulates (a regulariser) counts those runs too, so it is warned of."""
    import warnings
    x = torch.randn(4, 32, 16)
    quiet = apply_activation_policy(_Net(), memory_budget=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet(x).backward()
    hooked = apply_activation_policy(_Net(), memory_budget=0.5)
    hooked.layers[0].fc1.register_forward_hook(lambda m, i, o: None)
    with pytest.warns(UserWarning, match=r"forward hooks inside the layer it measures \(on fc1\) run again"):
        hooked(x).backward()


def test_a_layer_looped_on_its_own_output_is_refused_by_the_budget():
    """ALBERT runs one shared layer through the model's depth: the budget counted it once, so its choice held
    the layer's saves as many times as the loop ran (4 here, 12 in ALBERT-base), past the budget, silently.
    Refused at the second run, naming the layer; "fast" compresses every run, and trains."""
    cfg = transformers.AlbertConfig(vocab_size=100, embedding_size=16, hidden_size=32, num_hidden_layers=4,
                                    num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    m = transformers.AlbertForMaskedLM(cfg)
    x = torch.randint(0, 100, (2, 16))
    apply_activation_policy(m, memory_budget=0.5)
    with pytest.raises(ValueError, match=r"albert_layer_groups.0 ran again on its own output .* policy='fast'"):
        m(input_ids=x, labels=x)
    remove_activation_policy(m)
    apply_activation_policy(m, policy="fast")
    m(input_ids=x, labels=x).loss.backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad and p.dim() > 1)


def test_no_loop_is_seen_across_forwards_or_in_a_layer_that_returns_its_input():
    """The loop check forgets each forward's outputs at the next (a pre-hook on the model, removed with the
    policy): a one-layer stack called again on its own output, and a layer returning its input (skipped) fed
    the same inputs_embeds twice, were refused as loops."""
    torch.manual_seed(0)
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(32, 2, 64, batch_first=True, dropout=0.0), 1,
                                      enable_nested_tensor=False)
    hooks = len(enc._forward_pre_hooks)
    apply_activation_policy(enc, memory_budget=0.5)
    h = torch.randn(2, 8, 32, requires_grad=True)
    out = h
    for _ in range(3):   # a recurrent loop over the model: each call is a forward of its own
        out = enc(out)
    out.sum().backward()
    assert h.grad is not None
    remove_activation_policy(enc)
    assert len(enc._forward_pre_hooks) == hooks

    m = llama(3)
    skipped, real = m.model.layers[0], type(m.model.layers[0]).forward
    # layer 0 returns its input (as a LayerDrop-style skip does), patched before the policy takes the forward
    type(skipped).forward = lambda self, hidden_states, *a, **k: (
        hidden_states if self is skipped else real(self, hidden_states, *a, **k))
    try:
        apply_activation_policy(m, memory_budget=0.5)
        x = torch.randint(0, m.config.vocab_size, (2, 16))
        e = m.get_input_embeddings()(x).detach()
        for _ in range(2):
            m(inputs_embeds=e, labels=x).loss.backward()
    finally:
        type(skipped).forward = real


def test_layers_no_gradient_flows_into_run_plain_and_the_budget_is_chosen_at_the_first_that_records(monkeypatch):
    """LoRA on the later layers only: layer 0, frozen with no gradient flowing in, saves nothing. The choice was
    calibrated there: 0 bytes a layer, a budget of 0 x the layers, every layer plain and over the budget, silently
    (a reviewer's PEFT run: 3.3x a budget of 200 kB). It is made at the first layer that records, for it and the
    layers after it; offloaded layers then start there."""
    base = llama(4)
    for name, p in base.named_parameters():
        p.requires_grad_(".layers.2." in name or ".layers.3." in name)
    m = apply_activation_policy(copy.deepcopy(base), memory_budget=0.3)
    loss_of(m).backward()
    c = budget_choice(m)
    assert c["modes"][:2] == ["plain", "plain"] and c["modes"][2:] != ["plain", "plain"], c
    assert c["budget_bytes"] == int(0.3 * 2 * c["bytes"]["plain"]) > 0 and c["predicted_bytes"] <= c["budget_bytes"]
    m.requires_grad_(True)   # unfrozen (gradual unfreezing): chosen again, the first layers no longer plain
    loss_of(m).backward()
    c = budget_choice(m)
    assert "plain" not in c["modes"][:2] and c["budget_bytes"] == int(0.3 * 4 * c["bytes"]["plain"]), c
    monkeypatch.setattr(budget_mod, "_link_rate", lambda device: 1e15)
    fast = apply_activation_policy(copy.deepcopy(base), "fast")
    off = apply_activation_policy(copy.deepcopy(base), memory_budget=0.245)
    loss_of(fast).backward()
    loss_of(off).backward()
    c = budget_choice(off)
    assert c["modes"] == ["plain", "plain", "offload", "fast"], c
    counters = c["offload_counters"]
    assert (counters["layers_sent"], counters["layers_back"], counters["outside_reserve"]) == (1, 1, 0), counters
    for p, q in zip(fast.parameters(), off.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad))
    loss_of(off).backward()   # the next forward's copies start at the host buffer's beginning again
    counters = budget_choice(off)["offload_counters"]
    assert (counters["layers_sent"], counters["layers_back"], counters["outside_reserve"]) == (2, 2, 0), counters
