"""opt.state of an OffloadAdam whose step() returns before the host update ends (async_step, delay=True).

Its tensors are views of the engine's host memory, which the update queued by step() is still writing: a read
right after step() saw the step count, moments or master of before the update (or of part of it), and an
in-place change landed before or inside the update instead of after it (a reviewer's runs: `step` 1 where
FusedAdam had 2, weights 1e-2 apart after an `exp_avg.zero_()`). A read or change through this dict first waits
for the update, installing no weights (so delay's training is the same whether or not opt.state is read). The
optimizer's own uses come before step() marks the update in flight (its bookkeeping) or at the next step(),
by when backward has waited for it: none waits in a forward or backward."""
import collections
import functools
import weakref


class EngineState(collections.defaultdict):
    """A defaultdict(dict) whose every use waits for the update in flight (OffloadAdam._update_in_flight)."""

    def __init__(self, opt, entries=()):
        super().__init__(dict, entries)
        self._opt = weakref.ref(opt)

    def _wait(self) -> None:
        opt = self._opt()
        if opt is None or not getattr(opt, "_update_in_flight", False):
            return
        if opt._engine is not None and not opt._engine.closed:
            opt._engine.wait_updates()
        opt._update_in_flight = False   # after the wait: one a Ctrl-C cut short is waited for again

    def copy(self):
        self._wait()
        return collections.defaultdict(dict, self)

    def __reduce__(self):   # pickled or copied as torch's own opt.state, without the optimizer
        self._wait()
        return collections.defaultdict, (dict,), None, None, iter(dict.items(self))


def _waiting(name: str):
    method = getattr(collections.defaultdict, name)

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        self._wait()
        return method(self, *args, **kwargs)
    return call


for _name in ("__getitem__", "__setitem__", "__delitem__", "__contains__", "__iter__", "__reversed__", "__len__",
              "__repr__", "__eq__", "__ne__", "__or__", "__ior__", "get", "items", "keys", "values", "pop", "popitem",
              "setdefault", "clear", "update"):
    setattr(EngineState, _name, _waiting(_name))


def own_state(opt) -> None:
    """opt.state made an EngineState, its entries kept: at construction (what a caller holds as opt.state
    stays it), and where torch's load_state_dict (or a user) put another dict in its place."""
    if not isinstance(opt.state, EngineState):
        opt.state = EngineState(opt, opt.state)


def update_queued(opt) -> None:
    """After step(): where the update goes on after it returns (async_step, delay), opt.state's next use
    waits for it."""
    if not opt._delay:   # async_step's too (it runs on delay's machinery)
        return
    own_state(opt)
    opt._update_in_flight = True
