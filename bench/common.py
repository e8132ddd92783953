"""Helpers shared by the effmem benchmarks: timing, copy bandwidth, metadata, output.

Times are per call, in seconds. On CUDA each call is bracketed by CUDA events
(the GPU's own clock, so host-side launch overhead that overlaps earlier work is
not counted); on CPU by time.perf_counter. Benchmarks report medians, which a
noisy shared machine disturbs far less than means.
"""
import argparse
import datetime
import json
import os
import platform
import random
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from effmem._args import int_at_least, positive_int
from effmem.info import cpu_name, git_commit as _git_commit

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sync(device: torch.device) -> None:
    """Wait for all queued work on `device` (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], cuda: bool):
    """Runs fn once; returns seconds (float) or, on CUDA, an event pair to read after a sync."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        return start, end
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _seconds(t) -> float:
    return t if isinstance(t, float) else t[0].elapsed_time(t[1]) / 1e3


def time_interleaved(fns: Dict[str, Callable[[], object]], device, warmup: int = 3,
                     repeat: int = 10) -> Dict[str, List[float]]:
    """Seconds per call of each fn, taking turns: round r calls every fn once.

    Taking turns, rather than timing one fn after another, spreads slow drifts
    (a neighbour on a shared host, clock changes) over all of them evenly, so
    their ratios stay fair. The order is shuffled each round (seeded): in a
    fixed order the fn after another that read the same inputs always found
    them in cache, and the one after the copy never did (a reviewer's
    measurement: a 0.87x ratio read 1.70x in the other order). Warm-up calls
    are untimed.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    raw: Dict[str, list] = {name: [] for name in fns}
    order, rng = list(fns), random.Random(0)
    for _ in range(repeat):
        rng.shuffle(order)
        for name in order:
            raw[name].append(_timed(fns[name], cuda))
    sync(device)
    return {name: [_seconds(t) for t in ts] for name, ts in raw.items()}


def time_calls(fn: Callable[[], object], device, warmup: int = 3, repeat: int = 10) -> List[float]:
    """Seconds taken by each of `repeat` calls of fn, after `warmup` untimed calls."""
    return time_interleaved({"fn": fn}, device, warmup, repeat)["fn"]


def summarize(times: Sequence[float]) -> Dict[str, float]:
    """Median, min and max of per-call times, in milliseconds."""
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
            "max_ms": max(times) * 1e3}


def make_copy(device, numel: int):
    """A large fp32 dst.copy_(src) and the bytes it moves (read + write, 8 per element).

    That is the convention the benchmarks use for their kernels too, so a kernel
    at 100% moves its bytes as fast as a plain copy. On CPU the copy's stores
    also cost a read-for-ownership that neither side counts, while in-place
    updates (Adam's master/m/v) do not, so CPU kernels can exceed 100%.
    """
    src = torch.rand(numel, device=device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * numel * src.element_size()


def device_name(device) -> str:
    """GPU name, or the CPU model from /proc/cpuinfo."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def git_commit() -> Dict[str, object]:
    """HEAD of the repo the benchmark lives in, and whether the tree has local changes (effmem.info's)."""
    return _git_commit(REPO_ROOT)


def environment(device) -> Dict[str, object]:
    """Metadata that a result is meaningless without."""
    import effmem

    device = torch.device(device)
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": device_name(device),
        "cpu_name": device_name("cpu"),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "effmem_version": effmem.__version__,
        "effmem_cpu_isa": effmem._C.cpu_isa(),
        "effmem_cpu_threads": effmem._C.num_threads(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "hostname": platform.node(),
        # Other work on the machine skews CPU timings; keep the evidence.
        "loadavg": _loadavg(),
    }
    env.update({"git_" + k: v for k, v in git_commit().items()})
    return env


def _loadavg() -> Optional[List[float]]:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


# Dense bf16 peak of the GPUs this is run on (NVIDIA's datasheets, SXM parts): the denominator of MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


def peak_bf16_flops(device) -> Optional[float]:
    """The GPU's dense bf16 peak FLOP/s, or None (a CPU, or a GPU not in PEAK_BF16_FLOPS)."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


# The smoke runs' model (bench_capacity --smoke, bench_plan --smoke): a two-layer Llama config.
TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=320)


# argparse type of a count that must be at least 1 (steps, sizes): the CLI's own (0 fell back to a default in
# some scripts and timed nothing in others)
count = positive_int


# argparse type of a count that may be 0 (warm-up steps): a negative one read as none, or divided by 0
non_negative = int_at_least(0)


def positive_float(text: str) -> float:
    """argparse type of a rate (a learning rate): finite and > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def add_device(ap: argparse.ArgumentParser) -> None:
    """--device cpu|cuda, by default cuda where a GPU is visible."""
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")


def check_device(ap: argparse.ArgumentParser, device: str) -> None:
    """--device cuda without a GPU: argparse's message, not torch's traceback from the first CUDA call."""
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible here (torch.cuda.is_available() is False)")


def print_seed_gaps(reference: str, gaps: Dict[str, Sequence[float]], width: int = 32) -> None:
    """Each row's relative gap to `reference` over the seeds: its mean, min and max (the loss benchmarks' summary)."""
    seeds = len(next(iter(gaps.values()), []))
    print(f"gap to {reference} over {seeds} seeds: mean (min .. max)")
    for name, g in gaps.items():
        print(f"  {name:<{width}s} {sum(g) / len(g):+.2%}  ({min(g):+.2%} .. {max(g):+.2%})")


def write_json(path: str, payload: Dict[str, object]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def format_table(rows: Sequence[Dict[str, object]], columns: Sequence[tuple]) -> str:
    """Fixed-width text table; columns are (header, key, format spec)."""
    cells = [[h for h, _, _ in columns]]
    for row in rows:
        cells.append([format(row[k], spec) if row.get(k) is not None else "-" for _, k, spec in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
