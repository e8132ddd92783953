"""The "fast" activation policy's saved-tensor hooks: one decoder layer at a time.

While a layer's forward runs, autograd's saves go through a FastCompressor:

* a tensor that a fused function (activations.fused) registered as
  rebuildable (a norm's output, SwiGLU's product, a GELU's output) is not
  stored at all: the save holds a recipe (the function and its inputs, which
  are themselves saved through these rules), and backward rebuilds the
  output once for all of its saves;
* matmul inputs, attention's q, k, v and output, the residual stream: every
  other floating tensor of at least `min_numel` elements is stored as 8-bit
  (or 4-bit) codes, once per memory however often it is saved (compress/);
* kept as they are: parameters and autocast's copies of them, the layer's
  other inputs (rotary tables, masks: they live anyway), integer tensors,
  and statistics, recognised by size: fewer than hidden/8 values per token
  (attention's log-sum-exp, a norm's rstd) cost under 1/8 of one hidden
  state and their exactness matters to backward.

No dispatch mode watches the ops (compress_activations' exact-statistics
tracker costs 4-8 us per aten op); what a layer saves is classified from the
tensor alone, and the layer's inputs and parameter shapes are read once per
layer call. The hooks are C++ (effmem._C.SavedTensors.pack and unpack,
csrc/saved_hooks.cpp); they hand the cases that need Python (rebuildable
outputs, autocast's copies, subclasses and meta tensors, bool and integer
tensors) to FastCompressor._pack here, which states every rule.
"""
import functools
import math
import threading
import weakref
from contextlib import contextmanager
from typing import Callable, Dict, Optional, Sequence

import torch
from torch import Tensor, nn

from effmem import _C
from effmem.compress.hooks import (ActivationCompressor, _check_version, _Handle, _Kept, _version_handle,
                                   dtype_name, without_grad)
from effmem.compress import _codec
from effmem.compress.policy import ROW_STAT_MAX_LAST_DIM, CompressConfig, value_reason
from effmem.compress.tracker import storage_key

_LOCAL = threading.local()

# Saved tensors with fewer values per token than hidden / STATISTIC_FRACTION are statistics.
STATISTIC_FRACTION = 8


def current() -> Optional["FastCompressor"]:
    """The compressor of the layer running on this thread, if a "fast" layer is running."""
    return getattr(_LOCAL, "scope", None)


def recompute_output(out: Tensor, fn: Callable[..., Tensor], *inputs, node=None) -> None:
    """Under the "fast" policy, let saves of `out` rebuild it as fn(*inputs) in backward; else nothing.

    node: the ctx of the autograd Function whose forward made `out` (its grad_fn once forward returns),
    so that saves of autocast's casts of `out` rebuild it too (see FastCompressor._pack)."""
    if torch.compiler.is_compiling():  # a compiled graph decides what it saves; nothing to register
        return
    scope = getattr(_LOCAL, "scope", None)
    if scope is not None:
        scope.add_recipe(out, fn, inputs, node)


class _Recipe:
    """How to rebuild one output: fn applied to its packed inputs; shared by every save of that output."""
    __slots__ = ("fn", "inputs", "owner", "shape", "stride", "dtype", "device", "counter", "version", "saves",
                 "unpacked", "held", "node", "node_key", "__weakref__")


class _RecipeHandle:
    """One save of a rebuildable output: the recipe and this save's view of the output (cast to `cast`, a
    dtype, for a save of autocast's copy of it)."""
    __slots__ = ("recipe", "shape", "stride", "offset", "cast")

    def __init__(self, recipe: _Recipe, shape, stride, offset, cast=None):
        self.recipe, self.shape, self.stride, self.offset, self.cast = recipe, shape, stride, offset, cast


class FastCompressor(ActivationCompressor):
    """compress_activations' machinery (dedup, 8-bit entries, statistics) with the rules above."""

    def __init__(self, bits: int = 8, group_size: int = 128, min_numel: int = 4096, allow_meta: bool = False):
        super().__init__(CompressConfig(bits=bits, group_size=group_size, min_numel=min_numel, track_exact=False))
        # effmem plan runs layers on meta tensors under this compressor to count what it would store
        # (the kernels' fake implementations give the codes' shapes).
        self.allow_meta = allow_meta
        self._recipes: Dict[tuple, _Recipe] = {}
        self._by_node: Dict[int, _Recipe] = {}   # id of the Function node that made a rebuildable output
        self._external: set = set()
        self._tokens = self._hidden = 0
        self._param_shapes: frozenset = frozenset()
        self._layer_name = ""
        self._collect: Optional[list] = None  # under collecting(): the entries stored since

    def _init_runtime(self) -> None:
        super()._init_runtime()
        self._recipes, self._by_node = {}, {}
        self._saves.min_numel = self.config.min_numel
        if self.records is None:  # with records, every save goes through the Python rules, which note it
            self._pack_hook = self._saves.pack

    _RUNTIME = ActivationCompressor._RUNTIME + ("_recipes", "_by_node")

    # ------------------------------------------------------------ one layer call

    @contextmanager
    def layer(self, name: str, hidden: Tensor, others, param_shapes: frozenset, first: bool):
        """Route the saves of one layer call through this compressor; `others`: the layer's other inputs."""
        prev = (self._external, self._tokens, self._hidden, self._param_shapes, self._layer_name)
        self._external = {storage_key(t) for t in others}
        self._hidden = hidden.shape[-1] if hidden.dim() else 1
        self._tokens = hidden.numel() // max(self._hidden, 1)
        self._param_shapes = param_shapes
        self._layer_name = name
        self._saves.set_layer(list(self._external), self._tokens * self._hidden, list(param_shapes))
        outer = getattr(_LOCAL, "scope", None)
        _LOCAL.scope = self
        self._begin(reset=first)
        try:
            yield
        finally:
            self._end()
            self._count_cpp_saves()
            _LOCAL.scope = outer
            self._external, self._tokens, self._hidden, self._param_shapes, self._layer_name = prev
            self._saves.set_layer(list(self._external), self._tokens * self._hidden, list(self._param_shapes))

    def _count_cpp_saves(self) -> None:
        """Add what the C++ pack hook kept and stored in this layer call to the statistics."""
        for reason, dtype, count, before, after in self._saves.take_tallies():
            self.stats.add(reason, dtype_name(dtype), self._layer_name, count, before, after)

    @contextmanager
    def collecting(self):
        """Yield a list that receives every compressed entry stored inside (a layer whose codes
        activations.offload then moves to host memory)."""
        prev, self._collect = self._collect, []
        self._saves.collect = self._collect  # the C++ pack hook's new entries
        try:
            yield self._collect
        finally:
            self._collect = prev
            self._saves.collect = prev

    def _store(self, t: Tensor, module: str):
        h = super()._store(t, module)
        if self._collect is not None and type(h) is _Handle and h.entry.saves == 1:
            self._collect.append(h.entry)  # new here (a deduplicated save's entry was collected already)
        return h

    # ------------------------------------------------------------ rules

    def _reason(self, t: Tensor, excluded: bool, key=None) -> Optional[str]:
        # compress.policy's early_reason and value_reason, in the order and form cheapest for one save
        # (this runs for every save in a layer; parameters of type nn.Parameter never get here)
        if type(t) is not Tensor or t.layout is not torch.strided or (t.is_meta and not self.allow_meta):
            return "unsupported"
        base = t._base
        if (t.requires_grad and t.is_leaf) or (base is not None and base.requires_grad and base.is_leaf):
            return "parameter"
        if (key or storage_key(t)) in self._external:
            return "layer_input"
        dtype = t.dtype
        if dtype not in _codec.FLOAT_DTYPES:
            return value_reason(self.config, t)  # bool masks (packed), integers, float64: its rules
        n = t.numel()
        if n < self.config.min_numel:
            return "small"
        if t.dim() == 0 or t.shape[-1] <= ROW_STAT_MAX_LAST_DIM:
            return "row_statistic"
        if n * STATISTIC_FRACTION < self._tokens * self._hidden:
            return "statistic"
        if t.dim() == 2 and tuple(t.shape) in self._param_shapes and _is_parameter_copy(t):
            return "parameter_copy"
        return None

    # ------------------------------------------------------------ recipes

    def add_recipe(self, out: Tensor, fn: Callable[..., Tensor], inputs: Sequence, node=None) -> None:
        r = _Recipe()
        r.fn = fn
        # the inputs go through the same rules (and dedup) as any save: an input the function also
        # saves itself is stored once
        r.inputs = tuple(self._pack_hook(i) if isinstance(i, Tensor) else i for i in inputs)
        key = storage_key(out)
        # Forget the recipe when its output dies: its memory may then hold another tensor.
        r.owner = weakref.ref(out, functools.partial(_drop_recipe, weakref.ref(self), key, weakref.ref(r)))
        r.shape, r.stride, r.dtype, r.device = tuple(out.shape), out.stride(), out.dtype, out.device
        r.counter, r.version = _version_handle(out), out._version
        r.saves, r.unpacked, r.held = 0, 0, None
        r.node = None if node is None else weakref.ref(node)
        self._recipes[key] = r
        self._saves.add_python_key(key)  # the C++ pack hook leaves saves of this memory to _pack
        if node is not None:
            self._by_node[id(node)] = r
            r.node_key = id(node)

    def _pack(self, t: Tensor):
        # Every rule, in Python: the pack hook with records on, and what the C++ hook leaves otherwise.
        if torch.compiler.is_compiling():
            return t.detach()
        if type(t) is nn.Parameter:
            # a weight, kept with its version for the in-place check (a leaf has no grad_fn: no cycle to
            # break by detaching, as compress_activations' _keep does for an op's own output)
            return _Kept(t, t._version)
        base = t._base
        if base is not None and type(base) is nn.Parameter:
            return _Kept(t.detach(), t._version)  # weight.t(): nothing to store or count
        key = storage_key(t)
        if self._recipes:
            r = self._recipes.get(key)
            if r is not None and r.version == t._version:
                owner = r.owner()
                if owner is not None:
                    r.saves += 1
                    self.stats.deduplicated += 1
                    if self.records is not None:
                        self._note(t, self._layer_name, "recomputed")
                    return _RecipeHandle(r, tuple(t.shape), t.stride(), t.storage_offset() - owner.storage_offset())
        reason = self._reason(t, False, key)
        if reason is not None:
            return self._keep(t, reason, self._layer_name)
        if self._by_node:  # only for what would be stored: kept saves cost nothing to keep
            cast = self._cast_of_recipe(t)
            if cast is not None:
                return cast
        return self._store(t, self._layer_name)

    def _cast_of_recipe(self, t: Tensor) -> Optional[_RecipeHandle]:
        """A save of autocast's cast of a rebuildable output (a float32 norm output under autocast, cast
        to bf16 by each projection that reads it: q, k and v make three copies): rebuilt from the same
        recipe and cast again in backward, instead of storing each copy."""
        src = t._base if t._base is not None else t  # F.linear saves a 2-D view of its (cast) input
        fn = src.grad_fn
        if fn is None or type(fn).__name__ != "ToCopyBackward0":
            return None
        prev = fn.next_functions[0][0] if fn.next_functions else None
        for _ in range(2):  # the cast may be of a view of the output (GPT-2's Conv1D: x.view(-1, n))
            if prev is None or type(prev).__name__ not in _VIEW_NODES:
                break
            prev = prev.next_functions[0][0]
        r = self._by_node.get(id(prev)) if prev is not None else None
        if r is None or r.node() is not prev or r.owner() is None:
            return None
        # the copy holds the output's elements in the output's order: a cast of it, laid out as the copy
        if tuple(src.shape) != r.shape and not (src.is_contiguous() and src.numel() == math.prod(r.shape)
                                                and r.stride == _contiguous_strides(r.shape)):
            return None
        r.saves += 1
        self.stats.deduplicated += 1
        if self.records is not None:
            self._note(t, self._layer_name, "recomputed")
        return _RecipeHandle(r, tuple(t.shape), t.stride(), t.storage_offset() - src.storage_offset(), src.dtype)

    def _unpack_other(self, packed):
        if type(packed) is _RecipeHandle:
            return without_grad(_rebuild, self, packed)
        return super()._unpack_other(packed)


def _drop_recipe(comp_ref, key, recipe_ref, _dead) -> None:
    comp, r = comp_ref(), recipe_ref()
    if comp is not None and comp._recipes.get(key) is r:
        del comp._recipes[key]
        comp._saves.drop_python_key(key)
    if comp is not None and r is not None and r.node is not None and comp._by_node.get(r.node_key) is r:
        del comp._by_node[r.node_key]


def _rebuild(comp: FastCompressor, h: _RecipeHandle) -> Tensor:
    r = h.recipe
    if r.counter is not None:
        _check_version(r.counter, r.version, r.dtype, h.shape, r.device)
    out = r.held
    if out is None:
        out = r.fn(*[comp._unpack_hook(i) if isinstance(i, _PACKED) else i for i in r.inputs])
        if out.stride() != r.stride:  # the saves view the output's memory: lay it out as the original was
            out = torch.empty_strided(r.shape, r.stride, dtype=out.dtype, device=out.device).copy_(out)
    # Held until its last save is unpacked (q, k, v: one rebuild), then let go, as compressed entries are.
    r.unpacked += 1
    if r.unpacked < r.saves:
        r.held = out
    else:
        r.held, r.unpacked = None, 0
    if h.cast is not None:  # autocast's copy, made as forward made it (to() keeps the output's layout)
        out = out.to(h.cast)
    return _C.saved_view(out, h.shape, h.stride, out.storage_offset() + h.offset)


# Autograd nodes of views that keep their input's element order (a cast of one is a cast of the output).
_VIEW_NODES = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


# What packed inputs of a recipe can be (the rest, None or numbers, are kept as given).
_PACKED = (_Kept, _Handle, _RecipeHandle, Tensor)
# Autograd nodes that only cast or view their input.
_CAST_OR_VIEW = ("ToCopyBackward", "TBackward", "ViewBackward", "UnsafeViewBackward", "TransposeBackward",
                 "PermuteBackward")


def _is_parameter_copy(t: Tensor) -> bool:
    """Whether t's history is a parameter cast or viewed (autocast's weight copies): up to three
    cast/view nodes back to a gradient accumulator."""
    fn = t.grad_fn
    for _ in range(3):
        if fn is None:
            return False
        name = fn.name()
        if name == "torch::autograd::AccumulateGrad":
            return True
        if not name.startswith(_CAST_OR_VIEW):
            return False
        nexts = [f for f, _ in fn.next_functions if f is not None]
        if len(nexts) != 1:
            return False
        fn = nexts[0]
    return fn is not None and fn.name() == "torch::autograd::AccumulateGrad"


def param_shapes(layer: nn.Module) -> frozenset:
    """2-D parameter shapes of a layer and their transposes: where autocast copies of weights could hide."""
    shapes = set()
    for p in layer.parameters():
        if p.dim() == 2:
            shapes.add(tuple(p.shape))
            shapes.add(tuple(p.shape[::-1]))
    return frozenset(shapes)
