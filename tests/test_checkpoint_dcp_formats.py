"""torch.distributed.checkpoint's partial load between 8-bit and float32 moments (docs/offload_adam.md): the
checkpoint's moments are under other keys than the loading template's, so only the step count loads and the
template's zeros stay. Not silent any more: the load warns (effmem/optim/_adam_entries.warn_zero_moments)."""
import warnings

import pytest
import torch

from effmem import FusedAdam, OffloadAdam
from test_checkpoint_masters import train_step


def make(kind, params, bits):
    if kind == "fused":
        return FusedAdam(params, lr=1e-2, state_bits=bits)
    return OffloadAdam(params, lr=1e-2, state_bits=bits, num_threads=1)


def mlp(seed):
    torch.manual_seed(seed)   # 1024 weights: four 8-bit blocks in the first layer
    return torch.nn.Sequential(torch.nn.Linear(8, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4)).bfloat16()


@pytest.mark.parametrize("kind", ["fused", "offload"])
@pytest.mark.parametrize("bits", [(32, 8), (8, 32), (8, 8)], ids=["32to8", "8to32", "8to8"])
def test_dcp_partial_load_across_state_bits_warns_of_zero_moments(kind, bits, tmp_path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    opened = []
    try:
        m = mlp(0)
        opt = make(kind, m.parameters(), bits[0])
        opened.append(opt)
        for s in range(3):
            train_step(m, opt, s)
        dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)},
                 checkpoint_id=str(tmp_path))
        fresh = mlp(1)
        fo = make(kind, fresh.parameters(), bits[1])
        opened.append(fo)
        sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fo)}
        dcp.load(sd, checkpoint_id=str(tmp_path), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
        set_model_state_dict(fresh, sd["model"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            set_optimizer_state_dict(fresh, fo, sd["optim"])
        zero = [w for w in caught if "second moment (exp_avg_sq) is 0 at step 3" in str(w.message)]
        if bits[0] == bits[1]:   # the same keys: the moments loaded, nothing to say
            assert not zero, [str(w.message) for w in caught]
            for mine, theirs in zip(fo.state_dict()["state"].values(), opt.state_dict()["state"].values()):
                assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        else:
            assert len(zero) == 1 and zero[0].filename == __file__, [(str(w.message), w.filename) for w in caught]
            assert str(zero[0].message).startswith(f"{type(fo).__name__}.load_state_dict: every parameter's")
    finally:
        for o in opened:
            if isinstance(o, OffloadAdam):
                o.close()
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["fused", "offload"])
def test_state_of_zero_gradients_is_not_taken_for_a_template(kind):
    """Moments of zeros at step 0 (a state made before any step) and a load with some moment nonzero: quiet."""
    m = mlp(0)
    opt = make(kind, m.parameters(), 32)
    train_step(m, opt, 0)
    sd = opt.state_dict()
    sd["state"][0]["exp_avg_sq"].zero_()   # one parameter that never had a gradient: the others still hold v
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(kind, mlp(0).parameters(), 32).load_state_dict(sd)
    if kind == "offload":
        opt.close()
