"""Activation policies on models whose layers take more than a hidden state: encoder-decoder models (T5, Bart:
two stacks of layers; T5's position bias made with a gradient in one layer and passed to the next; Bart's
decoder layers reading the encoder's output), LoRA-style training with frozen embeddings (the layers' input
needs no gradient, their weights do), layers with buffers a training forward updates (BatchNorm), and
what apply_activation_policy refuses before changing anything.

"min" recomputes each layer from its input's 8-bit codes: its gradients differ from plain ones by that
rounding alone, so each is compared to plain with a relative tolerance; "checkpoint" is exact.
"""
import functools

import pytest
import torch
from torch import nn

from effmem.activations import apply_activation_policy, budget_choice, layer_stacks, remove_activation_policy
from activation_helpers import hf_checkpointing, tiny_llama

transformers = pytest.importorskip("transformers")


def t5():
    torch.manual_seed(0)
    cfg = transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=16,
                                vocab_size=256, decoder_start_token_id=0, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(cfg).train()


def bart():
    torch.manual_seed(0)
    cfg = transformers.BartConfig(d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                  vocab_size=256, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0)
    return transformers.BartForConditionalGeneration(cfg).train()


def llama():
    return tiny_llama(intermediate_size=256, num_hidden_layers=2, max_position_embeddings=128, use_cache=True)


def seq2seq_grads(model):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(1, 256, (2, 32), generator=g), torch.randint(1, 256, (2, 16), generator=g)
    loss = model(input_ids=x, labels=y).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("make", [t5, bart], ids=["t5", "bart"])
@pytest.mark.parametrize("policy", ["min", "fast", "checkpoint"])
def test_encoder_decoder_models_get_the_policy_on_both_stacks_and_train(make, policy):
    model = make()
    stacks = layer_stacks(model)
    assert len(stacks) == 2 and {len(s[1]) for s in stacks} == ({2} if make is t5 else {2, 3})
    loss0, g0 = seq2seq_grads(make())
    apply_activation_policy(model, policy)
    layers = [layer for _, ls in stacks for layer in ls]
    assert all(layer._effmem_policy is not None for layer in layers)   # the decoder too (or the encoder)
    loss1, g1 = seq2seq_grads(model)
    assert torch.equal(loss0, loss1)   # the forward is the model's own
    assert g1.keys() == g0.keys()      # every parameter reached, the encoder's through the decoder's inputs
    worst = max(rel(g1[n], g0[n]) for n in g0 if g0[n].norm() > 1e-6 * max(g.norm() for g in g0.values()))
    assert worst < (1e-6 if policy == "checkpoint" else 0.1), worst
    remove_activation_policy(model)
    assert all(getattr(layer, "_effmem_policy", None) is None for layer in layers)
    assert all(c.use_cache for c in (model.config, model.get_decoder().config))   # T5's decoder: its own config


class TorchSeq2Seq(nn.Module):
    """torch's nn.Transformer inside a model (post-norm layers, F.relu held as their activation)."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.core = nn.Transformer(64, 4, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=128,
                                   dropout=0.0, batch_first=True)
        self.head = nn.Linear(64, 8)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.head(self.core(src, tgt, tgt_mask=mask, tgt_is_causal=True))


@pytest.mark.parametrize("policy", ["min", "fast", "checkpoint"])
def test_torchs_transformer_gets_the_policy_on_both_stacks(policy):
    """nn.Transformer's decoder layers had no policy (the encoder's list alone, the longest one found first)."""
    g = torch.Generator().manual_seed(1)
    src, tgt, target = (torch.randn(2, n, d, generator=g) for n, d in ((40, 64), (24, 64), (24, 8)))

    def grads(model):
        torch.nn.functional.mse_loss(model(src, tgt), target).backward()
        return {n: p.grad for n, p in model.named_parameters()}
    model = TorchSeq2Seq()
    assert [(n, len(ls)) for n, ls in layer_stacks(model)] == [("core.encoder.layers", 2), ("core.decoder.layers", 3)]
    g0 = grads(TorchSeq2Seq())
    apply_activation_policy(model, policy)
    assert all(layer._effmem_policy is not None for layer in [*model.core.encoder.layers, *model.core.decoder.layers])
    g1 = grads(model)
    worst = max(rel(g1[n], g0[n]) for n in g0)
    assert worst < (1e-6 if policy == "checkpoint" else 0.03), worst   # 0.0098 for min on this CPU
    remove_activation_policy(model)
    assert all("forward" not in layer.__dict__ for layer in model.core.decoder.layers)
    with pytest.raises(ValueError, match="memory_budget: .*2 stacks of layers"):
        apply_activation_policy(model, memory_budget=0.5)


def test_a_small_nn_transformer_inside_a_model_leaves_its_main_stack_alone():
    """Found first, an nn.Transformer adapter took the policy from the model's own (longer) stack of layers."""
    class WithAdapter(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(6)])
            self.adapter = nn.Transformer(8, 2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16)
    assert [(n, len(ls)) for n, ls in layer_stacks(WithAdapter())] == [("layers", 6)]


def test_a_budget_refuses_two_stacks_of_layers():
    model = t5()
    with pytest.raises(ValueError, match="memory_budget: .*2 stacks of layers"):
        apply_activation_policy(model, memory_budget=0.5)
    assert all(getattr(b, "_effmem_policy", None) is None for b in model.encoder.block)


@pytest.mark.parametrize("kw", [dict(policy="min"), dict(memory_budget=0.05)], ids=["min", "budget"])
def test_min_trains_the_layers_when_their_input_needs_no_gradient(kw):
    """LoRA-style: embeddings frozen, a few weights inside the layers trained. The layers' input needs no
    gradient, so the checkpointed layer's output needs one through the weights alone."""
    def grads(model, trainable):
        for n, p in model.named_parameters():
            p.requires_grad_(any(t in n for t in trainable))
        x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
        model(input_ids=x, labels=x).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    for trainable in (("q_proj", "model.norm"), ("q_proj",)):
        plain = grads(llama(), trainable)
        model = apply_activation_policy(llama(), **kw)
        got = grads(model, trainable)
        if "memory_budget" in kw:
            assert budget_choice(model)["modes"] == ["min", "min"]
        assert all(got[n] is not None for n in plain), [n for n in plain if got[n] is None]
        assert max(rel(got[n], plain[n]) for n in plain) < 0.05


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(32, 32), nn.BatchNorm1d(32)

    def forward(self, x):
        return x + self.bn(self.lin(x).transpose(1, 2)).transpose(1, 2).relu()


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("kw", [dict(memory_budget=0.5), dict(policy="checkpoint"), dict(policy="selective"),
                                dict(policy="min"), dict(policy="fast")])
def test_recomputes_and_budget_probes_leave_the_layers_buffers_alone(kw):
    """The budget runs the first layer more than once to measure it, and the checkpointing policies run each
    layer again in backward; a BatchNorm's statistics count one step ("checkpoint" and "selective" counted
    two, and an eval forward then drifted from the plain model's)."""
    def stepped(model):
        model(torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(3))).sum().backward()
        return [dict(b.bn.named_buffers()) for b in model.blocks]

    want = stepped(_Net())
    got = stepped(apply_activation_policy(_Net(), **kw))
    for w, g in zip(want, got):
        assert g["num_batches_tracked"].item() == 1
        assert torch.equal(w["running_mean"], g["running_mean"]) and torch.equal(w["running_var"], g["running_var"])


class _InPlace(nn.Module):
    """A matrix product's output changed in place: by a module (nn.ReLU(inplace=True)) or by the code."""

    def __init__(self, by_module: bool):
        super().__init__()
        self.fc1, self.fc2, self.by_module = nn.Linear(16, 32), nn.Linear(32, 16), by_module
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.fc1(x)
        return x + self.fc2(self.act(h) if self.by_module else h.mul_(0.5))


def _in_place_net(by_module: bool):
    torch.manual_seed(0)
    net = nn.Module()
    net.layers = nn.ModuleList([_InPlace(by_module), _InPlace(by_module)])
    net.forward = lambda x: net.layers[1](net.layers[0](x))
    return net


def test_selective_runs_in_place_modules_out_of_place_and_names_in_place_code():
    """"selective" keeps matrix products' outputs, and nn.ReLU(inplace=True) changed one, which torch refused
    at backward ("Tensor cached during selective activation checkpoint has been mutated"): its modules now
    run out of place in the forward and the recompute (exact gradients, the module still in place outside);
    an in-place op in the layer's own code gets an error that names the policy and the fix."""
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    plain = _in_place_net(True)
    plain.forward(x).square().sum().backward()
    net = _in_place_net(True)
    apply_activation_policy(net, "selective")
    net.forward(x).square().sum().backward()
    for p, q in zip(plain.parameters(), net.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert all(layer.act.inplace for layer in net.layers)
    net = _in_place_net(False)
    apply_activation_policy(net, "selective")
    with pytest.raises(RuntimeError, match="_InPlace under effmem's 'selective' policy changes the output of a "
                                           "matrix product in place .* Use policy='checkpoint'"):
        net.forward(x).square().sum().backward()


@pytest.mark.parametrize("policy", ["min", "fast"])
def test_bad_bits_are_refused_before_any_change(policy):
    model = llama()
    with pytest.raises(ValueError, match="bits"):
        apply_activation_policy(model, policy, bits=3)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    assert model.config.use_cache


def test_a_budget_chooses_again_under_autocast():
    """Under autocast a layer saves other dtypes: a choice measured without it is not reused with it."""
    model = apply_activation_policy(llama(), memory_budget=0.5)
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    model(input_ids=x, labels=x).loss.backward()
    plain = budget_choice(model)["bytes"]["plain"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=x, labels=x).loss.backward()
    assert len(model._effmem_budget.choices) == 2 and budget_choice(model)["bytes"]["plain"] != plain


def test_min_accumulates_each_parameters_gradient_once_as_ddp_expects():
    """Under "min" the recomputed layer's parameter gradients go back through the outer backward, so each
    parameter's gradient is accumulated (and its hooks fire) once per backward. An inner backward that
    accumulated them itself fired them twice, and DDP refused the first backward ("Expected to mark a
    variable ready only once"); here DDP over one gloo rank in this process, and the hook count."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = apply_activation_policy(llama(), "min")
    calls = {}
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: calls.__setitem__(n, calls.get(n, 0) + 1))
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    model(input_ids=x, labels=x).loss.backward()
    assert set(calls.values()) == {1} and len(calls) == len(list(model.parameters()))

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plain = llama()
        plain(input_ids=x, labels=x).loss.backward()
        for unused in (False, True):
            ddp = DistributedDataParallel(apply_activation_policy(llama(), "min"), find_unused_parameters=unused)
            for _ in range(2):   # the second backward is where a reducer notices a twice-marked parameter
                ddp.zero_grad()
                ddp(input_ids=x, labels=x).loss.backward()
            for p, q in zip(ddp.module.parameters(), plain.parameters()):
                assert rel(p.grad, q.grad) < 0.05
    finally:
        dist.destroy_process_group()


class _SharedHead(nn.Module):
    """Layers that use a parameter of another module (held by reference, not registered in the layer)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(32, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(2)])
        for b in self.blocks:
            b.forward = functools.partial(lambda b, x: x + self.shared(b[1](b[0](x))), b)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _counting_hooks(params):
    calls = {}
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: calls.__setitem__(i, calls.get(i, 0) + 1))
    return calls


def test_min_gives_a_gradient_to_a_parameter_the_layer_reaches_by_reference():
    """A parameter of another module that the layer holds: its gradient through the autograd engine, so its
    hooks run once per use (DDP's reducer and a streaming optimizer's hand-over are such hooks)."""
    from effmem.activations.checkpoint import _layer_forward

    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))
    plain = _SharedHead()
    plain(x).square().sum().backward()
    model = _SharedHead()
    for b in model.blocks:
        b.forward = functools.partial(_layer_forward, b, b.forward, 8, 32)
    calls = _counting_hooks(list(model.parameters()))
    model(x).square().sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert p.grad is not None and rel(p.grad, q.grad) < 0.05
    shared = [i for i, p in enumerate(model.parameters()) if any(p is s for s in model.shared.parameters())]
    assert all(calls[i] == 2 for i in shared) and all(calls[i] == 1 for i in calls if i not in shared)


def test_compressed_checkpoint_accumulates_runs_parameters_through_the_engine():
    """compressed_checkpoint(run, x): run's parameters are not inputs of the checkpoint; their gradients go
    through the engine once (hooks run), and a frozen-since-forward parameter is no error."""
    from effmem.activations.checkpoint import compressed_checkpoint

    torch.manual_seed(0)
    lin = nn.Linear(32, 32)
    x = torch.randn(4, 32, requires_grad=True)
    calls = _counting_hooks(list(lin.parameters()))
    compressed_checkpoint(lambda t: lin(t).tanh(), x).square().sum().backward()
    assert calls == {0: 1, 1: 1} and x.grad is not None
    want = torch.autograd.grad(lin(x).tanh().square().sum(), lin.weight)[0]
    assert rel(lin.weight.grad, want) < 0.05

    model = apply_activation_policy(llama(), "min")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    loss = model(input_ids=ids, labels=ids).loss
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)   # frozen between forward and backward
    loss.backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is None
    assert model.model.layers[0].mlp.down_proj.weight.grad is not None


def test_a_vision_language_models_policy_goes_on_its_language_model():
    """Qwen2.5-VL's vision tower has 3 blocks here, its language model 2 layers: the longest list alone put
    the policy on the vision blocks and left every decoder layer plain, without a word."""
    cfg = transformers.Qwen2_5_VLConfig(
        # head size 128: the default multimodal rotary sections (16, 24, 24) cover half of it
        text_config=dict(hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=256),
        vision_config=dict(depth=3, hidden_size=32, out_hidden_size=256, intermediate_size=64, num_heads=2))
    torch.manual_seed(0)
    model = apply_activation_policy(transformers.Qwen2_5_VLForConditionalGeneration(cfg), "min")
    assert [(n, len(layers)) for n, layers in layer_stacks(model)] == [("model.language_model.layers", 2)]
    assert all(getattr(layer, "_effmem_policy", None) for layer in model.model.language_model.layers)
    assert not any(getattr(b, "_effmem_policy", None) for b in model.model.visual.blocks)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.model.language_model.layers[0].mlp.up_proj.weight.grad is not None
    remove_activation_policy(model)
    assert not any("forward" in layer.__dict__ for layer in model.model.language_model.layers)
    from effmem.plan.model import find_blocks
    assert find_blocks(model)[0] == "model.language_model.layers"   # effmem plan counts the same layers


def test_models_that_do_not_generate_keep_their_longest_stack():
    """get_decoder() is transformers' guess of a language model; a dual encoder (CLIP: a 4-layer vision
    tower, a 2-layer text tower) or a masked autoencoder (ViT-MAE: a 3-layer encoder, a 2-layer decoder)
    has none, and the guess took the smaller tower."""
    clip = transformers.CLIPModel(transformers.CLIPConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                           image_size=32, patch_size=16)))
    assert [(n, len(ls)) for n, ls in layer_stacks(clip)] == [("vision_model.encoder.layers", 4)]
    mae = transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, decoder_hidden_size=32,
        decoder_intermediate_size=64, decoder_num_hidden_layers=2, decoder_num_attention_heads=2, image_size=32,
        patch_size=16))
    assert [len(ls) for _, ls in layer_stacks(mae)] == [3]


@pytest.mark.parametrize("policy", ["min", "checkpoint", "fast"])
def test_a_policy_turns_the_training_cache_off_without_touching_the_config(policy, tmp_path):
    """A training forward makes no key/value cache (a recompute would add to it again), as under transformers'
    own checkpointing, but the config save_pretrained writes, and inference's cache, stay the model's own."""
    model = apply_activation_policy(llama(), policy)
    assert model.config.use_cache
    model.save_pretrained(tmp_path)
    assert transformers.AutoConfig.from_pretrained(tmp_path).use_cache
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    out = model(input_ids=x, labels=x)
    assert out.past_key_values is None
    out.loss.backward()
    model.eval()
    with torch.no_grad():
        assert model(input_ids=x).past_key_values.get_seq_length() == 16
    want = llama().eval().generate(x[:1, :4], max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(x[:1, :4], max_new_tokens=6, do_sample=False), want)
    remove_activation_policy(model.train())
    assert model(input_ids=x).past_key_values is not None   # the model's own training forward again


def test_a_policy_sees_packed_sequences_as_transformers_checkpointing_does():
    """Packed sequences (position_ids restarting, no attention mask) are masked apart only without a cache:
    the policy's loss equals the one under transformers' own gradient checkpointing."""
    x = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(6))
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]
    theirs = hf_checkpointing(llama())
    want = theirs(input_ids=x, position_ids=pos, labels=x).loss
    got = apply_activation_policy(llama(), "checkpoint")(input_ids=x, position_ids=pos, labels=x).loss
    assert torch.equal(got, want)
    # the cache is what changes it: the plain model's training forward makes one and attends across
    assert not torch.equal(llama()(input_ids=x, position_ids=pos, labels=x).loss, want)


@pytest.mark.parametrize("policy", ["fast", "min"])
def test_a_left_padded_row_keeps_its_exact_zeros_where_the_width_is_not_a_multiple_of_the_group(policy):
    """Gemma3 at width 64 (groups of 128): the saved-tensor store quantised flat groups of 128 over the memory,
    one group spanning two tokens, so a padded row of exact zeros (attention output of a masked query) came back
    as its neighbour's rounding, and the huge gradient Gemma3's post-attention norm gives that row reached
    o_proj's weight gradient, 16x plain's. Groups stay within rows now (as ops.quantize makes them)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0)
    model = transformers.Gemma3ForCausalLM(cfg).float().train()
    ids = torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0   # left padding, as Gemma's tokenizer pads
    labels = ids.masked_fill(mask == 0, -100)

    def grads():
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if "o_proj" in n}
    plain = grads()
    apply_activation_policy(model, policy)
    got = grads()
    remove_activation_policy(model)
    for name, g in plain.items():
        assert ((got[name] - g).norm() / g.norm()).item() < 0.05, name
