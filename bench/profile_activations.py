"""Where an activation policy's step time goes: the GPU kernels of one training step, by name, per policy.

    python bench/profile_activations.py [--rows plain,effmem_fast,effmem_min] [--layers L] [--json PATH]

bench_activations.py measures each policy's step against plain; this says which kernels make the
difference. Same model (TinyLlama's shape by default, bf16, batch 8 x 2048 on CUDA; the small CPU model
otherwise), same setup() per row; after 3 warm-up steps, torch.profiler records 2 steps and the kernels are
summed by name (device time, microseconds per step). Printed: each row's total and its top kernels, then
the kernels whose time differs most from the first row's.
"""
import argparse
import copy
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_activations import CPU_MODEL, GPU_MODEL, ROWS, SacCaches, progressions, setup  # noqa: E402
import common  # noqa: E402
from common import count, environment, write_json  # noqa: E402

import effmem  # noqa: E402

WARM, RECORDED = 3, 2


def kernel_times(name, base, args, device):
    """{kernel name: device microseconds per step} for row `name`."""
    model = copy.deepcopy(base).train()
    opt = effmem.FusedAdam(model.parameters(), lr=1e-4)
    fwd, undo = setup(name, model, args, SacCaches())
    x = progressions(args.batch, args.seq, 0, base.config.vocab_size).to(device)

    def step():
        fwd(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(WARM):
        step()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        torch.cuda.synchronize()
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(RECORDED):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    undo()
    times = Counter()
    for ev in prof.events():
        # device events are the kernels and copies; on the CPU, the aten ops at the top of the stack
        on_device = ev.device_type == torch.autograd.DeviceType.CUDA
        if on_device and getattr(ev, "is_user_annotation", False):
            continue  # a range such as Optimizer.step#FusedAdam.step spans kernels counted already
        if on_device or (device.type == "cpu" and ev.cpu_parent is None):
            us = ev.time_range.elapsed_us() if on_device else ev.cpu_time_total
            times[ev.name[:90]] += us / RECORDED
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_device(ap)
    ap.add_argument("--rows", default="plain,effmem_fast,effmem_min")
    ap.add_argument("--layers", type=count)
    ap.add_argument("--batch", type=count)
    ap.add_argument("--seq", type=count)
    ap.add_argument("--top", type=count, default=15)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    common.check_device(ap, args.device)
    unknown = sorted(set(args.rows.split(",")) - set(ROWS))
    if unknown:   # setup() leaves a model it does not know as it is: a typo would be profiled as plain
        ap.error(f"--rows: unknown {unknown}; expected some of {ROWS}")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.batch = args.batch or (8 if cuda else 2)
    args.seq = args.seq or (2048 if cuda else 64)
    args.compile_backend = "inductor"
    from transformers import LlamaConfig, LlamaForCausalLM
    shape = dict(GPU_MODEL if cuda else CPU_MODEL)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    torch.manual_seed(0)
    with torch.device(device):   # built where it runs: TinyLlama's random init takes tens of seconds on the host
        base = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=args.seq))
    base = base.to(device, torch.bfloat16 if cuda else torch.float32)
    rows = {}
    for name in args.rows.split(","):
        rows[name] = kernel_times(name, base, args, device)
        total = sum(rows[name].values())
        print(f"\n== {name}: {total / 1e3:.1f} ms of {'kernels' if cuda else 'top-level ops'} per step")
        for k, us in rows[name].most_common(args.top):
            print(f"  {us / 1e3:8.2f} ms  {k}")
    first = next(iter(rows))
    for name in list(rows)[1:]:
        diff = Counter({k: rows[name][k] - rows[first].get(k, 0.0) for k in set(rows[name]) | set(rows[first])})
        print(f"\n== {name} minus {first}: {sum(diff.values()) / 1e3:+.1f} ms; the largest differences")
        for k, us in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:args.top]:
            print(f"  {us / 1e3:+8.2f} ms  {k}")
    if args.json:
        write_json(args.json, {"benchmark": "profile_activations", "env": environment(device),
                               "config": {"shape": shape, "batch": args.batch, "seq": args.seq,
                                          "recorded_steps": RECORDED},
                               "rows": {n: dict(r.most_common()) for n, r in rows.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
