"""What autograd saves for backward, recorded from the model itself on meta tensors.

The model's forward runs on the meta device (shapes and dtypes, no memory) with a saved_tensors_hooks pack hook that
records every saved tensor's storage: its bytes, which storage it is (a tensor saved by three ops is held once),
whether it is a parameter (costs nothing extra), which module was running (for the per-kind breakdown) and whether
that was inside a decoder layer. Pre-hooks on the decoder layers record their inputs: what a checkpointed layer
keeps. The forward's outputs (loss, logits) are recorded too: the training loop holds them until backward.

From those records every activation strategy's bytes follow without another run (``Trace.activations``): all saved
(none), the outside of the layers plus their inputs (checkpointing), those plus the outputs of the layers' matmuls
and attention (selective checkpointing, whose recompute traffic is counted too), the saved tensors at effmem's
compressed sizes (compress), or nothing but the outputs (save_on_cpu).

Device kernels are modelled as the target device runs them (plan/trace_kernels.py: flash attention's saves, CUDA's
fused rms_norm, the CPU's layer-norm statistics)."""
import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes as _no_modes
from torch.utils._pytree import tree_map_only

from effmem import _C
from effmem.compress._codec import memory_row, packed_bytes, saved_groups
from effmem.compress.api import kinked_activation
from effmem.compress.hooks import SIGN_READ
from effmem.compress.policy import CompressConfig, attention_output, compared_inputs, value_reason
from effmem.activations import paths, relu
from effmem.activations.checkpoint import routes_tokens
from effmem.plan.trace_kernels import _Counter, _device_kernels, _Flops, _MetaAutocast, _tensors

# "grads": gradients a loss makes in its forward pass (linear_cross_entropy's grad_in_forward), alive from
# then on: costs.py counts them with the gradients, not the activations.
KINDS = ("embedding", "attention", "mlp", "norm", "block", "logits", "grads", "other")
_LAYER_KINDS = ("attention", "mlp", "norm", "block")   # what decoder layers save (plus "other")
_GROUP_SIZE = CompressConfig().group_size   # the compress candidates' (plan/costs.py: compress8, compress4)
_KIND_WORDS = (("logits", ("lm_head", "head", "output")), ("embedding", ("emb", "wte", "wpe")),
               ("attention", ("attn", "attention")),
               ("mlp", ("mlp", "moe", "expert", "feed_forward", "ffn", "fc")),
               ("norm", ("norm", "ln_", "ln")))


def kind_of(module_path: str, in_block: bool, after_head: bool) -> str:
    """The layer kind a saved tensor is charged to, from the running modules' names (innermost first); not
    "logits" in a layer (BERT's layer.N.output: a classifier's layers were charged 4.2 GB of logits)."""
    if after_head:
        return "logits"  # the loss, computed after the output projection
    for part in reversed(module_path.lower().split(".")) if module_path else ():
        for kind, words in _KIND_WORDS:
            if kind == "logits" and in_block:
                continue
            if any(part == w or part.startswith(w) or part.endswith(w) for w in words):
                return kind
    return "block" if in_block else "other"


@dataclass
class Record:
    """One storage the forward left alive."""
    nbytes: int
    kind: str
    elem_size: int
    last_dim: int
    dtype: torch.dtype
    saved: bool = False
    saved_outside: bool = False          # saved while no decoder layer ran
    first_block: Optional[int] = None    # first decoder layer that saved it
    boundary: bool = False               # a decoder layer's input
    block_input: bool = False            # its hidden-state input (what the "min" policy keeps in 8 bits)
    shared: bool = False                 # another input, made outside the layers: one for all (masks, rotary)
    output: bool = False                 # part of what forward returned
    sac_output: bool = False             # a decoder layer's matmul/attention output (selective keeps it)
    relu_mask: bool = False              # a layer's nn.ReLU's mask, 1 bit per element: what "min" keeps for it
    sign_read: bool = False              # a ReLU's output: compress_activations stores its exact mask beside it
    kink_read: bool = False              # saved by a LeakyReLU/Hardtanh/ReLU6 module: compress keeps its mask
    read_elsewhere: bool = False         # saved by another op too (compress then stores its codes as well)
    exact: bool = False                  # compress keeps it as it is: a fused attention's output, the input of
                                         # a reduction that compares it with its result (amax, max(), ...)
    layout_kept: bool = False            # saved through a view compress keeps as it is (_layout)
    dense_save: bool = False             # saved through a view compress quantises (_layout)

    def compressible(self, cfg: CompressConfig) -> bool:
        """Whether compress_activations would quantise it (its dtype, size and shape rules)."""
        if self.kind == "grads" or self.exact or (self.layout_kept and not self.dense_save):
            return False   # grads: held outside saved tensors, no hook sees them
        rows = max(1, self.nbytes // self.elem_size // max(self.last_dim, 1))
        probe = torch.empty((rows, self.last_dim), dtype=self.dtype, device="meta")
        return self.saved and value_reason(cfg, probe) is None


def _compressed_bytes(r: Record, cfg: CompressConfig, bits: int) -> int:
    """What compress_activations keeps of a saved storage: its codes (or itself, where its rules keep it as it
    is), and an activation's exact mask, 1 bit per element (compress.hooks._masked, api._masked_activations)."""
    mask = (r.nbytes // r.elem_size + 7) // 8
    if r.kink_read and not r.read_elsewhere:   # read by a patched activation alone: its mask replaces it
        return mask
    n = r.nbytes
    if r.compressible(cfg):
        rows, cols, group = saved_groups(n // r.elem_size, r.last_dim, cfg.group_size)
        n = (n // r.elem_size + 7) // 8 if r.dtype == torch.bool else packed_bytes(rows, cols, bits, group)
        n += (mask if r.sign_read else 0) + (r.nbytes if r.layout_kept else 0)
    return n + (mask if r.kink_read else 0)


def _layout(t: Tensor) -> dict:
    """Whether compress' store keeps this save as it is for where its elements lie (csrc/saved/layout.cpp): a view
    with gaps it cannot quantise through its base (gpt-oss's gate_up[..., ::2], counted compressed before: 0.54x
    of what a real forward held) keeps the whole storage alive, beside the codes of another save of it that the
    store quantises (gpt-oss's attention with sinks saves its scores and a slice of them)."""
    kept = _C.layout_kept(t, _GROUP_SIZE) is not None
    return {"layout_kept": kept, "dense_save": not kept}


def _storage(t: Tensor):
    s = t.untyped_storage()
    return s._cdata, s.nbytes()


def _a_slice(t: Tensor) -> bool:
    """A part of a larger tensor (a view of another shape, not an expanded one): Gemma3n and Gemma4 hand each
    decoder layer its slice of one per-layer stack, which grows with the layers as their own saves do, so it is
    not one tensor shared by all of them (a mask or rotary table; an expanded mask is one)."""
    base = t._base
    return base is not None and 0 not in t.stride() and tuple(base.shape) != tuple(t.shape)


def held_for_backward(out) -> List[Tensor]:
    """Tensors that autograd Functions of the graph behind `out` keep for backward outside saved tensors,
    listed in their ``ctx._effmem_held`` (effmem.linear_cross_entropy's gradients made in forward)."""
    held, seen = [], set()
    todo = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        held.extend(t for t in getattr(node, "_effmem_held", None) or () if t is not None)
        todo.extend(f for f, _ in node.next_functions)
    return held


@dataclass
class Trace:
    """The records of one forward, and the FLOPs it took."""
    records: Dict[int, Record] = field(default_factory=dict)
    num_blocks: int = 0
    routed: bool = False   # the layers route tokens to experts: "min" keeps their inputs as they are
    matmul_flops: float = 0.0     # forward FLOPs of everything but attention
    block_matmul_flops: float = 0.0  # of those, the decoder layers'
    attention_flops: float = 0.0  # forward FLOPs of attention scores and weighted sums
    # The same forward under effmem's "fast" policy (trace_module(fast=True)): its records hold what was
    # saved outside the decoder layers, the policy's compressor counted what the layers stored.
    fast: Optional["Trace"] = None
    fast_layer_bytes: int = 0        # bytes the layers' saves take under the policy
    fast_compressed_bytes: int = 0   # plain bytes of what it quantised (the work of its kernels)
    fast_codes_bytes: int = 0        # what that became: codes and statistics (what "offload" moves to the host)
    selective_recompute_bytes: float = 0.0  # read + written by the layers' ops that selective recomputes
    # a layer writes into a product's output in place: the "selective" policy refuses such a model
    selective_refused: bool = False
    elementwise_bytes: float = 0.0  # read + written by every forward op but products and attention
    head_recompute_flops: float = 0.0  # the fused loss's logits product, made again in backward (recompute path)
    backward_flops: float = 0.0   # backward's products: each forward product once per operand taking a gradient
    attention_backward_flops: float = 0.0   # attention's backward, where its inputs take gradients
    forward_ops: int = 0   # aten ops of the forward (each issued by the host in eager mode)
    block_ops: int = 0     # of those, the decoder layers'

    def _kept(self, strategy: str) -> List[Tuple[Record, bool]]:
        """(record, counts as saved activation) pairs that stay alive until backward under a strategy."""
        out = []
        for r in self.records.values():
            if strategy in ("none", "compress8", "compress4", "save_on_cpu"):
                alive = r.saved or r.output
            elif strategy in ("checkpoint", "checkpoint8"):
                alive = r.saved_outside or r.boundary or r.output or (strategy == "checkpoint8" and r.relu_mask)
            elif strategy == "selective":
                alive = r.saved_outside or r.boundary or r.output or r.sac_output
            else:
                raise ValueError(f"activation strategy: unknown {strategy!r}")
            if alive:
                out.append((r, r.saved or (strategy == "selective" and r.sac_output)))
        return out

    def activations(self, strategy: str) -> Dict[str, int]:
        """Bytes alive at the end of forward under a strategy, by kind (outputs included, under 'logits')."""
        if strategy == "fast":
            if self.fast is None:
                raise ValueError("activation strategy 'fast': this trace ran without the policy")
            by_kind = self.fast.activations("none")  # outside the layers: all that was saved
            by_kind["block"] += self.fast.fast_layer_bytes
            return by_kind
        by_kind = {k: 0 for k in KINDS}
        cfg = CompressConfig()
        for r, saved in self._kept(strategy):
            n = r.nbytes
            if r.output and not saved:
                by_kind["logits"] += n  # what forward returned: the logits and the loss
                continue
            if strategy.startswith("compress"):
                n = _compressed_bytes(r, cfg, int(strategy[len("compress"):]))
            if strategy == "checkpoint8" and r.block_input and not r.saved_outside and not self.routed:
                # effmem.activations.checkpoint: the layer input as 8-bit codes of its rows (as it is for a
                # layer that routes tokens to experts: routes_tokens).
                n = packed_bytes(n // r.elem_size // r.last_dim, r.last_dim, 8, cfg.group_size)
            if strategy == "save_on_cpu" and not r.output and r.kind != "grads":
                n = 0
            by_kind[r.kind] += n
        return by_kind

    def part(self, shared: bool) -> "Trace":
        """This trace with only the records that the layers share (shared=True) or only the others, for the
        extrapolation (plan/extrapolate.py), which counts the shared ones once."""
        return dataclasses.replace(self, records={k: r for k, r in self.records.items() if r.shared == shared})

    def fast_compressed(self) -> int:
        return 0 if self.fast is None else self.fast.fast_compressed_bytes

    def fast_codes(self) -> int:
        return 0 if self.fast is None else self.fast.fast_codes_bytes

    def saved_bytes(self, strategy: str) -> int:
        """Bytes saved for backward under a strategy: activations() less what forward returned."""
        outputs = sum(r.nbytes for r in self.records.values() if r.output and not r.saved)
        return sum(self.activations(strategy).values()) - outputs

    def offloaded_bytes(self) -> int:
        """Bytes torch.autograd.graph.save_on_cpu moves to the host."""
        return sum(r.nbytes for r in self.records.values() if r.saved and not r.output and r.kind != "grads")

    def block_bytes(self) -> List[int]:
        """Bytes saved inside each decoder layer (what a checkpointed layer recomputes)."""
        out = [0] * self.num_blocks
        for r in self.records.values():
            if r.saved and r.first_block is not None and not r.saved_outside and not r.boundary:
                out[r.first_block] += r.nbytes
        return out

    def largest(self, kind: Optional[str] = None) -> int:
        sizes = [r.nbytes for r in self.records.values() if r.saved and (kind is None or r.kind == kind)]
        return max(sizes, default=0)


def _output_head(model: nn.Module, blocks) -> Optional[nn.Module]:
    """The output projection: Hugging Face's get_output_embeddings(), else the widest Linear outside the layers."""
    if hasattr(model, "get_output_embeddings"):
        return model.get_output_embeddings()
    inside = {id(m) for b in blocks for m in b.modules()}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in inside]
    return max(linears, key=lambda m: m.out_features, default=None)


def default_inputs(model: nn.Module, batch: int, seq: int, device) -> Tuple[tuple, dict]:
    """Training inputs for the models effmem knows: Hugging Face causal LMs and the demo GPT."""
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    if hasattr(model, "config") and hasattr(model.config, "vocab_size"):
        return (), {"input_ids": ids, "labels": ids, "use_cache": False}
    from effmem.demo_model import ByteGPT
    if isinstance(model, ByteGPT):
        # targets in a storage of their own, as training passes them: the loss saves them, the embedding
        # saves the inputs, and one shared tensor would count once
        return (ids, torch.zeros_like(ids)), {}
    raise TypeError(f"model: effmem plan does not know how to call {type(model).__name__}; pass "
                    f"inputs=callable(batch, seq, device) -> (args, kwargs) giving a forward that returns the loss")


InputsFn = Callable[[int, int, torch.device], Tuple[tuple, dict]]


def model_inputs(model: nn.Module, inputs: Optional[InputsFn], batch: int, seq: int, device, dtype):
    """inputs' (else default_inputs') (args, kwargs), float tensors (pixels, audio features) in `dtype`, the
    weights', as a loop training in it passes them: the trace and verify's steps take the same."""
    args, kwargs = (inputs or (lambda b, s, d: default_inputs(model, b, s, d)))(batch, seq, device)
    return tree_map_only(Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs))


class TraceFailed(RuntimeError):
    """The model's own forward raised on the trace's inputs (a config it cannot run as given: DeepSeek-V2's
    defaults, X-MOD without a default language): its message is the error's type and text."""


def trace_module(model: nn.Module, batch: int, seq: int, dtype: torch.dtype, target: str,
                 inputs: Optional[InputsFn] = None, fast: bool = False, autocast: bool = False) -> Trace:
    """Run one training forward of `model` on meta tensors of `dtype` and record what it leaves alive.

    target: "cuda" or "cpu", the device whose attention kernel to model. fast: with
    effmem.apply_activation_policy(model, "fast") applied for the run (and removed after), its
    compressor counting what the decoder layers store. autocast: the forward under the target's bf16
    autocast (float32 weights; trace_kernels._MetaAutocast)."""
    if fast:
        from effmem.activations import apply_activation_policy, remove_activation_policy
        apply_activation_policy(model, "fast")
        comp = model._effmem_fast
        comp.allow_meta = True
        try:
            tr = trace_module(model, batch, seq, dtype, target, inputs, autocast=autocast)
        finally:
            remove_activation_policy(model)
        st = comp.stats
        tr.fast_layer_bytes = st.total_bytes_after
        kept = sum(t.bytes_before for reason, t in st.skipped.items() if reason not in ("parameter", "layer_input"))
        tr.fast_compressed_bytes = st.total_bytes_before - kept
        tr.fast_codes_bytes = st.total_bytes_after - kept
        return tr
    meta = torch.device("meta")
    # Parameters, as the model's: "fast" keeps a frozen one saved by a product as it is, where as a plain tensor
    # it was a copy of a weight, counted (a LoRA model's every frozen weight: 1.6x its measured saves)
    state = {k: nn.Parameter(torch.empty_like(v, device=meta, dtype=dtype if v.is_floating_point() else v.dtype),
                             requires_grad=v.requires_grad and v.is_floating_point())
             for k, v in model.named_parameters()}
    # Floating buffers in the model's dtype, as .to(dtype) and from_pretrained(dtype=) leave them: kept float32,
    # XGLM's position table made its bf16 hidden states float32 (every later save twice its size), Gemma's
    # embedding scale was cast and saved, MiniMax's and GPT-1's failed on a dtype mismatch. Rotary inverse
    # frequencies stay float32 (transformers keeps them so; only the values would differ).
    buffers = {k: torch.empty_like(v, device=meta, dtype=v.dtype if not v.is_floating_point()
                                   or k.rsplit(".", 1)[-1].endswith("inv_freq") else dtype)
               for k, v in model.named_buffers()}
    owned = {_storage(t)[0] for t in list(state.values()) + list(buffers.values())}
    args, kwargs = model_inputs(model, inputs, batch, seq, meta, dtype)

    tr = Trace()
    # every stack a policy covers: the decoder's alone left a T5's encoder kept under checkpointing (3.8x measured)
    from effmem.activations import layer_stacks   # (a cycle at import time)
    blocks = [layer for _, layers in layer_stacks(model) for layer in layers]
    tr.num_blocks = len(blocks)
    tr.routed = bool(blocks) and routes_tokens(blocks[0])
    block_index = {id(m): i for i, m in enumerate(blocks)}
    head = _output_head(model, blocks)
    names = {id(m): n for n, m in model.named_modules()}
    stack: List[nn.Module] = []
    st = {"block": None, "after_head": False, "graph": True, "recent": []}
    made_by_layers = set()   # storages a decoder layer returned: the next one's input, not a shared one

    alive: List[Tensor] = []  # keeps recorded storages from being freed and their addresses reused

    def record(t: Tensor, kind: Optional[str] = None, **flags) -> None:
        key, nbytes = _storage(t)
        if key in owned:
            return
        r = tr.records.get(key)
        if r is None:
            alive.append(t)
            path = names.get(id(stack[-1]), "") if stack else ""
            r = tr.records[key] = Record(nbytes, kind or kind_of(path, st["block"] is not None, st["after_head"] and
                                                                 not stack[1:]), t.element_size(),
                                         memory_row(t), t.dtype)
        for k, v in flags.items():
            if k == "first_block":
                if r.first_block is None:
                    r.first_block = v
            elif v:
                setattr(r, k, True)

    def pack(t: Tensor):
        kinked = bool(stack) and kinked_activation(stack[-1])
        # a reduction's inputs, saved just before its result: kept as they are (hooks.cpp's pin)
        for fn, nr in compared_inputs(t):
            for key, saved_fn, saved_nr in st["recent"]:
                if saved_fn is fn and saved_nr == nr and key in tr.records:
                    tr.records[key].exact = True
        st["recent"] = [(_storage(t)[0], t.grad_fn, t.output_nr)] + st["recent"][:1]
        record(t, saved=True, saved_outside=st["block"] is None, first_block=st["block"],
               sign_read=t.grad_fn is not None and t.grad_fn.name() in SIGN_READ, kink_read=kinked,
               read_elsewhere=not kinked, exact=attention_output(t), **_layout(t))
        # A node keeping its own output held the tensor itself, grad_fn and all: a cycle through C++ that
        # gc cannot free, one meta graph per plan for the life of the process. A detached alias breaks it;
        # made outside the dispatch modes, so the trace's op count (the host time of a step) does not see it.
        with _no_modes():
            return t.detach()

    def pre(mod, a, kw):
        stack.append(mod)
        i = block_index.get(id(mod))
        if i is not None:
            st["block"] = i
            hidden = a[0] if a else kw.get("hidden_states")
            inputs = list(_tensors((a, kw)))
            # frozen, and no gradient flows in: autograd records nothing, a checkpoint or SAC keeps nothing
            st["graph"] = any(t.requires_grad for t in inputs + list(mod.parameters()))
            if not st["graph"]:
                return
            for t in inputs:
                record(t, boundary=True, block_input=t is hidden,
                       shared=t is not hidden and _storage(t)[0] not in made_by_layers and not _a_slice(t))

    def post(mod, a, kw, out):
        if type(mod) in relu.MASKED and st["block"] is not None and not tr.routed and isinstance(out, Tensor):
            # "min" keeps the mask of each nn.ReLU (those the policies patch) for its recompute from rounded
            # inputs (effmem.activations.relu.relu_masks); a layer that routes tokens keeps its input exactly
            path = names.get(id(mod), "")
            tr.records[("relu_mask", _storage(out)[0])] = Record(
                (out.numel() + 7) // 8, kind_of(path, True, False), 1, 1, torch.uint8, relu_mask=True,
                first_block=st["block"])
        stack.pop()
        if id(mod) in block_index:
            st["block"], st["graph"] = None, True
            made_by_layers.update(_storage(t)[0] for t in _tensors(out))
        if mod is head:
            st["after_head"] = True

    handles = []
    # watchers only: a module the fused paths do not call (a gated MLP's act_fn) is not run here either
    setattr(pre, paths.OBSERVER, True)
    setattr(post, paths.OBSERVER, True)
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
    # what selective keeps: products' outputs, in a layer autograd records (requires_grad is not seen down here)
    flops = _Flops(keep=lambda t: st["graph"] and record(t, sac_output=True, first_block=st["block"]),
                   in_block=lambda: st["block"] is not None,
                   in_place_module=lambda: bool(stack) and getattr(stack[-1], "inplace", None) is True)
    from effmem import linear_ce
    amp = _MetaAutocast(target) if autocast else None
    previous, linear_ce._TRACE_TARGET[0] = linear_ce._TRACE_TARGET[0], target
    try:
        with _Counter(target, flops) as counter, _device_kernels(flops, target, amp), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp or contextlib.nullcontext():
            try:
                out = torch.func.functional_call(model, {**state, **buffers}, args, kwargs, tie_weights=True)
            except NotImplementedError as e:
                if "meta tensor" not in str(e):
                    raise
                raise ValueError(f"model: {type(model).__name__}'s forward reads tensor values (.tolist(), .item() "
                                 "or .cpu(), e.g. to route tokens to experts by count), which effmem plan's trace "
                                 "on meta tensors cannot run") from None
            except (ValueError, TypeError) as e:   # not an argument of the plan's: said so (TraceFailed)
                raise TraceFailed(f"{type(e).__name__}: {e}") from e
        st["after_head"] = True
        for t in _tensors(out):
            record(t, output=True)
        for t in held_for_backward(out):
            record(t, kind="grads", saved=True, saved_outside=True)
    finally:
        # The graph's saved-tensor hooks hold pack, and through it this list: emptied, the graph and its
        # meta tensors go with the trace's output (kept, one trace per plan stayed alive for good).
        alive.clear()
        linear_ce._TRACE_TARGET[0] = previous
        for h in handles:
            h.remove()
    tr.matmul_flops = float(counter.flops)
    tr.block_matmul_flops = float(counter.block_flops)
    tr.attention_flops = flops.attention
    tr.selective_recompute_bytes = flops.recompute_bytes
    tr.selective_refused = flops.kept_written
    tr.elementwise_bytes = flops.elementwise_bytes
    tr.head_recompute_flops = counter.head_recompute_flops
    tr.backward_flops, tr.attention_backward_flops = counter.backward_flops, flops.attention_backward
    tr.forward_ops, tr.block_ops = counter.ops, counter.block_ops
    return tr
