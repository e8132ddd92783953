"""Checkpointed layers whose input is kept in 8 (or 4) bits: less memory than checkpointing, for one extra
quantisation per layer.

Plain per-layer checkpointing keeps each layer's input (the residual
stream, [tokens, hidden] in the model's dtype) and recomputes the layer in
backward. Here the kept input is effmem's group-quantised codes (1.06 bytes
per element at 8 bits with groups of 128, against 2 for bf16 and 4 for
fp32), dequantised when backward recomputes the layer. The recomputed layer
sees the dequantised input, so its gradients carry the rounding error of one
stochastic 8-bit quantisation of the residual stream (unbiased).

Recompute replays the forward's random state (dropout) and autocast, as
torch.utils.checkpoint does, and differentiates the recomputed layer inside
this one's backward. A layer's parameters are inputs of the checkpoint, and
their gradients are returned to the outer backward, which accumulates each
once: DDP's and FSDP's hooks count one accumulation per parameter per backward
(and DDP's find_unused_parameters sees them). The price: a layer's parameter
gradients exist together until its backward returns, where the reentrant
scheme accumulated (and a streaming optimizer took) each as it was made: at
most one layer's gradients more at the peak, where they are streamed off or
accumulated into existing ones.
"""
import contextlib
import functools
import re
import weakref
from contextlib import nullcontext
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from effmem.activations.cache import refuse_cache, refuse_func_transforms, refuse_hf_checkpointing
from effmem.activations import relu
from effmem.activations.compiled import compiled_forward, leaves_graph
from effmem.activations.torch_checkpoint import as_in_forward, buffers_kept, modes_as, tensors_read, torch_checkpointed
from effmem.compress import _codec
from effmem.compress.hooks import torch_checkpoint_on_top
from effmem.compress.functions import _as_rows, _seed


_ROUTED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def routes_tokens(layer: nn.Module) -> bool:
    """Whether the layer sends each token to experts chosen from its input (a mixture of experts' router:
    transformers' *SparseMoeBlock / *MoE / *Router modules, or any with a top_k). "min" keeps such a layer's
    input as it is: recomputed from 8-bit codes, the router could choose other experts for a token than the
    forward did (seen on a tiny Mixtral: 1 token in 240, its experts' gradients 7.5% off, the router's 18%),
    which is not the unbiased rounding error the codes otherwise add."""
    routed = _ROUTED.get(layer)
    if routed is None:
        routed = _ROUTED[layer] = any(
            re.search(r"moe|expert|router", type(m).__name__, re.IGNORECASE) or hasattr(m, "top_k")
            or hasattr(m, "num_experts_per_tok") for m in layer.modules())
    return routed


def _drop(t: Tensor) -> None:
    return None


def _never_unpacked(_) -> Tensor:
    raise RuntimeError("compressed checkpointing ('min'): backward reached a tensor made inside a checkpointed "
                       "layer's forward other than its output (e.g. MoE router logits in an auxiliary loss, or "
                       "attention weights), of which 'min' keeps nothing; use 'fast' or 'checkpoint' for this "
                       "model, or do not ask it for those outputs")


class _CompressedCheckpoint(torch.autograd.Function):
    """run's outputs (the layer's hidden state, then its other outputs that need a gradient), keeping x as
    codes (as it is for bits=None: a layer that routes tokens, routes_tokens) and the n_in other inputs that
    need a gradient (masks are not: position biases, an encoder's output in a decoder layer) as they are; run
    is replayed in backward.

    tensors: those n_in inputs, then the layer's trainable parameters. As inputs, the parameters make the
    outputs need a gradient when no tensor input does (a frozen embedding under LoRA-style training), and
    their gradients go back through the outer backward: accumulated once, where an inner backward that
    accumulated them itself fired every parameter's hooks twice (DDP refused: "marked ready twice")."""

    @staticmethod
    def forward(ctx, run: Callable, x: Tensor, bits: int, group_size: int, seed: int, n_in: int, *tensors):
        ctx.set_materialize_grads(False)   # an output nobody used (attention weights) costs no backward
        ctx.run, ctx.shape, ctx.dtype = run, tuple(x.shape), x.dtype
        ctx.bits, ctx.group_size, ctx.n_in, ctx.n_params = bits, group_size, n_in, len(tensors) - n_in
        ctx.device = x.device
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        dev = x.device.type
        ctx.autocast = torch.get_autocast_dtype(dev) if dev in ("cuda", "cpu") and \
            torch.is_autocast_enabled(dev) else None
        extras = tensors[:n_in]
        # With grad enabled (and the inputs needing it as they will in the recompute), so that every op picks
        # the same kernel both times (the CPU's attention runs a different kernel, drawing dropout
        # differently, without grad) and the same outputs need a gradient; what the ops save is dropped at once.
        # each ReLU's exact mask, for the recompute from rounded inputs (relu.relu_masks); saved for backward
        # below, so that autograd frees them with the rest (a ctx attribute lived as long as the graph's loss)
        masks = []
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _never_unpacked), \
                (relu.relu_masks(masks, replay=False) if bits is not None else nullcontext()):
            outs = run(x.detach().requires_grad_(ctx.needs_input_grad[1]),
                       *[e.detach().requires_grad_(True) for e in extras])
        ctx.mask_shapes = [shape for shape, _ in masks]
        if bits is None:
            ctx.save_for_backward(x.detach(), *extras)
        else:
            rows = _as_rows(x.detach())
            codes, stats = _codec.quantize(rows, bits=bits, group_size=group_size, seed=seed, stochastic=True)
            ctx.rows_shape = tuple(rows.shape)
            ctx.save_for_backward(codes, stats, *extras, *(packed for _, packed in masks))
        ctx.params = tensors[n_in:]   # leaves: a reference, no copy
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        masks = []
        if ctx.bits is None:
            x, *extras = ctx.saved_tensors
            x = x.detach().requires_grad_(ctx.needs_input_grad[1])
        else:
            codes, stats, *rest = ctx.saved_tensors
            extras, packed = rest[:len(rest) - len(ctx.mask_shapes)], rest[len(rest) - len(ctx.mask_shapes):]
            masks = list(zip(ctx.mask_shapes, packed))
            x = _codec.dequantize(codes, stats, bits=ctx.bits, group_size=ctx.group_size, shape=ctx.rows_shape,
                                  dtype=ctx.dtype).view(ctx.shape).requires_grad_(ctx.needs_input_grad[1])
        extras = [e.detach().requires_grad_(True) for e in extras]
        devices = [ctx.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, enabled=True):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            # the forward's autocast state, off included: a backward run inside an autocast region must not
            # recompute the layer under it
            amp = (torch.autocast(ctx.device.type, dtype=ctx.autocast, enabled=ctx.autocast is not None)
                   if ctx.device.type in ("cuda", "cpu") else nullcontext())
            # run.keep: the layer's buffers as they were after the forward once the recompute's backward
            # is done (it may read the buffers the recompute updated: a BatchNorm's running statistics)
            with getattr(ctx.run, "keep", nullcontext)():
                with torch.enable_grad(), amp, relu.relu_masks(masks, replay=True):
                    outs = ctx.run(x, *extras)
                pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
                inputs = [x, *extras, *ctx.params]   # in the order of forward's tensor arguments
                wanted = [i for i, t in enumerate(inputs) if ctx.needs_input_grad[1 if i == 0 else 5 + i]
                          and t.requires_grad]   # a parameter frozen since the forward: none
                got = [None] * len(inputs)
                roots, root_grads = [o for o, _ in pairs], [g for _, g in pairs]
                if pairs and not ctx.n_params:
                    # compressed_checkpoint: run's parameters are not inputs of this function, so the engine
                    # accumulates them here (their hooks run once), and the inputs' gradients land in .grad
                    torch.autograd.backward(roots, root_grads)
                    got = [t.grad if i in wanted else None for i, t in enumerate(inputs)]
                elif pairs and wanted:
                    # a layer: its parameters are inputs; a parameter it holds by reference (rare) is not
                    others = _other_leaves(roots, inputs)
                    with _reentrant_named():
                        done = torch.autograd.grad(roots, [inputs[i] for i in wanted], root_grads,
                                                   allow_unused=True, retain_graph=bool(others))
                    for i, g in zip(wanted, done):
                        got[i] = g
                    if others:   # through the engine, which runs their hooks (DDP's, a streaming optimizer's)
                        torch.autograd.backward(roots, root_grads, inputs=others)
        return (None, *_first_order_only([got[0]]), None, None, None, None, *_first_order_only(got[1:]))


@contextlib.contextmanager
def _reentrant_named():
    """torch's refusal of autograd.grad through a reentrant checkpoint blames a .grad() the user never called."""
    try:
        yield
    except RuntimeError as err:
        if "use_reentrant=True" not in str(err):
            raise
        raise RuntimeError(
            "a layer under effmem's 'min' policy (or a memory budget's 'min' layer) calls "
            "torch.utils.checkpoint(use_reentrant=True) inside it: the policy's backward takes the layer's "
            "gradients with torch.autograd.grad, which reentrant checkpointing refuses. Pass use_reentrant=False "
            "there, or use policy='checkpoint' or 'fast'") from err


_NO_SECOND_ORDER = (b"effmem: a layer checkpointed with its input in 8 bits (the 'min' policy, checkpoint8, "
                    b"compressed_checkpoint, a memory budget's 'min' layers) has no second derivative: its "
                    b"recompute starts from a copy of the input, not the input's graph. For create_graph=True "
                    b"(a gradient penalty, a Hessian-vector product) use policy='checkpoint' or 'fast'")


def _first_order_only(grads: list) -> list:
    """Under create_graph=True, the gradients made without a graph: differentiating them raises why (they
    were constants to autograd, and a gradient penalty through a "min" layer was dropped with no error)."""
    if not torch.is_grad_enabled() or not any(g is not None for g in grads):
        return grads
    present = [g.detach().requires_grad_() for g in grads if g is not None]
    out = torch._C._functions.DelayedError(_NO_SECOND_ORDER, len(present))(*present)
    out = iter((out,) if isinstance(out, Tensor) else out)
    return [None if g is None else next(out) for g in grads]


def _other_leaves(roots, declared) -> list:
    """Tensors needing a gradient that the recomputed layer reached other than through the checkpoint's
    inputs (another module's parameter it holds a reference to): a walk of its graph, some tens of
    microseconds per layer."""
    known = {id(t) for t in declared}
    seen, stack, found = set(), [r.grad_fn for r in roots], []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)   # an AccumulateGrad node: the end of a branch
        if leaf is not None:
            if id(leaf) not in known:
                found.append(leaf)
            continue
        stack.extend(f for f, _ in fn.next_functions)
    return found


def compressed_checkpoint(run: Callable[[Tensor], Tensor], x: Tensor, *, bits: int = 8, group_size: int = 128,
                          seed: Optional[int] = None) -> Tensor:
    """run(x), saving nothing inside it and x in `bits`-bit codes; run is recomputed in backward.

    Other tensors run uses (masks, rotary tables) are held as they are, by the closure; none of them
    may need a gradient, and run's parameters get gradients only where x needs one. bits (8 or 4) and
    group_size (elements per scale: 32, 64, 128 or 256): x's codes. seed: their stochastic rounding's seed
    (default: the next of a per-process counter, so that two calls round independently)."""
    _codec.check_config(bits, group_size)
    if not callable(run):
        raise TypeError(f"run: expected a callable taking x, got {type(run).__name__}")
    if not isinstance(x, Tensor) or x.dtype not in _codec.FLOAT_DTYPES:
        raise TypeError(f"x: expected a float32, bfloat16 or float16 tensor, got "
                        f"{x.dtype if isinstance(x, Tensor) else type(x).__name__}")

    def run_one(x_):
        out = run(x_)
        if not isinstance(out, Tensor):
            raise TypeError(f"compressed_checkpoint: run returned {type(out).__name__}; expected a tensor")
        return (out,)
    return _CompressedCheckpoint.apply(run_one, x, bits, group_size, _seed(seed), 0)[0]


def _layer_forward(layer: nn.Module, original, bits: int, group_size: int, *args, **kwargs):
    """The layer's forward, checkpointed with its hidden-state input (first argument) compressed and its
    other inputs that need a gradient kept as they are."""
    if not torch.is_grad_enabled():   # nothing saved: the layer as it is (traced into a compiled model's graph)
        return original(*args, **kwargs)
    if torch.compiler.is_compiling():
        return _compiled_layer_forward(layer, original, bits, group_size, *args, **kwargs)
    refuse_hf_checkpointing(layer)
    if refuse_func_transforms(layer):   # vmap alone: the layer's own forward
        return original(*args, **kwargs)
    if torch_checkpoint_on_top():
        return original(*args, **kwargs)   # in the user's torch checkpoint: recomputed there once, not twice
    by_name = not args
    if by_name:
        if "hidden_states" not in kwargs:
            raise TypeError(f"{type(layer).__name__}: compressed checkpointing needs the hidden state as the "
                            "first argument or as hidden_states=")
        kwargs = dict(kwargs)
        x = kwargs.pop("hidden_states")
        rest = ()
    else:
        x, rest = args[0], args[1:]
    if not isinstance(x, Tensor) or x.dtype not in _codec.FLOAT_DTYPES:
        raise TypeError(f"{type(layer).__name__}: compressed checkpointing ('min'): the hidden state must be a "
                        f"float32, bfloat16 or float16 tensor, got "
                        f"{x.dtype if isinstance(x, Tensor) else type(x).__name__}")
    refuse_cache(layer, rest, kwargs)
    leaves, spec = tree_flatten((rest, kwargs))
    grad_at = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
    params = [p for p in layer.parameters() if p.requires_grad]
    held = tensors_read(layer)   # what this forward reads
    modes = [(m, m.training) for m in layer.modules()]   # and in which modes (dropout on or off)
    tail = {}

    def run(x_, *extras):
        args_ = list(leaves)
        for i, e in zip(grad_at, extras):
            args_[i] = e
        rest_, kwargs_ = tree_unflatten(args_, spec)
        replay, tail["ran"] = "ran" in tail, True   # the forward's own run reads what it reads
        with as_in_forward(layer, held) if replay else nullcontext(), modes_as(modes) if replay else nullcontext():
            out = original(*rest_, hidden_states=x_, **kwargs_) if by_name else original(x_, *rest_, **kwargs_)
        if isinstance(out, list):   # a list in the tuple's place (OpenAI GPT's Block): given back as a list
            out, tail["list"] = tuple(out), True
        if not isinstance(out, (Tensor, tuple)) or isinstance(out, tuple) and not (out and isinstance(out[0], Tensor)):
            got = type(out).__name__ if not isinstance(out, tuple) else (
                "an empty tuple" if not out else f"a tuple whose first entry is {type(out[0]).__name__}")
            raise TypeError(f"compressed checkpointing: the layer returned {got}; expected a "
                            "tensor (or a tuple whose first entry is the hidden state)")
        if isinstance(out, Tensor):
            return (out,)
        out_leaves, out_spec = tree_flatten(out[1:])
        if "spec" not in tail:   # the forward's run decides which other outputs go through autograd
            tail.update(spec=out_spec, leaves=out_leaves,
                        grad_at=[i for i, t in enumerate(out_leaves) if isinstance(t, Tensor) and t.requires_grad])
        return (out[0], *[out_leaves[i] for i in tail["grad_at"]])

    buffers = list(layer.buffers())   # none in transformers' decoder layers: nothing to keep there
    if buffers:   # kept around the recompute and its backward (a BatchNorm's statistics)
        run.keep = functools.partial(buffers_kept, buffers)
    bits = None if routes_tokens(layer) else bits
    outs = _CompressedCheckpoint.apply(run, x, bits, group_size, next_seed(layer), len(grad_at),
                                       *[leaves[i] for i in grad_at], *params)
    if "spec" not in tail:
        return outs[0]
    out_leaves = list(tail.pop("leaves"))
    for i, o in zip(tail["grad_at"], outs[1:]):
        out_leaves[i] = o
    out = (outs[0], *tree_unflatten(out_leaves, tail["spec"]))
    return list(out) if tail.get("list") else out


@leaves_graph
def _compiled_layer_forward(layer: nn.Module, original, bits: int, group_size: int, *args, **kwargs):
    """Inside a compiled model: the layer checkpointed as in eager mode, its forward (and recompute) a
    compiled graph of its own (activations.compiled)."""
    return _layer_forward(layer, compiled_forward(original, selective=False), bits, group_size, *args, **kwargs)


SEEDS = "_effmem_seeds"


class Seeds:
    """A counter of rounding seeds, 0, 1, 2, ...: itertools.count, but one that copy.deepcopy and pickle take on
    every Python (they stop taking itertools' from 3.14; a model under "min" pickles, as
    docs/activation_policies.md says)."""

    def __init__(self) -> None:
        self.next = 0

    def __iter__(self) -> "Seeds":
        return self

    def __next__(self) -> int:
        self.next += 1
        return self.next - 1


def next_seed(layer: nn.Module) -> int:
    """The seed of a compressed layer input's stochastic rounding: from a counter of the policy's application,
    shared by its layers (SEEDS), so that a run repeats in one process as it does in a new one (the package's
    counter of compress.functions ran on from model to model); elsewhere that counter's next."""
    seeds = layer.__dict__.get(SEEDS)
    return _seed(None) if seeds is None else next(seeds)


def checkpoint_layer(layer: nn.Module, bits: Optional[int] = 8, group_size: int = 128,
                     selective: bool = False, seeds: Optional[Iterator[int]] = None) -> None:
    """Checkpoint `layer` (in place; undo with restore_layer): its input kept in `bits`-bit codes, or
    as it is (torch.utils.checkpoint, non-reentrant) for bits=None; selective=True (bits=None) also keeps
    its matmul and attention outputs (activations.selective). seeds: the codes' rounding seeds (next_seed),
    shared by the layers of one model; None: a counter of this layer's own."""
    if "forward" in layer.__dict__:
        raise ValueError(f"{type(layer).__name__}: its forward is already replaced (by an activation policy "
                         "or checkpointing); remove that first")
    if bits is not None:
        layer.__dict__[SEEDS] = Seeds() if seeds is None else seeds
    if bits is None:
        layer.forward = functools.partial(torch_checkpointed, layer, layer.forward, selective)
        layer._effmem_policy = "selective" if selective else "checkpoint"
    else:
        layer.forward = functools.partial(_layer_forward, layer, layer.forward, bits, group_size)
        layer._effmem_policy = f"checkpoint{bits}"


def restore_layer(layer: nn.Module) -> None:
    layer.__dict__.pop(SEEDS, None)
    # the layer's own: a wrapper that passes attribute reads on (torch's CheckpointWrapper) holds none
    if layer.__dict__.get("_effmem_policy") is not None:
        del layer.forward
        del layer._effmem_policy
