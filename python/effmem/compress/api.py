"""The public entry points: compress_activations and remove_compression."""
import sys
from typing import Callable, Iterable, Optional, Union

import torch
from torch import Tensor, nn

from effmem import _checks
from effmem._dynamo import forget_compiled_code
from effmem.compress.hooks import ActivationCompressor
from effmem.compress.policy import CompressConfig, ModuleSpec

_ATTR = "_effmem_compressor"


def compress_activations(module: Optional[nn.Module] = None, *, bits: int = 8, group_size: int = 128,
                         min_numel: int = 4096, stochastic: bool = True, seed: int = 0,
                         exclude_modules: Iterable[ModuleSpec] = (),
                         exclude: Optional[Callable[[Tensor], bool]] = None, pack_bool_masks: bool = True,
                         track_exact: bool = True, record: bool = False,
                         names_from: Optional[nn.Module] = None) -> Union[nn.Module, ActivationCompressor]:
    """Quantise the floating tensors autograd saves for backward; restore them when backward needs them.

    Two forms:

    * ``with compress_activations(bits=8) as ctx: loss = model(x)`` compresses
      what is saved while the block runs (backward may run inside or after
      it). ``ctx.stats`` covers everything saved since the block was entered.
      Give ``names_from=model`` to name modules in the statistics and to use
      ``exclude_modules``; without it tensors are attributed to "<unknown>".
    * ``model = compress_activations(model, bits=8)`` returns the same module
      with hooks installed: a forward pre-hook on it enters the saved-tensor
      hooks, a forward hook (run even when forward raises) leaves them, and
      pre/post hooks on every submodule keep track of which one is running.
      No wrapper module is added, so ``state_dict`` keys are unchanged.
      Its nn.LeakyReLU, nn.ReLU6 and nn.Hardtanh modules take a subclass
      whose backward reads their exact slope mask (1 bit per element)
      instead of their quantised input, and nn.PReLU one that keeps the
      mask beside its input (_masked_activations); removal restores them.
      ``model.compress_stats`` describes the latest forward run with grad
      enabled (reset at the start of each; forwards under torch.no_grad()
      enter nothing and leave it alone). ``remove_compression(model)`` takes
      the hooks off.

    Options:

    * bits (4 or 8) and group_size (32, 64, 128 or 256): each group of that
      many consecutive elements (in memory order) is stored as bits-wide codes
      plus a float32 (min, scale): bits/8 + 8/group_size bytes per element.
    * stochastic: round up with probability equal to the fractional part (a
      counter-based hash of (seed, element index)), so the dequantised value
      is unbiased; False rounds to nearest (smaller error, slightly biased).
    * seed: base seed; the n-th tensor compressed by this object uses seed + n,
      so successive steps round differently.
    * min_numel: tensors with fewer elements are kept as they are (their
      compression would not pay for the work).
    * exclude_modules: names (glob patterns such as "blocks.*.attn") or
      nn.Module types; tensors saved while such a module (or one inside it)
      runs are kept as they are. exclude: a predicate on the saved tensor;
      True keeps it as it is.
    * pack_bool_masks: store bool tensors (dropout or masked-fill masks) eight
      per byte; exact.
    * track_exact: also run a dispatch mode (see compress.tracker) that finds
      attention log-sum-exps, normalisation statistics and parameter casts so
      they are never quantised. Turning it off saves its per-op Python cost;
      only the shape rules then protect those statistics.
    * record: keep a list of every pack decision in ``ctx.records`` (debugging).

    Never quantised: parameters and anything sharing their storage (and the
    model's buffers, when the model is known), autocast casts of parameters,
    integer tensors, float64, the statistics above, tensors with a last dim
    of 1 or 2 (per-row statistics), expanded views, a fused attention's
    output (its backward reads it beside the exact log-sum-exp). A tensor saved by several
    ops is stored once. Tensors come back with their dtype, shape and exact
    strides: dense ones in any dim order, and views with gaps (q, k, v sliced
    from one qkv projection) through the tensor they view, when that is at
    most 4x larger (otherwise they are kept as they are).

    Values: one extreme value per group of group_size (however often it occurs) is
    stored exactly and the rest of the group quantised on its own range, so
    masks (-inf, or torch.finfo(dtype).min) among ordinary values cost no
    precision. A group holding NaN, or both -inf and +inf, comes back as NaN:
    non-finite gradients as a rule, but a backward that only compares the
    saved values (clamp, threshold, max) turns NaN into zero gradients for the
    whole group, where the unsaved ones were finite (fp16 overflow clamped as
    T5 does: keep such a model in bf16 or float32, or exclude that module).

    torch.compile: compiled regions compile as usual and what they save is
    compressed when the compiled code runs: call a compiled model inside the
    ``with`` block, wrap a compiled model (``compress_activations(
    torch.compile(m))``) or compile a wrapped one (``torch.compile(
    compress_activations(m))``, where the entry and exit hooks run eagerly
    around the compiled forward). Inside compiled code submodules are not
    tracked, so its tensors are attributed to the compiled module; attention
    log-sum-exps are still recognised (the fused attention kernel is
    dispatched at run time) and compiled normalisations save their
    statistics with a last dim of 1, which the shape rule keeps. A ``with
    compress_activations()`` block inside a compiled function works but
    splits the graph around it (entering hooks cannot be traced).
    torch.utils.checkpoint (either mode) works: a checkpointed region saves
    only its inputs in forward, and those are compressed like any save (the
    region is recomputed from their restored copy, as the "min" policy
    recomputes a layer from its 8-bit input); what the recompute saves is
    compressed only if backward runs inside the ``with`` block.
    """
    config = CompressConfig(bits=bits, group_size=group_size, min_numel=min_numel, stochastic=stochastic,
                            seed=seed, exclude_modules=exclude_modules, exclude=exclude,
                            pack_bool_masks=pack_bool_masks, track_exact=track_exact, record=record)
    if names_from is not None and not isinstance(names_from, nn.Module):
        raise TypeError(f"names_from: expected the model (an nn.Module) whose modules name the statistics, got "
                        f"{type(names_from).__name__}")
    if module is None:
        if names_from is None and config.exclude_modules:
            raise ValueError("exclude_modules needs to know the modules: pass names_from=model, "
                             "or wrap the model with compress_activations(model, ...)")
        return ActivationCompressor(config, names_from=names_from)
    _checks.module(module, "module")
    if names_from is not None:
        raise ValueError("names_from is for the context-manager form; a wrapped module names its own submodules")
    if getattr(module, _ATTR, None) is not None:
        raise RuntimeError("compress_activations: this module is already wrapped; call "
                           "effmem.compress.remove_compression(module) first to change the options")
    compressor = ActivationCompressor(config)
    compressor.track_modules(module, include_root=False)
    compressor._handles += _masked_activations(module)
    compressor._handles.append(module.register_forward_pre_hook(_RootEnter(compressor)))
    compressor._handles.append(module.register_forward_hook(_RootExit(compressor), always_call=True))
    object.__setattr__(module, _ATTR, compressor)
    object.__setattr__(module, "compress_stats", compressor.stats)
    forget_compiled_code("compress_activations(module)", "it")
    return module


class _Unpatch:
    """Takes a module patched by _masked_activations back to its class (remove_hooks calls it as a hook's)."""
    __slots__ = ("module",)

    def __init__(self, module: nn.Module):
        self.module = module

    def remove(self) -> None:
        from effmem.activations import relu
        relu.unpatch(self.module)


def _masked_activations(module: nn.Module) -> list:
    """Give the model's nn.LeakyReLU, nn.Hardtanh and nn.ReLU6 modules a backward from their exact slope mask,
    1 bit per element (activations.relu, as the policies do). Autograd keeps their input, and its 8-bit codes
    moved values near a kink across it: a reviewer's 3-layer net's first weight gradient came out 5.7% off
    plain's with LeakyReLU (5.9% ReLU6, 1.5% Hardtanh) against 0.4% with GELU. The mask is exact and 8x
    smaller than the codes. nn.ReLU keeps autograd's save of its output, with the exact mask beside it
    (hooks._masked); functional calls (F.leaky_relu in a forward's code) cannot be reached and stay as they
    are. nn.PReLU gets its mask too, beside its input (its slope's gradient): 7.9% off plain to 0.7% in a
    reviewer's net. Returns the handles that undo it."""
    from effmem.activations import relu   # imports compress._codec: not at module level
    return [_Unpatch(m) for m in module.modules()
            if (kinked_activation(m) or relu.PLAIN.get(type(m), type(m)) is nn.PReLU) and relu.patch(m)]


def kinked_activation(m: nn.Module) -> bool:
    """Whether compress_activations(model) gives m a backward from its mask in place of its saved input (effmem
    plan counts its mask for it). Not nn.ReLU (hooks._masked: beside its output) nor nn.PReLU (beside its input)."""
    from effmem.activations import relu
    if type(m) in relu.PLAIN:   # masked already (a policy): counted as compress' too (relu.patch)
        return relu.PLAIN[type(m)] not in (nn.ReLU, nn.PReLU)
    return type(m) not in (nn.ReLU, nn.PReLU) and relu.patchable(m)


def remove_compression(module: nn.Module) -> nn.Module:
    """Undo compress_activations(module): remove its hooks and attributes. Also through a wrapper whose
    attribute reads pass to the wrapped model inside it (compress_activations(base), then peft's
    get_peft_model: removal through the PeftModel read the base's compressor and failed with a KeyError, its
    hooks gone and its attribute left). Unwrap a wrapped PeftModel before merge_and_unload(): the merged model
    keeps the hooks of a wrapper it no longer has (inert, but removable only through the PeftModel)."""
    _checks.module(module, "module")
    compressor = _compressor_in(module)
    if compressor is None:
        raise ValueError("remove_compression: this module was not wrapped by compress_activations")
    calls, caller = compressor._root_calls(), sys._getframe(1)
    if calls and calls[0][1] is not None:
        if _on_stack(calls[0][1], caller):
            raise RuntimeError("remove_compression: called inside the wrapped module's forward, whose exit would "
                               "then never leave the saved-tensor hooks; call it once the forward has returned")
        # a forward interrupted past its exit hook (Ctrl-C) left them pushed on this thread; with the hooks gone,
        # no later forward would drop them (_RootEnter), and every later save on the thread was quantised. A
        # module wrapped on its own inside, interrupted with it, pushed its hooks after: an exit pops the top of
        # the thread's stacks, so theirs go first (else this one's stayed, quantising the saves of other models)
        for m in reversed(list(module.modules())):
            inner = m.__dict__.get(_ATTR)
            if inner is not None and inner is not compressor and inner._root_calls():
                entered = inner._root_calls()[0][1]
                if entered is not None and not _on_stack(entered, caller):
                    inner._abandon()
        compressor._abandon()
    compressor.remove_hooks()
    owner = compressor._root
    del owner.__dict__[_ATTR]
    owner.__dict__.pop("compress_stats", None)
    forget_compiled_code("remove_compression(module)", "it")   # compiled with the hooks, it would go on compressing
    return module


def _compressor_in(module: nn.Module) -> Optional[ActivationCompressor]:
    """The compressor wrapping module, or the module inside it that its attribute reads pass to (PeftModel)."""
    c = module.__dict__.get(_ATTR)
    if c is not None:
        return c
    c = getattr(module, _ATTR, None)
    if isinstance(c, ActivationCompressor) and c._root is not None and any(m is c._root for m in module.modules()):
        return c
    return None


def compressor_of(module: nn.Module) -> Optional[ActivationCompressor]:
    """The ActivationCompressor behind a wrapped module (None if it is not wrapped)."""
    return getattr(module, _ATTR, None)


class _RootEnter:
    """Forward pre-hook of a wrapped module: enter the saved-tensor hooks, reset the statistics.

    A forward run without grad mode (evaluation) saves nothing, so it enters
    nothing and leaves the statistics of the last training forward as they
    were. The module hooks stay, though, and torch's nn.TransformerEncoder
    takes its inference fast path only for modules without hooks: wrapped, it
    runs the regular path (other bits, within rounding) until
    remove_compression().
    """

    def __init__(self, compressor: ActivationCompressor):
        self.compressor = compressor

    # Run eagerly even inside a compiled caller: Dynamo cannot trace entering
    # saved-tensor hooks, so it breaks the graph here instead, and the
    # compiled forward in between runs with the hooks active.
    @torch._dynamo.disable
    def __call__(self, module, args):
        calls = self.compressor._root_calls()
        caller = _module_call_frame()
        if calls and calls[0][1] is not None and not _on_stack(calls[0][1], caller):
            # The call that entered these is over without its exit hook: torch runs always_call hooks on an
            # Exception only, and a KeyboardInterrupt (Ctrl-C in a notebook) left the saved-tensor hooks
            # pushed, quantising any later autograd work, and the module stack stale. Dropped here.
            self.compressor._abandon()
        active = torch.is_grad_enabled()
        # the frame itself, not its id: a finished frame's id is soon another's (held until the exit hook)
        calls.append((active, caller))
        if active:
            self.compressor._begin(reset=True)
        self.compressor._push_module(module)


def _module_call_frame():
    """The frame of nn.Module._call_impl running this hook (alive until the module's forward returns)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not nn.Module._call_impl.__code__:
        frame = frame.f_back
    return frame


def _on_stack(entered, frame) -> bool:
    while frame is not None:
        if frame is entered:
            return True
        frame = frame.f_back
    return False


class _RootExit:
    def __init__(self, compressor: ActivationCompressor):
        self.compressor = compressor

    @torch._dynamo.disable
    def __call__(self, module, args, output):
        self.compressor._pop_module(module)
        calls = self.compressor._root_calls()
        if calls and calls.pop()[0]:
            self.compressor._end()
