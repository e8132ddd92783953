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

Host buffers come from torch's pinned-memory cache. Where it cannot give them (the host is out of
page-locked memory), the layer keeps its codes on the device and counts a failure: the step goes on.

On a CPU device the same steps run with clones in place of transfers and no streams: the bookkeeping
(what is sent, what comes back, prefetched or not) is what the CPU tests check; memory moves only on a
GPU.
"""
import weakref
from typing import Dict, List, Optional

import torch
from torch import Tensor


class Offloader:
    """The offloaded layers of one model: the side stream per device, the chain of layers of the
    current forward and counters."""

    def __init__(self):
        self._streams: Dict[torch.device, "torch.cuda.Stream"] = {}
        self._last: Optional["_Layer"] = None
        self.counters = dict(layers_sent=0, bytes_sent=0, layers_back=0, prefetched=0, fetched_late=0)

    # Deep copies and pickles of a model (an EMA copy, torch.save) carry no streams, events or layers in flight.
    def __getstate__(self):
        return {"counters": dict(self.counters)}

    def __setstate__(self, state):
        self.__init__()
        self.counters.update(state["counters"])

    def stream(self, device: torch.device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    def begin(self) -> None:
        """A new forward: its first offloaded layer has no layer before it to prefetch."""
        self._last = None

    def send(self, entries: List, device: torch.device) -> None:
        """Move the codes of `entries` (compress.hooks._Entry, just made by one layer) to host memory."""
        entries = [e for e in entries if e.codes is not None and e.offload is None]
        if not entries:
            return
        try:
            host = [[torch.empty(p.shape, dtype=p.dtype, pin_memory=True) if device.type == "cuda" else None
                     for p in _parts(e)] for e in entries]
        except RuntimeError:  # no page-locked memory left: this layer's codes stay where they are
            self.counters["host_alloc_failed"] = self.counters.get("host_alloc_failed", 0) + 1
            return
        layer = _Layer(self, entries, host, device, self._last)
        self._last = layer
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
    return [e.codes] if e.stats is None else [e.codes, e.stats]  # packed booleans have no statistics


class _Layer:
    """One layer's offloaded entries: their host copies until they come back."""

    def __init__(self, owner: Offloader, entries: List, host_buffers: List, device: torch.device,
                 prev: Optional["_Layer"]):
        self.owner, self.device, self.prev = owner, device, prev
        self.back: Optional[list] = None     # device copies made by the prefetch
        self.ready = None                    # the prefetch's event (CUDA)
        self.done = False
        cuda = device.type == "cuda"
        self.items = []   # (weakref to the entry, [host tensors])
        self.nbytes = 0
        if cuda:
            side = owner.stream(device)
            side.wait_stream(torch.cuda.current_stream(device))  # the codes are written on the current stream
        for e, host in zip(entries, host_buffers):
            parts = _parts(e)
            if cuda:
                with torch.cuda.stream(side):
                    for h, p in zip(host, parts):
                        h.copy_(p, non_blocking=True)
                for p in parts:
                    p.record_stream(side)  # its memory is reused only after the copy out
            else:
                host = [p.clone() for p in parts]
            self.nbytes += sum(p.numel() * p.element_size() for p in parts)
            e.codes = e.stats = None
            e.offload = self
            self.items.append((weakref.ref(e), host))

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
            if e is not None:
                e.codes = dev[0]
                e.stats = dev[1] if len(dev) > 1 else None
                e.offload = None
        counters["layers_back"] += 1
        # The host copies go back to torch's pinned-memory cache, which keeps them until the copies
        # reading them are done.
        self.items, self.back, self.done = [], None, True
        prev, self.prev = self.prev, None
        if prev is not None:
            prev.prefetch()
