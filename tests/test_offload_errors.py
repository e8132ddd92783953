"""OffloadAdam refuses to go on silently wrong (issue 14): a parameter given new memory after the
optimizer was built, and an overlapped backward that raised after updating some buckets."""
import pytest
import torch

from effmem import FusedAdam, OffloadAdam
from offload_helpers import HP, batches, tiny_gpt


@pytest.mark.parametrize("change", ["data", "half", "resize"])
def test_a_parameter_replaced_after_construction_is_refused(change):
    model = tiny_gpt(torch.float32)
    opt = OffloadAdam(model.parameters(), **HP)
    x, y = batches(1)[0]
    model(x, y)[1].backward()
    opt.step()
    opt.zero_grad()
    weight = model.head.weight
    if change == "data":
        weight.data = weight.data.clone()
        match = r"parameter \d+ \(param group 0, shape \(256, 32\)\) was replaced .*\(its memory;"
    elif change == "half":
        model.half()
        match = r"was replaced after the optimizer was built \(dtype torch.float32 -> torch.float16"
    else:
        weight.data = torch.zeros(10, 32)
        match = r"shape \(256, 32\) -> \(10, 32\)"
    with pytest.raises(RuntimeError, match=match):
        opt.step()
    if change != "resize":   # the first hook of a backward checks too
        with pytest.raises(RuntimeError, match="was replaced after the optimizer was built"):
            model(x.clone(), y)[1].float().backward()
    opt.close()


def test_unchanged_parameters_train_as_before():
    model = tiny_gpt(torch.float32)
    with OffloadAdam(model.parameters(), **HP) as opt:
        for x, y in batches(3):
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()


def _raise_in_backward(model):
    first = model.tok_emb.weight
    return first.register_hook(lambda g: (_ for _ in ()).throw(ValueError("a user hook failed")))


def test_overlap_backward_that_raises_midway_refuses_further_steps():
    """Buckets whose gradients had all landed were updated during the failed backward: FusedAdam
    fed the same data would not have taken that partial step. Refuse until the caller decides."""
    model = tiny_gpt(torch.float32)
    ref = tiny_gpt(torch.float32)
    opt = OffloadAdam(model.parameters(), overlap=True, bucket_size=2000, **HP)
    data = batches(3)
    model(*data[0])[1].backward()
    opt.step()
    opt.zero_grad()
    handle = _raise_in_backward(model)
    with pytest.raises(ValueError, match="a user hook failed"):
        model(*data[1])[1].backward()
    handle.remove()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"a backward raised after \d+ parameter updates had already been applied"):
        opt.step()
    with pytest.raises(RuntimeError, match="Further steps are refused"):
        model(*data[2])[1].backward()        # the next backward's first hook refuses too
    # the documented ways on: accept the partial step, or reload a checkpoint
    opt.accept_partial_step()
    model.zero_grad(set_to_none=True)
    model(*data[2])[1].backward()
    opt.step()
    opt.close()
    del ref


def test_overlap_failed_backward_then_checkpoint_reload_matches_fused_adam():
    torch.manual_seed(0)
    model, twin = tiny_gpt(torch.float32), tiny_gpt(torch.float32)
    opt = OffloadAdam(model.parameters(), overlap=True, bucket_size=2000, **HP)
    ref = FusedAdam(twin.parameters(), **HP)
    data = batches(3)
    for m, o in ((model, opt), (twin, ref)):
        m(*data[0])[1].backward()
        o.step()
        o.zero_grad()
    saved_opt, saved_model = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = {"state": {k: {n: t.clone() for n, t in s.items()} for k, s in saved_opt["state"].items()},
                 "param_groups": saved_opt["param_groups"]}
    handle = _raise_in_backward(model)
    with pytest.raises(ValueError):
        model(*data[1])[1].backward()
    handle.remove()
    opt.zero_grad()
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    for m, o in ((model, opt), (twin, ref)):
        for x, y in data[1:]:
            m(x, y)[1].backward()
            o.step()
            o.zero_grad()
    opt.flush()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    opt.close()


def test_a_failed_backward_without_overlap_is_left_to_the_caller():
    """Without overlap nothing is updated during backward: zero_grad() is the whole recovery, as in torch."""
    model = tiny_gpt(torch.float32)
    opt = OffloadAdam(model.parameters(), bucket_size=2000, **HP)
    handle = _raise_in_backward(model)
    with pytest.raises(ValueError):
        model(*batches(1)[0])[1].backward()
    handle.remove()
    opt.zero_grad()
    model(*batches(1)[0])[1].backward()
    opt.step()
    opt.close()


@pytest.mark.parametrize("change", ["clear", "assign_tensor", "assign_entry", "del", "new_entry"])
def test_assigning_into_opt_state_is_refused_not_ignored(change):
    """opt.state's tensors are views of the engine's host memory: a reset by assignment or clear() (FusedAdam
    and torch honour it) never reached the engine, and the next step went on from the old moments (0.12 off
    torch's AdamW after a clear()). Refused at the next step() or state_dict(); in-place changes act, and
    load_state_dict() makes opt.state the engine's again."""
    model = tiny_gpt(torch.float32)
    unused = torch.nn.Parameter(torch.zeros(8))   # no gradient ever: no entry in opt.state
    opt = OffloadAdam([*model.parameters(), unused], **HP)
    data = batches(3)
    model(*data[0])[1].backward()
    opt.step()
    opt.zero_grad()
    saved = opt.state_dict()
    saved = {"state": {k: {n: t.clone() for n, t in s.items()} for k, s in saved["state"].items()},
             "param_groups": saved["param_groups"]}
    params = list(model.parameters())
    p = params[0]
    if change == "clear":
        opt.state.clear()
    elif change == "assign_tensor":
        opt.state[p]["exp_avg"] = torch.zeros_like(p)
    elif change == "assign_entry":
        opt.state[p] = {k: v.clone() for k, v in opt.state[p].items()}
    elif change == "del":
        del opt.state[p]
    else:
        opt.state[unused] = {"exp_avg": torch.ones_like(unused)}
    for call in (opt.step, opt.state_dict):
        with pytest.raises(RuntimeError, match=r"opt.state was changed by assignment, del or clear\(\)"):
            call()
    opt.load_state_dict(saved)
    opt.state[p]["exp_avg"].zero_()   # in place: reaches the engine
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], torch.zeros_like(p))
    model(*data[1])[1].backward()
    opt.step()
    opt.close()
