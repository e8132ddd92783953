"""The "checkpoint" and "selective" policies: torch's checkpointing of a layer (non-reentrant), with the contexts
effmem adds around its forward and recompute: in-place modules out of place under "selective", the layer's
buffers as the forward left them, and torch's refusals named with the policy and its way out."""
import contextlib
import functools
import inspect
import itertools
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from effmem.activations.cache import refuse_cache, refuse_func_transforms, refuse_hf_checkpointing
from effmem.activations.selective import KeptOutputChanged, context as selective_context


@contextlib.contextmanager
def buffers_kept(buffers):
    """Extra runs of a layer's forward (a recompute, the budget's probes) leave these buffers of it as they
    were: a BatchNorm's running statistics and count would take each run as a training step."""
    kept = [(b, b.detach().clone()) for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in kept:
                b.copy_(value)


def tensors_read(layer: nn.Module) -> dict:
    """The parameters and buffers a forward of the layer reads, by name (as_in_forward's `held`)."""
    # every name, a tied or repeated tensor's second too: functional_call may pass it another tensor (bias-free
    # fast weights given one zero tensor: the second name kept the module's own, 7-73% off, a reviewer's run)
    return dict(itertools.chain(layer.named_parameters(remove_duplicate=False),
                                layer.named_buffers(remove_duplicate=False)))


def as_in_forward(layer: nn.Module, held: dict):
    """The recompute reads the tensors the forward read. Under torch.func.functional_call (MAML, an EMA's
    weights) those were the call's, put back by the time backward recomputes: the recompute read the module's
    own, and the call's tensors got no gradient while the module's parameters got one from other weights,
    silently (34% and 48% off under "selective" and "checkpoint" on a tiny Llama, a reviewer's run; torch's
    own checkpointing and transformers' do the same)."""
    changed = {name: t for name, t in held.items() if tensors_read(layer).get(name) is not t}
    if not changed:
        return nullcontext()
    from torch.nn.utils.stateless import _reparametrize_module   # what functional_call itself runs
    return _reparametrize_module(layer, changed)


@contextlib.contextmanager
def modes_as(modes):
    """The recompute runs each module in its forward's mode: a model.eval() between forward and backward (a
    validation pass) recomputed without the forward's dropout, and the gradients were silently those of
    another function under "min" (33% off on a tiny Llama with attention dropout, a reviewer's repro); torch's
    checkpointing ("checkpoint", "selective") raised a CheckpointError that named no cause."""
    now = [(m, m.training) for m, _ in modes]
    for m, training in modes:
        m.training = training
    try:
        yield
    finally:
        for m, training in now:
            m.training = training


def torch_checkpointed(layer: nn.Module, original, selective: bool, *args, **kwargs):
    """The layer under torch's checkpointing ("checkpoint"), or its selective form ("selective")."""
    if not torch.is_grad_enabled():   # nothing saved: the layer as it is (compiled, evaluation broke the graph)
        return original(*args, **kwargs)
    if torch.compiler.is_compiling():   # the compiler takes no contexts but selective checkpointing's own
        context = {"context_fn": selective_context} if selective else {}
    else:
        if torch.is_grad_enabled():
            refuse_cache(layer, args, kwargs)
            refuse_hf_checkpointing(layer)
            refuse_func_transforms(layer)
        context = {"context_fn": functools.partial(_eager_contexts, layer, selective)}
        if not _FORWARD_ERRORS_SEEN:   # eager only: the compiler traces torch's checkpoint as its own operator
            return _checkpoint_seeing_errors(original, context["context_fn"], *args, **kwargs)
    return torch_checkpoint(original, *args, use_reentrant=False, **context, **kwargs)


def _forward_errors_seen() -> bool:
    """Whether torch's checkpoint hands an error raised by the forward to its generator, as torch 2.13 does.
    torch 2.11 left the generator at its yield: the forward's contexts never saw the error (effmem's refusal
    went unnamed), and torch's saved-tensor hooks stayed pushed while the error lived, so a later backward of
    another model ran the failed layer again (a reviewer's run on 2.11)."""
    try:
        return "gen.throw(" in inspect.getsource(torch.utils.checkpoint)
    except (OSError, TypeError):   # no source to read: taken as the newer behaviour
        return True


_FORWARD_ERRORS_SEEN = _forward_errors_seen()


def _checkpoint_seeing_errors(fn, context_fn, *args, **kwargs):
    """torch's non-reentrant checkpoint, driving its generator as torch 2.13 does: an error of the forward is
    thrown into it, so that its contexts and hooks are left at once."""
    gen = torch.utils.checkpoint._checkpoint_without_reentrant_generator(
        fn, kwargs.pop("preserve_rng_state", True), context_fn, torch.utils.checkpoint._DEFAULT_DETERMINISM_MODE,
        False, True, *args, **kwargs)
    next(gen)
    try:
        out = fn(*args, **kwargs)
    except BaseException as err:
        try:
            gen.throw(err)   # raises it again, or what a context made of it
        except StopIteration:
            pass
        raise
    try:
        next(gen)
    except StopIteration:
        return out
    raise RuntimeError("torch.utils.checkpoint's generator went on after the forward's end")


def _eager_contexts(layer: nn.Module, selective: bool):
    """torch checkpointing's two contexts, for the forward and the recompute: selective's caches, and
    - the layer's in-place modules (nn.ReLU(inplace=True)...) run out of place in both under "selective":
      in place they changed the matrix product's output that it keeps, which torch then refused;
    - the recompute leaves the layer's buffers as the forward left them (a BatchNorm counted it as a
      second training step), and runs each module in the forward's train/eval mode;
    - under "selective", torch's refusal of a kept output changed in place otherwise names the fix."""
    forward, recompute = selective_context() if selective else (nullcontext(), nullcontext())
    flip = [m for m in layer.modules() if getattr(m, "inplace", None) is True] if selective else []
    modes = [(m, m.training) for m in layer.modules()]   # the forward's (made as it starts)
    held = tensors_read(layer)   # the forward's parameters: functional_call's where it runs under one
    return (_Reentrant(functools.partial(_forward, layer, flip, forward)),
            _Reentrant(functools.partial(_recompute, layer, flip, recompute, selective, modes, held)))


class _Reentrant:
    """A context manager entered afresh each time: torch enters the recompute's at every recompute (a second
    backward with retain_graph, a double backward), where a generator's context manager works once."""

    def __init__(self, make):
        self.make, self.open = make, []

    def __enter__(self):
        self.open.append(self.make())
        return self.open[-1].__enter__()

    def __exit__(self, *exc):
        return self.open.pop().__exit__(*exc)


@contextlib.contextmanager
def _out_of_place(modules, inner):
    for m in modules:
        m.inplace = False
    try:
        with inner:
            yield
    finally:
        for m in modules:
            m.inplace = True


@contextlib.contextmanager
def _recompute(layer: nn.Module, flip, inner, selective: bool, modes, held):
    with as_in_forward(layer, held), contextlib.ExitStack() as stack:
        buffers = list(layer.buffers())   # the forward's, as_in_forward put back
        if buffers:
            stack.enter_context(buffers_kept(buffers))
        stack.enter_context(modes_as(modes))
        try:
            with _out_of_place(flip, inner):
                yield
        except RuntimeError as err:
            if selective and "backward an extra time" in str(err):
                raise RuntimeError(
                    f"{type(layer).__name__} under effmem's 'selective' policy: torch's selective checkpointing "
                    "keeps what it saves for one backward, so a second one through these layers "
                    "(retain_graph=True) or differentiating their gradients again (create_graph=True: a "
                    "gradient penalty, a Hessian-vector product) is refused. Use policy='checkpoint' or 'fast' "
                    "for that") from err
            if selective and "has been mutated" in str(err):
                raise RuntimeError(_changed_in_place(layer)) from err
            raise


def _changed_in_place(layer: nn.Module) -> str:
    return (f"{type(layer).__name__} under effmem's 'selective' policy changes the output of a matrix product in "
            "place (an in-place op in its forward, such as x.add_(), or inside an op it calls, such as nn.GRU or a "
            "bfloat16 nn.LSTM on the CPU; in-place modules already run out of place there); selective "
            "checkpointing keeps those outputs for backward, and they would no longer be the forward's. Use "
            "policy='checkpoint' or 'fast' for this model, or make that op out of place")


@contextlib.contextmanager
def _forward(layer: nn.Module, flip, inner):
    """The checkpointed forward's context: in-place modules out of place; selective's refusal of a write into a
    kept output named."""
    try:
        with _out_of_place(flip, inner):
            yield
    except KeptOutputChanged as err:
        raise RuntimeError(_changed_in_place(layer)) from err
