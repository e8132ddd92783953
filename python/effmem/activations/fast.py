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
csrc/saved/): every rule above, the store and the rebuilds; they hand the
cases that need Python (autocast's copies of weights and of rebuilt outputs,
tensor subclasses and meta tensors, bool and integer tensors) to
FastCompressor._pack here, which states every rule again and decides alike
(tests/test_saved_hooks.py).
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
from effmem.compress.hooks import ActivationCompressor, _Kept, dtype_name
from effmem.compress import _codec
from effmem.compress.policy import ROW_STAT_MAX_LAST_DIM, CompressConfig, attention_output, value_reason
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
    if node is not None and not any(node.needs_input_grad):
        # no graph recorded (a frozen layer no gradient flows into): nothing saves `out`, so its inputs were
        # quantised for nothing (16 stores per step in a reviewer's frozen-body Llama, and `effmem plan` counted
        # them as kept)
        return
    scope = getattr(_LOCAL, "scope", None)
    if scope is not None:
        scope.add_recipe(out, fn, inputs, node)


class FastCompressor(ActivationCompressor):
    """compress_activations' machinery (dedup, 8-bit entries, statistics) with the rules above."""

    def __init__(self, bits: int = 8, group_size: int = 128, min_numel: int = 4096, allow_meta: bool = False):
        super().__init__(CompressConfig(bits=bits, group_size=group_size, min_numel=min_numel, track_exact=False))
        # effmem plan runs layers on meta tensors under this compressor to count what it would store
        # (the kernels' fake implementations give the codes' shapes).
        self.allow_meta = allow_meta
        # rebuilt outputs: storage key -> (recipe, weak reference to the output); id of the Function node that
        # made one -> (recipe, weak reference to the node)
        self._recipes: Dict[int, tuple] = {}
        self._by_node: Dict[int, tuple] = {}
        self._external: set = set()
        self._tokens = self._hidden = 0
        self._param_shapes: frozenset = frozenset()
        self._layer_name = ""

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
        # the store appends each entry it makes (a deduplicated save's entry was collected already)
        prev, self._saves.collect = self._saves.collect, []
        try:
            yield self._saves.collect
        finally:
            self._saves.collect = prev

    # ------------------------------------------------------------ rules

    def _reason(self, t: Tensor, excluded: bool) -> Optional[str]:
        # compress.policy's early_reason and value_reason, in the order and form cheapest for one save
        # (this runs for every save in a layer; parameters of type nn.Parameter never get here)
        if (type(t) is not Tensor or t.layout is not torch.strided or t.is_nested
                or (t.is_meta and not self.allow_meta)):
            return "unsupported"
        base = t._base
        if (t.requires_grad and t.is_leaf) or (base is not None and base.requires_grad and base.is_leaf):
            return "parameter"
        if storage_key(t) in self._external:
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
        fn = (base if base is not None else t).grad_fn
        if fn is not None and fn.name() == "ExpBackward0":   # the C++ rules' reasons (csrc/saved/hooks.cpp)
            return "exponential"
        return "attention_output" if attention_output(t) else None

    # ------------------------------------------------------------ recipes

    def add_recipe(self, out: Tensor, fn: Callable[..., Tensor], inputs: Sequence, node=None) -> None:
        # the inputs go through the same rules (and dedup) as any save: an input the function also
        # saves itself is stored once
        packed = [self._pack_hook(i) if isinstance(i, Tensor) else i for i in inputs]
        r = self._saves.add_recipe(out, fn, packed)  # the C++ store refers to it weakly
        key, node_key = storage_key(out), None if node is None else id(node)
        # Held while its output lives: then its memory may hold another tensor, and the recipe goes.
        owner = weakref.ref(out, functools.partial(_drop_recipe, weakref.ref(self), key, r, node_key))
        self._recipes[key] = (r, owner)
        if node is not None:
            self._by_node[node_key] = (r, weakref.ref(node))

    def _pack(self, t: Tensor):
        # Every rule, in Python: the pack hook with records on, and what the C++ hook leaves otherwise.
        if torch.compiler.is_compiling():
            return t.detach()
        self._pin_compared(t, self._layer_name)   # called by the C++ hook, which has done it: a no-op
        if type(t) is nn.Parameter:
            # a weight, kept with its version for the in-place check (a leaf has no grad_fn: no cycle to
            # break by detaching, as compress_activations' _keep does for an op's own output)
            return _Kept(t, t._version)
        base = t._base
        if base is not None and type(base) is nn.Parameter:
            return _Kept(t.detach(), t._version)  # weight.t(): nothing to store or count
        if self._recipes:
            h = self._saves.recipe_save(t)  # an output rebuilt in backward (unchanged, alive): nothing stored
            if h is not None:
                self.stats.deduplicated += 1
                if self.records is not None:
                    self._note(t, self._layer_name, "recomputed")
                return h
        reason = self._reason(t, False)
        if reason is not None:
            return self._keep(t, reason, self._layer_name)
        if self._by_node:  # only for what would be stored: kept saves cost nothing to keep
            cast = self._cast_of_recipe(t)
            if cast is not None:
                return cast
        return self._store(t, self._layer_name)

    def _cast_of_recipe(self, t: Tensor) -> Optional[_C.RecipeHandle]:
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
        got = self._by_node.get(id(prev)) if prev is not None else None
        if got is None or got[1]() is not prev or not got[0].alive():
            return None
        r = got[0]
        shape = tuple(r.shape)
        # the copy holds the output's elements in the output's order: a cast of it, laid out as the copy
        if tuple(src.shape) != shape and not (src.is_contiguous() and src.numel() == math.prod(shape)
                                              and tuple(r.stride) == _contiguous_strides(shape)):
            return None
        r.saves += 1
        self.stats.deduplicated += 1
        if self.records is not None:
            self._note(t, self._layer_name, "recomputed")
        self._saves.note_recipe(t, r)   # an amax of the copy keeps the output (SavedTensors.pin_compared)
        return _C.RecipeHandle(r, tuple(t.shape), t.stride(), t.storage_offset() - src.storage_offset(), src.dtype)


def _drop_recipe(comp_ref, key, r, node_key, _dead) -> None:
    comp = comp_ref()
    if comp is None:
        return
    got = comp._recipes.get(key)
    if got is not None and got[0] is r:
        del comp._recipes[key]
    got = comp._by_node.get(node_key) if node_key is not None else None
    if got is not None and got[0] is r:
        del comp._by_node[node_key]


# Autograd nodes of views that keep their input's element order (a cast of one is a cast of the output).
_VIEW_NODES = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


# Autograd nodes that only cast or view their input.
_CAST_OR_VIEW = ("ToCopyBackward", "TBackward", "ViewBackward", "UnsafeViewBackward", "TransposeBackward",
                 "PermuteBackward")


def _is_parameter_copy(t: Tensor) -> bool:
    """Whether t's history is a parameter cast or viewed (autocast's weight copies): up to three
    cast/view nodes back to a gradient accumulator. (Only 2-D saves of a layer's weight shape, or its
    transpose, are asked.) A frozen weight, a copy of one (autocast caches only copies of weights that take a
    gradient, so it makes one per use) and a view of either have no history at all: a save without history is
    taken as one. Anything else such a save could be, an activation of exactly a weight's shape made from
    inputs that take no gradient, is then kept in full: more memory, never a wrong gradient."""
    fn = t.grad_fn
    if fn is None and not t.requires_grad:
        return True
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
