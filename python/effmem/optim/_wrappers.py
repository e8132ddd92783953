"""Optimizer wrappers that pose as their optimizer's class.

Lightning's LightningOptimizer and Fabric's _FabricOptimizer make, for each optimizer they wrap, a class with
two bases (the wrapper's and the optimizer's class) and read from the optimizer what the wrapper lacks
(__getattr__). An effmem method called on such a wrapper then ran with `self` the wrapper: what it read came
from the optimizer, but what it wrote landed on the wrapper, and the optimizer never saw it. Clipping through
`opt.clip_grad_norm_` (Fabric, Lightning's manual optimization) was lost at every step, silently (its factor
written on the wrapper); and OffloadAdam's __del__, inherited by the wrapper, closed the optimizer it wrapped
when Lightning dropped a wrapper: every `Trainer.fit` failed at its first zero_grad ("this optimizer was closed").

A class made so (found when it is made, by __init_subclass__) gets, for each method of the optimizer's class
that the wrapper does not define itself, one that calls the wrapped optimizer's; its __del__ does nothing.
"""
import functools
from typing import Optional

import torch

# dunder methods that run on the wrapped optimizer too (the rest are the object's own machinery)
_FORWARDED_DUNDERS = ("__enter__", "__exit__")


def _posed_class(cls: type) -> Optional[type]:
    """The optimizer class that cls poses as (an effmem optimizer's, or a user's subclass of one), where cls
    is such a wrapper: before that class in cls's MRO comes a class that is no optimizer and forwards
    attribute reads (__getattr__). A user's subclass of FusedAdam (an optimizer itself) is not one."""
    mro = cls.__mro__
    first = next((i for i, c in enumerate(mro) if i > 0 and issubclass(c, torch.optim.Optimizer)), None)
    if first is None:
        return None
    if any("__getattr__" in vars(c) for c in mro[1:first]):
        return mro[first]
    return None


def _wrapped(wrapper, ours: type):
    """The optimizer a wrapper holds (Lightning's and Fabric's under `_optimizer`); the wrapper itself where it
    holds none (its calls then run on it, as before)."""
    held = vars(wrapper)
    inner = held.get("_optimizer")
    if isinstance(inner, ours) and inner is not wrapper:
        return inner
    return next((v for v in held.values() if isinstance(v, ours) and v is not wrapper), wrapper)


def _forward_method(name: str, ours: type, original):
    @functools.wraps(original)
    def call(self, *args, **kwargs):
        inner = _wrapped(self, ours)
        if inner is self:
            return original(self, *args, **kwargs)
        return getattr(inner, name)(*args, **kwargs)
    return call


def _forward_property(name: str, ours: type) -> property:
    return property(lambda self: getattr(_wrapped(self, ours), name), doc=f"the wrapped optimizer's {name}")


def _drop_wrapper(ours: type):
    original = getattr(ours, "__del__", None)

    def drop(self) -> None:
        """A wrapper going away leaves the optimizer it wraps as it is (open, its last update kept); an
        optimizer of such a class holding none (a user's mixin with a __getattr__) is closed as ours is."""
        if _wrapped(self, ours) is self and original is not None:
            original(self)
    return drop


def forward_to_wrapped(cls: type) -> None:
    ours = _posed_class(cls)
    if ours is None:
        return
    mro = cls.__mro__
    first = mro.index(ours)
    own = {name for c in mro[:first] for name in vars(c)}   # the wrapper's own methods (step, state_dict) stay
    done = set()
    for c in mro[first:]:
        for name, value in vars(c).items():
            if name in own or name in done or (name.startswith("__") and name not in _FORWARDED_DUNDERS):
                continue
            done.add(name)
            if isinstance(value, property):
                setattr(cls, name, _forward_property(name, ours))
            elif callable(value) and not isinstance(value, (staticmethod, classmethod, type)):
                setattr(cls, name, _forward_method(name, ours, value))
    if "__del__" not in own:
        cls.__del__ = _drop_wrapper(ours)
