"""Compressed activations offloaded to host memory: memory_budget's "offload" layers.

Such a layer runs as a "fast" layer. When its forward returns, the 8-bit codes it stored (every
compressed entry it made, statistics included) are copied to page-locked host memory on a side stream,
and their device memory goes back to the allocator as soon as those copies are done (record_stream: no
wait on the host). The copies run behind the next layers' forward.

In backward, the first restore of any of the layer's entries brings the whole layer back: it waits for
the layer's prefetch (a stream wait, not a host one) or, without one, copies now on the current stream.
It then starts the prefetch of the offloaded layer sent before it, the next one backward needs, on the
side stream, so that copy runs behind this layer's backward. Only the earliest layers are offloaded
(effmem.activations.budget): their copies out have the rest of the forward to hide behind, and their
copies back the backward of the layers after them. The last offloaded layer is prefetched when backward
reaches the layer after it (a hook on that layer's output, prefetch_on_backward), not at the start of
backward, where the codes would add to the peak.

Host memory: one page-locked buffer per model, reserved at calibration for the layers chosen (their codes
at 512-byte alignment) and reused by every forward: no allocation in the steps. (torch's pinned-memory
cache, which it comes from, rounds it up to a power of two and keeps it cached; effmem plan counts the
rounded size. Per-tensor allocations would be rounded each.) A forward that starts while an earlier
one's layers are still in host memory (two forwards before a backward) gets a new buffer; copies beyond
the reserve get their own pinned tensors. Where the host has no page-locked memory left, the layer keeps
its codes on the device and counts a failure: the step goes on.

On a CPU device the same steps run with copies into an ordinary buffer and clones back, no streams: the
bookkeeping (what is sent, what comes back, prefetched or not) is what the CPU tests check; memory moves
only on a GPU.
"""
import contextlib
import weakref
from typing import Dict, List, Optional

import torch
from torch import Tensor

from effmem import _C

ALIGN = 512  # bytes: where each host copy starts in the buffer (a multiple of every element size)


def aligned_bytes(parts: List[Tensor]) -> int:
    """Host buffer bytes that the copies of `parts` take."""
    return sum(-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in parts)


class Offloader:
    """The offloaded layers of one model: the side stream per device, the chain of layers of the
    current forward and counters."""

    def __init__(self):
        self._streams: Dict[torch.device, "torch.cuda.Stream"] = {}
        self._last: Optional["_Layer"] = None
        self._pool: Optional[Tensor] = None    # the host buffer (uint8) this forward's copies are cut from
        self._reserved = 0                     # its size, as reserve() asked
        self._offset = 0
        self._layers: List[weakref.ref] = []   # this forward's layers
        self.counters = dict(layers_sent=0, bytes_sent=0, layers_back=0, prefetched=0, fetched_late=0,
                             host_reserved=0, outside_reserve=0)

    # Deep copies and pickles of a model (an EMA copy, torch.save) carry no streams, events or layers in flight.
    def __getstate__(self):
        return {"counters": dict(self.counters), "reserved": self._reserved}

    def __setstate__(self, state):
        self.__init__()
        self.counters.update(state["counters"])
        self._reserved = state.get("reserved", 0)  # the copy's own buffer is allocated at its first forward

    def stream(self, device: torch.device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    def reserve(self, nbytes: int, device: torch.device) -> None:
        """Host memory for one forward's copies (at least nbytes), allocated once."""
        if nbytes > self._reserved or self._pool is None:
            self._reserved = max(nbytes, self._reserved)
            self._pool = None  # an older buffer lives on in the views of copies still out, if any
            try:
                self._pool = torch.empty(self._reserved, dtype=torch.uint8, pin_memory=device.type == "cuda")
            except RuntimeError:  # no page-locked memory left: copies take their own, or stay on the device
                self.counters["host_alloc_failed"] = self.counters.get("host_alloc_failed", 0) + 1
                return
            self.counters["host_reserved"] = self._reserved

    def begin(self, device: torch.device) -> None:
        """A new forward: its first offloaded layer has no layer before it to prefetch, and its copies
        start at the buffer's beginning, unless a layer of the last forward is still out."""
        self._last = None
        if any(r() is not None and not r().done for r in self._layers):
            self._pool = None  # still read: those layers' views keep it alive; this forward gets another
        if self._pool is None and self._reserved:  # (or a deep copy's first forward)
            self.reserve(self._reserved, device)
        self._layers, self._offset = [], 0

    def _host(self, parts: List[Tensor], device: torch.device) -> List[Tensor]:
        """Host tensors to copy `parts` into: views of the buffer while it lasts, else their own."""
        n = aligned_bytes(parts)
        if self._pool is None or self._offset + n > self._pool.numel():
            self.counters["outside_reserve"] += 1
            return [torch.empty(p.shape, dtype=p.dtype, pin_memory=device.type == "cuda") for p in parts]
        out, at = [], self._offset
        for p in parts:
            size = p.numel() * p.element_size()
            out.append(self._pool[at:at + size].view(p.dtype).view(p.shape))
            at += aligned_bytes([p])
        self._offset += n
        return out

    def send(self, entries: List, device: torch.device) -> None:
        """Move the codes of `entries` (effmem._C.SavedEntry, just made by one layer) to host memory."""
        entries = [e for e in entries if e.codes is not None and e.offload is None]
        if not entries:
            return
        try:
            host = [self._host(_parts(e), device) for e in entries]
        except RuntimeError:  # no page-locked memory left: this layer's codes stay where they are
            self.counters["host_alloc_failed"] = self.counters.get("host_alloc_failed", 0) + 1
            return
        layer = _Layer(self, entries, host, device, self._last)
        self._last = layer
        self._layers.append(weakref.ref(layer))
        self.counters["layers_sent"] += 1
        self.counters["bytes_sent"] += layer.nbytes

    def prefetch_on_backward(self, output) -> None:
        """Prefetch the latest offloaded layer when the gradient of `output` (the first tensor in it that
        requires grad: the output of the layer after it) is computed, as backward enters that layer."""
        last = self._last
        t = output if isinstance(output, Tensor) else next(
            (o for o in (output if isinstance(output, (tuple, list)) else ()) if isinstance(o, Tensor)), None)
        if last is None or t is None or not t.requires_grad:
            return

        def hook(grad):
            last.prefetch()
        t.register_hook(hook)


def _parts(e) -> List[Tensor]:
    """An entry's codes and statistics (packed booleans have none); none for an entry that keeps its memory as
    it is (SavedTensors.pin_compared: the input of an amax), which stays where it is."""
    if e.codes is None:
        return []
    return [e.codes] if e.stats is None else [e.codes, e.stats]


class _Layer:
    """One layer's offloaded entries: their host copies until they come back."""

    def __init__(self, owner: Offloader, entries: List, host_buffers: List, device: torch.device,
                 prev: Optional["_Layer"]):
        self.owner, self.device, self.prev = owner, device, prev
        self.back: Optional[list] = None     # device copies made by the prefetch
        self.ready = None                    # the prefetch's event (CUDA)
        self.done = False
        cuda = device.type == "cuda"
        self.items = []   # (weak reference to the entry, [host tensors])
        self.nbytes = 0
        if cuda:
            side = owner.stream(device)
            side.wait_stream(torch.cuda.current_stream(device))  # the codes are written on the current stream
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            for e, host in zip(entries, host_buffers):
                parts = _parts(e)
                for h, p in zip(host, parts):
                    h.copy_(p, non_blocking=cuda)
                    if cuda:
                        p.record_stream(side)  # its memory is reused only after the copy out
                self.nbytes += sum(p.numel() * p.element_size() for p in parts)
                e.codes = e.stats = None
                e.offload = self
                self.items.append((_C.SavedEntryRef(e), host))

    def _copy_back(self, prefetch: bool) -> list:
        """Device copies of the host tensors: on the side stream when prefetching (recording `ready`), on
        the current stream otherwise."""
        if self.device.type != "cuda":
            return [[h.clone() for h in host] for _, host in self.items]
        cur = torch.cuda.current_stream(self.device)
        side = self.owner.stream(self.device)
        # Allocated on the current stream, which uses them; written by the side stream once the
        # current stream is done with what the memory held before.
        out = [[torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in host] for _, host in self.items]
        if prefetch:
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                for dev, (_, host) in zip(out, self.items):
                    for d, h in zip(dev, host):
                        d.copy_(h, non_blocking=True)
                        d.record_stream(side)
            self.ready = torch.cuda.Event()
            self.ready.record(side)
        else:
            cur.wait_stream(side)  # the copies out are done
            for dev, (_, host) in zip(out, self.items):
                for d, h in zip(dev, host):
                    d.copy_(h, non_blocking=True)
        return out

    def prefetch(self) -> None:
        if not self.done and self.back is None:
            self.back = self._copy_back(prefetch=True)

    def bring_back(self) -> None:
        """Put every live entry's codes back on the device, then prefetch the layer sent before."""
        if self.done:
            return
        counters = self.owner.counters
        if self.back is not None:
            if self.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(self.ready)
            back, counters["prefetched"] = self.back, counters["prefetched"] + 1
        else:
            back, counters["fetched_late"] = self._copy_back(prefetch=False), counters["fetched_late"] + 1
        for (ref, _), dev in zip(self.items, back):
            e = ref()
            if e is not None and e.exact is not None:   # kept as it is since it was sent (pin_compared)
                e.offload = None
            elif e is not None:
                e.codes = dev[0]
                e.stats = dev[1] if len(dev) > 1 else None
                e.offload = None
        counters["layers_back"] += 1
        # The host copies are views of the buffer (or tensors of torch's pinned cache): the next forward
        # writes over them only after these copies, in stream order (see begin()).
        self.items, self.back, self.done = [], None, True
        prev, self.prev = self.prev, None
        if prev is not None:
            prev.prefetch()
