"""What effmem demo shows while it trains and measures: a progress line, a process's resident memory, MiB."""
import resource
import sys
import time
from typing import Optional


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


class ProgressBar:
    """One self-overwriting line on a terminal; on a pipe or file, a line at each quarter."""

    def __init__(self, label: str, total: int, stream=None, width: int = 20):
        self.label, self.total, self.width = label, total, width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.last_draw = 0.0
        self.last_len = 0
        self.next_quarter = 1

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        filled = self.width * step // self.total
        line = (f"{self.label:<32} [{'#' * filled}{'.' * (self.width - filled)}] {step:>5}/{self.total}"
                f"  loss {loss:6.3f}  {tokens_per_s:>9,.0f} tok/s")
        if self.tty:
            now = time.monotonic()
            # Redrawing every step would cost more than a tiny step on a fast GPU.
            if now - self.last_draw >= 0.1 or step == self.total:
                # Pad to the previous line's length so no characters of it are left behind.
                self.stream.write("\r" + line.ljust(self.last_len))
                self.last_len = len(line)
                self.stream.flush()
                self.last_draw = now
        elif step * 4 >= self.next_quarter * self.total:
            self.stream.write(line + "\n")
            self.stream.flush()
            self.next_quarter = 4 * step // self.total + 1

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _ru_maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


def _proc_status_bytes(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_now_and_peak():
    """(current RSS or None, peak RSS, how the peak was read) for this process.

    On Linux ru_maxrss is not this process's own: at exec the kernel folds the
    old address space's high-water mark into it, so a worker started by a
    parent that has imported torch reports at least the parent's size. VmHWM
    in /proc/self/status covers only the worker's own address space, so it is
    preferred; ru_maxrss is the fallback where /proc does not exist.
    """
    peak = _proc_status_bytes("VmHWM")
    if peak is not None:
        return _proc_status_bytes("VmRSS"), peak, "process peak RSS (VmHWM)"
    return None, _ru_maxrss_bytes(), "process peak RSS (ru_maxrss)"
