"""Wrappers that pose as their optimizer's class, as Lightning's LightningOptimizer and Fabric's _FabricOptimizer
do (effmem/optim/_wrappers.py): a class of (wrapper, the optimizer's class), attribute reads the wrapper lacks
taken from the optimizer. PoseWrapper below is that pattern, written here so the tests need no Lightning
(checked against lightning 2.6.6 too: Trainer.fit, Fabric and manual optimization)."""
import gc

import pytest
import torch

from effmem import FusedAdam, OffloadAdam


class PoseWrapper:
    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.__class__ = type("Pose" + optimizer.__class__.__name__, (self.__class__, optimizer.__class__), {})

    def step(self, closure=None):
        return self._optimizer.step(closure)

    def __getattr__(self, item):
        return getattr(self._optimizer, item)


MAKE = {"fused": lambda p: FusedAdam(p, lr=1e-2),
        "offload": lambda p: OffloadAdam(p, lr=1e-2, num_threads=1)}


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))


def run(kind, wrap, max_norm, steps=4):
    m = model()
    opt = MAKE[kind](m.parameters())
    used = PoseWrapper(opt) if wrap else opt
    assert isinstance(used, type(opt))
    g = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        norms.append(float(used.clip_grad_norm_(max_norm)))
        used.step()
        used.zero_grad()
    if kind == "offload":
        opt.close()
    return torch.cat([p.detach().flatten() for p in m.parameters()]), norms


@pytest.mark.parametrize("kind", ["fused", "offload"])
def test_clip_through_a_wrapper_clips(kind):
    """opt.clip_grad_norm_ on the wrapper wrote its factor on the wrapper, and the wrapped optimizer's step never
    saw it: the clipped run came out bit-identical to an unclipped one (a reviewer's Fabric run)."""
    plain, plain_norms = run(kind, False, 0.01)
    wrapped, wrapped_norms = run(kind, True, 0.01)
    unclipped, _ = run(kind, False, 1e9)
    assert not torch.equal(plain, unclipped)
    assert torch.equal(wrapped, plain) and wrapped_norms == plain_norms


def test_dropping_a_wrapper_leaves_offload_adam_open():
    """The wrapper class inherited OffloadAdam's __del__, which closed the optimizer it wrapped when Lightning's
    Trainer dropped its first wrappers during setup: every Trainer.fit failed at its first zero_grad."""
    m = model()
    opt = OffloadAdam(m.parameters(), lr=1e-2, num_threads=1, async_step=True)
    wrapper = PoseWrapper(opt)
    wrapper.attach(m)
    m(torch.randn(4, 16)).sum().backward()
    wrapper.step()   # an update in flight under async_step: still the optimizer's to install
    del wrapper
    gc.collect()
    opt.flush()
    m(torch.randn(4, 16)).sum().backward()
    opt.step()
    assert opt.state[m[0].weight]["step"] == 2
    opt.close()


def test_methods_the_wrapper_defines_stay_its_own():
    """Only what the wrapper lacks goes to the optimizer: its own step runs (Lightning's calls its strategy),
    and a user's subclass of an effmem optimizer (an optimizer itself) is no wrapper."""
    calls = []

    class Counting(PoseWrapper):
        def step(self, closure=None):
            calls.append(closure)
            return super().step(closure)

    class MyAdam(FusedAdam):
        def clip_grad_norm_(self, max_norm, **kwargs):
            self.mine = True
            return super().clip_grad_norm_(max_norm, **kwargs)

    m = model()
    opt = MyAdam(m.parameters(), lr=1e-2)
    wrapper = Counting(opt)
    m(torch.randn(4, 16)).sum().backward()
    wrapper.clip_grad_norm_(1.0)
    wrapper.step()
    assert calls == [None] and opt.mine and "mine" not in vars(wrapper)


def test_an_optimizer_with_a_getattr_mixin_is_still_closed_when_dropped():
    """A user's OffloadAdam subclass with a mixin that defines __getattr__ looks like a wrapper's class, but
    holds no optimizer: its calls run on itself, and dropping it closes it as dropping an OffloadAdam does."""
    class Defaults:
        def __getattr__(self, item):
            if item == "tag":
                return "default"
            raise AttributeError(item)

    class Tagged(Defaults, OffloadAdam):
        pass

    m = model()
    opt = Tagged(m.parameters(), lr=1e-2, num_threads=1)
    engine = opt._engine
    m(torch.randn(4, 16)).sum().backward()
    assert float(opt.clip_grad_norm_(1e9)) > 0 and opt.tag == "default"
    opt.step()
    assert opt.state[m[0].weight]["step"] == 1
    del opt
    gc.collect()
    assert engine.closed
