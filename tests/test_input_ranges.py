"""Inputs an audit found answered wrongly rather than refused: numbers float32 cannot hold (the kernels compute
in float32), in-place edits of OffloadAdam's state and param groups, fake kernels given tensors on two devices.
Each is refused with the argument's name, or (NumPy scalars) taken as the Python number it equals."""
import numpy as np
import pytest
import torch

from effmem import FusedAdam, OffloadAdam, linear_cross_entropy

OPS = torch.ops.effmem


@pytest.mark.parametrize("opt_class", [FusedAdam, OffloadAdam])
@pytest.mark.parametrize("option,value", [("lr", 1e39), ("lr", 3.5e38), ("eps", 1e-50), ("weight_decay", 1e39)])
def test_hyper_parameters_float32_cannot_hold_are_refused(opt_class, option, value):
    """lr=1e39 passed the finite check as a Python float and made every weight NaN in the float32 kernel; an
    eps of 1e-50 became 0 there (NaN where a gradient is 0)."""
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=f"{option}: expected a finite number"):
        opt = opt_class([p], **{option: value})
        opt.close() if hasattr(opt, "close") else None


def test_an_lr_past_float32_set_later_is_refused_at_step():
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdam([p])
    opt.param_groups[0]["lr"] = 1e39
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match=r"\['lr'\]: expected a finite number >= 0, got 1e\+39 \(past float32's range"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3))


def _stepped_offload():
    model = torch.nn.Linear(4, 3)
    opt = OffloadAdam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    return model, opt


@pytest.mark.parametrize("value", [-5.0, float("nan"), float("inf"), 0.5])
def test_offload_step_counts_written_in_place_must_be_whole_numbers(value):
    """opt.state[p]['step'] is a view of the engine's step count: -5, NaN or inf made every weight NaN, 0.5
    stepped as step 1.5. FusedAdam refuses the same."""
    model, opt = _stepped_offload()
    opt.state[model.weight]["step"].fill_(value)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"opt.state\[p\]\['step'\] of parameter 0 holds .*; expected a whole number"):
        opt.step()
    assert torch.equal(model.weight.detach(), before)
    opt.state[model.weight]["step"].fill_(1.0)
    opt.step()   # a whole number again: steps
    assert not torch.equal(model.weight.detach(), before)
    opt.close()


@pytest.mark.parametrize("change", ["pop", "append"])
def test_offload_param_group_lists_changed_by_hand_are_refused(change):
    """A parameter popped from a group's list went on training, one appended was never trained (FusedAdam
    follows the list)."""
    model, opt = _stepped_offload()
    params = opt.param_groups[0]["params"]
    params.pop() if change == "pop" else params.append(torch.nn.Parameter(torch.ones(2)))
    with pytest.raises(RuntimeError, match="param_groups' 'params' lists hold .* add_param_group"):
        opt.step()
    opt.close()


def test_linear_cross_entropy_takes_numpy_scalars_as_the_numbers_they_are():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(20, 8, generator=g), torch.randn(50, 8, generator=g)
    target = torch.randint(0, 50, (20,), generator=g)
    target[3] = 7
    ref = linear_cross_entropy(hidden, weight, target, label_smoothing=0.25, ignore_index=7, vocab_chunk=16,
                               logit_softcap=5.0)
    got = linear_cross_entropy(hidden, weight, target, label_smoothing=np.float32(0.25), ignore_index=np.int64(7),
                               vocab_chunk=np.int64(16), logit_softcap=np.float32(5.0))
    assert torch.equal(ref, got)


def test_adam8_fake_kernels_refuse_tensors_on_two_devices():
    """With one meta argument the dispatcher runs the fake kernel, which returned uninitialised CPU memory."""
    with pytest.raises(ValueError, match="effmem::adam8_decode: all tensors must be on one device"):
        OPS.adam8_decode(torch.zeros(300, dtype=torch.uint8, device="meta"), torch.ones(2), False)
    with pytest.raises(ValueError, match="effmem::adam8_encode: all tensors must be on one device"):
        OPS.adam8_encode(torch.randn(300), torch.rand(300, device="meta"), 1.0, 0)


def test_a_tensor_described_in_an_error_says_it_is_not_contiguous():
    m = torch.randn(600)[::2]
    with pytest.raises(ValueError, match=r"m must be a contiguous .* got .*strides \[2\] \(not contiguous\)"):
        OPS.adam8_encode(m, torch.rand(300), 1.0, 0)


def test_offload_num_threads_and_compress_names_from_are_named():
    p = torch.nn.Parameter(torch.ones(3))
    for n in (100000, 2 ** 40):   # "Resource temporarily unavailable"; pybind's "incompatible constructor arguments"
        with pytest.raises(ValueError, match=r"num_threads: expected an int in \[1, 1024\]"):
            OffloadAdam([p], num_threads=n)
    from effmem import compress_activations
    with pytest.raises(TypeError, match="names_from: expected the model"):   # 'str' object has no attribute
        compress_activations(names_from="m")


@pytest.mark.parametrize("other_group", [False, True])
def test_fused_adam_refuses_a_parameter_listed_twice_before_changing_anything(other_group):
    """Appended to a group's list by hand: in one group the step counts advanced before the kernel refused the
    step; in another group the parameter was stepped twice, silently."""
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = FusedAdam([{"params": [p]}, {"params": [q]}])
    p.grad, q.grad = torch.ones(3), torch.ones(2)
    opt.step()
    before = (p.detach().clone(), q.detach().clone())
    opt.param_groups[1 if other_group else 0]["params"].append(p)
    with pytest.raises(ValueError, match=r"param_groups\[[01]\]\['params'\]\[1\] \(shape \(3,\)\) is also "
                                         r"param_groups\[0\]\['params'\]\[0\]"):
        opt.step()
    assert float(opt.state[p]["step"]) == 1 and float(opt.state[q]["step"]) == 1
    assert torch.equal(p.detach(), before[0]) and torch.equal(q.detach(), before[1])


@pytest.mark.parametrize("opt_class", [FusedAdam, OffloadAdam])
def test_a_group_asking_for_a_differentiable_step_is_refused(opt_class):
    """torch's differentiable=True (a step autograd records) was accepted and stepped under no_grad."""
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="differentiable: differentiable=True is not implemented"):
        opt_class([{"params": [p], "differentiable": True}])


def test_tensor_betas_are_refused_saying_so():
    p = torch.nn.Parameter(torch.randn(4))
    for optimizer in (FusedAdam, OffloadAdam):
        with pytest.raises(ValueError, match=r"tensor betas, which torch's Adam takes, are not supported"):
            optimizer([p], betas=(torch.tensor(0.9), torch.tensor(0.999)))
