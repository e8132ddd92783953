"""effmem.apply_activation_policy(model, "fast"): 8-bit saves, cheap outputs rebuilt in backward (issue 10).

Checked on Hugging Face Llama, Mixtral and GPT-2 models (random init, no download) and the demo GPT, on
the CPU: the forward is unchanged bit for bit; gradients carry only the rounding of the 8-bit saves (a few
percent relative at most, against order 100% for a wrong rebuild); the saved activations of the decoder
layers, counted with saved-tensor hooks, are at most 0.30x of plain in bf16; each rebuilt output is rebuilt
once for all of its saves and each compressed memory dequantised once; training follows plain training to
within 1% of the final loss; torch.compile holds no more than eager; removing the policy restores the model.
"""
import copy

import pytest
import torch

import effmem
from effmem.activations import activation_stats, apply_activation_policy, fused, remove_activation_policy
from effmem.demo_model import ByteGPT, GPTConfig
from effmem.plan.model import find_blocks
from effmem.plan.verify import bytes_in_use
from activation_helpers import LLAMA, held_after_forward, loss_of, tiny_llama, without_transformers_packed_check

transformers = pytest.importorskip("transformers")

llama = tiny_llama


def gpt2(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=256, n_positions=256)
    return transformers.GPT2LMHeadModel(cfg).to(dtype).train()   # dropout 0.1 everywhere


def mixtral():
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                     vocab_size=256, max_position_embeddings=256, use_cache=False)
    return transformers.MixtralForCausalLM(cfg).train()


def demo_gpt():
    torch.manual_seed(0)
    return ByteGPT(GPTConfig(seq_len=128, n_layer=3, d_model=64, n_head=4)).train()


def ids(batch=2, seq=128, seed=1):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def grads(model, x, seed=5):
    torch.manual_seed(seed)  # the same dropout masks for every model
    loss = loss_of(model, x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


MODELS = {"llama": llama, "gpt2": gpt2, "mixtral": mixtral, "demo_gpt": demo_gpt}


@pytest.mark.parametrize("which", list(MODELS))
def test_forward_unchanged_and_gradients_carry_only_the_rounding(which):
    plain = MODELS[which]()
    quick = apply_activation_policy(copy.deepcopy(plain), "fast")
    x = ids()
    l0, g0 = grads(plain, x)
    l1, g1 = grads(quick, x)
    assert torch.equal(l0, l1)  # the fused functions compute the forward with the modules' own operations
    worst = max(((b - a).norm() / (a.norm() + 1e-12)).item() for a, b in zip(g0, g1) if a.norm() > 0)
    # 8-bit stochastic rounding of the saves: a few percent in the most sensitive weights (q and k, through
    # the softmax); a rebuild from the wrong tensor or a dropped save would be off by order 100%
    assert worst < 0.06, worst


class _LoraLike(torch.nn.Module):
    """PEFT's lora.Linear as the fast path sees it: the frozen projection as base_layer plus a low-rank delta."""

    def __init__(self, base, r=4):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.a = torch.nn.Linear(base.in_features, r, bias=False)
        self.b = torch.nn.Linear(r, base.out_features, bias=False)
        torch.nn.init.normal_(self.b.weight, std=0.02)

    def forward(self, x):
        return self.base_layer(x) + self.b(self.a(x))


def test_a_lora_on_the_mlp_keeps_the_fused_swiglu_and_trains_through_it():
    """LoRA on gate/up/down (PEFT wraps each nn.Linear): the MLP's fast path was skipped, silently."""
    plain = llama()
    for layer in plain.model.layers:
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(layer.mlp, name, _LoraLike(getattr(layer.mlp, name)))
    quick = apply_activation_policy(copy.deepcopy(plain), "fast")
    assert "LlamaMLP" in {type(p).__name__ for p in quick.model.layers[0]._effmem_patched}
    x = ids()
    losses = []
    for m in (plain, quick):
        torch.manual_seed(5)
        losses.append(loss_of(m, x))
        losses[-1].backward()
    assert torch.equal(losses[0], losses[1])
    pairs = [(a.grad, b.grad) for (n, a), b in zip(plain.named_parameters(), quick.parameters())
             if ".a." in n or ".b." in n]
    assert pairs and all(a is not None and b is not None for a, b in pairs)
    worst = max(((b - a).norm() / a.norm()).item() for a, b in pairs if a.norm() > 0)
    assert worst < 0.06, worst


def test_fast_paths_are_found_in_each_family():
    for make, expect in ((llama, {"LlamaRMSNorm", "LlamaMLP"}), (gpt2, {"LayerNorm", "NewGELUActivation"}),
                         (mixtral, {"MixtralRMSNorm"}), (demo_gpt, {"LayerNorm", "GELU"})):
        m = apply_activation_policy(make(), "fast")
        layer = find_blocks(m)[1][0]
        assert {type(p).__name__ for p in layer._effmem_patched} == expect


def layer_saved_bytes(model, x, policy):
    """Bytes autograd keeps for the decoder layers' backward: distinct storages saved while a layer runs
    (parameters and the layer's other inputs excluded); under "fast", the bytes its compressor stored."""
    if policy == "fast":
        apply_activation_policy(model, "fast")
        loss_of(model, x)
        return activation_stats(model).total_bytes_after
    layers = find_blocks(model)[1]
    seen, inside = {}, []

    def pack(t):
        if inside and not (t.requires_grad and t.is_leaf) and not (t._base is not None and t._base.is_leaf
                                                                   and t._base.requires_grad):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    def enter(*_):
        inside.append(1)

    def leave(*_):
        inside.pop()
    hooks = [h for layer in layers for h in (layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(model, x)
    for h in hooks:
        h.remove()
    return sum(seen.values()) - 2 * x.shape[1] * (LLAMA["hidden_size"] // LLAMA["num_attention_heads"]) * 2 * (
        model.config.model_type == "llama")  # cos and sin: inputs of every layer, not per-layer saves


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_bf16_layers_keep_at_most_030_of_plain(which):
    x = ids(4, 256)
    plain = layer_saved_bytes(MODELS[which](torch.bfloat16), x, "plain")
    quick = layer_saved_bytes(MODELS[which](torch.bfloat16), x, "fast")
    assert quick <= 0.30 * plain, quick / plain


@pytest.fixture
def mallinfo():
    if bytes_in_use(torch.device("cpu")) is None:
        pytest.skip("no glibc mallinfo2 here to count the allocator's bytes")


def test_memory_held_after_forward_is_a_fraction_of_plain(mallinfo):
    x = ids(4, 256)
    plain = held_after_forward(llama(torch.bfloat16), x)
    quick = held_after_forward(apply_activation_policy(llama(torch.bfloat16), "fast"), x)
    assert quick < 0.4 * plain, quick / plain   # the whole model: embedding, logits and loss included


def test_each_output_is_rebuilt_once_and_each_save_dequantised_once():
    m = apply_activation_policy(llama(), "fast")
    loss_of(m, ids()).backward()
    layers = LLAMA["num_hidden_layers"]
    saves = m._effmem_fast._saves  # rebuilds and the kernels' calls, counted where the C++ store makes them
    # per layer, three outputs rebuilt once each: the input norm's (saved by q, k and v), the second norm's
    # (gate and up), SwiGLU's (down)
    assert saves.rebuild_calls == 3 * layers
    assert saves.quantize_calls == saves.dequantize_calls > 0


def test_retain_graph_backward_twice_gives_the_same_gradients():
    m = apply_activation_policy(llama(), "fast")
    loss = loss_of(m, ids())
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(first, m.parameters()))


def test_remove_restores_the_model_and_copies_are_independent():
    m = llama()
    x = ids()
    before = loss_of(m, x)
    apply_activation_policy(m, "fast")
    twin = copy.deepcopy(m)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    assert torch.equal(loss_of(m, x), before)  # the copy's patched forwards call the copy's modules
    assert not torch.equal(loss_of(twin, x), before)
    with pytest.raises(ValueError, match="already applied"):
        apply_activation_policy(m, "min")
    remove_activation_policy(m)
    assert all("forward" not in mod.__dict__ for mod in m.modules())
    assert not hasattr(m, "_effmem_fast")
    assert torch.equal(loss_of(m, x), before)


def test_fused_functions_match_autograd_of_the_modules_they_replace():
    """Same forward bits, and gradients equal to autograd's up to the float rounding of the formulas:
    float32 for RMSNorm (Hugging Face's computes in float32 whatever the input), float64 for the rest."""
    torch.manual_seed(0)
    xs = torch.randn(3, 5, 64, requires_grad=True)
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    gs = torch.randn(3, 5, 64)
    ref = torch.autograd.grad(norm(xs), (xs, norm.weight), gs)
    out = fused.rms_norm(xs, norm.weight, 1e-5)
    assert torch.equal(out, norm(xs))
    for a, b in zip(ref, torch.autograd.grad(out, (xs, norm.weight), gs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    x = xs.detach().double().requires_grad_(True)
    g = gs.double()
    gate, up = torch.randn(2, 2, 8, 32, dtype=torch.float64, requires_grad=True).unbind(0)
    gsw = torch.randn(2, 8, 32, dtype=torch.float64)
    ref = torch.autograd.grad(torch.nn.functional.silu(gate) * up, (gate, up), gsw)
    for a, b in zip(ref, torch.autograd.grad(fused.swiglu(gate, up), (gate, up), gsw)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    ln = torch.nn.LayerNorm(64).double()
    ref = torch.autograd.grad(ln(x), (x, ln.weight, ln.bias), g)
    for a, b in zip(ref, torch.autograd.grad(fused.layer_norm(x, (64,), ln.weight, ln.bias, ln.eps),
                                             (x, ln.weight, ln.bias), g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    act = transformers.activations.NewGELUActivation()
    ref = torch.autograd.grad(act(x), x, g)[0]
    torch.testing.assert_close(torch.autograd.grad(fused.gelu(x, act.forward, "tanh"), x, g)[0], ref,
                               rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_autocast_copies_of_rebuilt_outputs_are_rebuilt_too(which):
    """Under autocast with float32 weights (torch AMP), a norm's float32 output is cast to bf16 by each
    projection that reads it (q, k and v: three copies): the copies are rebuilt from the norm's recipe
    and cast again, not stored one by one. The layers then store what a bf16 model's do (CPU autocast
    casts matmul inputs as CUDA's does); the gradients stay within the rounding of plain AMP training."""
    make = {"llama": llama, "gpt2": gpt2}[which]
    x = ids()
    low = apply_activation_policy(make(torch.bfloat16), "fast")
    loss_of(low, x)
    amp, plain = apply_activation_policy(make(), "fast"), make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        l0, g0 = grads(plain, x)
        l1, g1 = grads(amp, x)
    assert torch.equal(l0, l1)
    st, ref = activation_stats(amp), activation_stats(low)
    assert st.num_compressed == ref.num_compressed
    # autocast's own bf16 weight copies (kept by reference, as without the policy) aside
    copies = st.skipped["parameter_copy"].bytes_after if "parameter_copy" in st.skipped else 0
    assert st.total_bytes_after - copies <= 1.3 * ref.total_bytes_after
    for a, b in zip(g0, g1):
        assert (b - a).norm() <= 0.06 * a.norm() + 1e-6


@pytest.mark.parametrize("autocast", [True, False], ids=["fp32-autocast", "bf16"])
def test_frozen_weights_and_their_autocast_copies_are_kept_as_they_are(autocast):
    """LoRA-style: the projections' weights frozen. A frozen weight, and autocast's copy of one (made for each
    use: autocast caches only copies of weights that take a gradient), has no autograd history; they were
    stored as 8-bit codes under autocast (21 of them here), where a trained weight's are kept: the rounding of a
    weight in every input gradient. Now they count as a trained weight's do. The bf16 model without autocast is
    the control (its linear layers hand their weights over as they are, never through the hooks)."""
    x = ids(batch=2, seq=48)   # 96 tokens: no activation has a weight's shape
    dtype = torch.float32 if autocast else torch.bfloat16
    stats = {}
    for frozen in (False, True):
        model = llama(dtype)
        for name, p in model.named_parameters():
            p.requires_grad_(not (frozen and "proj" in name))
        apply_activation_policy(model, "fast")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss_of(model, x)
        stats[frozen] = activation_stats(model)
    assert stats[True].num_compressed == stats[False].num_compressed
    assert stats[True].total_bytes_after == stats[False].total_bytes_after
    if autocast:   # (a bf16 model's linear layers hand their weight over as it is, never through the hooks)
        assert stats[True].skipped["parameter_copy"].count == 3 * 7   # q k v o gate up down, in 3 layers


@pytest.mark.cuda
def test_layer_norm_under_cuda_autocast_matches_the_module():
    """CUDA's autocast runs layer norm in float32 over copies of its bf16 inputs: the fused function does
    the same (its backward once met the bf16 input beside a float32 gradient), with the module's output
    dtype and each gradient in its input's dtype."""
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(64).cuda().bfloat16()
    x = torch.randn(4, 16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = ln(x)
        out = fused.layer_norm(x, (64,), ln.weight, ln.bias, ln.eps)
    assert out.dtype == ref.dtype == torch.float32 and torch.equal(out, ref)
    g = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (x, ln.weight, ln.bias), g)
    got = torch.autograd.grad(out, (x, ln.weight, ln.bias), g)
    for a, b in zip(want, got):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2)


@pytest.mark.cuda
def test_gpt2_fast_policy_trains_under_cuda_autocast():
    m = apply_activation_policy(gpt2(torch.bfloat16).cuda(), "fast")
    x = ids().cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_of(m, x)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.cuda
def test_no_host_synchronisation_on_cuda(monkeypatch):
    without_transformers_packed_check(monkeypatch)
    m = apply_activation_policy(llama(torch.bfloat16).cuda(), "fast")
    x = ids().cuda()
    loss_of(m, x).backward()  # first call: lazy initialisation may synchronise
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = loss_of(m, x)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_plan_offers_and_applies_the_fast_policy():
    p = effmem.plan(dict(model_type="llama", **LLAMA), batch=2, seq=64, device="cpu", host_memory="8GB")
    fast_c = next(c for c in p.candidates if c.config.activations == "fast" and c.config.loss == "standard")
    plain = next(c for c in p.candidates if c.config.activations == "none" and c.config.loss == "standard"
                 and c.config.precision == fast_c.config.precision and c.config.micro_batch == fast_c.config.micro_batch)
    assert fast_c.cost.forward_alive < 0.5 * plain.cost.forward_alive
    from effmem.plan.report import code_for
    assert "apply_activation_policy(model, 'fast')" in code_for(fast_c.config, "cpu")
    m, _ = p.apply(llama(), fast_c.name)
    assert all(layer._effmem_policy == "fast" for layer in m.model.layers)


def _rms_inputs(dtype, device="cpu", rows=512, hidden=256):
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, dtype=dtype, device=device) * 3
    w = torch.rand(hidden, dtype=dtype, device=device) + 0.5
    g = torch.randn(rows, hidden, dtype=dtype, device=device)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)   # as _RMSNorm's forward keeps it
    n = x.double() * rstd.double()
    gn = g.double() * w.double()
    ref = (rstd.double() * (gn - n * (gn * n).mean(-1, keepdim=True)), (g.double() * n).sum(0))
    return g, x, rstd, w, ref


def _rel_err(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_backward_by_aten_matches_the_written_out_formula(dtype):
    """On a GPU, _RMSNorm's backward is aten's fused kernel: the arguments it passes (rstd with a trailing
    1, the mask, the order of the results) are checked here through torch's decomposition of that op, which
    runs on a CPU: both gradients within the written-out formula's own error of a float64 reference."""
    g, x, rstd, w, ref = _rms_inputs(dtype)
    dec = torch._decomp.decomposition_table[torch.ops.aten._fused_rms_norm_backward.default]
    mine = fused._rms_norm_backward([True, True], g, x, rstd, w)[:2]
    aten = fused._aten_rms_backward(g, x, rstd, w, [True, True], op=dec)
    for a, b, r in zip(aten, mine, ref):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        assert _rel_err(a, r) <= 2 * _rel_err(b, r) + 1e-6
    only_w = fused._aten_rms_backward(g, x, rstd, w, [False, True], op=dec)
    assert only_w[0] is None and torch.equal(only_w[1], aten[1])
    assert not fused._aten_rms_backward_applies(x, g, w)   # a CPU has no such kernel (torch 2.11-2.14)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_backward_on_cuda_takes_the_fused_kernel(dtype):
    g, x, rstd, w, ref = _rms_inputs(dtype, "cuda", rows=3 * 1024, hidden=2048)
    assert fused._aten_rms_backward_applies(x, g, w)
    xr = x.clone().requires_grad_(True)
    wr = w.clone().requires_grad_(True)
    got = torch.autograd.grad(fused.rms_norm(xr, wr, 1e-6), (xr, wr), g)
    mine = fused._rms_norm_backward([True, True], g, x, rstd, w)[:2]
    for a, b, r in zip(got, mine, ref):
        assert a.dtype == dtype
        assert _rel_err(a, r.cuda()) <= 2 * _rel_err(b, r.cuda()) + 1e-6
