"""Steps the CUDA Adam kernel refused, reported without a host sync.

On CUDA the lr tensor and the step counts live on the device, so adam_step_
cannot check them on the host without a sync; the kernel instead leaves the
tensors concerned unchanged and ORs a flag into a per-device int32 status
(1: an lr that is negative or not finite; 2: a step count that is not a whole
number in [1, 2**63)). After each step the status is copied to pinned host
memory without blocking; the next step (or state_dict()) looks at the copy
once its event has completed and raises, as a grad scaler reports found_inf
a step later.
"""
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

REASONS = {
    1: "an lr tensor held a negative or non-finite value",
    2: "a step count was not a whole number in [1, 2**63) (loaded from a checkpoint or set by hand?)",
}


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream. Not while torch.compile traces: on a GPU
    machine it folds is_available() to True and cannot trace is_current_stream_capturing() (a fullgraph step
    raised); a compiled step captured in a graph (mode="reduce-overhead") runs what was traced, without these
    Python checks."""
    if torch.compiler.is_compiling():
        return False
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _hands_off() -> bool:
    """No host copy, event or query now: a graph being captured, or a compiled step being traced (which leaves
    its refusals in the status, for the next eager step to report with its own)."""
    return torch.compiler.is_compiling() or capturing()


class RefusalMonitor:
    def __init__(self, owner: str):
        self.owner = owner
        self._status: Dict[torch.device, Tensor] = {}
        self._landing: Dict[torch.device, Tuple[Tensor, torch.cuda.Event]] = {}

    def status(self, device: torch.device) -> Optional[Tensor]:
        """The status tensor to pass to adam_step_ on `device` (None off CUDA: the CPU op raises; None in a
        compiled step before an eager one made it: refusals then go unreported)."""
        if device.type != "cuda":
            return None
        s = self._status.get(device)
        if s is None and not torch.compiler.is_compiling():
            s = self._status[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return s

    def launched(self, device: torch.device) -> None:
        """After a step on `device`: start copying its status to the host."""
        status = self._status.get(device)
        if status is None or _hands_off():
            return
        host = self._landing.get(device, (None, None))[0]
        if host is None:
            host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        host.copy_(status, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._landing[device] = (host, event)

    def check(self) -> None:
        """Raises for a refusal whose report has reached the host; never waits for one (nor looks,
        while a CUDA graph is being captured: event queries are not allowed then)."""
        if self._landing and _hands_off():
            return
        for device, (host, event) in list(self._landing.items()):
            if event is None or not event.query():
                continue
            self._landing[device] = (host, None)
            flags = int(host.item())
            if flags:
                self._status[device].zero_()
                host.zero_()
                reasons = "; ".join(text for bit, text in REASONS.items() if flags & bit)
                raise RuntimeError(f"{self.owner}: a step on {device} was refused ({reasons}); the parameters it "
                                   "concerned were left unchanged by that step")
