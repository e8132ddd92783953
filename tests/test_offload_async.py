"""OffloadAdam(async_step=True): step() returns at once and each module's forward installs its own new
weights, so the math stays FusedAdam's, bit for bit: on the host transfer backend, after add_param_group,
and (marked cuda) on the CUDA backend. Under FSDP2: tests/test_offload_distributed.py (fsdp2_async)."""
import copy

import pytest
import torch

from effmem import FusedAdam, OffloadAdam, demo_model
from offload_helpers import HP, assert_same_training, batches, tiny_gpt, train


@pytest.mark.parametrize("mode", ["plain", "clip", "accumulate"])
def test_async_step_is_exact_and_matches_fused_adam(mode):
    """async_step=True: step() returns at once and each module's forward installs its new weights, so the
    math is FusedAdam's (no stale gradient), clipping and accumulation included, bit for bit."""
    accum = 2 if mode == "accumulate" else 1
    clip = 0.5 if mode == "clip" else None
    data = batches(12 * accum)
    ref = tiny_gpt(torch.bfloat16)
    model = copy.deepcopy(ref)
    fused = FusedAdam(demo_model.decay_groups(ref, 0.1), **HP)
    with OffloadAdam(demo_model.decay_groups(model, 0.1), async_step=True, bucket_size=5000, **HP) as off:
        off.attach(model)
        la = train(ref, fused, data, accum=accum, clip=clip)
        lb = train(model, off, data, accum=accum, clip=clip)
        assert la[-1] < la[0]
        off.flush()
        assert_same_training(ref, model, fused, off, exact=clip is None)
        if clip is None:
            assert la == lb


def test_async_step_needs_attach_and_refuses_weights_read_outside_their_module():
    model = tiny_gpt(torch.bfloat16)
    with pytest.raises(ValueError, match="async_step: choose one"):
        OffloadAdam(model.parameters(), async_step=True, delay=True)
    x, y = batches(1)[0]
    with OffloadAdam(model.parameters(), async_step=True) as off:
        model(x, y)[1].backward()
        with pytest.raises(RuntimeError, match="call opt.attach\\(model\\) once before the first step"):
            off.step()
        off.zero_grad()
        off.attach(model)
        model(x, y)[1].backward()
        off.step()
        off.zero_grad()
        # a functional read of weights outside their module: their update was never installed (named by the
        # model's name for it: the engine's index alone left a user counting parameters)
        ln = model.ln_f
        h = torch.nn.functional.layer_norm(model.tok_emb(x), ln.normalized_shape, ln.weight, ln.bias)
        named = r"never installed.*\(parameter \d+ is the model's ln_f\.(bias|weight)\)"
        with pytest.raises(RuntimeError, match=named):
            (h.float() ** 2).mean().backward()


class _Branch(torch.nn.Module):
    """b always runs, c when asked: a branch (an expert) this batch may skip."""
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x, use_c: bool):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.c(h) if use_c else self.b(h)


@pytest.mark.parametrize("stream_grads", [True, False])
def test_a_gradient_autograd_did_not_make_is_taken_after_its_weights_are_installed(stream_grads):
    """A module that did not run installs nothing, yet may get a gradient: DDP(find_unused_parameters=True)
    averages the other ranks' into it (tests/test_offload_distributed.py's ddp_unused_async), or one is set by
    hand. Its weights were not read, so the gradient is exact: they are installed and it is taken (it was
    refused as "never installed", and under DDP the other rank failed). One that autograd made from weights
    not installed (a read outside the module's forward) is still refused."""
    torch.manual_seed(0)
    ref = _Branch()
    model = copy.deepcopy(ref)
    fused = FusedAdam(ref.parameters(), lr=1e-2)
    with OffloadAdam(model.parameters(), lr=1e-2, async_step=True, stream_grads=stream_grads) as off:
        off.attach(model)
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            x, y, other = (torch.randn(*shape, generator=g) for shape in ((4, 8), (4, 4), (4, 16)))
            for m, opt in ((ref, fused), (model, off)):
                torch.nn.functional.mse_loss(m(x, use_c=step % 3 == 0), y).backward()
                if step % 3 != 0:   # as DDP's average of another rank's gradient for the branch
                    m.c.weight.grad, m.c.bias.grad = other.clone(), other[:, 0].clone()
                opt.step()
                opt.zero_grad()
        with pytest.raises(RuntimeError, match="never installed"):   # in backward where the hooks stream
            torch.nn.functional.linear(torch.randn(4, 16), model.c.weight).square().mean().backward()
            off.step()
        off.zero_grad()
        off.flush()
        assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))


@pytest.mark.parametrize("case", ["second_clip", "unfrozen_later"])
def test_a_gradient_made_from_weights_not_installed_is_refused_however_it_is_taken(case):
    """The check above, along two more paths (a reviewer's repros): a clip after each micro-batch, whose second
    one sends the gradients again and had dropped the marks of autograd's; and a parameter frozen when the
    optimizer was built, which has no hook to mark them (torch takes none on it), unfrozen later."""
    torch.manual_seed(0)
    m = _Branch()
    if case == "unfrozen_later":
        m.c.requires_grad_(False)
    opt = OffloadAdam(m.parameters(), lr=1e-2, async_step=True, stream_grads=case != "second_clip")
    opt.attach(m)
    x = torch.randn(4, 8)
    m.c.requires_grad_(True)
    m(x, use_c=True).square().mean().backward()   # every parameter trains: c's new weights pending after step()
    opt.step()
    opt.zero_grad()
    h = torch.tanh(m.a(x))
    if case == "second_clip":
        m(x, use_c=False).square().mean().backward()
        opt.clip_grad_norm_(1.0)
    torch.nn.functional.linear(h, m.c.weight).square().mean().backward()   # c read outside its forward
    with pytest.raises(RuntimeError, match="never installed"):
        if case == "second_clip":
            opt.clip_grad_norm_(1.0)
        opt.step()
    opt.close()


def test_add_param_group_after_attach_installs_the_new_parameters_too():
    """Parameters added after attach() get installers of their own (attach runs again): training goes
    on as FusedAdam's with the same groups, instead of refusing a weight that was never installed."""
    data = batches(8)
    ref = tiny_gpt(torch.bfloat16)
    model = copy.deepcopy(ref)
    split = lambda m: ([p for n, p in m.named_parameters() if n.startswith("blocks.")],  # noqa: E731
                       [p for n, p in m.named_parameters() if not n.startswith("blocks.")])
    fused = FusedAdam(split(ref)[0], **HP)
    with OffloadAdam(split(model)[0], async_step=True, **HP) as off:
        off.attach(model)
        assert train(ref, fused, data[:4]) == train(model, off, data[:4])
        hooks = len(off._forward_hooks)
        fused.add_param_group({"params": split(ref)[1]})
        off.add_param_group({"params": split(model)[1]})
        assert len(off._forward_hooks) > hooks
        assert train(ref, fused, data[4:]) == train(model, off, data[4:])
        off.flush()
        assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))


@pytest.mark.cuda
@pytest.mark.parametrize("accum", [1, 2])
def test_cuda_async_step_matches_fused_adam(accum):
    """The CUDA transfer backend: uploads ordered after the last step's readers only (not after the
    forward's own kernels), the compute stream after each module's upload: FusedAdam's bits."""
    data = [(x.cuda(), y.cuda()) for x, y in batches(8 * accum)]
    ref = tiny_gpt(torch.bfloat16).cuda()
    model = copy.deepcopy(ref)
    fused = FusedAdam(demo_model.decay_groups(ref, 0.1), **HP)
    with OffloadAdam(demo_model.decay_groups(model, 0.1), async_step=True, bucket_size=5000, **HP) as off:
        assert off._engine.backend == "cuda"
        off.attach(model)
        assert train(ref, fused, data, accum=accum) == train(model, off, data, accum=accum)
        off.flush()
        assert_same_training(ref, model, fused, off)


@pytest.mark.cuda
def test_cuda_graph_capture_of_an_attached_forward_is_refused_clearly():
    model = tiny_gpt(torch.bfloat16).cuda()
    x, y = (t.cuda() for t in batches(1)[0])
    with OffloadAdam(model.parameters(), async_step=True) as off:
        off.attach(model)
        model(x, y)[1].backward()
        off.step()
        off.zero_grad()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="inside CUDA graph capture"):
            with torch.cuda.graph(graph):
                model(x, y)


def test_fsdp_units_all_gather_streams_wait_for_the_installed_weights():
    """Under FSDP2 on CUDA the shards are copied for the all-gather on FSDP's own streams, ordered after the
    current stream only in the root's pre-forward; the install hook makes both wait for the current stream
    (on which the uploads were ordered). Multi-GPU only, so checked here with stand-in streams, and against
    the names the installed torch uses."""
    import inspect
    import types
    from effmem.optim._offload_forward import order_all_gathers

    class Stream:
        def __init__(self):
            self.waited = []

        def wait_stream(self, other):
            self.waited.append(other)

    ctx = types.SimpleNamespace(all_gather_copy_in_stream=Stream(), all_gather_stream=Stream(),
                                reduce_scatter_stream=Stream())
    unit = types.SimpleNamespace(_get_fsdp_state=lambda: types.SimpleNamespace(_comm_ctx=ctx))
    order_all_gathers(unit, "current")
    assert ctx.all_gather_copy_in_stream.waited == ["current"] == ctx.all_gather_stream.waited
    assert ctx.reduce_scatter_stream.waited == []
    # before the root's first forward FSDP has made no streams: nothing to order, no error
    order_all_gathers(types.SimpleNamespace(_get_fsdp_state=lambda: types.SimpleNamespace(
        _comm_ctx=types.SimpleNamespace())), "current")
    fsdp = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_param_group")
    source = inspect.getsource(fsdp.FSDPCommContext)
    assert "self.all_gather_copy_in_stream" in source and "self.all_gather_stream" in source
    state = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_state")
    assert "self._comm_ctx" in inspect.getsource(state.FSDPState)


@pytest.mark.parametrize("mode", [dict(async_step=True), dict(delay=True)])
def test_a_dropped_optimizer_leaves_the_last_step_in_the_parameters(mode):
    """async_step and delay hold the last update on the host until a forward or flush installs it: an
    optimizer dropped without close() installs it too (as a torch optimizer leaves its last step)."""
    import gc

    def run(drop):
        torch.manual_seed(0)
        m = torch.nn.Linear(8, 8)
        opt = OffloadAdam(m.parameters(), lr=1e-2, **mode)
        if mode.get("async_step"):
            opt.attach(m)
        for _ in range(2):
            m(torch.ones(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        if drop:
            del opt
            gc.collect()
        else:
            opt.close()
        return m.weight.detach().clone()
    closed = run(drop=False)
    assert torch.equal(run(drop=True), closed)
    torch.manual_seed(0)
    assert not torch.equal(torch.nn.Linear(8, 8).weight.detach(), closed)


def test_attach_after_a_compiled_call_is_not_skipped_by_the_compiled_code():
    """Code torch.compile made before attach() ran without the new hooks (dynamo does not guard on module
    hooks), and the second step's backward raised that a parameter's weights were never installed. attach()
    now drops that code with a warning; the compiled model then trains as FusedAdam does. A model with the
    hooks attached pickles (the hooks held the optimizer by a weak reference, which cannot be pickled)."""
    import io
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 8)
    compiled(x).sum().backward()   # compiled before the optimizer exists (a warm-up, an evaluation)
    model.zero_grad(set_to_none=True)
    fused = FusedAdam(ref.parameters(), lr=1e-2)
    with OffloadAdam(model.parameters(), lr=1e-2, async_step=True) as off:
        with pytest.warns(UserWarning, match=r"compiled by torch.compile before attach\(\)"):
            off.attach(model)
        for k in range(3):
            xk = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
            for m, opt in ((ref, fused), (compiled, off)):
                m(xk).sum().backward()
                opt.step()
                opt.zero_grad()
        off.flush()
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a, b)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        copy_ = torch.load(buf, weights_only=False)
        assert torch.equal(copy_(x), model(x))   # its hooks have no optimizer: inert
    torch._dynamo.reset()


def test_a_saved_functional_read_before_the_install_is_refused_at_backward():
    """A weight read before its module's forward (here its own Linear's weight, multiplied in by hand) got the
    last step's weights. The install at the module's forward bumps the parameter's version, so autograd's
    in-place check refuses the backward that would use the stale read (silently wrong weights before)."""
    class ReadEarly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x):
            return self.head(torch.tanh(x @ self.head.weight))

    torch.manual_seed(0)
    model = ReadEarly()
    with OffloadAdam(model.parameters(), async_step=True, **HP) as off:
        off.attach(model)
        model(torch.randn(4, 8, requires_grad=True)).square().mean().backward()   # nothing to install yet
        off.step()
        loss = model(torch.randn(4, 8, requires_grad=True)).square().mean()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.filterwarnings("ignore:.*weight_norm is deprecated")
@pytest.mark.parametrize("wrap", ["weight_norm", "spectral_norm", "transformer"])
def test_async_step_installs_before_the_modules_own_pre_hooks_and_for_multihead_attention(wrap):
    """torch.nn.utils.weight_norm and spectral_norm compute a Linear's weight in forward pre-hooks of their
    own, registered before attach()'s: those read last step's weights unless the install runs first. torch's
    MultiheadAttention reads out_proj's weights without calling its forward (refused as never installed).
    Each trains as FusedAdam does, bit for bit."""
    def make():   # twice from one seed: a weight_norm'd module refuses deepcopy
        torch.manual_seed(0)
        if wrap == "transformer":
            return torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
        getattr(torch.nn.utils, wrap)(m[0])
        return m
    ref, model = make(), make()
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(2, 5, 16, generator=gen) for _ in range(4)]
    fused = FusedAdam(ref.parameters(), **HP)
    with OffloadAdam(model.parameters(), async_step=True, **HP) as off:
        off.attach(model)
        for m, opt in ((ref, fused), (model, off)):
            for x in data:
                m(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        off.flush()
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["async_step", "delay"])
def test_opt_state_read_or_changed_right_after_step_waits_for_the_update(mode):
    """step() returns before the host update ends: opt.state's tensors (views of the engine's memory) read right
    after it held the state of before the update, and an in-place change landed inside it (a reviewer's run:
    step 1 where FusedAdam had 2, the zeroed moment overwritten). opt.state waits for the update now, installing
    no weights: async_step trains as FusedAdam with the same change, bit for bit; delay reads what it wrote."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(512, 512).bfloat16()
    model = copy.deepcopy(ref)
    fused = FusedAdam(ref.parameters(), lr=1e-2)
    with OffloadAdam(model.parameters(), lr=1e-2, _host_delay_us=2000.0, **{mode: True}) as off:
        held = off.state   # the same object all along (Lightning keeps the optimizer's __dict__)
        if mode == "async_step":
            off.attach(model)
        x = torch.randn(8, 512).bfloat16()
        for k in range(3):
            for m, opt in ((ref, fused), (model, off)):
                m(x).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
                assert float(opt.state[m.weight]["step"]) == k + 1
                if k == 1:
                    opt.state[m.weight]["exp_avg"].zero_()
                    assert not opt.state[m.weight]["exp_avg"].any()   # not written over by the update after
        assert off.state is held
        if mode == "async_step":
            off.flush()
            assert torch.equal(ref.weight, model.weight)
            assert torch.equal(fused.state[ref.weight]["exp_avg"], off.state[model.weight]["exp_avg"])


@pytest.mark.parametrize("family", ["mamba", "lfm2"])
def test_children_a_transformers_forward_reads_without_calling_are_installed(family):
    """transformers' Mamba reads its mixer's conv1d and dt_proj weights without calling them (causal_conv1d_fn,
    a matmul), LFM2 its short convolution's: their own pre-hooks never run, and the second backward was refused
    as "never installed" (15 of transformers' state-space and hybrid models, a reviewer's sweep). The mixer's
    hook installs them, as transformers names them for accelerate (@force_accelerate_hooks). Bit for bit with
    FusedAdam."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(pytest.importorskip("transformers.integrations.accelerate"), "force_accelerate_hooks"):
        pytest.skip(f"transformers {transformers.__version__} names no children for accelerate's hooks")
    if family == "mamba":
        config = transformers.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=64, state_size=4)
    else:
        config = transformers.Lfm2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                         layer_types=["conv", "full_attention"])
    config.use_cache = False
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).train()
    model = copy.deepcopy(ref)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    fused = FusedAdam(ref.parameters(), **HP)
    with OffloadAdam(model.parameters(), async_step=True, **HP) as off:
        off.attach(model)
        for m, opt in ((ref, fused), (model, off)):
            for _ in range(3):
                m(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
        off.flush()
        for (name, a), b in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(a, b), name
