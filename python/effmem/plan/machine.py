"""What effmem plan reads from the machine and from the user's sizes: GPU count and memory, host memory, and
sizes such as 80GB or 80GiB."""
import math
import os
import re
from typing import Dict, Optional, Union

import torch


def parse_bytes(text: Union[str, int, float, None], what: str) -> Optional[int]:
    """'80GB' (10^9), '80GiB' (2^30), '512MB', '1e11', or a number of bytes; at least a MiB."""
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not _finite(text) or text < 1:
            raise ValueError(f"{what}: expected a positive, finite size, got {text!r}")
        if text < 1 << 20:   # gpu_memory=80: 80 bytes (nothing fits), where 80 GB was meant
            raise ValueError(f"{what}: {text!r} is {int(text)} bytes, less than a MiB: give a size with its unit "
                             f"('{text:g}GB') or bytes ({text:g}e9)")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"{what}: expected a size such as 80GB, 80GiB or a number of bytes, got {text!r}")
    if float(m.group(1)) <= 0:
        raise ValueError(f"{what}: expected a positive size, got {text!r}")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1}
    for i, p in enumerate("KMGT", start=1):
        scale[f"{p}B"], scale[f"{p}IB"] = 10 ** (3 * i), 1 << (10 * i)
    size = float(m.group(1)) * scale[unit]
    if not _finite(size):   # '1e400GB': an OverflowError from int() below, a traceback from the command
        raise ValueError(f"{what}: expected a size such as 80GB, 80GiB or a number of bytes, got {text!r} "
                         "(more than a float holds)")
    n = int(size)
    if n < 1:   # '0.5B': not a size (and 0 would read as 'not given')
        raise ValueError(f"{what}: expected a positive size, got {text!r} ({n} bytes)")
    if n < 1 << 20:   # '--gpu-memory 80': 80 bytes, where 80GB was meant (and '1KB' is no memory to plan for)
        raise ValueError(f"{what}: {text!r} is {n} bytes, less than a MiB: "
                         + (f"give a unit (for example {text}GB)" if m.group(2) is None else "expected a memory size"))
    return n


def _finite(x: Union[int, float]) -> bool:
    """Whether x is finite as a float too: the plan sums sizes in floats, and an int past float's range
    (10**400) makes math.isfinite itself raise an OverflowError."""
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def machine() -> Dict[str, object]:
    """What this machine has: GPU count and memory (of GPU 0), host memory."""
    host = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    host = int(line.split()[1]) * 1024
    except OSError:
        pass
    if host is None:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        props = torch.cuda.get_device_properties(0)
        return dict(gpus=gpus, gpu_memory=props.total_memory, gpu_name=props.name, host_memory=host)
    return dict(gpus=0, gpu_memory=None, gpu_name=None, host_memory=host)
