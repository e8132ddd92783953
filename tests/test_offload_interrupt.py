"""Ctrl-C in OffloadAdam. The engine waits without the GIL and checks no signals, so a KeyboardInterrupt lands as
its call returns, after it took the gradient or the step: the optimizer's bookkeeping must say so. Modelled here
by an engine whose call raises KeyboardInterrupt once it has returned (a reviewer's runs with a real SIGINT and
delayed copies showed the interrupt raised at that line)."""
import pytest
import torch

from effmem import OffloadAdam


class InterruptedOnReturn:
    """The engine, but `method`'s next call raises KeyboardInterrupt after it ran."""

    def __init__(self, engine, method: str):
        self._engine, self._method, self._armed = engine, method, True

    def __getattr__(self, name):
        real = getattr(self._engine, name)
        if name != self._method or not self._armed:
            return real

        def call(*args, **kwargs):
            self._armed = False
            real(*args, **kwargs)
            raise KeyboardInterrupt
        return call


def model_and_batch():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)), torch.randn(8, 16)


@pytest.mark.parametrize("mode", [dict(delay=True), {}], ids=["delay", "plain"])
def test_a_gradient_interrupted_on_its_hand_over_is_counted_once(mode):
    """In delay mode grad_ready waits for the previous update, where a Ctrl-C is likely: the gradient it took
    stayed in p.grad too, and the next clip or step() handed it over again (its norm counted twice)."""
    model, x = model_and_batch()
    opt = OffloadAdam(model.parameters(), lr=1e-2, **mode)
    params = list(model.parameters())
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    grads = torch.autograd.grad(model(x).sum(), params)   # at the weights the next backward reads
    real = opt._engine
    opt._engine = InterruptedOnReturn(real, "grad_ready")
    with pytest.raises(KeyboardInterrupt):
        model(x).sum().backward()   # the first gradient handed over is interrupted, the rest never made
    opt._engine = real
    assert len(opt._queued) == 1 and all(p.grad is None for p in params)
    (i,) = opt._queued
    got = opt.clip_grad_norm_(1e9)
    assert torch.allclose(got, grads[i].float().norm(), rtol=1e-5), (float(got), float(grads[i].norm()))
    opt.close()


def test_a_step_interrupted_on_return_keeps_its_bookkeeping():
    """The step was taken: the next backward must run on this step's settings (an lr set to 0 was ignored by
    overlap's updates after an interrupted step), and count it (delay's warm-up clock)."""
    model, x = model_and_batch()
    opt = OffloadAdam(model.parameters(), lr=1e-2, overlap=True)
    model(x).sum().backward()
    real = opt._engine
    opt._engine = InterruptedOnReturn(real, "step")
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    opt._engine = real
    assert opt._step_count == 1 and not opt._queued and not opt._in_backward
    opt.zero_grad()
    for g in opt.param_groups:
        g["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.flush()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.close()


def test_an_interrupt_before_the_engine_takes_a_later_micro_batch_keeps_it_in_p_grad(monkeypatch):
    """An interrupt on a line of the hand-over before the engine's call, in the second micro-batch: the parameter
    was already queued by the first, which made it look taken, and its gradient was dropped from p.grad while
    the engine never had it (a reviewer's repro)."""
    from effmem.optim import _validate
    model, x = model_and_batch()
    opt = OffloadAdam(model.parameters(), lr=1e-2)
    with opt.accumulating():
        model(x).sum().backward()
    real, armed = _validate.grad_like, [True]

    def interrupted(p, g):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        return real(p, g)
    monkeypatch.setattr(_validate, "grad_like", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model(2 * x).sum().backward()
    assert sum(p.grad is not None for p in model.parameters()) == 1   # the one interrupted, still the user's
    opt.close()


@pytest.mark.parametrize("flush", ["flush", "state_dict", "eval_forward"])
def test_a_delay_flush_between_forward_and_backward_makes_the_backward_refuse(flush):
    """delay=True installs a step's weights during the next backward; a flush before it (opt.flush(), the model's
    state_dict() or an evaluation forward under attach(), from another thread say) installed them under the
    graph of a forward that read the old ones, with no version change: its backward ran on other weights than
    its forward's, without an error (a reviewer's repro). Now it refuses, as torch does after an in-place write."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = OffloadAdam(model.parameters(), lr=0.1, delay=True)
    opt.attach(model)
    x = torch.randn(8, 16)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    loss = model(x).square().mean()
    if flush == "flush":
        opt.flush()
    elif flush == "state_dict":
        model.state_dict()
    else:
        with torch.no_grad():
            model.eval()(x)
        model.train()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    opt.zero_grad()
    model(x).square().mean().backward()   # a forward after the flush trains on
    opt.step()
    opt.close()


class _ClearInterrupted(set):
    """opt._queued, whose clear() is interrupted once it returned (where CPython delivers a pending signal)."""

    def clear(self):
        super().clear()
        raise KeyboardInterrupt


def test_an_interrupt_inside_the_steps_bookkeeping_still_counts_the_step():
    """A real SIGALRM landed just after step()'s bookkeeping cleared its queue (a reviewer's loop of 2,623 tries):
    the step the engine took went uncounted and the next backward ran as if inside this one."""
    model, x = model_and_batch()
    opt = OffloadAdam(model.parameters(), lr=1e-2, delay=True, delay_warmup=10)
    model(x).sum().backward()
    opt._queued = _ClearInterrupted(opt._queued)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert opt._step_count == 1 and not opt._in_backward and opt._plain_backwards == 0
    opt.close()
