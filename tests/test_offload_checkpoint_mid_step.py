"""OffloadAdam's state_dict() between a backward and its step() (a reviewer's resume fuzz: every mode resumed bit
for bit from a checkpoint at a step boundary, and the exact ones from one taken mid-step too). overlap=True has
updated the parameters during that backward, so the state is the step's while the loop has yet to take it: a run
resumed from it took that step twice. delay=True past its warm-up took this step's gradients at weights a step
stale, which no checkpoint holds: a run resumed from it parts from the saving one. Both warned of (a hook may save
inside a backward, which an exception would break)."""
import warnings

import pytest
import torch

from effmem import OffloadAdam


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).bfloat16()


def backward(m, s):
    g = torch.Generator().manual_seed(s)
    x, y = torch.randn(8, 16, generator=g).bfloat16(), torch.randn(8, 8, generator=g)
    torch.nn.functional.mse_loss(m(x).float(), y).backward()


def test_delay_warns_of_a_checkpoint_whose_gradients_were_taken_at_stale_weights():
    m = model()
    opt = OffloadAdam(m.parameters(), lr=1e-3, delay=True, delay_warmup=1, num_threads=1)
    opt.attach(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.state_dict()                 # before any backward
        backward(m, 0)
        opt.state_dict()                 # the first step's gradients: exact weights
        opt.step()
        opt.zero_grad()
        backward(m, 1)
        opt.state_dict()                 # warm-up: the first step's weights were installed at once
        opt.step()
        opt.zero_grad()
        opt.state_dict()                 # a step boundary (it installs the update: the next gradients are exact)
        backward(m, 2)
        opt.state_dict()
        opt.step()
        opt.zero_grad()
    backward(m, 3)                       # past the warm-up: taken at weights a step stale
    with pytest.warns(UserWarning, match=r"state_dict\(\) between a backward and its step\(\): this step's "
                                         r"gradients were taken at weights one step stale"):
        opt.state_dict()
    opt.step()
    opt.zero_grad()
    opt.flush()                          # the update installed before the next backward: its gradients exact
    backward(m, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.state_dict()
    opt.close()


def test_delay_warns_of_stale_gradients_waiting_in_p_grad_and_not_after_a_load():
    """stream_grads=False leaves the gradients in p.grad until step(): the engine has none queued, and the save was
    silent; after load_state_dict() the next backward runs at the loaded weights, and a save warned of stale ones
    (a reviewer's repros)."""
    m = model()
    opt = OffloadAdam(m.parameters(), lr=1e-3, delay=True, delay_warmup=0, stream_grads=False, num_threads=1)
    opt.attach(m)
    backward(m, 0)
    opt.step()
    opt.zero_grad()
    checkpoint = opt.state_dict()        # (it installs the update)
    backward(m, 1)
    opt.step()
    opt.zero_grad()
    backward(m, 2)
    with pytest.warns(UserWarning, match=r"delay=True\).state_dict\(\) between a backward and its step\(\)"):
        opt.state_dict()
    opt.zero_grad()
    opt.load_state_dict(checkpoint)
    backward(m, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.state_dict()
    opt.close()


def test_async_step_saves_mid_step_without_a_word():
    m = model()
    opt = OffloadAdam(m.parameters(), lr=1e-3, async_step=True, num_threads=1)
    opt.attach(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for s in range(3):
            backward(m, s)
            opt.state_dict()
            opt.step()
            opt.zero_grad()
    opt.close()


def test_overlap_warns_of_a_checkpoint_between_the_backward_that_updated_and_step():
    m = model()
    opt = OffloadAdam(m.parameters(), lr=1e-3, overlap=True, num_threads=1)
    with opt.accumulating():
        backward(m, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.state_dict()                 # inside an accumulation round: nothing updated yet
    backward(m, 1)
    with pytest.warns(UserWarning, match=r"overlap=True\).state_dict\(\) between a backward and its step\(\): the "
                                         r"backward has updated the parameters already"):
        opt.state_dict()
    opt.step()
    assert opt.state_dict()["state"][0]["step"] == 1
    opt.close()


@pytest.mark.parametrize("mode", [{}, {"async_step": True}])
def test_torch_dcp_state_helpers_before_the_first_step_leave_the_held_gradients_alone(mode):
    """torch.distributed.checkpoint's get_optimizer_state_dict makes a stateless optimizer's state by a step() at
    lr 0 with zero gradients unless some p.grad is set. Between OffloadAdam's first backward and first step the
    gradients are in the engine: that step took them at lr 0 and counted a step, the loop's step() then found
    nothing (weights 0.042 off the uninterrupted run after 3 steps: a reviewer's run). Now the state is left to
    the step to come, as for torch's AdamW with its p.grad set, and the run is the uninterrupted one bit for
    bit."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def run(peek):
        m = model()
        opt = OffloadAdam(m.parameters(), lr=1e-2, num_threads=1, **mode)
        if mode:
            opt.attach(m)
        for s in range(3):
            backward(m, s)
            if peek and s == 0:
                assert get_optimizer_state_dict(m, opt)["state"] == {}   # AdamW's answer there too
                assert opt._engine.counters()["param_updates"] == 0
            opt.step()
            opt.zero_grad()
        opt.close()
        return [p.detach() for p in m.parameters()]

    for p, q in zip(run(True), run(False)):
        assert torch.equal(p, q)
