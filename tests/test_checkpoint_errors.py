"""Refused checkpoints change nothing, and both optimizers refuse the same things the same way.

The fuzzer's cases (issue 14): wrong-shaped exp_avg / exp_avg_sq / master were broadcast over the
parameter; a refused checkpoint left the optimizer half-loaded; bad step counts gave NaN or inf
parameters; missing keys gave a bare KeyError.
"""
import copy
import warnings

import pytest
import torch

import effmem
from effmem import FusedAdam, OffloadAdam


def make(kind, dtype=torch.bfloat16):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3).to(dtype)), torch.nn.Parameter(torch.randn(5).to(dtype))]
    groups = [{"params": [params[0]], "lr": 1e-2}, {"params": [params[1]], "lr": 2e-2}]
    opt = FusedAdam(groups) if kind == "fused" else OffloadAdam(groups, bucket_size=8)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        opt.zero_grad()
    return params, opt


def snapshot(params, opt):
    sd = opt.state_dict()
    return [p.detach().clone() for p in params], copy.deepcopy(
        {"state": {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()} for k, s in sd["state"].items()},
         "param_groups": sd["param_groups"]})


def unchanged(before, params, opt):
    weights, sd = before
    now = opt.state_dict()
    assert all(torch.equal(a, p.detach()) for a, p in zip(weights, params))
    assert [{k: v for k, v in g.items()} for g in now["param_groups"]] == sd["param_groups"]
    for k, s in sd["state"].items():
        for n, v in s.items():
            got = now["state"][k][n]
            assert torch.equal(torch.as_tensor(got), torch.as_tensor(v)), (k, n)


BAD = {
    "exp_avg_shape": (lambda sd: sd["state"][1].__setitem__("exp_avg", torch.zeros(1)), ValueError,
                      r"state_dict\['state'\]\[1\]\['exp_avg'\]: expected shape \(5,\) \(the parameter's\), got \(1,\)"),
    "exp_avg_sq_shape": (lambda sd: sd["state"][0].__setitem__("exp_avg_sq", torch.zeros(3, 4)), ValueError,
                         r"\['exp_avg_sq'\]: expected shape \(4, 3\)"),
    "master_shape": (lambda sd: sd["state"][1].__setitem__("master", torch.zeros(())), ValueError,
                     r"\['master'\]: expected shape \(5,\)"),
    "missing_exp_avg": (lambda sd: sd["state"][1].pop("exp_avg"), ValueError,
                        r"state_dict\['state'\]\[1\]: missing 'exp_avg'"),
    "int_exp_avg": (lambda sd: sd["state"][1].__setitem__("exp_avg", torch.zeros(5, dtype=torch.int64)), TypeError,
                    r"\['exp_avg'\]: expected a floating-point tensor, got a torch.int64 tensor"),
    "bad_lr_late_group": (lambda sd: sd["param_groups"][1].__setitem__("lr", -1.0), ValueError,
                          r"state_dict: param_groups\[1\]: lr: expected a finite number >= 0, got -1.0"),
    "group_count": (lambda sd: sd["param_groups"].pop(), ValueError, r"state_dict: has 1 param groups but this"),
    "not_a_dict": (None, ValueError, r"state_dict: expected a dict with 'state' and 'param_groups'"),
    # an AttributeError ('list' object has no attribute 'get') before
    "state_a_list": (lambda sd: sd.__setitem__("state", []), TypeError,
                     r"state_dict\['state'\]: expected a dict from parameter id to its state, got list"),
    # loaded as step 0 before: the next step's bias correction took the saved moments for first ones
    "missing_step": (lambda sd: sd["state"][1].pop("step"), ValueError, r"state_dict\['state'\]\[1\]: missing 'step'"),
    # a JSON or YAML round trip: torch's loader (and effmem's before) dropped every entry without a word
    "string_ids": (lambda sd: sd.__setitem__("state", {str(k): v for k, v in sd["state"].items()}), ValueError,
                   r"entries \['0', '1'\] belong to no parameter .* \(string keys: a JSON or YAML round trip"),
    # failed midway through the copies before ("Cannot copy out of meta tensor"), half the state replaced
    "meta_exp_avg": (lambda sd: sd["state"][1].__setitem__("exp_avg", torch.zeros(5, device="meta")), ValueError,
                     r"\['exp_avg'\]: a meta tensor, which holds no values"),
    "codes_without_scales": (lambda sd: sd["state"][1].__setitem__("exp_avg", torch.zeros(5, dtype=torch.uint8)),
                             TypeError, r"got a torch.uint8 tensor \(8-bit codes without their block scales, "
                                        r"'exp_avg_scale'\)"),
    "group_not_a_dict": (lambda sd: sd["param_groups"].__setitem__(0, [0]), TypeError,
                         r"state_dict\['param_groups'\]: expected a list of dicts, each with a list 'params', got "
                         r"list of \['list', 'dict'\]"),
}


@pytest.mark.parametrize("kind", ["fused", "offload"])
@pytest.mark.parametrize("case", list(BAD))
def test_a_refused_checkpoint_changes_nothing(kind, case):
    params, opt = make(kind)
    corrupt, exc, match = BAD[case]
    good = copy.deepcopy(opt.state_dict())
    bad = {"state": {k: dict(s) for k, s in good["state"].items()}, "param_groups": [dict(g) for g in good["param_groups"]]}
    if corrupt is None:
        bad = [bad]
    else:
        corrupt(bad)
    # something changes first, so a half-load would show
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad()
    before = snapshot(params, opt)
    with pytest.raises(exc, match=match):
        opt.load_state_dict(bad)
    unchanged(before, params, opt)


@pytest.mark.parametrize("kind", ["fused", "offload"])
@pytest.mark.parametrize("step", [-1, 1.5, float("nan"), float("inf"), 2.0 ** 63, "3"])
def test_bad_step_counts_are_refused(kind, step):
    params, opt = make(kind)
    sd = opt.state_dict()
    sd = {"state": {k: dict(s) for k, s in sd["state"].items()}, "param_groups": sd["param_groups"]}
    sd["state"][1]["step"] = torch.tensor(step) if isinstance(step, float) else step
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match=r"state_dict\['state'\]\[1\]\['step'\]: expected"):
        opt.load_state_dict(sd)
    unchanged(before, params, opt)


@pytest.mark.parametrize("kind", ["fused", "offload"])
def test_step_zero_loads(kind):
    """A state whose steps a grad scaler all skipped has step 0; it loads, and the next step is step 1."""
    params, opt = make(kind, torch.float32)
    sd = opt.state_dict()
    sd["state"][0]["step"] = torch.tensor(0.0)
    opt.load_state_dict(sd)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)
    assert float(opt.state_dict()["state"][0]["step"]) == 1.0


def test_both_optimizers_give_the_same_errors():
    messages = []
    for kind in ("fused", "offload"):
        params, opt = make(kind)
        sd = opt.state_dict()
        sd["state"][1] = dict(sd["state"][1], exp_avg=torch.zeros(2))
        with pytest.raises(ValueError) as err:
            opt.load_state_dict(sd)
        messages.append(str(err.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("source", ["torch", "fused", "offload"])
@pytest.mark.parametrize("kind", ["fused", "offload"])
def test_an_empty_state_entry_is_no_state(source, kind):
    """A read of opt.state[p] (a defaultdict: a logging callback) leaves an empty entry that torch's
    state_dict saves; it loads as no state, as in torch, and effmem's own state_dicts leave it out."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    params[1].requires_grad_(False)   # frozen: never stepped
    opt = {"torch": lambda: torch.optim.AdamW(params, lr=1e-2), "fused": lambda: FusedAdam(params, lr=1e-2),
           "offload": lambda: OffloadAdam(params, lr=1e-2, bucket_size=8)}[source]()
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    assert [opt.state[p].get("step") is None for p in params] == [False, True]
    sd = opt.state_dict()
    assert (1 in sd["state"] and not sd["state"][1]) == (source == "torch")
    if source == "offload":
        opt.close()
    target = FusedAdam(params, lr=1e-2) if kind == "fused" else OffloadAdam(params, lr=1e-2, bucket_size=8)
    target.load_state_dict(sd)
    assert torch.equal(target.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])
    assert 1 not in target.state_dict()["state"]
    if kind == "offload":
        target.close()


@pytest.mark.parametrize("kind", ["fused", "offload"])
def test_a_load_that_fails_midway_refuses_steps_until_a_load_completes(kind, monkeypatch):
    """A failure while the state is made or copied in, after every check (out of memory, an interrupt), left
    the groups replaced, the first parameters with the new state and the rest with none (FusedAdam) or their
    old (OffloadAdam), and the next step went on from that. Steps are refused now until a load completes.
    (One entry at a time, the old state dropped first, so that a load needs one state of memory, not two.)"""
    import effmem.optim.fused_adam as fused_module
    import effmem.optim._adam8 as adam8_module
    module, name = (fused_module, "_restore_state") if kind == "fused" else (adam8_module, "convert")
    params, opt = make(kind)
    sd = copy.deepcopy(opt.state_dict())
    real, calls = getattr(module, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("the second entry")
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, failing)
    with pytest.raises(MemoryError):
        opt.load_state_dict(sd)
    monkeypatch.setattr(module, name, real)
    for p in params:
        p.grad = torch.randn_like(p)
    refused = "a load_state_dict failed while (making|copying) the state .*MemoryError"
    with pytest.raises(RuntimeError, match=refused):
        opt.step()
    if kind == "fused":   # a copy refuses as well (it stepped on the mixed state: a reviewer's repro)
        with pytest.raises(RuntimeError, match=refused):
            copy.deepcopy(opt).step()
    opt.load_state_dict(sd)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert float(opt.state_dict()["state"][1]["step"]) == float(sd["state"][1]["step"]) + 1
    if kind == "offload":
        opt.close()


@pytest.mark.parametrize("kind", ["fused", "offload"])
def test_an_8bit_checkpoint_names_its_codes_so_float_loaders_refuse_it(kind, tmp_path):
    """Under torch's names the codes 0..255 loaded into torch's AdamW, or into a float32 template of
    torch.distributed.checkpoint, as moments, without a word (up to 255 where the moments were 3.6e-3). Under
    their own names AdamW stops at 'exp_avg' and DCP names the missing key; effmem's loaders take both
    names, so checkpoints written before load bit for bit."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 8)
    cls = FusedAdam if kind == "fused" else (lambda ps, **kw: OffloadAdam(ps, bucket_size=64, **kw))
    opt = cls(m.parameters(), lr=1e-2, state_bits=8)
    m(torch.randn(2, 64)).sum().backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd["state"][0]) == {"step", "exp_avg_codes", "exp_avg_sq_codes", "exp_avg_scale", "exp_avg_sq_scale"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # DCP's warnings about running without a process group
        dcp.save({"optim": get_optimizer_state_dict(m, opt)}, checkpoint_id=str(tmp_path))
    if kind == "offload":
        opt.close()   # the parameters are its own until then
    adamw = torch.optim.AdamW(m.parameters(), lr=1e-2)
    adamw.load_state_dict(sd)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(KeyError, match="exp_avg"):
        adamw.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        float32 = FusedAdam(m.parameters(), lr=1e-2)
        float32.step()   # a state to fill: a fresh optimizer's template is empty
        template = {"optim": get_optimizer_state_dict(m, float32)}
        with pytest.raises(BaseException, match="Missing key in checkpoint state_dict: optim.state.weight.exp_avg"):
            dcp.load(template, checkpoint_id=str(tmp_path))
    old = {"state": {k: {{"exp_avg_codes": "exp_avg", "exp_avg_sq_codes": "exp_avg_sq"}.get(n, n): v
                         for n, v in e.items()} for k, e in sd["state"].items()}, "param_groups": sd["param_groups"]}
    for layout in (old, sd):
        again = cls(m.parameters(), lr=1e-2, state_bits=8)
        again.load_state_dict(layout)
        got = again.state_dict()["state"]
        assert all(torch.equal(got[k][n], v) for k, e in sd["state"].items() for n, v in e.items() if n != "step")
        if kind == "offload":
            again.close()
    both = {"state": {0: dict(sd["state"][0], exp_avg=torch.zeros(8, 64))}, "param_groups": sd["param_groups"]}
    refusing = cls(m.parameters(), lr=1e-2, state_bits=8)
    with pytest.raises(ValueError, match=r"holds 'exp_avg' next to 8-bit codes \('exp_avg_codes', 'exp_avg_sq_codes"):
        refusing.load_state_dict(both)
    if kind == "offload":
        refusing.close()


@pytest.mark.parametrize("kind", ["fused", "offload"])
def test_an_8bit_state_resumes_through_dcp_flattened_state_dicts(kind, tmp_path):
    """torch.distributed.checkpoint's flatten_optimizer_state_dict (torchtitan's) rebuilds each entry on load
    from opt.state's names: opt.state held the codes under 'exp_avg' where the checkpoint had 'exp_avg_codes',
    so the codes were dropped and the load failed ("expected a uint8 tensor ... got dict"). Resumed from the
    checkpoint, 2 more steps equal those of the run that went on."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    cls = FusedAdam if kind == "fused" else (lambda ps, **kw: OffloadAdam(ps, bucket_size=64, **kw))
    batches = [torch.randn(4, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def build(seed):
        torch.manual_seed(seed)
        m = torch.nn.Linear(64, 8).to(torch.bfloat16)
        return m, cls(m.parameters(), lr=1e-2, state_bits=8)

    def train(m, opt, xs):
        for x in xs:
            m(x.to(torch.bfloat16)).float().square().sum().backward()
            opt.step()
            opt.zero_grad()

    m, opt = build(0)
    train(m, opt, batches[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # DCP's warnings about running without a process group
        msd, osd = get_state_dict(m, opt, options=flat)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
        train(m, opt, batches[2:])
        m2, opt2 = build(1)
        msd, osd = get_state_dict(m2, opt2, options=flat)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(tmp_path))
        set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=flat)
    train(m2, opt2, batches[2:])
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))
    for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if kind == "offload":
        opt.close()
        opt2.close()


@pytest.mark.parametrize("kind", ["fused", "offload"])
def test_a_bf16_runs_masters_go_into_float32_parameters_holding_them_rounded(kind):
    """Moving a bf16 run to float32 (model's weights first, then the optimizer's) went on from the rounded
    weights, the masters dropped without a word (8.1e-4 apart in the reviewer's run). Now the float32
    parameter, its own master, gets the master's exact values; a parameter holding other weights keeps them,
    with a warning that says how to get the masters in."""
    params, opt = make(kind)   # bf16
    sd = copy.deepcopy(opt.state_dict())
    masters = [sd["state"][i]["master"] for i in range(2)]
    if kind == "offload":
        opt.close()
    rounded = [torch.nn.Parameter(p.detach().float()) for p in params]
    consolidated = [torch.nn.Parameter(m.clone()) for m in masters]   # a run's float32 weights, exact
    other = [torch.nn.Parameter(torch.zeros_like(p, dtype=torch.float32)) for p in params]
    for weights, warned in ((rounded, False), (consolidated, False), (other, True)):
        groups = [{"params": [weights[0]], "lr": 1e-2}, {"params": [weights[1]], "lr": 2e-2}]
        # OffloadAdam with the first parameter's state on the device (a FusedAdam's, loaded by its loader)
        target = FusedAdam(groups) if kind == "fused" else OffloadAdam(groups, bucket_size=8, device_state=200)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            target.load_state_dict(sd)
        ours = [w for w in caught if "do not hold those weights" in str(w.message)]
        assert len(ours) == warned   # once, also where device_state's loader checks its part again
        assert all(w.filename == __file__ for w in ours)   # the user's call, not effmem's or torch's frames
        for w, master in zip(weights, masters):
            assert torch.equal(w.detach(), torch.zeros_like(master) if warned else master)
        if kind == "offload":
            assert "differentiable" not in target.state_dict()["param_groups"][0]   # torch's __setstate__ adds it
            target.close()
    old = copy.deepcopy(sd)   # an OffloadAdam checkpoint from before: its groups had gained the key
    for g in old["param_groups"]:
        g["differentiable"] = False
    groups = [{"params": [rounded[0]], "lr": 1e-2}, {"params": [rounded[1]], "lr": 2e-2}]
    target = FusedAdam(groups) if kind == "fused" else OffloadAdam(groups, bucket_size=8)
    target.load_state_dict(old)
    assert all("differentiable" not in g for g in target.state_dict()["param_groups"])
    if kind == "offload":
        target.close()


@pytest.mark.parametrize("kind", ["fused", "offload"])
def test_zero_redundancy_optimizer_resumes_8bit_state(kind):
    """ZeroRedundancyOptimizer's load_state_dict assigns the consolidated entries, codes under their
    checkpoint names, straight into the inner optimizer's opt.state: FusedAdam now takes them at its next
    step (KeyError 'exp_avg' before), OffloadAdam through its check of assigned entries. The resumed run
    equals the uninterrupted one bit for bit."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    inner = FusedAdam if kind == "fused" else OffloadAdam
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def run(m, opt, seeds):
            for seed in seeds:
                m.zero_grad()
                m(torch.randn(2, 64, generator=torch.Generator().manual_seed(seed))).sum().backward()
                opt.step()
        torch.manual_seed(0)
        m = torch.nn.Linear(64, 8)
        start = copy.deepcopy(m.state_dict())
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=inner, lr=1e-2, state_bits=8)
        run(m, opt, [0, 1])
        opt.consolidate_state_dict(to=0)
        sd, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(m.state_dict())
        run(m, opt, [2])
        want = [p.detach().clone() for p in m.parameters()]
        if kind == "offload":
            opt.optim.close()
        m.load_state_dict(weights)
        again = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=inner, lr=1e-2, state_bits=8)
        again.load_state_dict(sd)
        run(m, again, [2])
        if kind == "offload":
            again.optim.flush()
        assert all(torch.equal(a, p) for a, p in zip(want, m.parameters()))
        assert not torch.equal(m.weight, start["weight"])
        if kind == "offload":
            again.optim.close()
    finally:
        dist.destroy_process_group()
