"""Benchmark of effmem's quantize/dequantize kernels against the same math in torch ops.

Script:  python bench/bench_compress.py [--device cpu|cuda] [--numel N] [--bits 8|4]
                                        [--no-compile] [--json PATH]
pytest:  python -m pytest bench/bench_compress.py --benchmark-only

Rows, all on the same bf16 tensor (last dim 4096, groups of 128, stochastic
rounding), each timed as quantize and dequantize separately:
  effmem          torch.ops.effmem.quantize / dequantize (one pass each way)
  torch eager     the same math written in torch ops (min/max, scale, hash-free
                  torch.rand for the rounding noise, pack), the baseline
  torch compile   that torch-ops version under torch.compile (default inductor)

With --gpt (meant for a GPU): training-step time and peak memory of a bf16
byte-level GPT of about 350M parameters (effmem.demo_model.ByteGPT, FusedAdam)
with and without compress_activations(bits=8), at the largest batch (of
1, 2, 4, ...) that trains uncompressed; the target is at most 1.10x the
uncompressed step time.

Bytes moved per element, counted the same way for every row: quantize reads
the input (2 B for bf16) and writes codes (bits/8 B) and stats (8 B per group);
dequantize reads codes and stats and writes the output.
"""
import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for common.py

import torch

import common
import effmem
from effmem import ops

GROUP = 128
LAST_DIM = 4096
DEFAULT_NUMEL = {"cpu": 16 << 20, "cuda": 256 << 20}
PYTEST_NUMEL = 2 << 20
TARGETS = {
    "cpu": [("effmem quantize >= 2x torch eager", "quantize", "vs_eager", 2.0),
            ("effmem dequantize >= 2x torch eager", "dequantize", "vs_eager", 2.0)],
    "cuda": [("effmem quantize >= 85% of copy bandwidth", "quantize", "bw_fraction", 0.85),
             ("effmem dequantize >= 85% of copy bandwidth", "dequantize", "bw_fraction", 0.85),
             ("effmem quantize faster than torch.compile", "quantize", "vs_compiled", 1.0),
             ("effmem dequantize faster than torch.compile", "dequantize", "vs_compiled", 1.0)],
}


def torch_quantize(x: torch.Tensor, bits: int):
    """The op's math in torch ops (noise from torch.rand instead of the hash)."""
    qmax = (1 << bits) - 1
    g = x.float().reshape(-1, GROUP)
    lo = g.amin(dim=1, keepdim=True)
    hi = g.amax(dim=1, keepdim=True)
    scale = (hi - lo) / qmax
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.floor((g - lo) * inv + torch.rand_like(g)).clamp_(0, qmax).to(torch.uint8)
    if bits == 4:
        q = q.reshape(-1, 2)
        q = q[:, 0] | (q[:, 1] << 4)
    return q, torch.cat([lo, scale], dim=1)


def torch_dequantize(codes: torch.Tensor, stats: torch.Tensor, bits: int, dtype: torch.dtype):
    if bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], dim=1)
    q = codes.reshape(-1, GROUP).float()
    return (stats[:, :1] + q * stats[:, 1:]).to(dtype)


def bytes_per_element(bits: int, dtype: torch.dtype) -> float:
    return torch.finfo(dtype).bits / 8 + bits / 8 + 8 / GROUP


def run(device, numel, bits, compile_baseline, repeat, warmup):
    x = torch.randn(numel // LAST_DIM, LAST_DIM, device=device).bfloat16()
    codes, stats = ops.quantize(x, bits=bits, group_size=GROUP, seed=1)
    t_codes, t_stats = torch_quantize(x, bits)
    seeds = iter(range(1 << 62))
    fns = {
        ("quantize", "effmem"): lambda: ops.quantize(x, bits=bits, group_size=GROUP, seed=next(seeds)),
        ("dequantize", "effmem"): lambda: ops.dequantize(codes, stats, bits=bits, group_size=GROUP,
                                                         shape=x.shape, dtype=x.dtype),
        ("quantize", "torch eager"): lambda: torch_quantize(x, bits),
        ("dequantize", "torch eager"): lambda: torch_dequantize(t_codes, t_stats, bits, x.dtype),
    }
    if compile_baseline:
        cq = torch.compile(torch_quantize)
        cd = torch.compile(torch_dequantize)
        fns[("quantize", "torch compile")] = lambda: cq(x, bits)
        fns[("dequantize", "torch compile")] = lambda: cd(t_codes, t_stats, bits, x.dtype)
    copy_fn, copy_bytes = common.make_copy(device, numel)
    fns[("copy", "")] = copy_fn
    times = common.time_interleaved(fns, device, warmup, repeat)
    copy_s = common.summarize(times.pop(("copy", "")))["median_ms"] / 1e3
    copy_gbs = copy_bytes / copy_s / 1e9
    nbytes = numel * bytes_per_element(bits, x.dtype)
    rows = []
    for (op, impl), ts in times.items():
        stats_ = common.summarize(ts)
        gbs = nbytes / (stats_["median_ms"] / 1e3) / 1e9
        rows.append(dict(op=op, impl=impl, **stats_, bytes=nbytes, gb_per_s=gbs, bw_fraction=gbs / copy_gbs,
                         times_ms=[t * 1e3 for t in ts]))
    by = {(r["op"], r["impl"]): r for r in rows}
    for r in rows:
        r["vs_eager"] = by[(r["op"], "torch eager")]["median_ms"] / r["median_ms"]
        if compile_baseline:
            r["vs_compiled"] = by[(r["op"], "torch compile")]["median_ms"] / r["median_ms"]
    targets = []
    for name, op, metric, thr in TARGETS[torch.device(device).type]:
        row = by[(op, "effmem")]
        if metric in row:
            targets.append(dict(name=name, measured=row[metric], threshold=thr, met=row[metric] >= thr))
    return rows, dict(bytes=copy_bytes, median_ms=copy_s * 1e3, gb_per_s=copy_gbs), nbytes, targets


def gpt_step_bench(device, n_layer, d_model, seq_len, max_batch, repeat, warmup, bits=8):
    """Median step time and peak memory with and without compressed activations."""
    from effmem import compress_activations, demo_model

    cfg = demo_model.GPTConfig(seq_len=seq_len, n_layer=n_layer, d_model=d_model, n_head=max(1, d_model // 64))
    model = demo_model.ByteGPT(cfg).to(device=device, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    opt = effmem.FusedAdam(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)

    def make_step(batch, compressed):
        x = torch.randint(0, demo_model.VOCAB_SIZE, (batch, seq_len), generator=gen).to(device)

        def step():
            if compressed:
                with compress_activations(bits=bits):
                    _, loss = model(x, x)
            else:
                _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def measure(batch, compressed):
        step = make_step(batch, compressed)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        times = common.time_calls(step, device, warmup, repeat)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        return common.summarize(times), peak

    batch, best = 1, None
    while batch <= max_batch:  # the largest batch that trains uncompressed
        try:
            measure(batch, False)
            best = batch
            batch *= 2
        except torch.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            break
    if best is None:
        raise RuntimeError("even batch 1 does not fit; use a smaller --gpt-layers/--gpt-d-model")
    plain, plain_peak = measure(best, False)
    packed, packed_peak = measure(best, True)
    return dict(params=params, n_layer=n_layer, d_model=d_model, seq_len=seq_len, batch=best, bits=bits,
                plain=dict(plain, peak_bytes=plain_peak), compressed=dict(packed, peak_bytes=packed_peak),
                step_time_ratio=packed["median_ms"] / plain["median_ms"],
                peak_ratio=(packed_peak / plain_peak) if plain_peak else None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_device(parser)
    parser.add_argument("--numel", type=common.count, help="elements (default 16M on CPU, 256M on CUDA)")
    parser.add_argument("--bits", type=int, choices=[4, 8], default=8)
    parser.add_argument("--repeat", type=common.count, default=15)
    parser.add_argument("--warmup", type=common.non_negative, default=3)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--json", help="write metadata and rows to this file")
    parser.add_argument("--gpt", action="store_true", help="also time GPT training steps with/without compression")
    parser.add_argument("--gpt-layers", type=common.count, default=28)
    parser.add_argument("--gpt-d-model", type=common.count, default=1024)
    parser.add_argument("--gpt-seq-len", type=common.count, default=1024)
    parser.add_argument("--gpt-max-batch", type=common.count, default=256)
    args = parser.parse_args(argv)
    common.check_device(parser, args.device)
    if args.numel is not None and args.numel < LAST_DIM:
        parser.error(f"--numel: expected at least {LAST_DIM} (whole rows of {LAST_DIM}), got {args.numel}")
    if args.gpt_d_model % max(1, args.gpt_d_model // 64):   # gpt_step_bench's heads: d_model // 64
        parser.error(f"--gpt-d-model: expected a multiple of its heads (d_model // 64), such as a multiple of 64, "
                     f"got {args.gpt_d_model}")
    device = torch.device(args.device)
    numel = (args.numel or DEFAULT_NUMEL[device.type]) // LAST_DIM * LAST_DIM
    rows, copy, nbytes, targets = run(device, numel, args.bits, not args.no_compile, args.repeat, args.warmup)
    env = common.environment(device)
    print(f"{env['device_name']} ({device}), torch {env['torch_version']}, commit {env['git_commit'][:12]}")
    print(f"{numel / 1e6:.1f}M bf16 elements, {args.bits} bits, groups of {GROUP}; "
          f"{nbytes / numel:.3f} B/element moved; copy bandwidth {copy['gb_per_s']:.1f} GB/s\n")
    columns = [("op", "op", "s"), ("impl", "impl", "s"), ("ms", "median_ms", ".2f"), ("GB/s", "gb_per_s", ".1f"),
               ("of copy BW", "bw_fraction", ".0%"), ("vs eager", "vs_eager", ".2f")]
    if not args.no_compile:
        columns.append(("vs compiled", "vs_compiled", ".2f"))
    print(common.format_table(rows, columns))
    gpt = None
    if args.gpt:
        gpt = gpt_step_bench(device, args.gpt_layers, args.gpt_d_model, args.gpt_seq_len, args.gpt_max_batch,
                             repeat=max(5, args.repeat // 2), warmup=args.warmup, bits=args.bits)
        print(f"\nGPT {gpt['params'] / 1e6:.0f}M params, batch {gpt['batch']} x {gpt['seq_len']}: step "
              f"{gpt['plain']['median_ms']:.1f} ms plain, {gpt['compressed']['median_ms']:.1f} ms with "
              f"{gpt['bits']}-bit activations ({gpt['step_time_ratio']:.3f}x; target <= 1.10x)")
        if gpt["peak_ratio"] is not None:
            print(f"peak memory {gpt['plain']['peak_bytes'] / 2**30:.2f} GiB -> "
                  f"{gpt['compressed']['peak_bytes'] / 2**30:.2f} GiB ({gpt['peak_ratio']:.3f}x)")
        targets.append(dict(name="GPT step with compression <= 1.10x plain", measured=gpt["step_time_ratio"],
                            threshold=1.10, met=gpt["step_time_ratio"] <= 1.10))
    print()
    for t in targets:
        print(f"target {t['name']}: measured {t['measured']:.2f} -> {'MET' if t['met'] else 'NOT MET'}")
    if args.json:
        common.write_json(args.json, {"benchmark": "quantize", "env": env,
                                      "config": dict(numel=numel, bits=args.bits, group_size=GROUP,
                                                     last_dim=LAST_DIM, dtype="bfloat16", repeat=args.repeat),
                                      "copy_bandwidth": copy, "rows": rows, "targets": targets, "gpt": gpt})
        print(f"wrote {args.json}")


# pytest-benchmark: effmem against torch eager, on the CPU, small size.

@functools.lru_cache(maxsize=1)
def _x():
    return torch.randn(PYTEST_NUMEL // LAST_DIM, LAST_DIM).bfloat16()


def test_effmem_quantize(benchmark):
    benchmark.group = "quantize-cpu"
    benchmark.pedantic(lambda: ops.quantize(_x(), bits=8, group_size=GROUP, seed=1), rounds=20, warmup_rounds=2)


def test_torch_eager_quantize(benchmark):
    benchmark.group = "quantize-cpu"
    benchmark.pedantic(lambda: torch_quantize(_x(), 8), rounds=20, warmup_rounds=2)


if __name__ == "__main__":
    main()
