"""effmem plan's trace on meta tensors made to behave like the device it plans for (plan/trace.py).

Device kernels: on the meta device scaled_dot_product_attention runs as
plain math (saving the [s, s] weights). CUDA runs a flash kernel, which
saves q, k, v, the output and a float32 log-sum-exp per row, and so does
the CPU without dropout (with dropout the CPU runs the math). CUDA's
F.rms_norm is one fused kernel keeping the input and a float32 rstd; the
CPU's is the math. The trace swaps in functions that save what the target
device's kernels save.

_Counter, a dispatch mode over the whole forward, also counts matmul FLOPs with torch's own formulas and,
inside decoder layers, what selective checkpointing keeps (matmul and attention outputs) and the memory
traffic of what it recomputes.
"""
import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

from effmem.activations.selective import SAVED_PACKETS
from effmem.plan.meta_ops import fast_meta


class ScaledDotProductFlashStandIn(torch.autograd.Function):
    """scaled_dot_product_attention as CUDA's flash kernel holds it: q, k, v, output, fp32 log-sum-exp (and
    the mask, where one is given: the kernels that take one keep it). Named as torch's nodes are
    (ScaledDotProduct...Backward), which the "fast" policy's rule for an attention's output reads."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        # The kernels allocate their output like the query (empty_like: dense, in the order of its strides):
        # [batch, seq, heads, dim] in memory for a query that is a view of its projection (the usual transpose
        # back before the output projection then costs no copy), [batch, heads, seq, dim] for one made
        # contiguous in that order (partial rotary's torch.cat: GPT-NeoX, Phi, StableLM), where it copies.
        shape = q.shape[:-1] + (v.shape[-1],)
        if q.stride(-3) < q.stride(-2):   # heads closer together than positions
            # not a view (as a kernel's output is not, to autograd): the "fast" rule for an attention's output
            # reads its node, where a view's would be its base's (none)
            layout = q.new_empty(shape[:-3] + (shape[-2], shape[-3], shape[-1]), device="meta").transpose(-3, -2)
            out = q.new_empty_strided(shape, layout.stride())
        else:
            out = q.new_empty(shape)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        if mask is None:
            ctx.save_for_backward(q, k, v, out, lse)
        else:   # sdpa turns a boolean mask into one of the query's dtype first: a tensor per call
            ctx.save_for_backward(q, k, v, out, lse, mask.new_empty(mask.shape, dtype=q.dtype)
                                  if mask.dtype == torch.bool else mask)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None


@dataclass
class _Flops:
    """What the trace's dispatch mode and kernel stand-ins count besides the saves."""
    attention: float = 0.0
    # attention's backward: twice its forward, where a gradient flows into query, key or value (not in a frozen
    # layer below every trained parameter)
    attention_backward: float = 0.0
    # selective checkpointing: keep(t) records a decoder layer's matmul/attention output; recompute_bytes
    # sums what the layers' other ops read and write (backward runs them again)
    keep: Optional[Callable[[Tensor], None]] = None
    in_block: Callable[[], bool] = lambda: False
    recompute_bytes: float = 0.0
    # what every op of the forward but the products and attention reads and writes (the step model's
    # memory-bound time: norms, activations, rotary, casts, residual adds, the loss's softmax)
    elementwise_bytes: float = 0.0
    # the storages of the outputs keep(t) recorded; whether an op of a layer then wrote into one in place
    # (Falcon's mlp_output += attention_output), which the "selective" policy refuses at its first forward.
    # in_place_module: the op runs in a module with inplace=True, which "selective" runs out of place
    kept: set = field(default_factory=set)
    kept_written: bool = False
    in_place_module: Callable[[], bool] = lambda: False


class _FusedRmsNorm(torch.autograd.Function):
    """F.rms_norm as CUDA runs it (aten._fused_rms_norm): it keeps the input and a float32 rstd per row.

    The CPU and the meta device run the math instead (a float32 copy of the
    input and of the normalised values are kept): that is traced as is."""

    @staticmethod
    def forward(ctx, x, weight, dims: int):
        rstd = torch.empty(x.shape[:x.dim() - dims] + (1,) * dims, dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, weight, _ = ctx.saved_tensors
        return torch.zeros_like(x), None if weight is None else torch.zeros_like(weight), None


def _cpu_runs_math(query, key, value, attn_mask, is_causal: bool, enable_gqa: bool) -> bool:
    """Whether this torch's CPU attention runs its math path (which keeps the weights) for these inputs' layout.
    Asked of torch itself with tiny real tensors of the same heads, head size, dtypes, broadcast dimensions and
    last-dimension contiguity (on meta tensors it always answers math): torch 2.13 ran math where key and
    value broadcast one head to the query's (Falcon's), 2.14 its flash kernel, and the stand-in's flash was
    15% short on 2.13."""
    def tiny(t, mask=False):
        if not isinstance(t, Tensor):
            return t
        shape = []
        for back, n in zip(range(t.dim(), 0, -1), t.shape):   # back: 1 for the last dimension
            if n == 1 or back == 3 or back == 1 and not mask:   # broadcast, heads, head size: as they are
                shape.append(n)
            else:   # sequence lengths 4, a batch 2
                shape.append(4 if back == 2 or back == 1 else min(n, 2))
        if t.dim() >= 2 and t.stride(-1) != 1 and t.shape[-1] > 1:   # a last dimension not contiguous: so too
            made = torch.zeros(shape[:-2] + shape[-1:] + shape[-2:-1], dtype=t.dtype).transpose(-1, -2)
        else:
            made = torch.zeros(shape, dtype=t.dtype)
        return made.requires_grad_(t.requires_grad and t.is_floating_point())
    try:
        from torch.nn.attention import SDPBackend
        choice = torch._fused_sdp_choice(tiny(query), tiny(key), tiny(value), tiny(attn_mask, True), 0.0,
                                         is_causal, enable_gqa=enable_gqa)
        return choice == int(SDPBackend.MATH)
    except Exception:   # a torch without the query, or a layout it refuses: the flash stand-in, as before
        return False


@contextlib.contextmanager
def _device_kernels(flops: _Flops, target: str, autocast: Optional["_MetaAutocast"] = None):
    """Swap in functions that save what the target device's kernels save (attention; CUDA's rms_norm).
    autocast: attention's inputs in bf16, as CUDA's autocast gives them to the kernel."""
    real_sdpa, real_rms = F.scaled_dot_product_attention, F.rms_norm

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if autocast is not None:
            query, key, value = (autocast.lower(t) for t in (query, key, value))
        # the CPU runs the math (which keeps the weights) with dropout, and for a mask that needs a gradient
        # (Doge's, made from parameters); the flash stand-in was 12% short there
        if target == "cpu" and (dropout_p > 0 or attn_mask is not None and attn_mask.requires_grad
                                and torch.is_grad_enabled()
                                or _cpu_runs_math(query, key, value, attn_mask, is_causal, enable_gqa)):
            return real_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                             scale=scale, enable_gqa=enable_gqa)
        b_h = math.prod(query.shape[:-2])
        s_q, s_k, d = query.shape[-2], key.shape[-2], query.shape[-1]
        # QK^T and PV, 2 FLOPs per multiply-add; a causal mask halves the work a flash kernel does.
        work = 4.0 * b_h * s_q * s_k * d * (0.5 if is_causal and attn_mask is None else 1.0)
        flops.attention += work
        if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
            flops.attention_backward += 2 * work
        out = ScaledDotProductFlashStandIn.apply(query, key, value, attn_mask)
        if flops.keep is not None and flops.in_block():
            for t in (out, out.grad_fn.saved_tensors[4] if out.grad_fn is not None else None):
                if t is not None:
                    flops.keep(t)  # selective checkpointing keeps the kernel's output and log-sum-exp
        return out

    def rms_norm(input, normalized_shape, weight=None, eps=None):
        flops.elementwise_bytes += 2 * input.nbytes  # one fused kernel: read the input, write the output
        if flops.in_block():
            flops.recompute_bytes += 2 * input.nbytes
        return _FusedRmsNorm.apply(input, weight, len(tuple(normalized_shape)))

    F.scaled_dot_product_attention = sdpa
    if target == "cuda":
        F.rms_norm = rms_norm
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.rms_norm = real_sdpa, real_rms


def _functions(*names: str) -> frozenset:
    """The torch functions of those names that this torch has: torch.X, torch.Tensor.X and F.X."""
    return frozenset(f for n in names for f in (getattr(torch, n, None), getattr(Tensor, n, None), getattr(F, n, None))
                     if f is not None)


# What autocast runs in its lower precision (matmuls and convolutions; attention goes through the stand-in
# below) and in float32, on each device (torch's documented lists, as far as a transformer's forward meets them).
_AUTOCAST_LOWER = _functions("linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm",
                             "addbmm", "einsum", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                             "conv_transpose3d", "prelu")
_LOSSES = ("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
           "binary_cross_entropy", "binary_cross_entropy_with_logits", "poisson_nll_loss", "margin_ranking_loss")
_AUTOCAST_FLOAT = {
    "cuda": _functions(*_LOSSES, "softmax", "log_softmax", "softmin", "layer_norm", "group_norm", "normalize",
                       "cosine_similarity", "pow", "__pow__", "__rpow__", "__rtruediv__", "exp", "expm1", "log",
                       "log1p", "log2", "log10", "rsqrt", "reciprocal", "cumsum", "cumprod", "prod", "sum", "norm",
                       "softplus", "erfinv", "cdist"),
    "cpu": _functions(*_LOSSES, "prod", "cdist"),
}


class _MetaAutocast(TorchFunctionMode):
    """The target device's bf16 autocast for a forward on meta tensors, which have no autocast of their own
    ("fp32" candidates train float32 weights under autocast on a GPU): matmul-like functions get bf16 copies of their float32
    inputs, and a parameter's copy is made once per forward (autocast caches it; backward keeps it), the
    functions autocast runs in float32 get float32 copies of bf16/fp16 inputs. The copies are ordinary ops
    under autograd, so the trace records what backward keeps of them as it records the rest."""

    dtype = torch.bfloat16

    def __init__(self, target: str = "cuda"):
        super().__init__()
        self.float_ops = _AUTOCAST_FLOAT[target]
        self.cache = {}   # id(parameter) -> (parameter, its bf16 copy); the parameter kept so its id stays its

    def __enter__(self):
        # effmem.linear_cross_entropy casts its inputs itself under autocast: on meta tensors it asks here
        from effmem import linear_ce
        self._previous, linear_ce._TRACE_TARGET[1] = linear_ce._TRACE_TARGET[1], self.dtype
        return super().__enter__()

    def __exit__(self, *exc):
        from effmem import linear_ce
        linear_ce._TRACE_TARGET[1] = self._previous
        return super().__exit__(*exc)

    def lower(self, t):
        if not isinstance(t, Tensor) or t.dtype != torch.float32:
            return t
        if t.is_leaf and t.requires_grad:
            hit = self.cache.get(id(t))
            if hit is None:
                hit = self.cache[id(t)] = (t, t.to(self.dtype))
            return hit[1]
        return t.to(self.dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _AUTOCAST_LOWER:
            args, kwargs = tree_map(self.lower, (args, kwargs))
        elif func in self.float_ops:
            args, kwargs = tree_map(lambda t: t.float() if isinstance(t, Tensor) and t.dtype in
                                    (torch.bfloat16, torch.float16) else t, (args, kwargs))
        return func(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _writes_first(func) -> bool:
    """Whether the op writes into its first argument (add_, copy_, an out= form on it)."""
    a = func._schema.arguments
    return bool(a) and a[0].alias_info is not None and a[0].alias_info.is_write


class _Counter(TorchDispatchMode):
    """Counts matmul FLOPs (torch's own formulas) and makes meta tensors behave like the target device's.

    Hugging Face models test a value now and then (is this a packed batch?
    is the mask all ones?); a meta tensor has none, so the check gets the
    answer of an ordinary unpacked, unmasked batch: True (or 0). Meta
    kernels follow CUDA's dtypes; the CPU's layer norm keeps its mean and
    rstd in a bf16/fp16 input's own dtype, CUDA's in float32. The commonest
    ops get their outputs from plan/meta_ops.py (torch's Python meta
    functions cost most of a trace)."""

    def __init__(self, target: str, sel: Optional[_Flops] = None):
        super().__init__()
        self.flops = 0.0
        self.block_flops = 0.0  # of those, the decoder layers' (what checkpointing runs again)
        self.head_recompute_flops = 0.0  # products the fused loss's backward runs again (see below)
        # backward's products: each forward product once per operand that takes a gradient (a frozen weight
        # takes none; nor does an activation below every trained parameter, which autograd never reaches)
        self.backward_flops = 0.0
        self.ops = 0        # aten ops the forward ran: each one the host issues in eager mode
        self.block_ops = 0  # of those, the decoder layers' (what checkpointing issues again)
        self.target = target
        self.sel = sel  # where selective checkpointing's keeps and recompute traffic are counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return True if args[0].dtype == torch.bool else 0
        out = fast_meta(func, args, kwargs)
        packet = func._overloadpacket
        if out is None and packet is torch.ops.aten._grouped_mm and self.target == "cpu":
            out = _grouped_mm_cpu(*args, **kwargs)
        if out is None:
            out = func(*args, **kwargs)
        in_block = self.sel is not None and self.sel.in_block()   # asked once per op: this runs for every op
        if self.sel is not None:
            matmul = packet in flop_registry or packet is torch.ops.aten._grouped_mm or packet in _FUSED_CE
            kept = in_block and packet in SAVED_PACKETS
            recomputed = in_block and not kept
            # one count of the op's bytes serves both uses (views and ops that make no memory move none)
            traffic = _traffic(packet, args, out) if recomputed or not matmul else 0.0
            if kept:   # selective checkpointing keeps this op's outputs
                for t in _tensors(out):
                    self.sel.keep(t)
                    self.sel.kept.add(t.untyped_storage()._cdata)
            elif recomputed:   # any other op that makes new memory runs again in the recompute
                self.sel.recompute_bytes += traffic
                if (self.sel.kept and _writes_first(func) and isinstance(args[0], Tensor)
                        and args[0].untyped_storage()._cdata in self.sel.kept and not self.sel.in_place_module()):
                    self.sel.kept_written = True
            if not matmul:
                self.sel.elementwise_bytes += traffic
        if (self.target == "cpu" and packet is torch.ops.aten.native_layer_norm
                and args[0].dtype in (torch.bfloat16, torch.float16)):
            return out[0], out[1].to(args[0].dtype), out[2].to(args[0].dtype)
        before = self.flops
        self._count(packet, args, kwargs, out)
        self.ops += 1
        if in_block:
            self.block_flops += self.flops - before
            self.block_ops += 1
        return out

    def _count(self, packet, args, kwargs, out) -> None:
        before = self.flops
        if packet in flop_registry:
            self.flops += flop_registry[packet](*args, **kwargs, out_val=out)
        elif packet is torch.ops.aten._grouped_mm:
            # [tokens, k] x [experts, k, n]: each token row meets one expert's matrix.
            self.flops += 2.0 * out.numel() * args[0].shape[-1]
        elif packet in _FUSED_CE:
            # effmem.linear_cross_entropy: the logits' product, as the unfused head's, and its gradients' (one
            # per operand taking one: the kernels run them in backward, or in forward with the gradients). They
            # run where autograd's grad mode is off (an autograd.Function's forward, the op's own autograd),
            # so they are counted here, not below. Recomputed, backward makes the logits again: one more.
            tokens, hidden = args[0].shape
            product = 2.0 * tokens * hidden * args[1].shape[0]
            self.flops += product
            self.backward_flops += product * (args[0].requires_grad + args[1].requires_grad)
            if packet is torch.ops.effmem.linear_ce_forward:
                self.head_recompute_flops += product
        if packet not in _FUSED_CE and self.flops != before and torch.is_grad_enabled():
            operands = [t for t in args if isinstance(t, Tensor) and t.dim() >= 2][:2]
            self.backward_flops += (self.flops - before) * sum(t.requires_grad for t in operands)


_FUSED_CE = (torch.ops.effmem.linear_ce_forward, torch.ops.effmem.linear_ce_forward_backward)


def _grouped_mm_cpu(a: Tensor, b: Tensor, offs=None, bias=None, out_dtype=None) -> Optional[Tensor]:
    """torch._grouped_mm (a mixture of experts' products in transformers) on meta tensors for a CPU, where it
    takes float32 too; torch's meta function refuses all but bf16 (as CUDA's kernel does: on a GPU a float32
    MoE has no candidates). [tokens, k] x [experts, k, n] -> [tokens, n]; [g, m, k] x [g, k, n] -> [g, m, n].
    None: another case, left to torch."""
    if a.device.type != "meta" or a.dtype != torch.float32 or b.dim() != 3 or a.dim() not in (2, 3):
        return None
    shape = (a.shape[0], b.shape[-1]) if a.dim() == 2 else (a.shape[0], a.shape[1], b.shape[-1])
    return torch.empty(shape, dtype=out_dtype or a.dtype, device="meta")


def _traffic(packet, args, out) -> float:
    """Bytes an op that makes new memory moves: its inputs read, its outputs written. Views and in-place ops
    make none (counted as nothing), nor do the empty tensors of the kernel stand-ins above; an embedding
    reads only the rows it gathers."""
    ins = list(_tensors(args))
    if not ins or "empty" in packet.__name__:
        return 0.0
    inputs = {_storage_id(t) for t in ins}
    new = [t for t in _tensors(out) if _storage_id(t) not in inputs]
    if not new:
        return 0.0
    written = sum(t.nbytes for t in new)
    if packet is torch.ops.aten.embedding:
        return 2.0 * written
    return written + sum(t.nbytes for t in ins)


def _storage_id(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(obj):
    """Every tensor in nested lists, tuples and mappings (a model's outputs, a layer's arguments)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict) or hasattr(obj, "items"):
        try:
            for o in obj.values():
                yield from _tensors(o)
        except Exception:  # a ModelOutput-like object that is not a mapping after all
            return
