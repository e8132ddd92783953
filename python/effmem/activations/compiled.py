"""Decoder layers of a torch.compile'd model under an activation policy: each layer its own compiled graph.

A policy's layer wrapper, reached while dynamo traces a compiled model, leaves the model's graph there
(torch.compiler.disable) and runs the layer through a compiled graph of its own: the policy's hooks, or
its checkpointing, then act around one layer at a time, as in eager mode. (Traced into the model's one
graph, the hooks would see every layer's saves together: the compiled backward restores them all at
once, and the peak rises.) One graph serves every layer of a class; a graph break inside the layer
itself stays the compiler's affair.

selective=True wraps the layer in torch's selective checkpointing with the "selective" policy's rule
(activations.selective: matmul and attention outputs kept, the rest recomputed): the partitioner then
rebuilds norms and elementwise ops in backward, as the "fast" policy's fused functions do in eager mode.
"""
import functools
import inspect
from typing import Callable, Dict, Tuple

import torch
import torch.utils.checkpoint

_GRAPHS: Dict[Tuple[Callable, bool], Callable] = {}

_REASON = ("effmem's activation policy runs each decoder layer as a compiled graph of its own, outside the "
           "model's, so that backward restores one layer's saves at a time: torch.compile(fullgraph=True) cannot "
           "take it. Compile without fullgraph, or use policy 'selective' or 'checkpoint', which trace into the "
           "model's graph")


def leaves_graph(fn: Callable) -> Callable:
    """torch.compiler.disable, with the reason fullgraph=True's error gives (a torch without reason=: none)."""
    try:
        return torch.compiler.disable(fn, reason=_REASON)
    except TypeError:
        return torch.compiler.disable(fn)


def _selective(forward, *args, **kwargs):
    """The layer under torch's selective checkpointing, inside the policy's saved-tensor hooks. Where it runs
    eagerly (a layer with dropout, or one with a graph break the compiler leaves to eager), selective
    checkpointing keeps its saves as they are (exact, as tested): torch 2.14 warns that a later release sends
    them through the hooks, and takes respect_saved_tensors_hooks=False (checkpoint's own argument, not the
    layer's) to keep this. Without it (older torch) it is so anyway."""
    from effmem.activations.selective import context
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, context_fn=context,
                                             **_KEEP_SAC_SAVES, **kwargs)


_KEEP_SAC_SAVES = ({"respect_saved_tensors_hooks": False}
                   if "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
                   else {})


def drops_out(layer: torch.nn.Module) -> bool:
    """Whether the layer, in training, applies dropout: a dropout module with p > 0, or an attention's rate
    (transformers keep it as a float, attention_dropout, and pass it to the attention kernel)."""
    return layer.training and any(
        (isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0)
        or (isinstance(getattr(m, "attention_dropout", None), float) and m.attention_dropout > 0)
        for m in layer.modules())


def compiled_forward(original, selective: bool) -> Callable:
    """original (a layer's bound forward) as a compiled function of the same arguments.

    The "fast" policy's fused forwards (activations.paths) come off the layer's modules for good at its first
    compiled call: each is an object of its own module, and torch 2.11's dynamo guards on its identity, so
    every layer compiled its graph again until the recompile limit (8) and a TinyLlama's other 14 layers ran
    eagerly (seen on an H100: the compiled "fast" step slower than eager). The compiled graph does their
    work itself (selective checkpointing recomputes norms and elementwise ops), and with them gone for good
    an eager fallback's recompute meets the modules its forward met. The ReLUs stay: their class is what
    was changed (activations.relu), one for every layer, and their exact masks are correctness, not speed."""
    layer = original.__self__
    if drops_out(layer):
        # Compiled, the graph's backward drew dropout masks anew where the policy recomputes (selective
        # checkpointing's rebuild, "min"'s recompute): gradients 10-12% off those of the loss computed, in a
        # reviewer's GPT-2 with dropout 0.1. Eager, torch's checkpointing replays the RNG: such a layer runs so.
        return functools.partial(_selective, original.__func__, layer) if selective else original
    patched = layer.__dict__.get("_effmem_patched")
    if patched:
        from effmem.activations import paths   # on use: the package is still importing when it imports this
        layer._effmem_patched = paths.for_compiler(patched)
    func = original.__func__
    fn = _GRAPHS.get((func, selective))
    if fn is None:
        fn = _GRAPHS[func, selective] = torch.compile(functools.partial(_selective, func) if selective else func)
    return functools.partial(fn, layer)
