"""Bad input to FusedAdam and the adam_step_ op: clear errors naming the argument."""
import pytest
import torch

import effmem
from effmem import ops


def param(*shape, dtype=torch.float32, device="cpu"):
    return torch.nn.Parameter(torch.randn(*shape, device=device).to(dtype))


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=-1e-3), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(eps=0.0), "eps"),
    (dict(eps=-1e-8), "eps"),
    (dict(betas=(1.0, 0.999)), r"betas\[0\]"),
    (dict(betas=(0.9, -0.1)), r"betas\[1\]"),
    (dict(betas=(0.9,)), "betas"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(lr=torch.ones(2)), "lr"),
    (dict(eps=float("inf")), "eps"),
    (dict(weight_decay=float("inf")), "weight_decay"),
    (dict(decoupled_weight_decay="no"), "decoupled_weight_decay: expected True or False"),
    (dict(bias_correction=None), "bias_correction: expected True or False"),
])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        effmem.FusedAdam([param(3)], **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(overlap="False"), "overlap: expected True or False"),      # a non-empty string: True, taken as such
    (dict(delay="no"), "delay: expected True or False"),
    (dict(async_step=1), "async_step: expected True or False"),
    (dict(pin_state=None), "pin_state: expected True or False"),
    (dict(stream_grads="False"), "stream_grads: expected True, False or None"),
])
def test_offload_mode_flags_are_booleans(kwargs, match):
    with pytest.raises(ValueError, match=match):
        effmem.OffloadAdam([param(3)], **kwargs)


def test_step_scale_arguments():
    """step(inv_scale=, found_inf=) as GradScaler's attributes are: a Python number is a one-element tensor
    (it failed with "'float' object has no attribute 'to'"), a tensor of several values is refused by name."""
    ref, p = param(4), param(4)
    with torch.no_grad():
        p.copy_(ref)
    opts = []
    for q, kw in ((ref, dict(inv_scale=torch.tensor(0.5), found_inf=torch.tensor(0.0))),
                  (p, dict(inv_scale=0.5, found_inf=0))):
        q.grad = torch.ones_like(q)
        opts.append(effmem.FusedAdam([q], lr=0.1))
        opts[-1].step(**kw)
    assert torch.equal(ref, p)
    assert torch.equal(opts[0].state[ref]["exp_avg"], opts[1].state[p]["exp_avg"])   # the step alone is scale-free
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    effmem.FusedAdam([p], lr=0.1).step(found_inf=1.0)   # a step skipped
    assert torch.equal(p, before)
    for kw, match in ((dict(found_inf=torch.tensor([0.0, 1.0])), "found_inf: expected a one-element floating"),
                      (dict(inv_scale="2"), "inv_scale: expected a one-element floating"),
                      (dict(inv_scale=torch.tensor(1)), "inv_scale: expected a one-element floating")):
        with pytest.raises(TypeError, match=match):
            effmem.FusedAdam([p], lr=0.1).step(**kw)


def test_bad_hyperparameters_in_a_later_group():
    opt = effmem.FusedAdam([param(3)])
    with pytest.raises(ValueError, match="eps"):
        opt.add_param_group({"params": [param(3)], "eps": 0.0})


@pytest.mark.parametrize("flag", ["amsgrad", "maximize"])
@pytest.mark.parametrize("make", [effmem.FusedAdam, effmem.OffloadAdam], ids=["fused", "offload"])
def test_torch_adam_options_in_a_group_are_refused(make, flag):
    """Refused as keywords (no such argument), so refused in a group's dict too: ignoring them would step
    with plain Adam's math."""
    with pytest.raises(ValueError, match=f"{flag}=True is not implemented"):
        make([{"params": [param(3)], flag: True}])
    opt = make([param(3)])
    with pytest.raises(ValueError, match=flag):
        opt.add_param_group({"params": [param(3)], flag: True})
    assert len(opt.param_groups) == 1
    make([{"params": [param(3)], flag: False}])   # what torch's own groups hold


@pytest.mark.parametrize("make", [effmem.FusedAdam, effmem.OffloadAdam], ids=["fused", "offload"])
def test_a_groups_own_state_bits_is_refused(make):
    """state_bits=32 in a group of an 8-bit optimizer (embeddings kept in float32) was kept in the group and
    never read: that group's moments were 8-bit, silently."""
    with pytest.raises(ValueError, match=r"state_bits: a param group's own \(32\) is not supported"):
        make([{"params": [param(3)], "state_bits": 32}, {"params": [param(3)]}], state_bits=8)
    opt = make([param(3)], state_bits=8)
    with pytest.raises(ValueError, match="state_bits"):
        opt.add_param_group({"params": [param(3)], "state_bits": 32})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [param(3)], "state_bits": 8})   # the optimizer's own: ZeRO's groups hold it
    for p in (q for g in opt.param_groups for q in g["params"]):
        p.grad = torch.ones_like(p)
    opt.step()
    saved, groups = opt.state_dict(), [{"params": g["params"]} for g in opt.param_groups]
    if hasattr(opt, "close"):
        opt.close()
    other = make(groups, state_bits=32)
    other.load_state_dict(saved)   # a ZeRO-style group's 8 from the checkpoint: the loader's own now
    other.step()   # refused at every step before ("a param group's own (8)")
    if hasattr(other, "close"):
        other.close()


@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(eps=0.0), dict(betas=(1.5, 0.9)), dict(weight_decay=-1.0),
                                 dict(lr=torch.tensor(float("nan")))], ids=lambda d: next(iter(d)))
def test_a_refused_step_changes_nothing(bad):
    """A group made bad after construction: the step is refused before any group is updated or any step
    count advanced, so fixing the setting and going on trains as if the refused step never happened."""
    torch.manual_seed(0)
    ps = [param(4), param(4)]
    opt = effmem.FusedAdam([{"params": [ps[0]]}, {"params": [ps[1]]}], lr=0.1)
    for p in ps:
        p.grad = torch.ones(4)
    opt.step()
    before = [p.detach().clone() for p in ps]
    good = dict(opt.param_groups[1])
    opt.param_groups[1].update(bad)
    with pytest.raises(ValueError, match=r"param_groups\[1\]"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    assert [opt.state[p]["step"].item() for p in ps] == [1.0, 1.0]


@pytest.mark.parametrize("change", ["expanded", "aliased"])
def test_a_parameter_given_bad_memory_after_construction_is_refused_before_any_change(change):
    """p.data = an expanded tensor: the kernel refused it after the earlier group was stepped and every step
    count advanced. p.data = another group's parameter's data: that memory was stepped twice, silently."""
    ps = [param(4), param(4)]
    opt = effmem.FusedAdam([{"params": [ps[0]]}, {"params": [ps[1]]}], lr=0.1)
    for p in ps:
        p.grad = torch.ones(4)
    opt.step()
    ps[1].data = torch.zeros(1).expand(4) if change == "expanded" else ps[0].data
    before = [p.detach().clone() for p in ps]
    with pytest.raises(ValueError, match="not a dense tensor" if change == "expanded" else "share memory"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    assert [opt.state[p]["step"].item() for p in ps] == [1.0, 1.0]


@pytest.mark.parametrize("make", [effmem.FusedAdam, effmem.OffloadAdam], ids=["fused", "offload"])
def test_a_setting_deleted_from_a_group_is_named(make):
    """A group edited by hand without a setting: a ValueError naming the group and the key (a bare
    KeyError('lr') before), the step refused before any change."""
    p = param(4)
    opt = make([p], lr=0.1)
    p.grad = torch.ones(4)
    del opt.param_groups[0]["lr"]
    with pytest.raises(ValueError, match=r"param_groups\[0\]: lr: missing from the group"):
        opt.step()
    opt.param_groups[0]["lr"] = 0.1
    opt.step()
    assert opt.state[p]["step"].item() == 1.0
    if make is effmem.OffloadAdam:
        opt.close()


def test_a_bool_lr_is_refused_without_a_range_hint():
    with pytest.raises(ValueError, match=r"lr: expected a finite number >= 0, got True$"):
        effmem.FusedAdam([param(3)], lr=True)


def test_params_on_two_devices_in_one_group():
    with pytest.raises(ValueError, match="params: a param group must hold parameters of one device"):
        effmem.FusedAdam([param(3), param(3, device="meta")])


def test_overlapping_params():
    base = torch.randn(10)
    a, b = torch.nn.Parameter(base[:6]), torch.nn.Parameter(base[4:])
    with pytest.raises(ValueError, match="share memory"):
        effmem.FusedAdam([a, b])
    with pytest.raises(ValueError, match="share memory"):
        opt = effmem.FusedAdam([a])
        opt.add_param_group({"params": [b]})


@pytest.mark.parametrize("cls", [effmem.FusedAdam, effmem.OffloadAdam])
def test_a_parameter_listed_twice_is_named_as_such(cls):
    """torch warns of a parameter listed twice in a group; ours refused it as "views of one tensor?", pointing at
    the wrong cause (a reviewer's note)."""
    p = param(3)
    with pytest.raises(ValueError, match="parameters 0 and 1 are one tensor listed twice"):
        cls([p, p])


def test_disjoint_views_are_fine():
    base = torch.randn(10)
    effmem.FusedAdam([torch.nn.Parameter(base[:5]), torch.nn.Parameter(base[5:])])


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float64, torch.int32])
def test_unsupported_param_dtypes(dtype):
    p = torch.zeros(3, dtype=dtype)
    with pytest.raises(TypeError, match=r"params\[0\]"):
        effmem.FusedAdam([p])


def test_non_dense_param():
    p = torch.nn.Parameter(torch.randn(10)[::2])
    with pytest.raises(ValueError, match=r"params\[0\].*dense"):
        effmem.FusedAdam([p])


def test_sparse_grad():
    p = param(5, 3)
    opt = effmem.FusedAdam([p])
    p.grad = torch.randn(5, 3).to_sparse()
    with pytest.raises(TypeError, match=r"grad of the parameter of shape \(5, 3\): expected a dense .* got a sparse "
                                        r"one \(use a dense embedding or torch.optim.SparseAdam\)"):
        opt.step()


def test_complex_grad():
    p = param(4)
    opt = effmem.FusedAdam([p])
    if hasattr(p, "grad_dtype"):  # torch >= 2.14 checks grad dtypes unless told not to
        p.grad_dtype = None
    p.grad = torch.randn(4, dtype=torch.complex64)
    with pytest.raises(TypeError, match=r"grad of the parameter of shape \(4,\): expected a dense float32, bfloat16 or "
                                        r"float16 gradient, got torch.complex64"):
        opt.step()


def test_loading_an_amsgrad_checkpoint_is_refused():
    p = param(4)
    torch_opt = torch.optim.AdamW([p], amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        effmem.FusedAdam([p]).load_state_dict(torch_opt.state_dict())


def _op_args(n=3, dtype=torch.bfloat16):
    p = [torch.randn(n).to(dtype)]
    return dict(params=p, grads=[torch.randn(n).to(dtype)], exp_avgs=[torch.zeros(n)], exp_avg_sqs=[torch.zeros(n)],
                masters=[x.float() for x in p] if dtype != torch.float32 else [], steps=[torch.ones(())])


HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)


@pytest.mark.parametrize("change, exc, match", [
    (dict(lr=-1.0), ValueError, "lr must be"),
    (dict(eps=0.0), ValueError, "eps must be"),
    (dict(beta1=1.0), ValueError, "beta1 must be"),
    (dict(beta2=1.5), ValueError, "beta2 must be"),
    (dict(weight_decay=-1.0), ValueError, "weight_decay must be"),
])
def test_op_rejects_bad_scalars(change, exc, match):
    with pytest.raises(exc, match=match):
        ops.adam_step_(**_op_args(), **{**HYPER, **change})


def test_op_rejects_bad_lists():
    args = _op_args()
    args["grads"] = []
    with pytest.raises(ValueError, match="same length"):
        ops.adam_step_(**args, **HYPER)
    args = _op_args()
    args["masters"] = []
    with pytest.raises(ValueError, match="masters"):
        ops.adam_step_(**args, **HYPER)
    args = _op_args()
    args["exp_avgs"] = [torch.zeros(4)]
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] has shape"):
        ops.adam_step_(**args, **HYPER)
    args = _op_args()
    args["exp_avg_sqs"] = [torch.zeros(3, dtype=torch.bfloat16)]
    with pytest.raises(TypeError, match=r"exp_avg_sqs\[0\] must be float32"):
        ops.adam_step_(**args, **HYPER)
    args = _op_args()
    args["params"] = [torch.zeros(3, dtype=torch.float64)]
    with pytest.raises(TypeError, match="params must be float32, bfloat16 or float16"):
        ops.adam_step_(**args, **HYPER)
    args = _op_args()
    args["steps"] = [torch.ones((), dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"steps\[0\]"):
        ops.adam_step_(**args, **HYPER)
    args = _op_args()
    args["grads"] = [torch.randn(6).bfloat16()[::2]]
    with pytest.raises(ValueError, match=r"grads\[0\] has strides"):
        ops.adam_step_(**args, **HYPER)


# ---------------------------------------------------------------------------------------------
# What the fuzzer found (issue 14): values and aliases the op used to accept silently


@pytest.mark.parametrize("step", [0.0, -1.0, 1.5, float("nan"), float("inf"), 2.0 ** 63, 2.0 ** 70])
def test_op_refuses_step_counts_outside_whole_numbers_from_1(step):
    args = _op_args()
    args["steps"] = [torch.full((), step)]
    before = args["params"][0].clone()
    with pytest.raises(ValueError, match=r"steps\[0\] must hold a whole number in \[1, 2\^63\)"):
        ops.adam_step_(**args, **HYPER)
    assert torch.equal(args["params"][0], before)


@pytest.mark.parametrize("lr", [-1.0, float("nan"), float("inf")])
def test_op_refuses_a_bad_lr_tensor(lr):
    args = _op_args()
    with pytest.raises(ValueError, match="lr_tensor must hold a finite number >= 0"):
        ops.adam_step_(**args, **HYPER, lr_tensor=torch.tensor([lr]))


@pytest.mark.parametrize("lr", [-1.0, float("nan")])
def test_fused_adam_checks_an_lr_tensor_given_or_assigned(lr):
    with pytest.raises(ValueError, match="lr: expected a finite number >= 0, got a tensor holding"):
        effmem.FusedAdam([param(3)], lr=torch.tensor(lr))
    p = param(3)
    opt = effmem.FusedAdam([p], lr=torch.tensor(1e-3))
    p.grad = torch.randn(3)
    opt.step()
    opt.param_groups[0]["lr"] = torch.tensor(lr)   # assigned later (a scheduler, by hand)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\]: expected a finite number >= 0"):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_fused_adam_refuses_an_lr_tensor_changed_in_place_to_a_bad_value():
    p = param(3)
    lr = torch.tensor(1e-3)
    opt = effmem.FusedAdam([p], lr=lr)
    p.grad = torch.randn(3)
    opt.step()
    lr.fill_(-1.0)                                   # the same tensor, changed: a CPU tensor is read each step
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\]: expected a finite number >= 0, got a "
                                         "tensor holding -1"):
        opt.step()
    assert opt.state[p]["step"].item() == 1.0


@pytest.mark.parametrize("alias", ["same_param_twice", "exp_avg_is_param", "overlapping_views", "grad_is_master"])
def test_op_refuses_aliased_tensors(alias):
    args = _op_args(8, torch.float32)
    p = args["params"][0]
    if alias == "same_param_twice":
        for key in ("params", "grads", "exp_avgs", "exp_avg_sqs", "steps"):
            args[key] = args[key] + ([p] if key == "params" else [args[key][0].clone()])
    elif alias == "exp_avg_is_param":
        args["exp_avgs"] = [p]
    elif alias == "overlapping_views":
        base = torch.zeros(12)
        args["exp_avgs"], args["exp_avg_sqs"] = [base[:8]], [base[4:]]
    else:
        args = _op_args(8, torch.bfloat16)
        args["grads"] = [args["masters"][0].bfloat16()]   # fine: a copy
        ops.adam_step_(**args, **HYPER)
        args["grads"] = [args["params"][0]]              # the param itself as its gradient
    with pytest.raises(ValueError, match="share memory; each tensor the Adam step writes, and each parameter.s "
                                         "step count"):
        ops.adam_step_(**args, **HYPER)


def test_grads_may_share_memory_with_each_other():
    args = _op_args(8, torch.float32)
    q = torch.randn(8)
    for key in ("params", "exp_avgs", "exp_avg_sqs", "steps"):
        args[key] = args[key] + [torch.randn(8) if key == "params" else args[key][0].clone()]
    args["grads"] = [q, q]
    ops.adam_step_(**args, **HYPER)


def test_meta_and_cpu_tensors_mixed_are_refused():
    args = _op_args(8, torch.float32)
    args["exp_avgs"] = [torch.zeros(8, device="meta")]
    with pytest.raises(ValueError, match=r"all tensors must be on one device, got params\[0\] on cpu, exp_avgs\[0\] on meta"):
        ops.adam_step_(**args, **HYPER)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        ops.l2norm([torch.ones(3), torch.ones(3, device="meta")])
    codes, stats = ops.quantize(torch.randn(2, 64))
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        torch.ops.effmem.dequantize(codes, stats.to("meta"), 8, 128, 64, torch.float32)


def test_empty_lists_are_a_valid_call():
    ops.adam_step_([], [], [], [], [], [], **HYPER)
    torch.ops.effmem.adam_step_([], [], [], [], [], [], 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    assert ops.l2norm([]).item() == 0.0 and torch.ops.effmem.l2norm([]).dtype == torch.float32
    with pytest.raises(ValueError, match="lr must be"):
        ops.adam_step_([], [], [], [], [], [], **{**HYPER, "lr": -1.0})


def test_sparse_inputs_get_our_message():
    args = _op_args(8, torch.float32)
    args["grads"] = [torch.randn(8).to_sparse()]
    with pytest.raises(ValueError, match=r"grads\[0\] is a Float tensor of shape \[8\] and layout Sparse"):
        ops.adam_step_(**args, **HYPER)
    with pytest.raises(ValueError, match=r"tensors\[0\] is .*layout Sparse"):
        ops.l2norm([torch.randn(8).to_sparse()])
    with pytest.raises(ValueError, match="x must be a dense"):
        torch.ops.effmem.quantize(torch.randn(4, 64).to_sparse(), 8, 64, 0, True)


def test_messages_say_what_they_got():
    args = _op_args()
    args["steps"] = [torch.ones((), dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"steps\[0\] must be a one-element float32 tensor on cpu, got a Double "
                                         r"tensor of shape \[\] on cpu"):
        ops.adam_step_(**args, **HYPER)
    args = _op_args()
    args["exp_avgs"] = [torch.zeros(3, dtype=torch.bfloat16)]
    with pytest.raises(TypeError, match=r"exp_avgs\[0\] must be float32, got BFloat16"):
        ops.adam_step_(**args, **HYPER)
    for seed in (2 ** 64, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"seed: expected an int in \[0, 2\*\*64\)"):
            ops.quantize(torch.randn(2, 64), seed=seed)
    x = torch.randn(2, 64)
    assert torch.equal(ops.quantize(x, seed=2 ** 64 - 1)[0], ops.quantize(x, seed=2 ** 64 - 1)[0])
