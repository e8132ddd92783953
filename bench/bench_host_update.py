"""What OffloadAdam(delay=True)'s delay_correction adds to the host's update, on the CPU.

    python bench/bench_host_update.py [--numel 16777216] [--repeat 12] [--json PATH]

One bf16 parameter of --numel elements per optimizer, on the host backend. Each round hands every optimizer
a gradient (backward, untimed: on a GPU the correction it triggers is a device kernel), then times step() and
flush(), which waits for the host's update and installs its weights: the work a GPU run leaves to the host.
The optimizers take turns, delay_correction off and on, with float32 and 8-bit moments. Prints the median
per step, the bytes per element the update moves and its bandwidth as a fraction of a float32 copy's (timed
in the same rounds), and each delay_correction row's ratio to the same moments without it, measured in the
same run.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for common.py
import common  # noqa: E402
from effmem import OffloadAdam  # noqa: E402


def optimizer(numel, state_bits, correction):
    p = torch.nn.Parameter(torch.randn(numel, dtype=torch.bfloat16) * 0.02)
    # no warm-up: every timed update writes its prediction from the first step on
    return p, OffloadAdam([p], lr=1e-3, delay=True, delay_correction=correction, delay_warmup=0,
                          state_bits=state_bits)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=common.count, default=16 << 20)
    parser.add_argument("--repeat", type=common.count, default=12)
    parser.add_argument("--json", help="write metadata and rows to this file")
    args = parser.parse_args(argv)
    runs = {(bits, corr): optimizer(args.numel, bits, corr) for bits in (32, 8) for corr in (False, True)}
    g = torch.randn(args.numel) * 1e-3
    times = {k: [] for k in runs}
    copy, copy_bytes = common.make_copy("cpu", args.numel)
    copy_times = []
    for r in range(args.repeat + 2):   # two untimed rounds first
        t0 = time.perf_counter()
        copy()
        if r >= 2:
            copy_times.append(time.perf_counter() - t0)
        for k, (p, opt) in runs.items():
            (p.float() * g).sum().backward()   # hands the gradient over (and installs the last prediction)
            opt._engine.fence()   # the host backend: the copy thread's correction of that install done
            t0 = time.perf_counter()
            opt.step()
            opt.flush()
            if r >= 2:
                times[k].append(time.perf_counter() - t0)
    print(f"OffloadAdam(delay=True): step() + flush() of {args.numel:,} bf16 elements on the host, "
          f"{torch.get_num_threads()} threads (medians of {args.repeat}, taking turns)")
    copy_gbs = copy_bytes / statistics.median(copy_times) / 1e9
    print(f"  float32 copy in the same rounds: {copy_gbs:.1f} GB/s (read + write; see common.make_copy)")
    rows = []
    for (bits, corr), ts in times.items():
        ms = statistics.median(ts) * 1e3
        # the update reads and writes master and moments, reads the gradient and writes the weights; the
        # prediction writes pred and r (and reads the state the update has just written, from cache as far as
        # a 64K-element span stays there)
        moved = 8 + 2 * (8 if bits == 32 else 2) + 4 + (4 if corr else 0)
        gbs = moved * args.numel / (ms / 1e3) / 1e9
        row = {"state_bits": bits, "delay_correction": corr, "median_ms": ms, "times_ms": [t * 1e3 for t in ts],
               "bytes_per_element": moved, "gb_per_s": gbs, "bw_fraction": gbs / copy_gbs}
        line = (f"  moments {bits:>2}-bit, delay_correction={corr!s:<5}  {ms:7.1f} ms  ({moved} B/element, "
                f"{gbs:.1f} GB/s, {row['bw_fraction']:.0%} of the copy's)")
        if corr:
            row["vs_without"] = ms / (statistics.median(times[(bits, False)]) * 1e3)
            line += f"  {row['vs_without']:.2f}x the same without it"
        rows.append(row)
        print(line)
    if args.json:
        common.write_json(args.json, {"benchmark": "host_update", "env": common.environment(torch.device("cpu")),
                                      "config": vars(args), "copy_gb_per_s": copy_gbs, "rows": rows})
        print(f"wrote {args.json}")
    for _, opt in runs.values():
        opt.close()


if __name__ == "__main__":
    main()
