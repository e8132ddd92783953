"""What users met with the optimizers: checkpoints exchanged between 8-bit and float32 moments over
parameters laid out differently in memory, an OffloadAdam checkpoint loaded before the model's weights, a
second optimizer over parameters an open OffloadAdam steps, a clip factor left by a skipped step, and a
float state_bits."""
import copy

import pytest
import torch

from effmem import FusedAdam, OffloadAdam
from offload_helpers import finish_step

CL, C = torch.channels_last, torch.contiguous_format


def _close(opt):
    """OffloadAdam's engine threads stop at close(); FusedAdam has none."""
    if isinstance(opt, OffloadAdam):
        opt.close()
SHAPE = (8, 16, 3, 3)


def _param(layout):
    torch.manual_seed(0)
    return torch.nn.Parameter(torch.randn(SHAPE).contiguous(memory_format=layout))


def _grad():
    g = torch.Generator().manual_seed(1)
    return torch.randn(SHAPE, generator=g) * torch.linspace(0.01, 10, 8).view(-1, 1, 1, 1)


def _moments(cls, layout, bits, state=None):
    """exp_avg after one step from zero ((1 - beta1) * grad), or after loading `state`, as float32."""
    p = _param(layout)
    opt = cls([p], lr=1e-2, state_bits=bits)
    if state is None:
        p.grad = _grad()
        opt.step()
    else:
        opt.load_state_dict(state)
    sd = opt.state_dict()
    if bits == 8:   # decoded by a float32 optimizer over a parameter of the same layout
        q = _param(layout)
        reader = FusedAdam([q], lr=1e-2)
        reader.load_state_dict(sd)
        sd = reader.state_dict()
    _close(opt)
    return sd, sd["state"][0]["exp_avg"]


@pytest.mark.parametrize("cls", [FusedAdam, OffloadAdam])
@pytest.mark.parametrize("saved,loaded", [((C, 32), (CL, 8)), ((CL, 8), (C, 32)), ((CL, 8), (C, 8)),
                                          ((C, 8), (CL, 8)), ((CL, 32), (C, 32))])
def test_moments_survive_a_checkpoint_between_memory_layouts(cls, saved, loaded):
    """The 8-bit blocks run along memory: a channels_last parameter's codes are in another order than a
    contiguous one's. Loading across layouts (and formats) keeps every moment within 8-bit rounding."""
    true = 0.1 * _grad()
    sd, _ = _moments(cls, *saved)
    _, got = _moments(cls, *loaded, state=sd)
    assert ((got - true).abs().max() / true.abs().max()).item() < 0.03


@pytest.mark.parametrize("cls", [FusedAdam, OffloadAdam])
def test_an_8bit_checkpoint_of_the_same_layout_loads_bit_for_bit(cls):
    p = _param(CL)
    first = cls([p], lr=1e-2, state_bits=8)
    p.grad = _grad()
    first.step()
    sd = first.state_dict()
    p = _param(CL)
    opt = cls([p], lr=1e-2, state_bits=8)
    opt.load_state_dict(sd)
    again = opt.state_dict()["state"][0]
    for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        assert torch.equal(again[key], sd["state"][0][key])
    _close(opt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offload_resumes_from_weights_loaded_after_its_checkpoint(dtype):
    """opt.load_state_dict(...) and then model.load_state_dict(...), both before the first step: a float32
    parameter is its own master, so the master comes from the model's weights as they are at the step."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(8, 4).to(dtype)

    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2)).to(dtype)

    def train(m, opt, steps):
        for _ in range(steps):
            m(x).float().square().mean().backward()
            finish_step(opt)

    m = model()
    opt = OffloadAdam(m.parameters(), lr=1e-2)
    train(m, opt, 2)
    ckpt = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict()})
    train(m, opt, 2)
    want = [p.detach().clone() for p in m.parameters()]
    opt.close()

    m2 = model()   # fresh weights, different from the checkpoint's
    opt2 = OffloadAdam(m2.parameters(), lr=1e-2)
    opt2.load_state_dict(ckpt["opt"])   # the optimizer first ...
    m2.load_state_dict(ckpt["model"])    # ... then the weights
    train(m2, opt2, 2)
    assert all(torch.equal(a, b) for a, b in zip(want, m2.parameters()))
    opt2.close()


@pytest.mark.parametrize("second", [OffloadAdam, FusedAdam])
def test_a_second_optimizer_over_an_open_offload_adams_parameters_is_refused(second):
    m = torch.nn.Linear(4, 2)
    first = OffloadAdam(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="params: parameter 0 .* another OffloadAdam, still open"):
        second(m.parameters(), lr=0.1)
    other = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="another OffloadAdam"):   # nor a group added later
        FusedAdam(other.parameters(), lr=0.1).add_param_group({"params": [m.weight]})
    first.close()
    again = second(m.parameters(), lr=0.1)   # closed: the parameters are free
    m(torch.randn(3, 4)).sum().backward()
    before = m.weight.detach().clone()
    again.step()
    assert not torch.equal(before, m.weight)
    _close(again)


def test_a_dropped_offload_adam_frees_its_parameters():
    m = torch.nn.Linear(4, 2)
    opt = OffloadAdam(m.parameters(), lr=0.1)
    del opt   # __del__ closes it
    OffloadAdam(m.parameters(), lr=0.1).close()


@pytest.mark.parametrize("cls", [FusedAdam, OffloadAdam])
def test_a_clip_factor_of_a_skipped_step_does_not_reach_the_next(cls):
    """clip_grad_norm_, then the step skipped on a spiking norm (zero_grad and go on): the next step is as if
    the spike never happened."""
    def update(skip_first):
        p = torch.nn.Parameter(torch.zeros(4))
        opt = cls([p], lr=1.0, betas=(0.0, 0.0), eps=1.0, bias_correction=False)   # update g / (|g| + 1)
        if skip_first:
            p.grad = torch.full((4,), 1e6)
            assert opt.clip_grad_norm_(1.0) > 1e3
            opt.zero_grad()
        p.grad = torch.tensor([1.0, 2.0, 3.0, 4.0])
        opt.step()
        _close(opt)
        return p.detach()

    assert torch.equal(update(False), update(True))


@pytest.mark.parametrize("cls", [FusedAdam, OffloadAdam])
@pytest.mark.parametrize("bits", [8.0, "8", 16])
def test_state_bits_must_be_the_int_8_or_32(cls, bits):
    with pytest.raises(ValueError, match="state_bits: expected 32 .* or 8"):
        cls([torch.nn.Parameter(torch.zeros(3))], state_bits=bits)


@pytest.mark.parametrize("cls", [FusedAdam, OffloadAdam, None])
def test_max_norm_may_be_a_tensor_as_in_torch(cls):
    """torch.nn.utils.clip_grad_norm_ takes a tensor max_norm; so do effmem's clips, with the same factor."""
    def clipped(max_norm):
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
        if cls is None:
            from effmem import clip_grad_norm_
            clip_grad_norm_([p], max_norm)
            return p.grad.clone()
        opt = cls([p], lr=1.0, betas=(0.0, 0.0), eps=1.0, bias_correction=False)
        opt.clip_grad_norm_(max_norm)
        opt.step()
        _close(opt)
        return p.detach().clone()

    assert torch.equal(clipped(1.0), clipped(torch.tensor(1.0))) and torch.equal(clipped(1.0),
                                                                              clipped(torch.tensor(1.0).double()))
    with pytest.raises(ValueError, match="max_norm: expected a value >= 0"):
        clipped(torch.tensor(-1.0))


def test_clip_names_norm_type_when_it_is_not_a_number():
    from effmem import clip_grad_norm_
    with pytest.raises(ValueError, match="norm_type: only the L2 norm"):
        clip_grad_norm_([torch.nn.Parameter(torch.zeros(2))], 1.0, norm_type="fro")
