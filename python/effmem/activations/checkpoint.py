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
torch.utils.checkpoint does, and runs its own backward inside this one's
(the reentrant scheme): parameter gradients accumulate into ``.grad``.
"""
import functools
from contextlib import nullcontext
from typing import Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from effmem.activations.compiled import compiled_forward
from effmem.activations.selective import context as selective_context
from effmem.compress import _codec
from effmem.compress.functions import _as_rows, _seed
from effmem.plan.trace import _tensors


def _drop(t: Tensor) -> None:
    return None


def _never_unpacked(_) -> Tensor:
    raise RuntimeError("compressed checkpointing ('min'): backward reached a tensor made inside a checkpointed "
                       "layer's forward other than its output (e.g. MoE router logits in an auxiliary loss, or "
                       "attention weights), of which 'min' keeps nothing; use 'fast' or 'checkpoint' for this "
                       "model, or do not ask it for those outputs")


class _CompressedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: Callable[[Tensor], Tensor], x: Tensor, bits: int, group_size: int, seed: int):
        ctx.run, ctx.shape, ctx.dtype = run, tuple(x.shape), x.dtype
        ctx.bits, ctx.group_size = bits, group_size
        ctx.device = x.device
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        dev = x.device.type
        ctx.autocast = torch.get_autocast_dtype(dev) if dev in ("cuda", "cpu") and \
            torch.is_autocast_enabled(dev) else None
        # With grad enabled, as in the recompute, so that every op picks the same kernel both times
        # (the CPU's attention runs a different kernel, drawing dropout differently, without grad);
        # what the ops save is dropped at once.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _never_unpacked):
            out = run(x.detach())
        if not isinstance(out, Tensor):
            raise TypeError(f"compressed checkpointing: the layer returned {type(out).__name__}; expected a tensor "
                            "(or a tuple whose first entry is the hidden state)")
        rows = _as_rows(x.detach())
        codes, stats = _codec.quantize(rows, bits=bits, group_size=group_size, seed=seed, stochastic=True)
        ctx.rows_shape = tuple(rows.shape)
        ctx.save_for_backward(codes, stats)
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        codes, stats = ctx.saved_tensors
        x = _codec.dequantize(codes, stats, bits=ctx.bits, group_size=ctx.group_size, shape=ctx.rows_shape,
                              dtype=ctx.dtype).view(ctx.shape).requires_grad_(True)
        devices = [ctx.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, enabled=True):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            # the forward's autocast state, off included: a backward run inside an autocast region must not
            # recompute the layer under it
            amp = (torch.autocast(ctx.device.type, dtype=ctx.autocast, enabled=ctx.autocast is not None)
                   if ctx.device.type in ("cuda", "cpu") else nullcontext())
            with torch.enable_grad(), amp:
                out = ctx.run(x)
        torch.autograd.backward(out, grad_out)
        return None, x.grad, None, None, None


def compressed_checkpoint(run: Callable[[Tensor], Tensor], x: Tensor, *, bits: int = 8, group_size: int = 128,
                          seed: Optional[int] = None) -> Tensor:
    """run(x), saving nothing inside it and x in `bits`-bit codes; run is recomputed in backward.

    Other tensors run uses (masks, rotary tables) are held as they are, by the closure; none of them
    may need a gradient."""
    _codec.check_config(bits, group_size)
    if not isinstance(x, Tensor) or x.dtype not in _codec.FLOAT_DTYPES:
        raise TypeError(f"x: expected a float32, bfloat16 or float16 tensor, got "
                        f"{x.dtype if isinstance(x, Tensor) else type(x).__name__}")
    return _CompressedCheckpoint.apply(run, x, bits, group_size, _seed(seed))


def _layer_forward(layer: nn.Module, original, bits: int, group_size: int, *args, **kwargs):
    """The layer's forward, checkpointed with its hidden-state input (first argument) compressed."""
    if torch.compiler.is_compiling():
        return _compiled_layer_forward(layer, original, bits, group_size, *args, **kwargs)
    if not torch.is_grad_enabled():
        return original(*args, **kwargs)
    by_name = not args
    if by_name:
        if "hidden_states" not in kwargs:
            raise TypeError(f"{type(layer).__name__}: compressed checkpointing needs the hidden state as the "
                            "first argument or as hidden_states=")
        x = kwargs.pop("hidden_states")
        rest = ()
    else:
        x, rest = args[0], args[1:]
    _refuse_cache(layer, rest, kwargs)
    if any(t.requires_grad for t in _tensors((rest, kwargs))):
        raise TypeError(f"{type(layer).__name__}: an input other than the hidden state needs a gradient; "
                        "compressed checkpointing recomputes from the hidden state alone")
    tail = {}

    def run(x_):
        out = original(*rest, hidden_states=x_, **kwargs) if by_name else original(x_, *rest, **kwargs)
        if isinstance(out, tuple):
            tail["rest"] = out[1:]
            return out[0]
        return out

    y = compressed_checkpoint(run, x, bits=bits, group_size=group_size)
    return (y, *tail["rest"]) if "rest" in tail else y


def _refuse_cache(layer: nn.Module, args, kwargs) -> None:
    if any(type(a).__name__.endswith("Cache") for a in (*args, *kwargs.values())):
        raise TypeError(f"{type(layer).__name__}: got a key/value cache; recomputing a layer would add to it "
                        "a second time. Train with use_cache=False (apply_activation_policy sets it in the "
                        "model's config)")


def _torch_checkpointed(layer: nn.Module, original, selective: bool, *args, **kwargs):
    """The layer under torch's checkpointing ("checkpoint"), or its selective form ("selective")."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        _refuse_cache(layer, args, kwargs)
    context = {"context_fn": selective_context} if selective else {}
    return torch_checkpoint(original, *args, use_reentrant=False, **context, **kwargs)


@torch.compiler.disable
def _compiled_layer_forward(layer: nn.Module, original, bits: int, group_size: int, *args, **kwargs):
    """Inside a compiled model: the layer checkpointed as in eager mode, its forward (and recompute) a
    compiled graph of its own (activations.compiled)."""
    return _layer_forward(layer, compiled_forward(original, selective=False), bits, group_size, *args, **kwargs)


def checkpoint_layer(layer: nn.Module, bits: Optional[int] = 8, group_size: int = 128,
                     selective: bool = False) -> None:
    """Checkpoint `layer` (in place; undo with restore_layer): its input kept in `bits`-bit codes, or
    as it is (torch.utils.checkpoint, non-reentrant) for bits=None; selective=True (bits=None) also keeps
    its matmul and attention outputs (activations.selective)."""
    if "forward" in layer.__dict__:
        raise ValueError(f"{type(layer).__name__}: its forward is already replaced (by an activation policy "
                         "or checkpointing); remove that first")
    if bits is None:
        layer.forward = functools.partial(_torch_checkpointed, layer, layer.forward, selective)
        layer._effmem_policy = "selective" if selective else "checkpoint"
    else:
        layer.forward = functools.partial(_layer_forward, layer, layer.forward, bits, group_size)
        layer._effmem_policy = f"checkpoint{bits}"


def restore_layer(layer: nn.Module) -> None:
    if getattr(layer, "_effmem_policy", None) is not None:
        del layer.forward
        del layer._effmem_policy
