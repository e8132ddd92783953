"""OffloadAdam(device_state=BYTES): the first parameters' state stays on their device, stepped there by
FusedAdam's kernel, the engine takes the rest. One FusedAdam over every parameter is the reference, bit for bit:
every mode, clipping by global norm, accumulation, 8-bit moments, checkpoints both ways."""
import copy

import pytest
import torch

from effmem import FusedAdam, OffloadAdam, demo_model
from effmem.optim._offload_resident import resident_bytes
from effmem.optim.clip import clip_coefficient
from offload_helpers import HP, assert_same_training, backward_both, batches, tiny_gpt

BUDGET = 250_000   # the tiny GPT's embedding and first few tensors (of 34,176 parameters)


def _train(model, opt, ref, fused, data, accum, clip):
    """The same micro-batches through both; with `clip`, both apply OffloadAdam's clip factor (the two norms
    are summed in different orders and may differ in the last bit). Returns (fused, offload) norms."""
    norms = []
    for k in range(0, len(data), accum):
        backward_both(ref, model, opt, data[k:k + accum])
        if clip is not None:
            total = opt.clip_grad_norm_(clip)
            norms.append((float(fused.clip_grad_norm_(clip)), float(total)))
            device = next(ref.parameters()).device
            fused._pending_grad_scale = {device: clip_coefficient(total, clip).to(device)}
        for o in (fused, opt):
            o.step()
            o.zero_grad()
    return norms


@pytest.mark.parametrize("mode", ["plain", "async_step", "overlap"])
@pytest.mark.parametrize("bits", [32, 8])
def test_device_state_matches_one_fused_adam_over_every_parameter(mode, bits):
    clip = None if mode == "overlap" else 0.05   # overlap cannot clip (its buckets update during backward)
    data = batches(8)
    ref = tiny_gpt(torch.bfloat16)
    model = copy.deepcopy(ref)
    fused = FusedAdam(demo_model.decay_groups(ref, 0.1), state_bits=bits, **HP)
    kw = {"async_step": True} if mode == "async_step" else {"overlap": True} if mode == "overlap" else {}
    with OffloadAdam(demo_model.decay_groups(model, 0.1), device_state=BUDGET, bucket_size=5000, state_bits=bits,
                     **kw, **HP) as off:
        if mode == "async_step":
            off.attach(model)
        kept = off.counters()["device_state_params"]
        assert 0 < kept < sum(p.numel() for p in model.parameters())
        norms = _train(model, off, ref, fused, data, accum=2, clip=clip)
        for a, b in norms:   # the device-resident gradients are in the norm: the factor really clipped
            assert a == pytest.approx(b, rel=1e-5) and b > clip
        off.flush()
        assert_same_training(ref, model, fused, off)


def test_a_transformers_llama_trains_as_with_fused_adam():
    """A real client: transformers' LlamaForCausalLM (random init), async_step with its embedding and first
    layers' state kept, clipped, two micro-batches: FusedAdam's losses and weights, bit for bit."""
    pytest.importorskip("transformers")
    from activation_helpers import tiny_llama

    ref = tiny_llama(torch.bfloat16, num_hidden_layers=4)
    model = copy.deepcopy(ref)

    class Loss(torch.nn.Module):   # _train's model(x, y) -> (logits, loss)
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, x, y):
            out = self.lm(input_ids=x, labels=y)
            return out.logits, out.loss

    budget = sum(resident_bytes(p, 32) for p in list(model.parameters())[:12])   # embedding + layer 0 + part of 1
    fused = FusedAdam(ref.parameters(), **HP)
    with OffloadAdam(model.parameters(), async_step=True, device_state=budget, bucket_size=20_000, **HP) as off:
        off.attach(model)
        assert off._first == 12
        norms = _train(Loss(model), off, Loss(ref), fused, batches(8), accum=2, clip=0.5)
        off.flush()
        assert all(a == pytest.approx(b, rel=1e-5) and b > 0.5 for a, b in norms)   # clipped every step
        assert_same_training(ref, model, fused, off)


def test_the_longest_prefix_that_fits_stays_and_its_gradients_stay_in_p_grad():
    model = tiny_gpt(torch.bfloat16)
    params = list(model.parameters())
    need = [resident_bytes(p, 32) for p in params]
    assert need[0] == params[0].numel() * (4 + 8 + 2)   # master, two float32 moments, the bf16 gradient
    budget = sum(need[:3]) + need[3] - 1   # three fit, the fourth by one byte not
    x, y = batches(1)[0]
    with OffloadAdam(params, device_state=budget, **HP) as off:
        assert off.counters()["device_state_params"] == sum(p.numel() for p in params[:3])
        assert off.counters()["device_state_bytes"] == sum(need[:3])
        model(x, y)[1].backward()
        assert all(p.grad is not None for p in params[:3])        # stepped on the device, from p.grad
        assert all(p.grad is None for p in params[3:])            # handed to the engine during backward
        off.step()
        assert len(off.state) == len(params)
        assert off.state[params[0]]["exp_avg"].device == params[0].device
        off.zero_grad()
        assert params[0].grad is None
    assert not off.state and not off._resident_opt.state   # close() let go of the kept state too
    with OffloadAdam(params, device_state=0) as off:   # the default: everything offloaded
        assert off.counters()["device_state_params"] == 0


@pytest.mark.parametrize("bits", [32, 8])
def test_checkpoints_move_between_device_state_fused_adam_and_plain_offload_exactly(bits):
    data = batches(8)
    ref = tiny_gpt(torch.bfloat16)
    a, b, c = (copy.deepcopy(ref) for _ in range(3))
    fused = FusedAdam(demo_model.decay_groups(ref, 0.1), state_bits=bits, **HP)
    off = OffloadAdam(demo_model.decay_groups(a, 0.1), device_state=BUDGET, state_bits=bits, **HP)
    _train(a, off, ref, fused, data[:4], accum=1, clip=0.05)
    # into a FusedAdam and a plain OffloadAdam, and back into a fresh device_state one: all go on as one
    fused_b = FusedAdam(demo_model.decay_groups(b, 0.1), state_bits=bits, **HP)
    plain = OffloadAdam(demo_model.decay_groups(c, 0.1), state_bits=bits, **HP)
    b.load_state_dict(a.state_dict())
    c.load_state_dict(a.state_dict())
    fused_b.load_state_dict(copy.deepcopy(off.state_dict()))
    plain.load_state_dict(copy.deepcopy(off.state_dict()))
    off.close()
    back = OffloadAdam(demo_model.decay_groups(a, 0.1), device_state=BUDGET, state_bits=bits, **HP)
    back.load_state_dict(copy.deepcopy(fused_b.state_dict()))
    for model, opt in ((a, back), (b, fused_b), (c, plain)):
        for x, y in data[4:]:
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
    for model, opt in ((a, back), (c, plain)):
        opt.flush()
        assert_same_training(b, model, fused_b, opt)
    back.close()
    plain.close()


def test_device_state_refusals_name_the_argument():
    model = tiny_gpt(torch.bfloat16)
    with pytest.raises(ValueError, match="device_state"):
        OffloadAdam(model.parameters(), device_state=-1)
    with pytest.raises(ValueError, match="device_state: not with delay=True"):
        OffloadAdam(model.parameters(), device_state=BUDGET, delay=True)
    with pytest.raises(ValueError, match="leaving nothing to offload; use effmem.FusedAdam"):
        OffloadAdam(model.parameters(), device_state=1 << 40)
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    with OffloadAdam(blocks, device_state=BUDGET) as off:
        with pytest.raises(RuntimeError, match="add_param_group: with device_state"):
            off.add_param_group({"params": rest})
        assert len(off.param_groups) == 1


def test_gradients_taken_at_step_and_under_ddp():
    """stream_grads=False (DDP without attach_ddp): every gradient stays in p.grad until step(), which hands the
    engine its own and steps the kept ones on the device: FusedAdam's bits. attach_ddp, which hands DDP's
    buckets to the engine as they are reduced, is refused with device_state."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    data = batches(4)
    ref = tiny_gpt(torch.bfloat16)
    model = copy.deepcopy(ref)
    fused = FusedAdam(ref.parameters(), **HP)
    with OffloadAdam(model.parameters(), device_state=BUDGET, stream_grads=False, **HP) as off:
        _train(model, off, ref, fused, data, accum=1, clip=0.05)
        off.flush()
        assert_same_training(ref, model, fused, off)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        with OffloadAdam(model.parameters(), device_state=BUDGET, stream_grads=False) as off:
            with pytest.raises(RuntimeError, match="attach_ddp: not with device_state"):
                off.attach_ddp(ddp)
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_cuda_device_state_with_async_step_matches_fused_adam():
    """On the GPU: the resident prefix stepped by the CUDA kernel on the compute stream, the rest uploaded by
    the engine and installed module by module: one FusedAdam's bits."""
    data = [(x.cuda(), y.cuda()) for x, y in batches(8)]
    ref = tiny_gpt(torch.bfloat16).cuda()
    model = copy.deepcopy(ref)
    fused = FusedAdam(demo_model.decay_groups(ref, 0.1), **HP)
    with OffloadAdam(demo_model.decay_groups(model, 0.1), async_step=True, device_state=BUDGET, bucket_size=5000,
                     **HP) as off:
        off.attach(model)
        assert off.counters()["device_state_params"] > 0
        norms = _train(model, off, ref, fused, data, accum=2, clip=0.05)
        off.flush()
        assert all(a == pytest.approx(b, rel=1e-5) for a, b in norms)
        assert_same_training(ref, model, fused, off)


def test_zeroed_or_stale_gradients_step_no_parameter_whatever_the_budget():
    """A parameter is stepped when a backward gave it a gradient since the last step, on the device or off it:
    with zero_grad(set_to_none=False) and a second step() without a backward, the kept parameters were stepped
    on zeroed or stale gradients (their moments decayed, their step counts ran ahead) and the offloaded ones
    not, so the result depended on the device_state budget."""
    def run(device_state):
        torch.manual_seed(0)
        a, b = torch.nn.Linear(8, 8).bfloat16(), torch.nn.Linear(8, 8).bfloat16()
        x = torch.randn(4, 8).bfloat16()
        with OffloadAdam([*a.parameters(), *b.parameters()], device_state=device_state, **HP) as opt:
            assert opt.counters()["device_state_params"] == (72 if device_state else 0)   # a's weight and bias
            for s in range(4):
                (b(x) if s % 2 else a(x) + b(x)).float().sum().backward()   # a gets no gradient on odd steps
                opt.step()
                opt.step()   # no backward since the last: nothing to step
                opt.zero_grad(set_to_none=False)
            opt.flush()
            return [p.detach().clone() for p in (*a.parameters(), *b.parameters())], \
                [float(opt.state[p]["step"]) for p in a.parameters()]
    (w0, steps0), (w1, steps1) = run(0), run(72 * 14 + 100)
    assert steps0 == steps1 == [2.0, 2.0]
    assert all(torch.equal(u, v) for u, v in zip(w0, w1))
