"""OffloadAdam's lifetime (a mixin of OffloadAdam): flush, counters, close and the context manager."""
import collections
import os
import weakref
from typing import Dict, Iterable, Tuple

import torch
from torch import Tensor

# id(param) -> (the parameter, the open OffloadAdam stepping it), both weakly: an OffloadAdam's gradient hooks
# take each gradient off its parameter as backward makes it, so a second optimizer over the same parameters
# (FusedAdam, or an OffloadAdam built while the first is still referenced) would silently never train.
_OWNERS: Dict[int, Tuple[weakref.ref, weakref.ref]] = {}

# In a process forked from the one that made an OffloadAdam: its engine has none of its threads there, and its
# gradient hooks stay on the parameters until close() (the engine's own message said to build a new optimizer,
# which was refused until then: a reviewer's run).
FORKED = ("OffloadAdam: this optimizer's engine belongs to the process that made it; this process was forked "
          "from it and has none of its threads. Call opt.close() here to use the model without it (it keeps the "
          "weights installed before the fork), then build a new optimizer if this process trains")


def _owner(p: Tensor):
    entry = _OWNERS.get(id(p))
    if entry is None:
        return None
    q, opt = entry[0](), entry[1]()
    if q is not p or opt is None or opt._engine is None or opt._engine.closed:
        del _OWNERS[id(p)]   # stale: the parameter or its optimizer is gone, or closed
        return None
    return opt


def check_unowned(params: Iterable[Tensor], who: str, me=None) -> None:
    """Refuses parameters an open OffloadAdam (other than `me`) steps."""
    for i, p in enumerate(params):
        other = _owner(p)
        if other is not None and other is not me:
            if os.getpid() != other._pid:
                raise ValueError(f"params: parameter {i} (shape {tuple(p.shape)}) is stepped by an OffloadAdam "
                                 "made in the process this one was forked from, whose gradient hooks are still on "
                                 "it: call that optimizer's close() here first")
            raise ValueError(f"params: parameter {i} (shape {tuple(p.shape)}) is stepped by another OffloadAdam, "
                             f"still open, whose gradient hooks take its gradients, so this {who} would never "
                             "see them; close() the other one first (or del it)")


def claim(opt, params: Iterable[Tensor]) -> None:
    for p in params:
        _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(opt))


def release(opt, params: Iterable[Tensor]) -> None:
    for p in params:
        if _owner(p) is opt:
            del _OWNERS[id(p)]


class OffloadLifetime:
    def flush(self) -> None:
        """Waits for the updates in flight and, with ``delay=True``, copies the weights not yet
        installed into the parameters: afterwards they hold every step taken so far."""
        self._check_open()
        self._synchronize()

    def _synchronize(self) -> None:
        """The engine's synchronize, the parameters it wrote (delay: weights not installed yet) marked as changed
        in place: a graph saved before refuses its backward, as torch's does after an in-place write, where a
        flush between a forward and its backward (opt.flush(), model.state_dict(), an evaluation forward) made
        the backward use weights other than its forward's, silently (a reviewer's repro)."""
        written = self._engine.synchronize()
        self._stale_next = False   # the next backward's gradients are exact
        if written:
            torch.autograd.graph.increment_version([self._local[i] for i in written])

    def counters(self) -> Dict[str, int]:
        """bytes_down / bytes_up (gradient and weight copies so far), param_updates, accumulations,
        landed_sq_sums (gradients whose sum of squares clip_grad_norm_ took as they landed), and the host
        memory held: engine_pinned_bytes, engine_pageable_bytes (this engine) and
        process_pinned_bytes, process_pageable_bytes (every live effmem engine), and device_state_params,
        device_state_bytes (the parameters device_state kept on the device, and the bytes their step needs)."""
        self._check_open()
        return {**self._engine.counters(), **self._resident_counters()}

    def close(self) -> None:
        """Stops the engine's threads and releases its memory (state tensors handed out stay valid)."""
        release(self, getattr(self, "_params", []))
        for h in self._hooks + self._ddp_handles + self._forward_hooks:
            h.remove()
        self._hooks, self._ddp_handles, self._forward_hooks = [], [], []
        if self._engine is not None and not self._engine.closed:
            try:
                # the last step's weights into the parameters (not in a process forked from the one that
                # made the engine: it has none of the engine's threads, and close() only lets go there)
                if self._delay and os.getpid() == self._pid:
                    self._synchronize()
            finally:
                self._engine.close()
                # Let go of the host state, so that its memory goes now rather than with this
                # object; tensors the caller took from state_dict() keep theirs alive.
                self.state = collections.defaultdict(dict)
                self._views = []
                if getattr(self, "_resident_opt", None) is not None:   # device_state's GPU state goes too
                    self._resident_opt.state = collections.defaultdict(dict)

    def __del__(self):
        # Dropped without close(): the parameters must still hold every step taken, as after a torch
        # optimizer's last step. async_step and delay keep the last update on the host until a forward
        # or a flush installs it; close() does. (A failure here, e.g. at interpreter exit, can only be
        # printed by Python: nothing raised from __del__ reaches the caller.)
        engine = getattr(self, "_engine", None)
        if engine is not None and not engine.closed:
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._engine is None or self._engine.closed:
            raise RuntimeError("OffloadAdam: this optimizer was closed")
        if os.getpid() != getattr(self, "_pid", os.getpid()):   # a step() with nothing pending returned quietly
            raise RuntimeError(FORKED)
        err = getattr(self, "_ddp_error", None)
        if err is not None:
            raise RuntimeError(f"OffloadAdam: handing DDP's gradients to the engine failed: {err}") from err

    # Optimizer.__repr__ and __getstate__ work as for any optimizer; the engine
    # itself cannot be pickled or deep-copied (it owns threads and host memory).
    def __getstate__(self):
        raise TypeError("OffloadAdam cannot be pickled or copied; save opt.state_dict() instead")
