"""Entries of FusedAdam's opt.state changed by hand between steps (ZeroRedundancyOptimizer's load assigns
them; torch's loader casts a bf16 parameter's moments to bf16): taken as OffloadAdam takes them (converted),
or refused before any parameter is stepped, naming the parameter, with a pending clip kept for the retry."""
import pytest
import torch

import effmem


def three_params():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(4))                          # group 0
    b = torch.nn.Parameter(torch.randn(3))                          # group 1: parameter 1
    c = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))    # group 1: parameter 2, another bucket
    return a, b, c


def stepped(optimizer=effmem.FusedAdam, **kw):
    a, b, c = three_params()
    opt = optimizer([{"params": [a]}, {"params": [b, c]}], lr=1e-2, **kw)
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    opt.step()
    for p in (a, b, c):
        p.grad = torch.full_like(p, 0.5)
    return opt, (a, b, c)


EDITS = {
    "wrong shape": (lambda s: s.__setitem__("exp_avg_sq", torch.zeros(3)), ValueError,
                    r"opt.state\[p\] of parameter 2\['exp_avg_sq'\]: expected shape \(5,\)"),
    "missing moment": (lambda s: s.pop("exp_avg"), ValueError, "opt.state\\[p\\] of parameter 2: missing 'exp_avg'"),
    "not a tensor": (lambda s: s.__setitem__("exp_avg", [0.0]), TypeError,
                     r"parameter 2\['exp_avg'\]: expected a floating-point tensor, got list"),
    # its tensor freed: the check's weak reference gives None, as the entry does now
    "set to None": (lambda s: s.__setitem__("exp_avg", None), TypeError,
                    r"parameter 2\['exp_avg'\]: expected a floating-point tensor, got NoneType"),
    "fractional step": (lambda s: s["step"].fill_(1.5), ValueError,
                        r"FusedAdam: opt.state\[p\]\['step'\] of parameter 2 holds 1.5; expected a whole number"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_refused_entry_changes_nothing_and_names_its_parameter(edit):
    change, error, message = EDITS[edit]
    opt, params = stepped()
    change(opt.state[params[2]])
    before = [p.detach().clone() for p in params]
    steps = [opt.state[p]["step"].clone() for p in params]
    with pytest.raises(error, match=message):
        opt.step()
    for p, b, s in zip(params, before, steps):   # the other group and bucket were stepped before the fix
        assert torch.equal(p, b) and torch.equal(opt.state[p]["step"], s)


def test_a_parameter_whose_data_changed_dtype_or_shape_is_converted_or_refused_before_any_step():
    """p.data replaced after a step (model.to(torch.bfloat16), a resize): the entry, unchanged itself, was taken as
    checked, and the kernel refused it only after the other group had stepped and every step count advanced,
    naming no parameter (a reviewer's repro). A new dtype is converted as an assigned entry is; a new shape
    refused, naming the parameter, with nothing changed."""
    opt, params = stepped()
    params[2].data = torch.randn(7, dtype=torch.bfloat16)
    before = [p.detach().clone() for p in params]
    steps = [opt.state[p]["step"].clone() for p in params]
    with pytest.raises(ValueError, match=r"parameter 2\['exp_avg'\]: expected shape \(7,\)"):
        opt.step()
    for p, b, s in zip(params, before, steps):
        assert torch.equal(p, b) and torch.equal(opt.state[p]["step"], s)
    opt, params = stepped()
    params[1].data = params[1].data.bfloat16()
    opt.step()
    master = opt.state[params[1]]["master"]
    assert master.dtype == torch.float32 and torch.equal(params[1], master.bfloat16())
    assert all(float(opt.state[p]["step"]) == 2 for p in params)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_model_made_float32_in_place_goes_on_from_its_master(dtype):
    """model.float() after steps in bf16/fp16: the float32 master went with the entry's conversion, and the run went
    on from the rounded weights (a reviewer's repro). Now the step puts the master into the parameter before it
    updates it, as a checkpoint's load into a float32 model does (the gradients were taken at the rounded
    weights, which the optimizer cannot change: it learns of the new dtype at the step)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(dtype)
    opt = effmem.FusedAdam(model.parameters(), lr=1e-2)
    x = torch.randn(4, 16)
    for _ in range(3):
        opt.zero_grad()
        model(x.to(dtype)).float().square().mean().backward()
        opt.step()
    master = opt.state[model.weight]["master"].clone()
    assert not torch.equal(model.weight.float(), master)
    loaded = torch.nn.Linear(16, 8)
    loaded.load_state_dict(model.float().state_dict())   # model.float(): in place, the optimizer kept
    by_load = effmem.FusedAdam(loaded.parameters(), lr=1e-2)
    by_load.load_state_dict(opt.state_dict())
    opt.zero_grad()
    model(x).square().mean().backward()
    for a, b in zip(model.parameters(), loaded.parameters()):
        b.grad = a.grad.clone()
    opt.step()
    by_load.step()
    assert "master" not in opt.state[model.weight]
    for a, b in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(a, b)


def same_in_both_optimizers(make, edit, key: str):
    """Each optimizer made by make(optimizer) -> (opt, params), its entries changed by edit(opt, params) and
    stepped: FusedAdam's parameters and state[key] equal OffloadAdam's, bit for bit. Returns FusedAdam's."""
    finals = []
    for optimizer in (effmem.FusedAdam, effmem.OffloadAdam):
        opt, params = make(optimizer)
        edit(opt, params)
        opt.step()
        finals.append([p.detach().clone() for p in params] + [opt.state[p][key].clone() for p in params])
        if optimizer is effmem.OffloadAdam:
            opt.close()
    for f, o in zip(*finals):
        assert f.dtype == o.dtype and torch.equal(f, o)
    return finals[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_moments_assigned_in_another_dtype_are_converted_as_offload_adam_converts_them(dtype):
    def edit(opt, params):
        for p in params:
            opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].to(dtype)
            opt.state[p]["step"] = int(opt.state[p]["step"])   # torch's checkpoints of old held a number

    fused = same_in_both_optimizers(stepped, edit, "exp_avg")
    assert fused[3].dtype == torch.float32


def stepped_8bit(optimizer):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(600)), torch.nn.Parameter(torch.randn(700, dtype=torch.bfloat16))]
    opt = optimizer(params, lr=1e-2, state_bits=8)   # three blocks each: a strided scale is not contiguous
    for grad in (1.0, 0.5):
        for p in params:
            p.grad = torch.full_like(p, grad)
        if grad == 1.0:
            opt.step()
    return opt, params


@pytest.mark.parametrize("edit", ["float64", "strided"])
def test_8bit_scales_assigned_in_another_dtype_or_layout_are_converted_as_offload_adam_converts_them(edit):
    """FusedAdam handed them to the kernel, which refused them, where OffloadAdam converted them."""
    def change(opt, params):
        for p in params:
            for key in ("exp_avg_scale", "exp_avg_sq_scale"):
                scales = opt.state[p][key]
                opt.state[p][key] = (scales.double() if edit == "float64" else
                                     torch.stack([scales, scales], 1)[:, 0])   # the same values, stride 2

    same_in_both_optimizers(stepped_8bit, change, "exp_avg_scale")


@pytest.mark.parametrize("optimizer", [effmem.FusedAdam, effmem.OffloadAdam])
def test_a_refused_step_keeps_the_pending_clip_for_the_step_that_follows(optimizer):
    results = []
    for refuse_first in (False, True):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(8))
        opt = optimizer([w], lr=1e-2)
        w.grad = torch.full((8,), 100.0)
        opt.clip_grad_norm_(1.0)
        if refuse_first:
            opt.param_groups[0]["lr"] = -1.0
            with pytest.raises(ValueError, match="expected a finite number >= 0, got -1.0"):
                opt.step()
            opt.param_groups[0]["lr"] = 1e-2
        opt.step()
        results.append((w.detach().clone(), opt.state[w]["exp_avg"].clone()))
        if optimizer is effmem.OffloadAdam:
            opt.close()
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[0][1].abs().max() < 0.1   # clipped: 0.1 * 100 unclipped


def test_a_compiled_step_does_not_compile_again_at_each_load_state_dict():
    """The check of an entry's tensors kept their ids for the next step; under torch.compile the graph guarded
    on them: a recompile at step 2 and two per load_state_dict, until fullgraph=True failed at the limit."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    params = [torch.nn.Parameter(torch.randn(16, 8, dtype=torch.bfloat16)) for _ in range(4)]
    opt = effmem.FusedAdam(params, lr=torch.tensor(1e-3))
    step = torch.compile(opt.step, backend="aot_eager", fullgraph=True)

    def go():
        for p in params:
            p.grad = torch.randn_like(p)
        step()
    for _ in range(3):
        go()
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(5):
        opt.load_state_dict(opt.state_dict())
        go()
        go()
    assert counters["stats"]["unique_graphs"] == graphs <= 2


@pytest.mark.parametrize("n", [0, 1])
def test_what_the_kernel_refuses_is_refused_before_any_group_steps(n):
    """A .grad sharing its parameter's memory met the kernel's refusal only after the groups before had stepped
    and every step count had advanced, again at each retry (a reviewer's find); the kernel's checks run over
    every call but the first before it now (that one's refusal undoes its step-count advance), the message
    names the parameter, not the kernel's lists, and a pending clip waits for the step after the fix."""
    results = []
    for refuse in (False, True):
        opt, params = stepped()
        opt.clip_grad_norm_(1e-3)
        if refuse:
            before = [p.detach().clone() for p in params]
            grad, params[n].grad = params[n].grad, params[n].detach()
            for _ in range(2):
                with pytest.raises(ValueError, match=f"FusedAdam: parameter {n} and the .grad of parameter {n} sh"):
                    opt.step()
            assert all(torch.equal(p, q) for p, q in zip(params, before))
            assert [float(opt.state[p]["step"]) for p in params] == [1.0, 1.0, 1.0]
            params[n].grad = grad
        opt.step()
        assert [float(opt.state[p]["step"]) for p in params] == [2.0, 2.0, 2.0]
        results.append([p.detach().clone() for p in params])
    assert all(torch.equal(p, q) for p, q in zip(*results))
    w = torch.randn(5, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.effmem.adam_check.default,
                          ([w], [torch.randn(5)], [torch.zeros(5)], [torch.zeros(5)], [w.float()], [torch.ones(())],
                           [], []))


@pytest.mark.parametrize("key", ["exp_avg_sq", "master", "exp_avg.data"])
def test_any_state_entry_with_other_strides_is_laid_out_as_its_parameter(key):
    """Only exp_avg's strides were compared: an exp_avg_sq or master assigned with others met the kernel's
    refusal (torch's optimizers take any layout). exp_avg relaid in place (`.data =`), which the entry's
    check (by its tensors' identities) does not see, is still compared at every step."""
    def run(edit):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.bfloat16).t())    # column-major
        opt = effmem.FusedAdam([w], lr=1e-2)
        for i in range(3):
            w.grad = torch.randn(6, 4).t().to(torch.bfloat16)
            opt.step()
            if edit and i == 0 and key == "exp_avg.data":
                opt.state[w]["exp_avg"].data = opt.state[w]["exp_avg"].data.contiguous()
            elif edit and i == 0:
                opt.state[w][key] = opt.state[w][key].contiguous()
        return w.detach().clone(), opt.state[w][key.split(".")[0]]
    (w, t), (ref, t_ref) = run(True), run(False)
    assert torch.equal(w, ref) and torch.equal(t, t_ref) and t.stride() == (1, 4)


def test_8bit_codes_along_other_memory_are_re_encoded_along_the_parameter_s():
    """p.data given the same values in column-major memory: the 8-bit codes' blocks ran along the old memory,
    and the kernel refused them after the groups before had stepped. They are re-encoded along the new memory,
    as a checkpoint's are when it loads into a parameter laid out otherwise: as near float32 moments' weights
    as the run whose parameter kept its memory (moments zeroed instead: 30x further)."""
    def run(bits, relayout):
        torch.manual_seed(0)
        a, w = torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(40, 30))
        opt = effmem.FusedAdam([{"params": [a]}, {"params": [w]}], lr=1e-2, state_bits=bits)
        for i in range(4):
            a.grad, w.grad = torch.randn(300), torch.randn(40, 30) + 1
            if i == 2 and relayout:
                w.data = w.data.t().contiguous().t()
            opt.step()
        return a.detach().clone(), w.detach().clone(), opt.state[w]
    a, w, state = run(8, True)
    a_ref, w_ref, _ = run(8, False)
    _, w32, _ = run(32, False)
    assert state["exp_avg_codes"].stride() == (1, 40) and torch.equal(a, a_ref)
    assert (w - w32).abs().max() < 2 * (w_ref - w32).abs().max(), ((w - w32).abs().max(), (w_ref - w32).abs().max())


def test_a_meta_model_steps_as_torch_s_optimizers_step_it():
    """The step-count check read a meta tensor's value (torch's error, naming nothing); AdamW does nothing."""
    p = torch.nn.Parameter(torch.randn(8, device="meta"))
    opt = effmem.FusedAdam([p], lr=1e-2)
    p.grad = torch.randn(8, device="meta")
    opt.step()
    assert opt.state[p]["step"].device.type == "meta"


@pytest.mark.parametrize("bits", [32, 8])
def test_the_kernel_s_refusal_names_the_entries_opt_state_holds(bits):
    """8-bit moments are opt.state's exp_avg_codes / exp_avg_sq_codes: the refusal named them exp_avg_sq."""
    a, b = torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(300))
    opt = effmem.FusedAdam([a, b], state_bits=bits)
    a.grad, b.grad = torch.randn(300), torch.randn(300)
    opt.step()
    key = "exp_avg_sq" if bits == 32 else "exp_avg_sq_codes"
    opt.state[b][key].data = opt.state[a][key].data
    with pytest.raises(ValueError, match=rf"opt.state\[p\]\['{key}'\] of parameter 0 and opt.state\[p\]\['{key}'\] "
                                         "of parameter 1 share memory"):
        opt.step()
