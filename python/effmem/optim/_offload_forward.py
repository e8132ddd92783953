"""OffloadAdam(async_step=True)'s forward side (a mixin of OffloadAdam): the hooks that install each
module's new weights before its forward reads them.

A plain module gets a forward pre-hook for the parameters it owns. Under FSDP2 (``fully_shard``) the
forward reads no parameter of its own: the unit's pre-forward hook all-gathers the local shards into full
weights first. So each FSDP unit gets one hook, placed before FSDP's own, for every parameter the unit
manages (its subtree, less nested units) and for those of the units it prefetches
(``set_modules_to_forward_prefetch``): the shards hold the new weights before any all-gather reads them.
"""
import os
import types
import weakref
from typing import Dict, List

import torch
from torch import nn

from effmem import _checks
from effmem._dynamo import forget_compiled_code
from effmem.optim._offload_guards import _backward_depth
from effmem.optim._validate import is_dtensor


class OffloadForward:
    def attach(self, model: nn.Module) -> nn.Module:
        """Ties the optimizer to the model it trains; returns the model. Called again after ``add_param_group``.

        async_step (required there): install each parameter's new weights before the forward that reads it (a
        forward pre-hook on every module owning one of this optimizer's parameters, or on every FSDP2 unit: call
        it after ``fully_shard``). Every mode: ``model.zero_grad()`` also drops the gradients a backward handed
        to the engine since the last step; ``model.state_dict()`` (a checkpoint, Hugging Face's Trainer
        saving one, ``save_pretrained``) first waits for the updates in flight and installs their weights
        (``flush()``), and so does a forward in eval mode without gradients (evaluation), which with
        ``delay=True`` would otherwise read weights one step old. Without it, a loop that does not call
        ``flush()`` itself saved weights that missed the last update (async_step, delay)."""
        _checks.module(model)
        self._check_open()
        if not any(p in self._index for p in model.parameters()):   # refused before the hooks it had go
            raise ValueError("model: none of its modules owns a parameter of this optimizer")
        for h in self._forward_hooks:
            h.remove()
        self._forward_hooks = []
        self._hook_flushes(model)
        self._attached = weakref.ref(model)
        if not self._async:
            return model
        units = _fsdp_units(model)
        if not units and any(is_dtensor(p) for p in self._index):
            raise ValueError("model: this optimizer's parameters are DTensors but no module of the model is an "
                             "FSDP2 unit; call attach(model) after fully_shard, on the model that was sharded")
        if units:
            ids_of = self._unit_ids(units)
            for unit in units.values():
                if ids_of[id(unit)]:
                    # prepend: before FSDP's pre-forward, which all-gathers what the hook installs
                    self._forward_hooks.append(
                        unit.register_forward_pre_hook(_Installer(self, ids_of[id(unit)], fsdp=True), prepend=True))
        inside = {id(m) for u in units.values() for m in _managed_modules(u, units)}
        for module in model.modules():
            if id(module) in inside:
                continue
            ids = [self._index[p] for p in _read_by(module) if p in self._index]
            if ids:
                # prepend: before the module's own pre-hooks (torch.nn.utils.weight_norm's, prune's and
                # spectral_norm's compute the weight from parameters this one installs)
                self._forward_hooks.append(module.register_forward_pre_hook(_Installer(self, ids), prepend=True))
        forget_compiled_code("OffloadAdam.attach", "attach()")
        return model

    def _hook_flushes(self, model: nn.Module) -> None:
        """state_dict pre-hooks on the model and on every module owning a parameter of this optimizer (a
        state_dict of any module above one reaches it), a flush before pickling or copying any of them, and the
        eval-mode forward pre-hook on the model."""
        owners = [m for m in model.modules() if any(p in self._index for p in m.parameters(recurse=False))]
        for module in [model] + [m for m in owners if m is not model]:
            self._forward_hooks.append(module.register_state_dict_pre_hook(_Flush(self)))
            self._forward_hooks.append(_CopyFlush(self, module))
        self._forward_hooks.append(model.register_forward_pre_hook(_Flush(self, eval_forward=True)))
        self._forward_hooks.append(_ZeroGrad(self, model))

    def _unit_ids(self, units: Dict[int, nn.Module]) -> Dict[int, List[int]]:
        """Per FSDP unit: its managed parameters' indices and those of the units it prefetches."""
        own = {uid: [self._index[p] for m in _managed_modules(u, units) for p in m.parameters(recurse=False)
                     if p in self._index] for uid, u in units.items()}
        out = {}
        for uid, unit in units.items():
            ids = list(own[uid])
            state = unit._get_fsdp_state()
            for other in getattr(state, "_states_to_forward_prefetch", ()):
                for m in getattr(other, "_modules", ()):
                    ids += own.get(id(m), [])
            out[uid] = ids
        return out

    def _reattach(self) -> None:
        """After add_param_group: the new parameters need hooks too."""
        model = self._attached() if self._attached is not None else None
        if model is not None:
            self.attach(model)


def _read_by(module: nn.Module) -> List[nn.Parameter]:
    """The parameters a module's forward reads: its own, and those of the children it reads without calling
    them: torch's MultiheadAttention's out_proj (F.multi_head_attention_forward), and those transformers names
    for accelerate's offload hooks, which have the same need (_read_directly)."""
    own = list(module.parameters(recurse=False))
    if isinstance(module, nn.MultiheadAttention):
        own += list(module.out_proj.parameters())
    for child in _read_directly(module):
        own += list(child.parameters())
    return own


def _read_directly(module: nn.Module) -> List[nn.Module]:
    """The children transformers' @force_accelerate_hooks([...]) names on the module's forward: Mamba's, Jamba's
    and FalconMamba's conv1d and dt_proj (their weights go to causal_conv1d_fn and a matmul), Mamba2's and the
    hybrids' conv1d, LFM2's conv. Their forward pre-hooks never ran, and async_step refused the second backward
    of 15 of transformers' state-space and hybrid models as "never installed" (a reviewer's sweep). The names
    sit in the decorator's closure (a freevar child_module_names), found along the forward's __wrapped__ chain."""
    fn, seen = type(module).forward, 0
    while fn is not None and seen < 8:   # (a bound on the chain: a __wrapped__ loop must not hang attach)
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
        if code is not None and cells and "child_module_names" in code.co_freevars:
            names = cells[code.co_freevars.index("child_module_names")].cell_contents
            names = [names] if isinstance(names, str) else list(names)
            return [c for c in (getattr(module, n, None) for n in names) if isinstance(c, nn.Module)]
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return []


def _fsdp_units(model: nn.Module) -> Dict[int, nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return {}
    return {id(m): m for m in model.modules() if isinstance(m, FSDPModule)}


def _managed_modules(unit: nn.Module, units: Dict[int, nn.Module]) -> List[nn.Module]:
    """The unit and its submodules, less nested units and theirs: whose parameters FSDP2 shards with it."""
    out, stack = [], [unit]
    while stack:
        m = stack.pop()
        out.append(m)
        stack.extend(c for c in m.children() if id(c) not in units)
    return out


def _no_optimizer():
    return None


class _EngineHook:
    """A hook of attach()'s: holds the optimizer weakly (no reference cycle through the model's hooks), reads
    its engine at each call (add_param_group lays out a new one), and pickles without it: torch.save(model)
    with the hooks attached copies hooks that have no optimizer to act for (the optimizer is not part of the
    model, and a weak reference cannot be pickled either). Subclasses name the fields they keep in _KEEP."""
    _KEEP: tuple = ()

    def __getstate__(self):
        return {k: getattr(self, k) for k in self._KEEP}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.opt = _no_optimizer

    def _engine_open(self):
        """The optimizer, or None where it is gone or closed."""
        opt = self.opt()
        return None if opt is None or opt._engine is None or opt._engine.closed else opt


def _same_process(opt) -> None:
    """Before a hook's call into the engine: in a forked child (a child saving or evaluating the model) the
    engine's own refusal named neither the model's call nor a way out."""
    if os.getpid() != opt._pid:
        raise RuntimeError(
            "OffloadAdam.attach(model)'s hooks ran in a process forked from the one that made the optimizer, "
            "where its engine has none of its threads: call opt.close() in this process to use the model "
            "without it (its weights are those installed before the fork; opt.flush() in the parent before "
            "forking installs every step's)")


class _Flush(_EngineHook):
    """attach()'s state_dict pre-hook (any mode), or with eval_forward its forward pre-hook for a model in eval
    mode run without gradients: the updates in flight finish and their weights are installed before anything
    reads the model."""
    _KEEP = ("eval_forward",)

    def __init__(self, opt, eval_forward: bool = False):
        self.opt, self.eval_forward = weakref.ref(opt), eval_forward

    @torch.compiler.disable
    def __call__(self, module, *args):
        opt = self._engine_open()
        if opt is None:
            return
        if self.eval_forward and (module.training or torch.is_grad_enabled()):
            # Training: after a backward that raised (its task still open, none running on this thread), the
            # weights its hooks installed are ordered before this forward reads them (delay).
            if opt._open_tasks and _backward_depth() == 0:
                _same_process(opt)
                opt._engine.fence()
            return   # evaluation is an eval-mode forward without gradients; training in eval mode keeps its overlap
        _same_process(opt)
        opt._synchronize()


class _BoundMethod(_EngineHook):
    """A method of the module bound in its own __dict__ (one hook per optimizer attached, listed under LIST),
    which calls the class's and then acts for each optimizer: torch.save(model) pickles a bound method as
    getattr(model, its name), so a loaded model gets the class's."""
    LIST: str
    NAME: str

    def __init__(self, opt, module: nn.Module):
        self.opt, self.module = weakref.ref(opt), weakref.ref(module)
        module.__dict__.setdefault(self.LIST, []).append(self)
        module.__dict__[self.NAME] = types.MethodType(self.method, module)

    def remove(self) -> None:
        module = self.module()
        hooks = module.__dict__.get(self.LIST, []) if module is not None else []
        if any(h is self for h in hooks):
            hooks[:] = [h for h in hooks if h is not self]
            if not hooks:
                del module.__dict__[self.LIST], module.__dict__[self.NAME]

    @classmethod
    def open_optimizers(cls, module: nn.Module):
        for hook in module.__dict__.get(cls.LIST, ()):
            opt = hook._engine_open()
            if opt is not None:
                yield opt


def _attached_zero_grad(module: nn.Module, set_to_none: bool = True) -> None:
    type(module).zero_grad(module, set_to_none)
    for opt in _ZeroGrad.open_optimizers(module):
        if opt._in_backward:
            _same_process(opt)
            opt.zero_grad(set_to_none)


def _attached_reduce_ex(module: nn.Module, protocol):
    for opt in _CopyFlush.open_optimizers(module):
        _same_process(opt)
        opt._synchronize()
    reduced = type(module).__reduce_ex__(module, protocol)
    if len(reduced) > 2 and isinstance(reduced[2], dict):
        # the copy (or the loaded model) carries none of attach()'s entries: a method bound to this module would
        # act for it (a copy of a loaded copy pickled the loaded model, a reviewer's run); its hooks stay, inert
        state = {k: v for k, v in reduced[2].items() if k not in _BOUND_KEYS}
        reduced = (*reduced[:2], state, *reduced[3:])
    return reduced


class _ZeroGrad(_BoundMethod):
    """attach()'s model.zero_grad(): also drops the gradients a backward handed to the engine since the last
    step. They left p.grad as they were handed over, so torch's zero_grad found none to drop (skipping a bad
    batch sent it into the next step). After step() none is pending: nothing waits (async_step's update runs
    on)."""
    LIST, NAME, method = "_effmem_zero_grad", "zero_grad", staticmethod(_attached_zero_grad)


class _CopyFlush(_BoundMethod):
    """attach()'s flush before the module is pickled or deep-copied: torch.save(model) and copy.deepcopy(model)
    (an EMA or teacher copy) read the parameters without state_dict(), and right after an async_step or delay
    step() they held the weights from before it (a reviewer's repro). pickle and copy.deepcopy both take
    __reduce_ex__ from the instance."""
    LIST, NAME, method = "_effmem_copy_flush", "__reduce_ex__", staticmethod(_attached_reduce_ex)


# A bound method pickles as getattr(model, its name): the names the functions are bound under
_attached_zero_grad.__name__ = "zero_grad"
_attached_reduce_ex.__name__ = "__reduce_ex__"
_BOUND_KEYS = {key for cls in (_ZeroGrad, _CopyFlush) for key in (cls.LIST, cls.NAME)}


class _Installer(_EngineHook):
    """The forward pre-hook of async_step: the module's parameters' new weights up before it runs."""
    _KEEP = ("ids", "fsdp")
    splits_compiled_graph = True   # run between graphs (torch.compiler.disable): memory_budget reads this

    def __init__(self, opt, ids, fsdp: bool = False):
        self.opt, self.ids, self.fsdp = weakref.ref(opt), ids, fsdp

    @torch.compiler.disable  # a call into the engine: torch.compile runs it between graphs
    def __call__(self, module, args):
        opt = self._engine_open()
        if opt is None:
            return
        if opt._local[0].is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("OffloadAdam(async_step=True): a module's forward ran inside CUDA graph capture, "
                               "where its weights cannot be installed (the upload is ordered by events the "
                               "capture cannot see); call opt.flush() and capture the forward without "
                               "opt.attach(model)'s hooks, or use OffloadAdam without async_step")
        _same_process(opt)
        opt._engine.install_for_forward(self.ids)
        if self.fsdp and opt._local[0].is_cuda:
            order_all_gathers(module, torch.cuda.current_stream())


def order_all_gathers(unit: nn.Module, current) -> None:
    """Make an FSDP2 unit's all-gather streams wait for `current`, on which install_for_forward ordered the
    new weights. FSDP2 copies the shards for an all-gather on streams of its own, ordered after the current
    stream only in the root's pre-forward: from the second unit on, they would read shards the upload is
    still writing. (Private FSDP2 state, read defensively: before the root's first forward it has no
    streams yet, and that forward orders them itself.)"""
    ctx = getattr(unit._get_fsdp_state(), "_comm_ctx", None)
    for name in ("all_gather_copy_in_stream", "all_gather_stream"):
        stream = getattr(ctx, name, None)
        if stream is not None:
            stream.wait_stream(current)
