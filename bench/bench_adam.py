"""Benchmark of effmem's fused Adam step against torch's fused AdamW.

Script:  python bench/bench_adam.py [--device cpu|cuda] [--numel N] [--repeat R]
                                    [--isa scalar|avx2|avx512] [--json PATH]
pytest:  python -m pytest bench/bench_adam.py --benchmark-only

Rows (every one is AdamW, weight decay 0.01, over the same tensors):
  effmem bf16     bf16 params/grads, fp32 master/m/v, one effmem adam_step_ call
  baseline        what mixed precision costs without effmem: bf16 grad -> fp32
                  master.grad, torch AdamW(fused=True) on the masters, master -> bf16 param
  torch fp32      torch AdamW(fused=True) on fp32 params/grads (the reference)
  effmem fp32     fp32 params/grads, no masters, one effmem adam_step_ call
  effmem bf16 adam8  as effmem bf16 with 8-bit moments (state_bits=8): it moves 16 B/param
                  (codes 2 read + 2 written instead of 16, plus a scale per 256 of each moment);
                  on a CPU it is compute-bound

GB/s counts each row's own bytes per parameter (BYTES_MOVED): 28 for a fused bf16 step (grad 2,
master/m/v read 12 and written 12, param 2) and equally for an fp32 step (param/grad/m/v read 16,
param/m/v written 12); 40 for the baseline (its casts add 12); 16.06 for 8-bit moments. Its fraction
of the copy's bandwidth is then bus traffic against bus traffic.
"""
import argparse
import functools
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for common.py

import torch

import common
import effmem
from effmem import ops

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
BYTES_MOVED = {"effmem bf16": 28, "baseline": 40, "torch fp32": 28, "effmem fp32": 28,
               "effmem bf16 adam8": 16 + 16 / 256}   # + a float32 scale per moment per 256 read and written
DEFAULT_NUMEL = {"cpu": 32 << 20, "cuda": 256 << 20}
PYTEST_NUMEL = 4 << 20
# Targets: (name, row, metric, threshold). Metrics are those of the result rows.
TARGETS = {
    "cpu": [("effmem bf16 >= 1.4x baseline", "effmem bf16", "vs_baseline", 1.4),
            ("effmem bf16 >= 0.9x torch fused fp32", "effmem bf16", "vs_torch_fp32", 0.9)],
    "cuda": [("effmem bf16 >= 90% of copy bandwidth", "effmem bf16", "bw_fraction", 0.9),
             ("effmem bf16 >= 1.35x baseline", "effmem bf16", "vs_baseline", 1.35)],
}


def param_shapes(numel: int, layers: int = 2):
    """Shapes of a small transformer's parameters, exactly `numel` elements in all.

    Per layer: qkv, attention-out and the two MLP matrices with their biases and
    two norm weights. An embedding matrix takes the rest (about 1/8), and an odd
    vector the last few elements, so sizes are realistic and not all aligned.
    """
    h = max(64, int(math.sqrt(numel * 7 / 8 / (12 * layers))) // 64 * 64)
    layer = [(3 * h, h), (3 * h,), (h, h), (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,)]
    shapes = layer * layers
    rest = numel - sum(math.prod(s) for s in shapes)
    if rest < 0:
        raise ValueError(f"numel={numel} is too small for {layers} layers")
    rows, tail = divmod(rest, h)
    return ([(rows, h)] if rows else []) + shapes + ([(tail,)] if tail else [])


def make_source(shapes, device):
    """fp32 weights and gradients every row starts from (built outside any timing)."""
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(s, generator=gen, device=device) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen, device=device) * 1e-3 for s in shapes]
    return weights, grads


def build_effmem(source, dtype, state_bits=32):
    """A step of effmem's fused op; bf16 params get fp32 masters, fp32 params none."""
    weights, grads_f32 = source
    device = weights[0].device
    params = [w.to(dtype, copy=True) for w in weights]
    grads = [g.to(dtype, copy=True) for g in grads_f32]
    masters = [w.clone() for w in weights] if dtype != torch.float32 else []
    moment = torch.float32 if state_bits == 32 else torch.uint8
    exp_avgs = [torch.zeros_like(w, dtype=moment) for w in weights]
    exp_avg_sqs = [torch.zeros_like(w, dtype=moment) for w in weights]
    steps = [torch.zeros(1, device=device) for _ in weights]
    eight = {} if state_bits == 32 else dict(   # a float32 scale per moment per block, a salt per tensor
        exp_avg_scales=[torch.zeros(-(-w.numel() // 256), device=device) for w in weights],
        exp_avg_sq_scales=[torch.zeros(-(-w.numel() // 256), device=device) for w in weights],
        salts=list(range(len(weights))))

    def step():
        torch._foreach_add_(steps, 1.0)  # the op takes the count after this step
        ops.adam_step_(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr=LR,
                       beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY,
                       decoupled=True, **eight)
    return step


def build_torch(source, mixed: bool):
    """A step of torch AdamW(fused=True): on fp32 masters with bf16 casts (mixed), or all fp32."""
    weights, grads_f32 = source
    masters = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                            fused=True)
    if not mixed:
        for m, g in zip(masters, grads_f32):
            m.grad = g.clone()
        return opt.step

    params = [w.to(torch.bfloat16) for w in weights]     # the model's bf16 weights
    grads = [g.to(torch.bfloat16) for g in grads_f32]    # what backward produced
    for m in masters:
        m.grad = torch.empty_like(m)
    master_grads = [m.grad for m in masters]

    def step():
        torch._foreach_copy_(master_grads, grads)  # bf16 grad -> fp32
        opt.step()
        torch._foreach_copy_(params, masters)      # fp32 master -> bf16 param
    return step


BUILDERS = {
    "effmem bf16": lambda src: build_effmem(src, torch.bfloat16),
    "baseline": lambda src: build_torch(src, mixed=True),
    "torch fp32": lambda src: build_torch(src, mixed=False),
    "effmem fp32": lambda src: build_effmem(src, torch.float32),
    "effmem bf16 adam8": lambda src: build_effmem(src, torch.bfloat16, state_bits=8),
}


def run(device, numel, repeat, warmup):
    """Times every row and the copy, taking turns step by step (see common.time_interleaved).

    All rows are alive at once: about 94 bytes per parameter in all (24 GB at 256M).
    """
    shapes = param_shapes(numel)
    source = make_source(shapes, device)
    fns = {name: build(source) for name, build in BUILDERS.items()}
    del source
    fns["copy"], copy_bytes = common.make_copy(device, numel)
    times = common.time_interleaved(fns, device, warmup, repeat)

    copy_times = times.pop("copy")
    copy_s = statistics.median(copy_times)
    copy = {"numel": numel, "bytes": copy_bytes, "median_ms": copy_s * 1e3,
            "gb_per_s": copy_bytes / copy_s / 1e9, "times_ms": [t * 1e3 for t in copy_times]}
    rows = []
    for name, ts in times.items():
        stats = common.summarize(ts)
        seconds = stats["median_ms"] / 1e3
        rows.append(dict(name=name, **stats, times_ms=[t * 1e3 for t in ts],
                         params_per_s=numel / seconds,
                         gb_per_s=numel * BYTES_MOVED[name] / seconds / 1e9,   # its own bytes
                         bytes_moved_per_param=BYTES_MOVED[name]))
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        r["bw_fraction"] = r["gb_per_s"] / copy["gb_per_s"]
        r["vs_baseline"] = r["params_per_s"] / by_name["baseline"]["params_per_s"]
        r["vs_torch_fp32"] = r["params_per_s"] / by_name["torch fp32"]["params_per_s"]
    targets = [dict(name=t, row=row, metric=metric, threshold=thr,
                    measured=by_name[row][metric], met=by_name[row][metric] >= thr)
               for t, row, metric, thr in TARGETS[device.type]]
    return shapes, copy, rows, targets


def _table(rows):
    rows = [dict(r, mparams_per_s=r["params_per_s"] / 1e6) for r in rows]
    return common.format_table(rows, [
        ("row", "name", "s"), ("ms/step", "median_ms", ".2f"), ("Mparam/s", "mparams_per_s", ".0f"),
        ("GB/s", "gb_per_s", ".1f"), ("of copy BW", "bw_fraction", ".0%"),
        ("vs baseline", "vs_baseline", ".2f"), ("vs torch fp32", "vs_torch_fp32", ".2f"),
    ])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_device(parser)
    parser.add_argument("--numel", type=common.count, help="parameters in all (default 32M on CPU, 256M on CUDA)")
    parser.add_argument("--repeat", type=common.count, default=15, help="timed steps per row (median reported)")
    parser.add_argument("--warmup", type=common.non_negative, default=3, help="untimed steps per row first")
    parser.add_argument("--isa", choices=["scalar", "avx2", "avx512"], help="effmem CPU vector unit")
    parser.add_argument("--threads", type=common.count, help="torch.set_num_threads (effmem follows it)")
    parser.add_argument("--json", help="write metadata and rows to this file")
    args = parser.parse_args(argv)
    common.check_device(parser, args.device)

    device = torch.device(args.device)
    numel = args.numel or DEFAULT_NUMEL[device.type]
    try:
        param_shapes(numel)
    except ValueError as e:
        parser.error(f"--numel: {e}")
    if args.isa:
        effmem._C.set_cpu_isa(args.isa)
    if args.threads:
        torch.set_num_threads(args.threads)

    shapes, copy, rows, targets = run(device, numel, args.repeat, args.warmup)
    env = common.environment(device)  # after the run: effmem's pool is sized lazily

    print(f"{env['device_name']} ({device}), torch {env['torch_version']}, effmem isa "
          f"{env['effmem_cpu_isa']}, threads torch={env['torch_threads']} "
          f"effmem={env['effmem_cpu_threads']}, commit {env['git_commit'][:12]}")
    print(f"{numel / 1e6:.1f}M params in {len(shapes)} tensors; median of {args.repeat} steps "
          f"after {args.warmup} warm-up; GB/s from each row's own bytes per parameter")
    print(f"copy bandwidth (fp32 dst.copy_(src), read+write, timed in the same rounds): "
          f"{copy['gb_per_s']:.1f} GB/s\n")
    print(_table(rows))
    print()
    for t in targets:
        print(f"target {t['name']}: measured {t['measured']:.2f} -> {'MET' if t['met'] else 'NOT MET'}")

    if args.json:
        common.write_json(args.json, {
            "benchmark": "adam_step", "env": env,
            "config": dict(numel=numel, repeat=args.repeat, warmup=args.warmup, lr=LR, betas=BETAS,
                           eps=EPS, weight_decay=WEIGHT_DECAY, bytes_moved_per_param=BYTES_MOVED,
                           shapes=shapes),
            "copy_bandwidth": copy, "rows": rows, "targets": targets,
        })
        print(f"wrote {args.json}")


# pytest-benchmark: the three main rows on the CPU at a small size, in one
# group so they are compared. No pytest import: the script must run without it.

@functools.lru_cache(maxsize=1)
def _pytest_source():
    return make_source(param_shapes(PYTEST_NUMEL), torch.device("cpu"))


def _bench(benchmark, name):
    step = BUILDERS[name](_pytest_source())
    benchmark.group = f"adam-step-cpu-{PYTEST_NUMEL >> 20}M"
    benchmark.extra_info.update(numel=PYTEST_NUMEL, threads=torch.get_num_threads(),
                                cpu_isa=effmem._C.cpu_isa())
    benchmark.pedantic(step, rounds=20, warmup_rounds=3, iterations=1)


def test_effmem_bf16(benchmark):
    _bench(benchmark, "effmem bf16")


def test_baseline_torch_fused_with_casts(benchmark):
    _bench(benchmark, "baseline")


def test_torch_fused_fp32(benchmark):
    _bench(benchmark, "torch fp32")


if __name__ == "__main__":
    main()
