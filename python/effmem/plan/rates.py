"""The machine rates the step-time model uses: measured here (``effmem plan --calibrate``) or from a named GPU's runs.

Every default comes from a committed measurement and says which. A rate
measured on this machine (``calibrate()``) is written to
``~/.cache/effmem/plan_rates.json`` under the device's name and wins.
"""
import json
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional

import torch


@dataclass(frozen=True)
class Rates:
    """The machine rates a plan turns bytes and FLOPs into time with: shipped for an H100 and a CPU, or
    measured by calibrate() (``effmem plan --calibrate``); fields as commented below."""
    device: str                 # what the rates describe
    matmul_flops: float         # achieved dense matmul FLOP/s in the training dtype, at large sizes
    matmul_flops_fp32: float    # the same for fp32 weights (under autocast on a GPU)
    memory_bw: float            # device memory copy bandwidth, B/s (read + write counted)
    link_bw: float              # host <-> device, B/s, one direction (0: no link, CPU training)
    host_adam: float            # parameters/s of effmem's CPU Adam on this host
    compress_bw: float          # saved bytes/s that compress_activations quantises and restores (both ways)
    interconnect_bw: float      # all-reduce bus bandwidth between GPUs, B/s
    half_rate_tokens: float     # tokens per micro-batch at which matmuls run at half their large-size rate
    source: str                 # where the numbers come from
    # Plain bytes/s that the "fast" and "min" policies' own quantize + dequantize kernels turn into codes and
    # back in a training step; 0 where they do not run (a CPU): compress_bw then.
    policy_codec_bw: float = 0.0
    attention_flops: float = 0.0     # attention kernels' FLOP/s (0: matmul_flops)
    # The memory-bound ops (norms, activations, casts, the loss's softmax) of a forward and its backward take
    # this many passes of the forward's traffic at memory_bw; 0 where matmul_flops is an effective rate
    # that includes them (the CPU defaults).
    elementwise_passes: float = 0.0
    # Seconds of the host's time per aten op of an eager training step (Python, dispatch, launch): on a GPU the
    # floor of a step whose device work is shorter, on a CPU added to its work (plan/step_model.py host_s);
    # 0: not counted (the CPU defaults, whose matmul rate is an effective one, host work included).
    host_op_s: float = 0.0

    def as_dict(self) -> dict:
        """The rates as plain JSON values (the plan's JSON "rates")."""
        return asdict(self)


# H100 80GB HBM3 (bench/results, torch 2.11): copy bandwidth from gpu_adam.json (3.00 TB/s); the link from
# gpu_offload.json (transfer: 54.0 GB/s); host Adam from its plain OffloadAdam row (292 ms for 1.35e9
# parameters, less the 49 ms weight upload: 5.5e9 parameters/s on 16 cores); compress from the TinyLlama run
# in gpu-runs/2026-11-23-h100 (117 ms more per step for about 36 GB saved: 3.1e11 B/s). The interconnect is
# NVLink 4's all-reduce bus bandwidth as NVIDIA quotes it (not measured here: one GPU).
# Products, attention and elementwise ops from the kernel profile of a TinyLlama step (batch 8 x 2048, bf16,
# 2026-11-27-h100-ad52e0c/gpu_profile.json): the GEMM kernels ran 130.5 ms for the trace's 101.7 TFLOP
# (7.8e14 FLOP/s), attention 28.2 ms for 9.1 TFLOP (3.2e14), the other kernels (norms, casts, the fp32 loss,
# adds) 153.1 ms where the trace counts 109.7 GB of forward traffic: 4.2 passes at the copy bandwidth. Checked
# on another model: bench/llama.py's 1.3B (its own blocks, no fp32 loss upcast; gpu_offload.json's FusedAdam
# row, 1,061 ms of forward and backward for 4 micro-batches) is predicted at 259 ms per micro-batch against
# 265 measured. fp32 weights under autocast: 0.9 of the bf16 rate (bf16 products and the casts).
# half_rate_tokens: small micro-batches leave an H100 idle between kernels; 600 puts the capacity rows of
# gpu_offload_capacity.json (1.3B and 3B at 2,048 tokens per step) within 20% (tests/test_plan_h100.py).
# policy_codec_bw: the same profile: effmem's quantize and dequantize kernels ran 18.5 ms for the 14.4 GB of
# plain saves that the plan's trace says "fast" quantises at batch 8 x 2048: 7.8e11 B/s.
# host_op_s: the two host-bound rows of bench_plan's first run (2026-11-27-h200-68edd28/gpu_plan.json, the same
# 16-core hosts): Hugging Face Llamas of 160M and 410M, plain bf16 at batch 4 x 1024, 39 and 89 ms for the
# 2,831 and 5,519 ops the trace counts (13.8 and 16.1 us each).
H100 = Rates("NVIDIA H100 80GB HBM3", 7.8e14, 7.0e14, 3.0e12, 5.4e10, 5.5e9, 3.1e11, 3.6e11, 600.0,
             "bench/results/gpu_*.json (H100, commit 30c4269), 2026-11-27-h100-ad52e0c/gpu_profile.json and "
             "2026-11-27-h200-68edd28/gpu_plan.json", policy_codec_bw=7.8e11, attention_flops=3.2e14,
             elementwise_passes=4.2, host_op_s=15e-6)
# This 2-core AVX2 development machine (effmem plan --calibrate, 2026-11-23).
CPU_DEFAULT = Rates("cpu", 1.0e10, 6.0e10, 1.0e10, 0.0, 3.0e8, 2.0e9, 1.0e9, 16.0,
                    "2-core AVX2 defaults; interconnect: gloo over loopback, assumed")

_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "effmem" / "plan_rates.json"


def _cached() -> dict:
    try:
        data = json.loads(_CACHE.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# the rates the step-time model divides by: a cached 0 was a ZeroDivisionError
_POSITIVE = ("matmul_flops", "matmul_flops_fp32", "memory_bw", "host_adam", "compress_bw")


def _checked(r: Rates) -> Rates:
    """r, or a ValueError naming the field that is not a finite number (> 0 where the model divides by it)."""
    for f in fields(r):
        v = getattr(r, f.name)
        if f.name in ("device", "source"):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                or (f.name in _POSITIVE and v == 0):
            raise ValueError(f"{f.name} = {v!r}, expected a finite number {'> 0' if f.name in _POSITIVE else '>= 0'}")
    return r


def rates_for(device: str) -> Rates:
    """Rates for "cpu" or a GPU name: this machine's calibration if there is one, else the defaults. An entry
    this version cannot read (another version's fields, a damaged file) is passed over with a warning;
    --calibrate writes it anew."""
    cached = _cached().get(device)
    if cached:
        try:
            return _checked(Rates(**cached))
        except (TypeError, ValueError) as e:
            warnings.warn(f"effmem plan: {_CACHE}'s rates for {device!r} do not fit this version ({e}); using "
                          "the defaults (effmem plan --calibrate measures them again)", stacklevel=2)
    return _default_rates(device)


def _default_rates(device: str) -> Rates:
    """The rates this version ships for "cpu" or a GPU name (the H100's for any other GPU)."""
    if device == "cpu":
        return CPU_DEFAULT
    if "H100" not in device:
        return replace(H100, device=device, source=f"{H100.source}; no calibration for {device}: "
                                                     "run effmem plan --calibrate on it")
    return H100


def _median_time(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _host_op_s(device: torch.device) -> float:
    """Host seconds per aten op of an eager training step: a tiny Hugging Face Llama (its Python is what a
    user's model runs; a stack of torch modules where transformers is missing) whose tensors are too small
    for the device's work to matter, its forward and backward ops counted by a dispatch mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    try:
        import transformers
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=4, vocab_size=128)
        model = transformers.LlamaForCausalLM(cfg).to(device)
        ids = torch.randint(0, 128, (2, 16), device=device)
        step = lambda: model(input_ids=ids, labels=ids).loss.backward()  # noqa: E731
    except ImportError:
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 128),
                                                          torch.nn.SiLU(), torch.nn.Linear(128, 64))
                                      for _ in range(8)]).to(device)
        x = torch.randn(2, 16, 64, device=device)
        step = lambda: model(x).square().mean().backward()  # noqa: E731
    count = Count()
    with count:
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run():
        step()
        sync()
    return _median_time(run) / count.ops


def calibrate(device: Optional[torch.device] = None, write: bool = True) -> Rates:
    """Measure this machine's rates (a few seconds) and remember them for later plans.

    device: the device to measure (default: the GPU where there is one, else the CPU). write: remember them
    in the cache that rates_for reads (``effmem plan --calibrate`` does), else only return them. What it does
    not measure comes from the shipped rates: the compression codecs' and the interconnect's rates, the
    tokens at half rate, the elementwise passes and attention's rate in proportion to the products'."""
    from effmem.optim import FusedAdam
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(fn):
        def run():
            fn()
            sync()
        return _median_time(run)

    n = 4096 if cuda else 512
    flops = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(n, n, device=device, dtype=dtype)
        flops[dtype] = 2 * n ** 3 / timed(lambda: a @ a)
    numel = (1 << 28) if cuda else (1 << 24)
    src = torch.empty(numel, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    memory_bw = 2 * numel / timed(lambda: dst.copy_(src))
    link_bw = 0.0
    if cuda:
        host = torch.empty(numel, dtype=torch.uint8, pin_memory=True)
        link_bw = numel / timed(lambda: src.copy_(host, non_blocking=True))
    p = torch.zeros(1 << 22, requires_grad=True)
    p.grad = torch.randn_like(p)
    opt = FusedAdam([p])
    host_adam = p.numel() / _median_time(opt.step)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    # what calibration does not measure, from the shipped rates (a calibration's own, taken before, nested
    # its source in each new one's and named itself as the source of rates it never measured), named without
    # the advice to calibrate that the shipped rates carry for a GPU other than an H100
    base = _default_rates(name)
    base = replace(base, source=H100.source) if cuda and base.device != H100.device else base
    # fp32 weights train under bf16 autocast on a GPU (bf16 matmuls, plus the casts: 0.9 as in the H100
    # figures above); on a CPU they run fp32 matmuls.
    fp32 = 0.9 * flops[torch.bfloat16] if cuda else flops[torch.float32]
    rates = Rates(name, flops[torch.bfloat16], fp32, memory_bw, link_bw, host_adam,
                  base.compress_bw, base.interconnect_bw, base.half_rate_tokens,
                  f"effmem plan --calibrate on this machine, {time.strftime('%Y-%m-%d')} (compress and "
                  f"interconnect: {base.source})", policy_codec_bw=base.policy_codec_bw if cuda else 0.0,
                  # the attention kernels' rate in proportion to the products' as the base measured it;
                  # passes: a property of the kernels and the bandwidth they reach, kept from the base
                  attention_flops=(base.attention_flops / base.matmul_flops * flops[torch.bfloat16]
                                   if cuda and base.attention_flops else 0.0),
                  elementwise_passes=base.elementwise_passes if cuda else 0.0,
                  # on a CPU the ops run as the host issues them: their Python and dispatch add to the
                  # products' time (step_model.step_time), which the peak rates above do not hold
                  host_op_s=_host_op_s(device))
    if write:
        data = _cached()
        data[name] = rates.as_dict()
        try:
            _CACHE.parent.mkdir(parents=True, exist_ok=True)
            _CACHE.write_text(json.dumps(data, indent=1))
        except OSError as e:
            raise OSError(f"calibrate: the rates were measured but cannot be written to {_CACHE} ({e}); point "
                          "XDG_CACHE_HOME at a writable folder") from e
    return rates
