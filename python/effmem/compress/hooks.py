"""compress_activations: quantise the tensors autograd saves for backward.

The pack hook (torch.autograd.graph.saved_tensors_hooks) decides, from shapes,
dtypes, storages and what the OutputTracker saw, whether to quantise a saved
tensor; it never reads tensor values, so it adds no host synchronisation.
A memory saved by several ops (the input of q, k and v) is quantised once,
as long as the tensor owning it lives. The unpack hook dequantises it once
and hands the same buffer to each of those saves, keeping it until the last
of them is unpacked; it never frees the compressed data, so a graph kept
with retain_graph=True can be unpacked again; the data goes when the last
handle referring to it does.
"""
import itertools
import threading
import weakref
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

from effmem import _C
from effmem.compress import _codec
from effmem.compress.layout import DENSE, OVERLAPPING, classify
from effmem.compress.policy import CompressConfig, early_reason, module_excluded, value_reason
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


# A strided view is compressed through the dense tensor it views when that
# tensor is at most this many times larger (q, k, v of one qkv: 3); beyond,
# compressing it would store more than keeping the view does.
MAX_BASE_GROWTH = 4
# The dedup table is purged of dead entries when it reaches this many (or twice the live ones after a purge).
TABLE_PURGE_MIN = 1024


class _Entry:
    """One compressed stretch of memory, shared by every save of it (same data, same version).

    ``counter`` is an empty tensor sharing the saved memory's version counter
    (effmem._C.version_handle) and ``version`` its value when saved: autograd
    checks saved tensors for in-place changes only when no saved_tensors_hooks
    are active, so the unpack hook makes that check itself."""
    __slots__ = ("codes", "stats", "rows", "cols", "n", "dtype", "bits", "group_size", "origin", "restored",
                 "saves", "unpacked", "held", "offload",
                 "counter", "version", "__weakref__")


class _Kept:
    """A save kept as it is: a detached alias (same memory, same version counter) and its version."""
    __slots__ = ("tensor", "version")

    def __init__(self, tensor: Tensor, version: int):
        self.tensor, self.version = tensor, version


def _check_version(counter: Tensor, saved: int, dtype: torch.dtype, shape, device: torch.device) -> None:
    """torch's error for a saved tensor modified in place after it was saved."""
    now = counter._version
    if now != saved:
        kind = str(dtype).replace("torch.", "")
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{kind} {list(shape)} on {device}], saved for backward under effmem's compress_activations, is at "
            f"version {now}; expected version {saved} instead. Hint: change a copy (t.clone()) instead, or "
            "enable anomaly detection (torch.autograd.set_detect_anomaly(True)) to find the operation that "
            "saved it.")


class _Handle:
    """What autograd holds for one save: the shared entry and this save's view of it."""
    __slots__ = ("entry", "shape", "stride", "offset")

    def __init__(self, entry: _Entry, shape, stride, offset):
        self.entry, self.shape, self.stride, self.offset = entry, shape, stride, offset


def _restore(h: _Handle) -> Tensor:
    e = h.entry
    if e.offload is not None:  # its codes in host memory (activations.offload): back on the device
        e.offload.bring_back()
    if e.counter is not None:
        _check_version(e.counter, e.version, e.dtype, h.shape, e.codes.device)
    flat = e.restored() if e.restored is not None else None
    if flat is None:
        if e.dtype == torch.bool:
            flat = _codec.unpack_bool(e.codes, e.n)
        else:
            # [rows, cols] at storage offset 0: as_strided below reads its storage as the flat memory
            flat = _codec.dequantize(e.codes, e.stats, bits=e.bits, group_size=e.group_size,
                                     shape=(e.rows, e.cols), dtype=e.dtype)
        # Saves of one memory (q, k and v of one qkv) unpacked together share
        # one restored buffer, as the originals shared one storage.
        e.restored = weakref.ref(flat)
    # Held until every save of this memory has been unpacked (the backward of q, k and v's inputs: one
    # dequantize, not three), then let go, so a graph kept with retain_graph=True restores it afresh the
    # next time. Never longer than autograd held the original: as long as its last save.
    e.unpacked += 1
    if e.unpacked < e.saves:
        e.held = flat
    else:
        e.held, e.unpacked = None, 0
    # The buffer is the memory the tensor lived in, so its own strides view it.
    return flat.as_strided(h.shape, h.stride, h.offset)


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
        self._seeds = itertools.count()
        # Entries live as long as a handle refers to them; the table only finds them, through plain weak
        # references (a WeakValueDictionary's set and get cost microseconds per save), the dead ones
        # purged as the table grows (_remember).
        self._table: Dict[tuple, weakref.ref] = {}
        self._purge_at = TABLE_PURGE_MIN
        self._local = threading.local()
        self._model_storages: set = set()

    # Deep copies and pickles (of a wrapped model) carry the options and hooks, not the live state.
    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in ("_seeds", "_table", "_local", "_model_storages")}
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

    def live_entries(self) -> List["_Entry"]:
        """The compressed entries some autograd graph still refers to."""
        return [e for e in (ref() for ref in self._table.values()) if e is not None]

    def _remember(self, key: tuple, entry: "_Entry") -> None:
        """The table's entry for key; first the dead ones go, once it has doubled since the last purge."""
        if len(self._table) >= self._purge_at:
            self._table = {k: ref for k, ref in self._table.items() if ref() is not None}
            self._purge_at = max(TABLE_PURGE_MIN, 2 * len(self._table))
        self._table[key] = weakref.ref(entry)

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

    def _begin(self, reset: bool) -> None:
        s = self._state()
        s.depth += 1
        if s.depth > 1:  # re-entered (a wrapped model called inside itself): one set of hooks is enough
            return
        if reset:
            self.stats.reset()
            if self.records is not None:
                self.records.clear()
        if self._root is not None:
            self._model_storages = {storage_key(t) for t in itertools.chain(
                self._root.parameters(), self._root.buffers()) if t.device.type != "meta"}
        contexts = [torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)]
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

    def track_modules(self, root: nn.Module, include_root: bool = True) -> None:
        """Name saved tensors after root's submodules (and honour exclude_modules) from now on."""
        self._root = root
        self._names = {}
        for _, m in root.named_modules():
            if m is root and not include_root:
                continue
            self._handles.append(m.register_forward_pre_hook(self._push_module))
            self._handles.append(m.register_forward_hook(self._pop_module, always_call=True))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---------------------------------------------------------------- pack / unpack

    def _keep(self, t: Tensor, reason: str, module: str) -> Tensor:
        self.stats.record_kept(reason, dtype_name(t.dtype), module, t.numel() * t.element_size())
        if self.records is not None:
            self._note(t, module, reason)
        # A detached alias, not t itself: t may be the op's output, and a
        # packed output holding its own grad_fn would be a reference cycle.
        # The alias shares t's version counter, so in-place changes still show.
        return _Kept(t.detach(), t._version)

    def _note(self, t: Tensor, module: str, decision: str) -> None:
        if self.records is not None:
            self.records.append({"shape": tuple(t.shape), "stride": tuple(t.stride()), "dtype": t.dtype,
                                 "module": module, "decision": decision,
                                 "storage": None if decision == "unsupported" else storage_key(t)})

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
        return value_reason(cfg, t)

    def _pack(self, t: Tensor):
        if torch.compiler.is_compiling():  # traced with fake tensors: nothing real to store
            return t.detach()
        s = self._state()
        module, excluded = s.stack[-1] if s.stack else (UNKNOWN_MODULE, False)
        reason = self._reason(t, excluded)
        if reason is not None:
            return self._keep(t, reason, module)
        return self._store(t, module)

    def _store(self, t: Tensor, module: str):
        """t's memory as compressed codes shared by every save of it (or t kept, where that is no gain)."""
        case = classify(t)
        if case == OVERLAPPING:
            return self._keep(t, "overlapping", module)
        src = t  # the tensor whose memory is compressed: t, or the dense tensor t views
        if case != DENSE:
            base = t._base
            if (base is None or classify(base) != DENSE or base.numel() > MAX_BASE_GROWTH * t.numel()
                    or base.dtype != t.dtype):
                return self._keep(t, "strided_view", module)
            src = base
        cfg = self.config
        n, nbytes = src.numel(), src.numel() * src.element_size()
        g = cfg.group_size
        rows, cols = (n // g, g) if n % g == 0 else (1, n)
        if t.dtype != torch.bool and _codec.packed_bytes(rows, cols, cfg.bits, g) >= nbytes:
            return self._keep(t, "no_gain", module)

        offset = src.storage_offset()
        handle_args = (tuple(t.shape), t.stride(), t.storage_offset() - offset)
        # Keyed by the memory covered, so every view of it, in any shape, shares one entry.
        key = (storage_key(src), src.dtype, src._version, offset, n)
        ref = self._table.get(key)
        entry = ref() if ref is not None else None
        # The first saver must still be alive, or its memory may since hold another tensor.
        if entry is not None and entry.origin() is not None:
            entry.saves += 1
            self.stats.deduplicated += 1
            if self.records is not None:
                self._note(t, module, "deduplicated")
            return _Handle(entry, *handle_args)

        detached = src.detach()
        entry = _Entry()
        entry.n, entry.dtype, entry.bits, entry.group_size = n, t.dtype, cfg.bits, g
        # The tensor that owns the memory, not src: src is often a temporary view (the 2-D view
        # F.linear makes of its input), gone before the next op saves the same memory (k and v's
        # projections after q's), while the owner lives as long as the memory does.
        entry.origin = weakref.ref(src._base if src._base is not None else src)
        entry.restored, entry.saves, entry.unpacked, entry.held, entry.offload = None, 1, 0, None, None
        entry.counter, entry.version = _version_handle(src), src._version
        # the memory covered, in memory order, as the flat run (bool) or the [rows, cols] groups it is
        if t.dtype == torch.bool:
            flat = detached.as_strided((n,), (1,), offset)
            entry.codes, entry.stats, entry.rows, entry.cols = _codec.pack_bool(flat), None, 1, n
            after = entry.codes.numel()
        else:
            entry.rows, entry.cols = rows, cols
            entry.codes, entry.stats = _codec.quantize(
                detached.as_strided((rows, cols), (cols, 1), offset), bits=cfg.bits, group_size=g,
                seed=cfg.seed + next(self._seeds), stochastic=cfg.stochastic)
            after = entry.codes.numel() + entry.stats.numel() * 4
        self._remember(key, entry)
        self.stats.record_compressed(dtype_name(t.dtype), module, nbytes, after)
        if self.records is not None:
            self._note(t, module, "compressed")
        return _Handle(entry, *handle_args)

    def _unpack(self, packed):
        if isinstance(packed, Tensor):  # saved while compiling
            return packed
        if isinstance(packed, _Kept):
            t = packed.tensor
            _check_version(t, packed.version, t.dtype, t.shape, t.device)
            return t
        return without_grad(_restore, packed)


def without_grad(fn, *args):
    """fn(*args) with grad mode off (a rebuild or restore must not join a create_graph backward's graph). Not
    `with torch.no_grad()`: that context costs about 2 us, and this runs for every unpacked save; backward
    has grad mode off already unless create_graph is set."""
    if not torch.is_grad_enabled():
        return fn(*args)
    torch._C._set_grad_enabled(False)
    try:
        return fn(*args)
    finally:
        torch._C._set_grad_enabled(True)


def _version_handle(t: Tensor) -> Optional[Tensor]:
    """An empty tensor sharing t's version counter (None for inference tensors, which have none)."""
    if t.is_inference():
        return None
    return _C.version_handle(t)
