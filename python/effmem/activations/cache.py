"""A training forward without a key/value cache, as transformers' own gradient checkpointing runs it.

A recomputed layer would append its keys and values to the cache a second time, and a cache made in a
training forward holds every layer's keys and values until the output is dropped. transformers turns the
cache off for checkpointed training itself; for ours, a forward pre-hook on each module that takes a
`use_cache` argument passes use_cache=False in every forward with gradients (in training mode or not: an
eval-mode forward with gradients, dropout off, is recomputed all the same). Not config.use_cache=False: the
user's config stays as it was (save_pretrained writes it), and inference or generate() (no gradients) under
the policy keeps its cache."""
import copy
import inspect
import warnings

import torch
from torch import nn

from effmem import _checks

_HOOKS = "_effmem_no_cache"


def _position(module: nn.Module):
    """Where `use_cache` is among forward's positional parameters (None: keyword only or absent), or -1 when
    forward takes no `use_cache`."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):   # a builtin or C forward: nothing to read
        return -1
    for i, p in enumerate(params):
        if p.name == "use_cache":
            return i if p.kind == p.POSITIONAL_OR_KEYWORD else None
    return -1


class _NoCache:
    """The forward pre-hook: use_cache=False where forward takes it at `position` (None: by keyword). A class,
    not a closure, so that a model under a policy pickles (torch.save(model))."""

    def __init__(self, position):
        self.position = position

    def __call__(self, module, args, kwargs):
        if not torch.is_grad_enabled() or _holds_cache(args, kwargs):
            # A cache handed in is the caller's to fill ("fast" runs each layer once; the policies that run one
            # again refuse it: refuse_cache). Turned off, the layers filled it all the same but GPT-2's and
            # Qwen2's forwards returned none, and a call chained on that ran without its prefix (a reviewer's)
            return None
        position = self.position
        positional = position is not None and position < len(args)
        if (args[position] if positional else kwargs.get("use_cache")) is True:
            warnings.warn(f"{type(module).__name__}: use_cache=True in a forward with gradients is turned off by "
                          "effmem (under an activation policy a recomputed layer would add its keys and values to "
                          "the cache again, as under transformers' own gradient checkpointing; plan.apply turns "
                          "the cache off in training forwards, as its prediction has it)", stacklevel=2)
        if positional:
            return (*args[:position], False, *args[position + 1:]), kwargs
        return args, {**kwargs, "use_cache": False}


def _holds_cache(args, kwargs) -> bool:
    """Whether a key/value cache object (transformers' DynamicCache, MambaCache, ...) is among the arguments."""
    return any(type(a).__name__.endswith("Cache") for a in (*args, *kwargs.values()))


def refuse_cache(layer: nn.Module, args, kwargs) -> None:
    """A cache object given to a layer that will run again, in a forward with gradients: refused (a recomputed
    layer, or the budget's probes, would add its keys and values again; use_cache=False alone does not stop a
    layer from updating a cache it is handed)."""
    if _holds_cache(args, kwargs):
        raise TypeError(f"{type(layer).__name__}: got a key/value cache in a forward with gradients; this "
                        "activation policy runs the layer again ('min', 'checkpoint' and 'selective' in backward, "
                        "memory_budget's probes at a new shape), which would add to the cache again. Pass no "
                        "past_key_values when training (use_cache=False is passed for you), or use 'fast'; some "
                        "models (transformers' XLM) make a cache in every forward themselves: 'fast' then")


HF_CHECKPOINTING = ("transformers' gradient checkpointing is on (gradient_checkpointing_enable() or "
                    "activation_checkpointing_enable(), or Trainer's gradient_checkpointing=True); under a policy "
                    "each layer would run again besides, on top of what the policy keeps or recomputes. Turn it "
                    "off (model.gradient_checkpointing_disable(), TrainingArguments(gradient_checkpointing=False)): "
                    "'checkpoint' is the policy that checkpoints")


def refuse_hf_checkpointing(layer: nn.Module) -> None:
    """transformers' gradient checkpointing turned on after the policy was applied (Trainer does so in train()):
    refused at the layer's first training forward, as apply_activation_policy refuses it before. Its layers
    (GradientCheckpointingLayer) carry the flag that gradient_checkpointing_enable() sets."""
    if layer.training and getattr(layer, "gradient_checkpointing", False) is True:
        raise ValueError(f"{type(layer).__name__}: {HF_CHECKPOINTING}")


def refuse_func_transforms(layer: nn.Module) -> bool:
    """A training forward inside torch.func transforms: whether vmap alone runs (then "fast", "min" and the
    budget run the layer's own forward, as their hooks and autograd functions have no vmap rule, and torch's
    checkpointing runs as before: model ensembling evaluates so without no_grad, a reviewer's run); a grad, vjp,
    jacrev or jvp among them is refused, naming the policy (each failed with torch's or an internal message:
    "fast" under torch.func.grad, "Cannot access storage of TensorWrapper")."""
    if torch.compiler.is_compiling():
        return False
    stack = torch._C._functorch.get_interpreter_stack() or []
    if all(i.key() == torch._C._functorch.TransformType.Vmap for i in stack):
        return bool(stack)
    raise RuntimeError(
        f"{type(layer).__name__} is under an effmem activation policy, which cannot run inside a torch.func "
        "transform that differentiates (grad, vjp, jacrev, jvp): it keeps what autograd saves through saved-tensor "
        "hooks and autograd functions of its own, which those transforms do not run. Call "
        "effmem.remove_activation_policy(model) for this computation, or take the gradients with backward()")


def _has_hook(m: nn.Module) -> bool:
    return any(isinstance(h, _NoCache) for h in m._forward_pre_hooks.values())


class _Shared:
    """The list of handles as the layers hold it: not pickled (a pickle of one layer carried every hooked
    module's hooks with it, and a user's lambda among them failed it). A deep copy copies it, through the
    copy's memo: the copied layers share the copied model's list, so a removal through the model inside
    the copy reaches the hooks around it (a reviewer's repro)."""
    __slots__ = ("handles",)

    def __init__(self, handles):
        self.handles = handles

    def __reduce__(self):
        return _Shared, ([],)

    def __deepcopy__(self, memo):
        return _Shared(copy.deepcopy(self.handles, memo))


def _handles(m: nn.Module, pop: bool = False) -> list:
    held = m.__dict__.pop(_HOOKS, None) if pop else m.__dict__.get(_HOOKS)
    return held.handles if isinstance(held, _Shared) else (held or [])


def no_training_cache(model: nn.Module, layers=()) -> None:
    """Turn the cache off in `model`'s training forwards (once per module; undo with restore_training_cache).
    Every module is looked at: a list of handles on a wrapper outlives a removal through the model inside.
    `layers` hold the list too: a removal through a model inside `model` (the LlamaModel of a
    LlamaForCausalLM) reaches them, not `model`, whose hook turned the cache off after it (a reviewer's repro)."""
    handles = _handles(model)
    for m in model.modules():
        position = _position(m)
        if position != -1 and not _has_hook(m):   # a module hooked through a wrapper already: not twice
            handles.append(m.register_forward_pre_hook(_NoCache(position), with_kwargs=True))
    model.__dict__[_HOOKS] = handles
    for layer in layers:
        layer.__dict__[_HOOKS] = _Shared(handles)


def restore_training_cache(model: nn.Module) -> None:
    """Turns the key/value cache back on in forwards with gradients: removes the use_cache=False pre-hooks
    that apply_activation_policy and plan.apply put on (an activation policy stays on; under one, a layer
    run again refuses a cache). From every module of `model`, whichever object the hooks were put on: a wrapper
    (PEFT's PeftModel forwards attribute reads to the model inside, not __dict__) held its handles, so the
    model inside, or the one merge_and_unload() returned, kept its hooks (and use_cache=False) after removal.
    The handles its layers hold remove those of the modules around it."""
    _checks.module(model)
    for m in model.modules():
        for h in _handles(m, pop=True):
            h.remove()
        for key in [k for k, h in m._forward_pre_hooks.items() if isinstance(h, _NoCache)]:
            del m._forward_pre_hooks[key]
            m._forward_pre_hooks_with_kwargs.pop(key, None)
