"""A dispatch mode that notes which op outputs must not be quantised.

Autograd saves an op's outputs right after the op returns, so a
TorchDispatchMode that sees the aten op first can tell the pack hook what a
saved tensor is. It records:

* the statistics whose exactness the backward relies on: the log-sum-exp of
  every fused attention kernel, and the mean / inverse standard deviation of
  layer, group, batch and RMS normalisation (output positions below; checked
  against torch 2.14, where CPU attention dispatches
  ``_scaled_dot_product_flash_attention_for_cpu`` and CPU RMSNorm decomposes
  into rsqrt and mul, its rstd caught by the policy's last-dim rule instead);
* copies of parameters (autocast's casts of the weights): they are the
  weights, and quantising them would change the layer, not an activation;
* the storages of parameters used in ops, for the context-manager form where
  no model was given.

Records are weak references, checked by identity, so a freed tensor's reused
memory is never mistaken for it. The mode asks to be left out of
torch.compile's tracing (ignore_compile_internals): compiled code then
compiles as usual, and the mode sees only what the compiled code dispatches
at run time (fused attention kernels are among those; inductor's fused
normalisations are not, which is why the last-dim rule exists).
"""
import weakref
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten


def _packets(names_and_outputs):
    out = {}
    for name, positions in names_and_outputs:
        packet = getattr(_aten, name, None)
        if packet is not None:  # some ops exist only in some builds
            out[packet] = positions
    return out


# Output positions of the statistics, by op (every overload alike).
EXACT_OUTPUTS: Dict[object, Tuple[int, ...]] = _packets([
    ("_scaled_dot_product_flash_attention_for_cpu", (1,)),
    ("_scaled_dot_product_flash_attention", (1,)),
    ("_scaled_dot_product_efficient_attention", (1,)),
    ("_scaled_dot_product_cudnn_attention", (1,)),
    ("_scaled_dot_product_fused_attention_overrideable", (1,)),
    ("_flash_attention_forward", (1,)),
    ("_efficient_attention_forward", (1,)),
    ("native_layer_norm", (1, 2)),
    ("native_group_norm", (1, 2)),
    ("native_batch_norm", (1, 2)),
    ("_native_batch_norm_legit", (1, 2)),
    ("_native_batch_norm_legit_functional", (1, 2)),
    ("_batch_norm_with_update", (1, 2, 3)),
    ("cudnn_batch_norm", (1, 2, 3)),
    ("miopen_batch_norm", (1, 2)),
    ("_fused_rms_norm", (1,)),
])

# A cast of a parameter (autocast's weight copies) is the parameter in another dtype.
_CASTS = _packets([("_to_copy", ())])


def is_param_like(t) -> bool:
    """A parameter, or a leaf that autograd accumulates a gradient into."""
    # type() is, not isinstance: Parameter's isinstance check is slow, and
    # this runs for every argument of every op.
    return type(t) is torch.nn.Parameter or (t.requires_grad and t.is_leaf)


class WeakTable:
    """key -> tensor, without keeping the tensor alive; an entry leaves when its tensor dies."""

    def __init__(self):
        self._refs: Dict[object, weakref.ref] = {}

    def put(self, key, t: Tensor) -> None:
        refs = self._refs

        def drop(ref, key=key):
            if refs.get(key) is ref:
                del refs[key]
        self._refs[key] = weakref.ref(t, drop)

    def get(self, key) -> Optional[Tensor]:
        ref = self._refs.get(key)
        return None if ref is None else ref()

    def __len__(self) -> int:
        return len(self._refs)


def storage_key(t: Tensor) -> int:
    """The identity of t's storage object: equal for every view of one storage while it lives (on any
    device). Not the data pointer: empty storages (and every meta tensor, as effmem plan traces models)
    all have data pointer 0."""
    return t.untyped_storage()._cdata


class OutputTracker(TorchDispatchMode):
    """Records exact statistics and parameter copies while active; see the module docstring."""

    def __init__(self):
        super().__init__()
        self.exact = WeakTable()           # id(tensor) -> tensor
        self.param_storages = WeakTable()  # storage_key -> a parameter (or view) keeping it alive
        self.copy_storages = WeakTable()   # storage_key -> a parameter cast keeping it alive

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        positions = EXACT_OUTPUTS.get(packet)
        if positions is not None:
            for i in positions:
                if i < len(out) and isinstance(out[i], Tensor):
                    self.exact.put(id(out[i]), out[i])
            return out
        # Parameters are recognised where an op reads them: views of them
        # (weight.t()) share their storage, casts of them are recorded.
        for a in args:
            if type(a) in _PLAIN and is_param_like(a) and a.device.type != "meta":
                key = storage_key(a)
                if self.param_storages.get(key) is None:
                    self.param_storages.put(key, a)
                if packet in _CASTS and isinstance(out, Tensor):
                    self.copy_storages.put(storage_key(out), out)
        return out

    def is_exact(self, t: Tensor) -> bool:
        return self.exact.get(id(t)) is t


_PLAIN = (Tensor, torch.nn.Parameter)
