"""compress_activations: quantise the tensors autograd saves for backward.

The pack hook (torch.autograd.graph.saved_tensors_hooks) decides, from shapes,
dtypes, storages and what the OutputTracker saw, whether to quantise a saved
tensor; it never reads tensor values, so it adds no host synchronisation.
The store behind it is effmem._C.SavedTensors (csrc/saved/): a
memory saved by several ops (the input of q, k and v) is quantised once, as
long as its storage lives; the unpack hook, also there, dequantises it once
and hands the same buffer to each of those saves, keeping it until the last
of them is unpacked. It never frees the compressed data, so a graph kept
with retain_graph=True can be unpacked again; the data goes when the last
handle referring to it does.

Where a tensor's elements lie decides how it is stored: a dense tensor (one
contiguous stretch of its storage, in any dim order: transposed,
channels-last, a slice along the first dim) is quantised in memory order and
restored stride for stride; a view with gaps (q, k and v sliced out of one
qkv) through the dense tensor it views, when that is at most 4x larger
(compiled backward graphs check saved strides, so a denser copy would not
do), in groups within its runs of elements; an overlapping one (expand,
as_strided windows) is kept as it is.
"""
import itertools
import threading
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

from effmem import _C
from effmem.compress.policy import (CompressConfig, attention_output, check_patterns, early_reason, module_excluded,
                                    value_reason)
from effmem.compress.stats import CompressionStats
from effmem.compress.tracker import OutputTracker, storage_key

UNKNOWN_MODULE = "<unknown>"
_DTYPE_NAMES: Dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16 (cached: the statistics name a dtype per save)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


# What autograd holds for a save: kept as it is (a detached alias, same memory and version counter, and
# its version), or compressed (the entry shared by every save of a memory, and this save's view of it).
_Kept = _C.KeptTensor
_Handle = _C.SavedHandle
# Saves whose backward reads only the sign of the saved output (a mask), which rounding must not flip.
SIGN_READ = frozenset(("ReluBackward0",))


class _MaskedSave:
    """A compressed save and its exact mask (a packed bool handle, or the bool tensor kept as it is)."""
    __slots__ = ("values", "mask")

    def __init__(self, values, mask):
        self.values, self.mask = values, mask


def _version_error(now: int, saved: int, dtype: torch.dtype, shape, device: torch.device) -> None:
    """torch's error for a saved tensor modified in place after it was saved (raised by the C++ unpack hook,
    csrc/saved/store.cpp, which finds the version changed)."""
    kind = str(dtype).replace("torch.", "")
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{kind} {list(shape)} on {device}], saved for backward under effmem's compress_activations, is at "
        f"version {now}; expected version {saved} instead. Hint: change a copy (t.clone()) instead, or "
        "enable anomaly detection (torch.autograd.set_detect_anomaly(True)) to find the operation that "
        "saved it.")


def _has_storage(t: Tensor) -> bool:
    """Whether t has a storage to name: torch.func's batched and grad-tracking wrappers have none."""
    return not torch._C._functorch.is_functorch_wrapped_tensor(t)


def torch_checkpoint_on_top() -> bool:
    """Whether the saved-tensor hooks a save would use now are torch.utils.checkpoint's (torch 2.14 marks them;
    2.11's are known by their functions' names)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return False
    pack = top[0]
    return bool(getattr(pack, "_checkpoint_internal", False)) or getattr(pack, "__qualname__", "").startswith(
        ("_checkpoint_hook.", "_recomputation_hook."))


class ActivationCompressor:
    """The state behind compress_activations: options, hooks, dedup table, statistics.

    Used as a context manager (``with compressor: ...``), or driven by the
    forward hooks that compress_activations(module) installs.
    """

    def __init__(self, config: CompressConfig, names_from: Optional[nn.Module] = None):
        self.config = config
        self.stats = CompressionStats()
        self.records: Optional[List[dict]] = [] if config.record else None
        self._root = names_from
        self._names: Dict[int, str] = {}
        self._handles: list = []
        self._context_hooks = False
        self._init_runtime()

    def _init_runtime(self) -> None:
        cfg = self.config
        # the quantisation seeds run on from cfg.seed, modulo 2**64 (the kernels read 64 bits unsigned)
        seed = cfg.seed % (1 << 64)
        self._saves = _C.SavedTensors(cfg.bits, cfg.group_size, seed - (1 << 64) if seed >= 1 << 63 else seed,
                                      cfg.stochastic, self)
        # The hooks pushed while active (benchmarks wrap these to time them): this class's Python rules, the
        # C++ store's unpack.
        self._pack_hook, self._unpack_hook = self._pack, self._saves.unpack
        self._local = threading.local()
        self._model_storages: set = set()

    # Deep copies and pickles (of a wrapped model) carry the options and hooks, not the live state.
    _RUNTIME = ("_saves", "_pack_hook", "_unpack_hook", "_local", "_model_storages")

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in self._RUNTIME}
        state["_names"] = {}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_runtime()

    # ---------------------------------------------------------------- per-thread state

    def _state(self):
        s = self._local
        if not hasattr(s, "depth"):
            s.depth, s.contexts, s.stack, s.root_calls = 0, [], [], []
        return s

    def _root_calls(self) -> list:
        """Per call of a wrapped module: whether its pre-hook entered the hooks."""
        return self._state().root_calls

    @property
    def live_buffers(self) -> int:
        """Compressed buffers still referred to by some autograd graph."""
        return len(self.live_entries())

    def live_entries(self) -> List[_C.SavedEntry]:
        """The compressed entries some autograd graph still refers to."""
        return self._saves.live_entries()

    # ---------------------------------------------------------------- entering and leaving

    def __enter__(self) -> "ActivationCompressor":
        if self._root is not None and not self._handles and self._state().depth == 0:
            self.track_modules(self._root)  # the context form names modules only while active
            self._context_hooks = True
        self._begin(reset=True)
        return self

    def __exit__(self, *exc) -> None:
        self._end()
        if self._context_hooks and self._state().depth == 0:
            self.remove_hooks()
            self._context_hooks = False

    def reset_stats(self) -> None:
        """A new forward's statistics (and records)."""
        self.stats.reset()
        self._saves.clear_kept()   # a memory kept is counted once a forward (the policies': once a layer call)
        if self.records is not None:
            self.records.clear()

    def _begin(self, reset: bool) -> None:
        s = self._state()
        s.depth += 1
        if s.depth > 1:  # re-entered (a wrapped model called inside itself): one set of hooks is enough
            return
        if reset:
            self.reset_stats()
        if self._root is not None:
            # torch.func's functional_call under vmap or grad swaps in wrappers that have no storage, and the
            # forward reads those, not the module's own: skipped (torch refuses to name their storage)
            self._model_storages = {storage_key(t) for t in itertools.chain(
                self._root.parameters(), self._root.buffers()) if t.device.type != "meta" and _has_storage(t)}
        if torch_checkpoint_on_top():
            # inside torch's non-reentrant checkpoint (its forward keeps nothing but the region's inputs, its
            # recompute hands its saves to backward): hooks pushed above its own hid them, and the region kept
            # every save in 8 bits with nothing recomputed (a reviewer's repro)
            s.contexts = []
            return
        contexts = [torch.autograd.graph.saved_tensors_hooks(self._pack_hook, self._unpack_hook)]
        if self.config.track_exact:
            contexts.append(OutputTracker())
        entered = []
        try:
            for c in contexts:
                c.__enter__()
                entered.append(c)
        except BaseException:
            for c in reversed(entered):
                c.__exit__(None, None, None)
            s.depth -= 1
            raise
        s.contexts = entered

    def _end(self) -> None:
        s = self._state()
        s.depth -= 1
        if s.depth > 0:
            return
        for c in reversed(s.contexts):
            c.__exit__(None, None, None)
        s.contexts = []

    def _abandon(self) -> None:
        """Drop what a forward interrupted past its exit hook left on this thread: the hooks it entered
        (the latest on the thread's stacks, since `with` blocks entered after them have exited) and its
        module stack."""
        s = self._state()
        for c in reversed(s.contexts):
            c.__exit__(None, None, None)
        s.depth, s.contexts = 0, []
        s.stack.clear()
        s.root_calls.clear()

    def _tracker(self) -> Optional[OutputTracker]:
        s = self._state()
        return s.contexts[1] if len(s.contexts) > 1 else None

    # ---------------------------------------------------------------- module names

    def _name_of(self, module: nn.Module) -> str:
        name = self._names.get(id(module))
        if name is None and self._root is not None:
            # Built lazily, and again after a miss: modules can be added after wrapping.
            self._names = {id(m): n for n, m in self._root.named_modules()}
            name = self._names.get(id(module))
        return name if name is not None else type(module).__name__

    def _push_module(self, module: nn.Module, *args) -> None:
        if torch.compiler.is_compiling():
            return
        s = self._state()
        name = self._name_of(module)
        excluded = bool(s.stack and s.stack[-1][1]) or module_excluded(self.config.exclude_modules, name, module)
        s.stack.append((name or "<root>", excluded))

    def _pop_module(self, module: nn.Module, *args) -> None:
        if torch.compiler.is_compiling():
            return
        s = self._state()
        if s.stack:
            s.stack.pop()

    _pop_module._effmem_observes = True   # reads no output: fuse_linear_cross_entropy lets it stay on lm_head

    def track_modules(self, root: nn.Module, include_root: bool = True) -> None:
        """Name saved tensors after root's submodules (and honour exclude_modules) from now on."""
        if self.__dict__.get("_checked_root") is not root:   # once per model (the `with` form: at every entry)
            check_patterns(self.config.exclude_modules, root)
            self._checked_root = root
        self._root = root
        self._names = {}
        for _, m in root.named_modules():
            if m is root and not include_root:
                continue
            self._handles.append(m.register_forward_pre_hook(self._push_module))
            self._handles.append(m.register_forward_hook(self._pop_module, always_call=True))

    def remove_hooks(self) -> None:
        """Removes the module hooks track_modules() registered (naming and exclusion end there)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---------------------------------------------------------------- pack / unpack

    def _keep(self, t: Tensor, reason: str, module: str) -> Tensor:
        # a memory kept by several ops (a fused attention's output, which the output projection saves too) is
        # held once: counted once, in the C++ store's set of kept memories (its own rules' keeps are there)
        first = (t.layout is not torch.strided or t.is_nested or not _has_storage(t) or type(t) is not Tensor
                 or self._saves.first_keep(t))
        self.stats.record_kept(reason, dtype_name(t.dtype), module, t.numel() * t.element_size() if first else 0)
        if self.records is not None:
            self._note(t, module, reason)
        # A detached alias, not t itself: t may be the op's output, and a
        # packed output holding its own grad_fn would be a reference cycle.
        # The alias shares t's version counter, so in-place changes still show.
        return _Kept(t.detach(), t._version)

    def _note(self, t: Tensor, module: str, decision: str) -> None:
        if self.records is not None:
            nested = t.is_nested  # a nested tensor has no single shape or strides
            self.records.append({"shape": None if nested else tuple(t.shape),
                                 "stride": None if nested else tuple(t.stride()), "dtype": t.dtype,
                                 "module": module, "decision": decision,
                                 "storage": None if decision == "unsupported" else storage_key(t),
                                 # what a save kept as it is holds alive: its whole storage (a view's too)
                                 "storage_bytes": None if decision == "unsupported" else t.untyped_storage().nbytes()})

    def _reason(self, t: Tensor, excluded: bool) -> Optional[str]:
        cfg = self.config
        reason = early_reason(cfg, t)
        if reason is not None:
            return reason
        tracker = self._tracker()
        key = storage_key(t)
        if key in self._model_storages or (tracker is not None and tracker.param_storages.get(key) is not None):
            return "parameter"
        if tracker is not None and tracker.copy_storages.get(key) is not None:
            return "parameter_copy"
        if excluded:
            return "excluded_module"
        if cfg.exclude is not None and cfg.exclude(t):
            return "excluded_predicate"
        if tracker is not None and tracker.is_exact(t):
            return "exact"
        if attention_output(t):
            return "attention_output"   # as under the "fast" policy
        return value_reason(cfg, t)

    def _pack(self, t: Tensor):
        if torch.compiler.is_compiling():  # traced with fake tensors: nothing real to store
            return t.detach()
        s = self._state()
        module, excluded = s.stack[-1] if s.stack else (UNKNOWN_MODULE, False)
        self._pin_compared(t, module)
        reason = self._reason(t, excluded)
        if reason is not None:
            return self._keep(t, reason, module)
        h = self._store(t, module)
        if type(h) is _Handle and h.entry.saves == 1 and t.grad_fn is not None and t.grad_fn.name() in SIGN_READ:
            return self._masked(t, h, module)
        return h

    def _pin_compared(self, t: Tensor, module: str) -> None:
        """Before t's own rules: where t is amax's (max()'s, an infinity norm's...) result and a save just
        stored or rebuilt was that reduction's input, the input is kept as it is (csrc/saved/hooks.cpp: the
        backward looks for elements equal to the maximum, and a float32 group's maximum comes back 1 ulp off)."""
        for reason, dtype, count, before, after in self._saves.pin_compared(t):
            self.stats.add(reason, dtype_name(dtype), module, count, before, after)

    def _masked(self, t: Tensor, h, module: str) -> "_MaskedSave":
        """A ReLU's own save of its output (the first of that memory: a layer reading it saves it later), with its
        exact mask (not t <= 0, 1 bit per element: a NaN passes its gradient, as in threshold_backward) beside
        the codes. ReLU's backward passes a gradient where its
        output is positive, and a small positive value that rounds to code 0 lost its gradient: in a reviewer's
        Linear-ReLU net, 283 of 65,413 positive outputs came back as 0 and the weight gradients were 9% off
        (38% at 4 bits)."""
        mask = ~(t <= 0)
        m = self._saves.store(mask)
        if type(m) is str:   # no gain in packing it: kept as it is
            m = mask
        self.stats.record_extra("bool", module, m.entry.bytes_after if type(m) is _Handle else mask.numel())
        return _MaskedSave(h, m)

    def _store(self, t: Tensor, module: str):
        """t's memory as compressed codes shared by every save of it (or t kept, where that is no gain)."""
        h = self._saves.store(t)
        if type(h) is str:  # overlapping, strided_view (a view of a much larger tensor) or no_gain
            return self._keep(t, h, module)
        e = h.entry
        if e.saves > 1:  # a memory stored already (and its storage alive): one entry, one more save
            self.stats.deduplicated += 1
            if self.records is not None:
                self._note(t, module, "deduplicated")
            return h
        self.stats.record_compressed(dtype_name(t.dtype), module, e.bytes_before, e.bytes_after)
        if self.records is not None:
            self._note(t, module, "compressed")
        return h

    def _unpack_other(self, packed):
        """What the C++ unpack hook leaves to Python: saves made while compiling (the tensor itself), and a
        ReLU's output with its exact mask (_masked): positive where the mask is, 0 elsewhere."""
        if isinstance(packed, Tensor):
            return packed
        if isinstance(packed, _MaskedSave):
            values = self._saves.unpack(packed.values)
            mask = packed.mask if isinstance(packed.mask, Tensor) else self._saves.unpack(packed.mask)
            return torch.where(mask, values.clamp_min(torch.finfo(values.dtype).tiny), values.new_zeros(()))
        raise TypeError(f"effmem: cannot unpack a saved {type(packed).__name__}")
