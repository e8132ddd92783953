"""Capacity: for each model size, the fastest configuration that trains on this GPU, and the anchors.

    python bench/bench_capacity.py [--sizes 7b,13b,3b,1.3b] [--batch 32] [--seq 2048] [--steps 3]
                                   [--per-size 4] [--timeout 240] [--json PATH]
    python bench/bench_capacity.py --smoke     # a tiny model on the CPU: the loop, no targets (tests run it)

Issue 12, item 5. For each size (Llama-shaped transformers LlamaForCausalLM, random init, no download)
and a fixed global batch (default 32 x 2048 tokens per optimizer step), effmem.plan lists every
configuration it knows (micro-batch and accumulation, activation checkpointing and effmem's activation
policies, the fused loss, FusedAdam or OffloadAdam and its modes, Adam's moments in float32 or 8 bits)
with a predicted peak and step. Measuring all of them would take hours, so this measures, each in a
fresh process (an out-of-memory try cannot poison the next), these roles:

  pick             the plan's pick: the fastest predicted configuration that fits
  exact            the fastest predicted with full AdamW math: float32 moments, no stale gradients
  adam8            the fastest predicted with state_bits=8 (what lets 13B fit 128 GiB of host memory)
  fused_adam       anchor: FusedAdam on the GPU (bf16 weights, fp32 master and moments)
  torch_adamw_amp  anchor: torch.optim.AdamW(fused=True) over fp32 weights under bf16 autocast
                   (both anchors with torch's own means for the rest: no checkpointing or HF's
                   checkpointing, the standard loss; their fastest predicted micro-batch)
  runner_up        the fastest predicted whose activation strategy or optimizer differs from the pick's
  grads_on_gpu     the fastest predicted with OffloadAdam's device_accumulation: gradients summed on the GPU
                   over the micro-batches and sent once per step (compare its PCIe bytes per param per
                   step with the others')

(one run may fill several roles; at most --per-size runs per size, in that order). Each run trains
with clipping by global norm (1.0), the usual recipe: warm-up steps, then `steps` timed steps.

Per run: tokens/s (median step), MFU (6 x parameters x tokens/s over the GPU's dense bf16 peak:
model FLOPs, so recomputation is not counted as useful work), the GPU peak
(torch.cuda.max_memory_allocated over the run), host memory (the worker's peak resident set, and
OffloadAdam's own pinned and pageable bytes), the final loss, and the plan's predictions beside them.
Sizes run in the order given (default: the targets' sizes first). Host memory is part of the plan: a
configuration that needs more than 90% of it is not predicted to fit and is not run. The JSON is
written after every run, so a run cut off by the device's time limit keeps what it measured.

A --gpu-memory smaller than the GPU's caps each run's allocator there
(torch.cuda.set_per_process_memory_fraction), so that an H200 measures what fits an H100.

Targets on one H100 80 GB (MET / NOT MET at the end): 7B full-parameter AdamW (fp32 master and
moments, exact math) at MFU >= 0.35; 13B trains with state_bits=8 on a host with 128 GiB; and, per
size, the plan's pick measured within 10% of the fastest measured configuration. The 7B target
reads n/a when the runs were held to more than an H100's 80 GB (--gpu-memory), the 13B one when the
plan was given more than 128 GiB of host memory (--host-memory): they answer for those machines only.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for common.py

import torch

import common
import llama

LR = 1e-4
CLIP = 1.0
SIZES = {
    # The shapes of bench/llama.py (1.3b, 3b) and the Llama 2 presets (7b, 13b), as transformers configs.
    "1.3b": llama.SIZES["1.3b"].hf_config(),
    "3b": llama.SIZES["3b"].hf_config(),
    "7b": "llama-7b",
    "13b": "llama-13b",
}
SMOKE_SIZES = {"tiny": common.TINY_LLAMA}
ROLES = ("pick", "exact", "adam8", "fused_adam", "torch_adamw_amp", "runner_up", "grads_on_gpu")
MFU_TARGET = 0.35
H100_80GB = 85017362432   # an H100 80GB HBM3's total_memory, as torch reports it (bench/gpu_check.sh)
HOST_128GIB = 128 << 30


def is_exact(cfg) -> bool:
    """AdamW's own math: float32 moments (state_bits=8 rounds them) and no stale gradients (the plan offers
    no delayed mode, and overlap keeps the math)."""
    return cfg.state_bits == 32


def choose(plan, per_size: int):
    """[(candidate name, [roles], anchor)] to measure, in ROLES order, at most per_size of them."""
    fits = [c for c in plan.candidates if c.fits]  # fastest predicted first
    if not fits:
        return []
    pick = fits[0].config

    def first(pred):
        return next((c for c in fits if pred(c.config)), None)
    def alone(k, precision):
        """An optimizer on the GPU with float32 moments and torch's own means for the rest."""
        return (k.optimizer == "gpu" and k.precision == precision and k.state_bits == 32 and k.loss == "standard"
                and k.activations in ("none", "checkpoint"))
    wanted = {
        "pick": fits[0],
        "exact": first(is_exact),
        "adam8": first(lambda k: k.state_bits == 8),
        "fused_adam": first(lambda k: alone(k, "bf16")),
        "torch_adamw_amp": first(lambda k: alone(k, "fp32")),
        "runner_up": first(lambda k: (k.activations, k.optimizer) != (pick.activations, pick.optimizer)),
        "grads_on_gpu": first(lambda k: k.device_accumulation > 0),
    }
    out = []
    for role in ROLES:
        c = wanted[role]
        if c is None:
            continue
        anchor = "torch_adamw" if role == "torch_adamw_amp" else None
        same = next((o for o in out if o[0] == c.name and o[2] == anchor), None)
        if same is not None:
            same[1].append(role)
        elif len(out) < per_size:
            out.append((c.name, [role], anchor))
    return out


def cap_gpu_memory(device: torch.device, gpu_memory) -> None:
    """Hold this process to --gpu-memory where the GPU has more, so that a larger card (an H200's 141 GB)
    answers for a smaller one (an H100's 80 GB) with real out-of-memory errors: the plan is told the same
    size. The CUDA context lies outside the allocator's fraction, as it lies inside the smaller card's
    total, so it is taken off (the plan's own figure for it)."""
    from effmem.plan.costs import CUDA_CONTEXT
    from effmem.plan.machine import parse_bytes
    total = torch.cuda.get_device_properties(device).total_memory
    want = parse_bytes(gpu_memory, "--gpu-memory")
    if want is not None and want < total:
        torch.cuda.set_per_process_memory_fraction(max(want - CUDA_CONTEXT, 0) / total, device)


def plan_for(size_model, args):
    import effmem
    return effmem.plan(size_model, batch=args.batch, seq=args.seq, device=args.device,
                       gpu_memory=args.gpu_memory, host_memory=args.host_memory)


def worker(args) -> None:
    """One run in this process: plan, build the model in its dtype where it trains, apply the candidate,
    train, print one EFFMEM_CAPACITY line of JSON."""
    from effmem import OffloadAdam
    from effmem.demo_measure import rss_now_and_peak
    from effmem.plan.apply import micro_batch
    from effmem.plan.verify import model_for
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        cap_gpu_memory(device, args.gpu_memory)
    sizes = SMOKE_SIZES if args.smoke else SIZES
    plan = plan_for(sizes[args.size], args)
    cand = plan.candidate(args.candidate)
    cfg = cand.config
    result = {}
    try:
        t_build = time.perf_counter()
        model = model_for(plan, torch.bfloat16 if cfg.precision == "bf16" else torch.float32)
        model, opt = plan.apply(model, args.candidate, lr=LR, weight_decay=0.1)
        params = [p for p in model.parameters() if p.requires_grad]
        if args.anchor == "torch_adamw":
            del opt  # FusedAdam allocates its state at the first step: nothing to free yet
            opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1, fused=cuda)
        result["setup_s"] = time.perf_counter() - t_build
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "fp32" and cuda)
        vocab = plan.spec.config["vocab_size"]
        g = torch.Generator(device=device).manual_seed(0)
        data = [torch.randint(0, vocab, (cfg.micro_batch, args.seq), device=device, generator=g) for _ in range(2)]
        times, losses = [], []
        for step in range(args.warmup + args.steps):
            common.sync(device)
            t0 = time.perf_counter()
            total = 0.0
            for j in range(cfg.accumulation):
                x = data[(step * cfg.accumulation + j) % 2]
                with micro_batch(opt, j, cfg.accumulation):
                    with autocast:
                        loss = model(input_ids=x, labels=x).loss
                    (loss / cfg.accumulation).backward()
                total += loss.detach()
            if hasattr(opt, "clip_grad_norm_"):
                opt.clip_grad_norm_(CLIP)
            else:
                torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            common.sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(float(total) / cfg.accumulation)
        timed = times[args.warmup:]
        tokens = args.batch * args.seq
        tps = tokens / statistics.median(timed)
        peak = common.peak_bf16_flops(device)
        result.update(status="ok", step_s=timed, warmup_step_s=times[:args.warmup], tokens_per_step=tokens,
                      tokens_per_s=tps, mfu=tps * 6 * plan.params / peak if peak else None, losses=losses,
                      gpu_peak_bytes=torch.cuda.max_memory_allocated(device) if cuda else None)
        if isinstance(opt, OffloadAdam):
            opt.flush()  # async and delay modes: the last step's uploads, counted below
            c = opt.counters()
            result.update(engine_pinned_bytes=c["engine_pinned_bytes"], engine_pageable_bytes=c["engine_pageable_bytes"],
                          pcie_bytes_per_param_per_step=(c["bytes_down"] + c["bytes_up"]) / (
                              len(times) * plan.trainable_params))
            opt.close()
    except torch.OutOfMemoryError as e:
        result.update(status="out of memory", error=str(e).splitlines()[0])
    except RuntimeError as e:
        result.update(status="failed", error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    result["host_peak_rss_bytes"] = rss_now_and_peak()[1]  # VmHWM: host memory touched, pinned included
    print("EFFMEM_CAPACITY " + json.dumps(result), flush=True)


def run_one(args, size, name, anchor):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--size", size, "--candidate", name,
           "--device", args.device, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--gpu-memory", str(args.gpu_memory), "--host-memory", str(args.host_memory)]
    if anchor:
        cmd += ["--anchor", anchor]
    if args.smoke:
        cmd.append("--smoke")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        result = next((json.loads(line[len("EFFMEM_CAPACITY "):]) for line in proc.stdout.splitlines()
                       if line.startswith("EFFMEM_CAPACITY ")), None)
        if result is None:  # killed (host out of memory) or crashed before reporting
            result = {"status": f"process exited with {proc.returncode}", "error": proc.stderr[-2000:]}
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        result = {"status": f"timed out after {args.timeout} s", "error": err[-2000:]}
    result["wall_s"] = time.perf_counter() - t0
    return result


def targets(rows, smoke: bool, gpu_memory, host_memory):
    """MET / NOT MET / None (n/a, with a "why") of each target. gpu_memory and host_memory: the limits the runs
    were held to (--gpu-memory, --host-memory); the 7B target is judged only on an H100's 80 GB or less, the 13B
    one only in 128 GiB of host memory or less (a larger card or host answers a question nobody asked)."""
    from effmem.plan.machine import parse_bytes
    ok = [r for r in rows if r["status"] == "ok"]
    out = []
    if smoke:
        return out
    gpu, host = parse_bytes(gpu_memory, "gpu_memory"), parse_bytes(host_memory, "host_memory")
    exact7 = [r for r in ok if r["size"] == "7b" and r["exact"] and r.get("mfu") is not None]
    best = max((r["mfu"] for r in exact7), default=None)
    # None only where 7B was not asked for: an exact run that ran out of memory or failed, or none chosen (the
    # plan found none that fits, or only 8-bit ones), does not meet the target
    tried7 = any(r["size"] == "7b" for r in rows)
    mfu = {"target": f"7B full-parameter AdamW (fp32 master and moments, exact) at MFU >= {MFU_TARGET} on one "
                     "80 GB GPU", "value": best,
           "met": (False if tried7 else None) if best is None else best >= MFU_TARGET}
    if tried7 and (gpu is None or gpu > H100_80GB):
        mfu.update(met=None, why=f"the runs were held to {gpu_memory} of GPU memory, not an H100's 80 GB "
                                 "(pass --gpu-memory 80GB)")
    out.append(mfu)
    ran13 = [r for r in ok if r["size"] == "13b" and r["state_bits"] == 8]
    fits13 = [r for r in ran13 if host is not None and r["host_peak_rss_bytes"] <= host]
    # 13B asked for: NOT MET when no 8-bit run was chosen (the plan found none that fits) or none finished
    tried13 = any(r["size"] == "13b" for r in rows)
    big = {"target": f"13B trains with state_bits=8 in {HOST_128GIB >> 30} GiB of host memory",
           "value": next((r["tokens_per_s"] for r in fits13), None), "met": bool(fits13) if tried13 else None}
    if tried13 and (host is None or host > HOST_128GIB):
        big.update(met=None, why=f"the plan was given {host_memory} of host memory, more than "
                                 f"{HOST_128GIB >> 30} GiB (pass --host-memory 128GiB)")
    out.append(big)
    for size in dict.fromkeys(r["size"] for r in rows):
        here = [r for r in ok if r["size"] == size]
        pick = next((r for r in here if "pick" in r["roles"]), None)
        fastest = max((r["tokens_per_s"] for r in here), default=None)
        ratio = pick["tokens_per_s"] / fastest if pick and fastest else None
        pick_failed = any(r["size"] == size and "pick" in r["roles"] and r["status"] != "ok" for r in rows)
        out.append({"target": f"{size}: the plan's pick within 10% of the fastest measured", "value": ratio,
                    "met": (False if pick_failed else None) if ratio is None else ratio >= 1 / 1.10})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--sizes", default=None, help="comma-separated, run in this order (default 7b,13b,3b,1.3b)")
    ap.add_argument("--batch", type=common.count, default=None, help="sequences per optimizer step (default 32)")
    ap.add_argument("--seq", type=common.count, default=None, help="tokens per sequence (default 2048)")
    ap.add_argument("--steps", type=common.count, default=3, help="timed steps per run")
    ap.add_argument("--warmup", type=common.non_negative, default=2,
                    help="untimed steps first (the first allocates state)")
    ap.add_argument("--per-size", type=common.count, default=4, help="runs per size at most")
    ap.add_argument("--timeout", type=common.count, default=240, help="seconds allowed to each run")
    ap.add_argument("--gpu-memory", default=None, help="as effmem plan's (default: this GPU's); less than this "
                    "GPU's holds each run to it")
    ap.add_argument("--host-memory", default=None, help="as effmem plan's (default: this machine's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: runs the loop, no targets")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--candidate", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--anchor", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from effmem.plan.machine import parse_bytes
    for flag in ("gpu_memory", "host_memory"):   # a size refused by its flag now, not in a traceback later
        if getattr(args, flag) is not None:
            try:
                parse_bytes(getattr(args, flag), "--" + flag.replace("_", "-"))
            except ValueError as e:
                ap.error(str(e))
    if args.smoke:
        defaults = dict(device="cpu", sizes="tiny", batch=4, seq=64)
    else:
        defaults = dict(device="cuda", sizes="7b,13b,3b,1.3b", batch=32, seq=2048)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_capacity: needs a CUDA GPU (or --smoke)")
        return 2
    if args.worker:
        worker(args)
        return 0
    from effmem.plan.machine import machine
    here = machine()
    # The plan's memory figures, fixed here and passed to every worker so that they plan the same.
    args.gpu_memory = args.gpu_memory or here["gpu_memory"] or here["host_memory"]
    args.host_memory = args.host_memory or here["host_memory"]
    env = common.environment(args.device)
    print(f"{env['device_name']} ({args.device}), torch {env['torch_version']}, commit {env['git_commit'][:12]}; "
          f"batch {args.batch} x {args.seq} tokens per step")
    sizes = SMOKE_SIZES if args.smoke else SIZES
    rows, plans = [], {}

    def save(partial=True):
        if args.json:
            common.write_json(args.json, {"benchmark": "capacity", "env": env, "config": vars(args), "plans": plans,
                                          "rows": rows, "partial": partial,
                                          "targets": targets(rows, args.smoke, args.gpu_memory, args.host_memory)})

    unknown = [size for size in args.sizes.split(",") if size not in sizes]
    if unknown:   # before any run: a GPU run of minutes was lost to a typo in the last size
        raise SystemExit(f"--sizes: unknown size {unknown[0]!r} (expected some of {', '.join(sizes)})")
    for size in args.sizes.split(","):
        plan = plan_for(sizes[size], args)
        chosen = choose(plan, args.per_size)
        plans[size] = {"params": plan.params, "best": plan.best, "measured": [c[0] for c in chosen],
                       "fitting": sum(c.fits for c in plan.candidates), "candidates": len(plan.candidates)}
        print(f"\n{size}: {plan.params / 1e9:.2f}B params; {plans[size]['fitting']} of "
              f"{len(plan.candidates)} candidates predicted to fit; measuring {len(chosen)}", flush=True)
        save()   # the plans at least, for a part whose first run its time limit cuts off
        if not chosen:
            rows.append({"size": size, "candidate": None, "roles": [], "status": "nothing predicted to fit",
                         "exact": False, "state_bits": None})
        for name, roles, anchor in chosen:
            c = plan.candidate(name)
            row = {"size": size, "params": plan.params, "candidate": name, "roles": roles, "anchor": anchor,
                   "exact": is_exact(c.config), "state_bits": c.config.state_bits,
                   "optimizer": "torch AdamW (fused)" if anchor else c.config.optimizer,
                   "predicted_peak_bytes": c.cost.peak_bytes, "predicted_allocated_bytes": c.cost.allocated_bytes,
                   "predicted_host_bytes": c.cost.host_bytes, "predicted_step_s": c.step_time_s}
            row.update(run_one(args, size, name, anchor))
            rows.append(row)
            save()
            if row["status"] == "ok":
                print(f"  {'/'.join(roles):<28} {name:<48} {row['tokens_per_s']:>9,.0f} tok/s"
                      + (f"  MFU {row['mfu']:.3f}" if row.get("mfu") is not None else "")
                      + (f"  GPU peak {row['gpu_peak_bytes'] / 1e9:.1f} GB" if row.get("gpu_peak_bytes") else "")
                      + f"  host {row['host_peak_rss_bytes'] / 1e9:.1f} GB  (predicted step "
                      f"{row['predicted_step_s']:.2f} s, measured {statistics.median(row['step_s']):.2f} s)",
                      flush=True)
            else:
                print(f"  {'/'.join(roles):<28} {name:<48} {row['status']}: {row.get('error', '')[:200]}", flush=True)
    save(partial=False)
    print()
    for t in targets(rows, args.smoke, args.gpu_memory, args.host_memory):
        value = "n/a" if t["value"] is None else f"{t['value']:.3g}"
        why = f": {t['why']}" if "why" in t else ""
        print(f"{'n/a' if t['met'] is None else 'MET' if t['met'] else 'NOT MET'}: {t['target']} ({value}){why}")
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
