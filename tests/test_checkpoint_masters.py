"""A checkpoint's float32 masters of bf16 parameters against the model's weights at the first step after the load
(effmem/optim/_adam_entries.take_masters_off_params)."""
import copy
import warnings

import pytest
import torch

from effmem import FusedAdam, OffloadAdam

MAKE = {"fused": lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1),
        "offload": lambda p: OffloadAdam(p, lr=1e-2, weight_decay=0.1, num_threads=1)}


def mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).bfloat16()


def train_step(m, opt, s):
    g = torch.Generator().manual_seed(s)
    x, y = torch.randn(16, 8, generator=g).bfloat16(), torch.randn(16, 4, generator=g)
    torch.nn.functional.mse_loss(m(x).float(), y).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("kind", ["fused", "offload"])
def test_torch_adamw_state_loaded_partially_through_dcp_trains_the_loaded_weights(kind, tmp_path):
    """docs/offload_adam.md's route between torch's AdamW and effmem (dcp.load with allow_partial_load, in
    torch's order: model, then optimizer): get_optimizer_state_dict's state-making step had set the masters
    from the fresh model, AdamW's checkpoint has none to replace them, and the first step put them back into
    the model over the loaded weights (0.7 away, 68x the step's own update: a reviewer's run). The loaded
    weights now train, as AdamW's continued run does to bf16 rounding, with a warning that points at the
    caller's line."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        m = mlp(0)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        for s in range(3):
            train_step(m, opt, s)
        dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)},
                 checkpoint_id=str(tmp_path))
        train_step(m, opt, 3)
        fresh = mlp(1)
        fo = MAKE[kind](fresh.parameters())
        sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fo)}
        dcp.load(sd, checkpoint_id=str(tmp_path), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
        set_model_state_dict(fresh, sd["model"])
        set_optimizer_state_dict(fresh, fo, sd["optim"])
        with pytest.warns(UserWarning, match=f"{type(fo).__name__}: 4 loaded float32 masters .* held other "
                                             "weights than the model's .* as made from a model") as caught:
            train_step(fresh, fo, 3)
        assert {w.filename for w in caught} == {__file__}
        if kind == "offload":
            fo.close()
        for p, q in zip(fresh.parameters(), m.parameters()):
            assert float((p.detach().float() - q.detach().float()).abs().max()) < 0.02   # bf16 rounding, 1e-2 step
    finally:
        dist.destroy_process_group()


def resume_bit_for_bit(kind, step, model_first=True):
    """Four steps of `step`, saved after two (opt.state_dict() and the model's), resumed in a fresh model and
    optimizer (the model's weights loaded before or after the optimizer's state): no warning, the same bits."""
    m = mlp(0)
    opt = MAKE[kind](m.parameters())
    for s in range(2):
        step(m, opt, s)
    saved_opt, saved_model = copy.deepcopy(opt.state_dict()), copy.deepcopy(m.state_dict())
    for s in range(2, 4):
        step(m, opt, s)
    fresh = mlp(1)
    fo = MAKE[kind](fresh.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if model_first:
            fresh.load_state_dict(saved_model)
        fo.load_state_dict(saved_opt)
        if not model_first:
            fresh.load_state_dict(saved_model)
        for s in range(2, 4):
            step(fresh, fo, s)
    for o in (opt, fo):
        if kind == "offload":
            o.close()
    for p, q in zip(fresh.parameters(), m.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kind", ["fused", "offload"])
@pytest.mark.parametrize("model_first", [True, False])
def test_own_checkpoints_keep_their_masters_in_either_order(kind, model_first):
    """A checkpoint's parameters are its masters rounded: loaded before or after the model's weights, its masters
    stay and the run resumes bit for bit."""
    resume_bit_for_bit(kind, train_step, model_first)


@pytest.mark.parametrize("kind", ["fused", "offload"])
def test_a_loop_that_clamps_its_weights_between_steps_resumes_bit_for_bit(kind):
    """A write into the parameters between steps (WGAN's clamp) is overwritten by the next step, and is saved in
    the checkpoint's parameters: their masters are trained ones, not a model's weights, so they stay (taken from
    the clamped parameters, the resumed run had parted from the uninterrupted one by 0.03: a reviewer's run)."""
    def clamped_step(m, opt, s):
        train_step(m, opt, s)
        with torch.no_grad():
            for p in m.parameters():
                p.clamp_(-0.1, 0.1)

    resume_bit_for_bit(kind, clamped_step)
