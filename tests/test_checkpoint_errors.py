"""Refused checkpoints change nothing, and both optimizers refuse the same things the same way.

The fuzzer's cases (issue 14): wrong-shaped exp_avg / exp_avg_sq / master were broadcast over the
parameter; a refused checkpoint left the optimizer half-loaded; bad step counts gave NaN or inf
parameters; missing keys gave a bare KeyError.
"""
import copy

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
