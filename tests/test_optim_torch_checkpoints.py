"""Checkpoints that went through torch's AdamW and back: its groups carry torch's flags and its state FusedAdam's
'master', cast and never updated; FusedAdam and OffloadAdam take neither as theirs."""
import copy

import pytest
import torch

from effmem import FusedAdam, OffloadAdam
from test_optim_journeys import _close, _linear, _train


@pytest.mark.parametrize("cls", [FusedAdam, OffloadAdam])
@pytest.mark.parametrize("between", [torch.bfloat16, torch.float32], ids=["bf16", "model.float()"])
def test_a_master_carried_through_torchs_adamw_is_not_trusted(cls, between):
    """FusedAdam -> AdamW -> FusedAdam: AdamW keeps the 'master' entry, cast to its parameter's dtype and never
    updated. The resumed run takes the master from the parameters (as from a checkpoint without one), instead of
    going back to the weights of before AdamW's steps; also where AdamW trained the model in float32, which kept
    the stale master in float32 (a reviewer's repro: it was taken as a master then)."""
    m = _linear(torch.bfloat16)
    opt = cls(m.parameters(), lr=1e-2)
    _train(m, opt, 2)
    sd = opt.state_dict()
    _close(opt)
    m.to(between)
    adamw = torch.optim.AdamW(m.parameters(), lr=1e-2)
    adamw.load_state_dict(sd)
    _train(m, adamw, 3, seed=3)
    m.to(torch.bfloat16)
    carried = adamw.state_dict()
    assert carried["state"][0]["master"].dtype == between
    stripped = copy.deepcopy(carried)
    for s in stripped["state"].values():
        del s["master"]
    ends = []
    for ckpt in (carried, stripped):
        m2 = copy.deepcopy(m)
        opt2 = cls(m2.parameters(), lr=1e-2)
        opt2.load_state_dict(copy.deepcopy(ckpt))
        _train(m2, opt2, 1, seed=4)
        ends.append([p.detach().clone() for p in m2.parameters()])
        _close(opt2)
    assert all(torch.equal(a, b) for a, b in zip(*ends))


@pytest.mark.parametrize("cls", [FusedAdam, OffloadAdam])
def test_a_run_started_from_torchs_adamw_resumes_from_its_own_checkpoints_exactly(cls):
    """torch's loader copies a checkpoint's group keys in: started from an AdamW checkpoint, the optimizer's own
    groups carried amsgrad & co. on, which marks a checkpoint of torch's, and its masters were dropped at every
    resume (a reviewer's repro). The load drops torch's flags; the resumed run is the uninterrupted one."""
    m = _linear(torch.bfloat16)
    adamw = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _train(m, adamw, 1)
    opt = cls(m.parameters(), lr=1e-2)
    opt.load_state_dict(adamw.state_dict())
    _train(m, opt, 3, seed=3)
    sd = copy.deepcopy(opt.state_dict())
    assert not set(sd["param_groups"][0]) & {"amsgrad", "maximize", "foreach", "capturable", "fused"}
    m2 = copy.deepcopy(m)
    _train(m, opt, 2, seed=4)
    _close(opt)
    opt2 = cls(m2.parameters(), lr=1e-2)
    opt2.load_state_dict(sd)
    _train(m2, opt2, 2, seed=4)
    _close(opt2)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
