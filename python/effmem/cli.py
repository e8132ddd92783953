"""The ``effmem`` command: ``effmem info``, ``effmem demo`` and ``effmem plan`` (effmem/plan/cli.py).

``effmem demo`` trains the same small byte-level GPT once per optimizer
configuration (``DEMO_CONFIGS``), each in a fresh Python process, so that
every configuration's peak memory is its own and not the high-water mark
of the ones before it.
"""
import argparse
import functools
import json
import math
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional

import torch

import effmem
from effmem import demo_model
from effmem._args import positive_int
from effmem.compress import compress_activations
from effmem.demo_measure import ProgressBar, mib, rss_now_and_peak
from effmem.info import collect_info, cpu_name, format_info, git_commit
from effmem.optim.offload_adam import CORRECTION_WARMUP
from effmem.plan import cli as plan_cli
from effmem.plan.demo import compare, demo_plan

def cmd_info(args) -> int:
    info = collect_info()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


# ---------------------------------------------------------------------------
# effmem demo: the configurations compared


@dataclass(frozen=True)
class DemoConfig:
    """One row of the demo's table. Add an entry to DEMO_CONFIGS to compare another setup."""
    name: str
    param_dtype: torch.dtype
    # (param groups, hyperparameters, state_bits=...) -> optimizer; groups carry their own weight_decay, and
    # every factory takes state_bits (train_one passes this config's).
    make_optimizer: Callable[..., torch.optim.Optimizer]
    # (optimizer, parameters, max_norm) -> total norm; clips by the global norm.
    clip_grad: Callable[[torch.optim.Optimizer, Iterable[torch.Tensor], float], torch.Tensor]
    # fp32 models run under bf16 autocast on a GPU (the usual mixed-precision
    # recipe); a model already in bf16 needs none.
    autocast_on_gpu: bool = False
    # Quantise the activations saved for backward to this many bits
    # (effmem.compress.compress_activations); None keeps them as they are.
    compress_bits: Optional[int] = None
    # OffloadAdam(async_step=True): its forward pre-hooks install the new weights (opt.attach(model)).
    attach: bool = False
    # Adam's moments: 32 (float32) or 8 (effmem's optimizers' state_bits=8); the plan predicts by it too.
    state_bits: int = 32


def _torch_adamw(groups, hp, state_bits=32):
    if state_bits != 32:
        raise ValueError("torch's AdamW keeps float32 moments only (state_bits=32)")
    return torch.optim.AdamW(groups, lr=hp["lr"], betas=hp["betas"], eps=hp["eps"])


def _fused_adam(groups, hp, state_bits=32):
    return effmem.FusedAdam(groups, lr=hp["lr"], betas=hp["betas"], eps=hp["eps"], state_bits=state_bits)


def _offload_adam(groups, hp, state_bits=32, **mode):
    return effmem.OffloadAdam(groups, lr=hp["lr"], betas=hp["betas"], eps=hp["eps"], state_bits=state_bits, **mode)


_offload_adam_async = functools.partial(_offload_adam, async_step=True)
_offload_adam_delay = functools.partial(_offload_adam, delay=True)
_offload_adam_corrected = functools.partial(_offload_adam, delay=True, delay_correction=True)


def _torch_clip(opt, params, max_norm):
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def _optimizer_clip(opt, params, max_norm):
    # effmem's optimizers apply the clip factor inside their next step's kernel
    # (no pass over the gradients); OffloadAdam computes the norm on the host,
    # where its gradients are after backward.
    return opt.clip_grad_norm_(max_norm)


DEMO_CONFIGS: List[DemoConfig] = [
    DemoConfig("torch AdamW (fp32)", torch.float32, _torch_adamw, _torch_clip, True),
    DemoConfig("FusedAdam (fp32)", torch.float32, _fused_adam, _optimizer_clip, True),
    DemoConfig("FusedAdam (bf16 + fp32 master)", torch.bfloat16, _fused_adam, _optimizer_clip),
    DemoConfig("FusedAdam (bf16 + fp32 master), 8-bit activations", torch.bfloat16, _fused_adam,
               _optimizer_clip, compress_bits=8),
    DemoConfig("FusedAdam (bf16 + fp32 master), 8-bit moments", torch.bfloat16, _fused_adam, _optimizer_clip,
               state_bits=8),
    DemoConfig("OffloadAdam (bf16, master + moments on the host)", torch.bfloat16, _offload_adam,
               _optimizer_clip),
    DemoConfig("OffloadAdam async_step (exact, update behind the next forward)", torch.bfloat16,
               _offload_adam_async, _optimizer_clip, attach=True),
    DemoConfig("OffloadAdam delay (one-step-stale gradients)", torch.bfloat16, _offload_adam_delay,
               _optimizer_clip),
    DemoConfig("OffloadAdam delay + delay_correction (predicted weights)", torch.bfloat16,
               _offload_adam_corrected, _optimizer_clip),
]
# Their loss curves are printed side by side (FusedAdam bf16 is the exact reference for the others).
CURVE_CONFIGS = ("FusedAdam (bf16 + fp32 master)", "OffloadAdam (bf16, master + moments on the host)",
                 "OffloadAdam async_step (exact, update behind the next forward)",
                 "OffloadAdam delay (one-step-stale gradients)",
                 "OffloadAdam delay + delay_correction (predicted weights)")
CURVE_POINTS = 8

# Sized so that all nine CPU runs finish in under three minutes on two cores (151 s measured, 2026-12-01).
CPU_DEFAULTS = dict(steps=200, layers=4, d_model=128, seq_len=64, batch_size=12)
GPU_DEFAULTS = dict(steps=600, layers=6, d_model=384, seq_len=256, batch_size=32)
HYPERPARAMETERS = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
WARMUP_STEPS = 5    # steps left out of the tokens/s median (allocator and kernel warm-up)
LOSS_WINDOW = 20    # the reported training loss is the mean over this many final steps
VAL_BATCHES = 8
RESULT_MARKER = "EFFMEM_DEMO_RESULT "


def lr_lambda(total_steps: int):
    """Linear warmup over 10% of the steps, then cosine decay to 10% of the peak."""
    warmup = max(1, total_steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def _config_by_name(name: str) -> DemoConfig:
    for cfg in DEMO_CONFIGS:
        if cfg.name == name:
            return cfg
    raise KeyError(f"unknown demo configuration {name!r}")


def train_one(cfg: DemoConfig, s: dict) -> dict:
    """Train one configuration in this process and measure it. s: the demo settings."""
    device = torch.device(s["device"])
    hp = HYPERPARAMETERS
    if device.type == "cuda":
        if device.index is None:  # pin "cuda" to one index so the memory statistics name one GPU
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    train, val = demo_model.split_corpus(demo_model.stdlib_corpus())

    # Initialise in fp32 under the shared seed, then cast: every configuration
    # starts from the same weights (rounded, for the bf16 one).
    torch.manual_seed(s["seed"])
    gcfg = demo_model.GPTConfig(seq_len=s["seq_len"], n_layer=s["layers"], d_model=s["d_model"], n_head=s["heads"])
    model = demo_model.ByteGPT(gcfg).to(device=device, dtype=cfg.param_dtype)
    if cfg.compress_bits is not None:
        # Hooks only: same parameters, same state_dict; model.compress_stats
        # then describes the latest training forward.
        model = compress_activations(model, bits=cfg.compress_bits)
    opt = cfg.make_optimizer(demo_model.decay_groups(model, hp["weight_decay"]), hp, state_bits=cfg.state_bits)
    if cfg.attach:
        opt.attach(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(s["steps"]))
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16)
                if device.type == "cuda" and cfg.autocast_on_gpu else nullcontext())
    data_gen = torch.Generator().manual_seed(s["seed"])  # same batches for every configuration
    # What the process holds before training (runtime, corpus, weights), so
    # the table can show how much training itself added on top.
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start_bytes = torch.cuda.memory_allocated(device)
    else:
        start_bytes = rss_now_and_peak()[0]

    losses, rates = [], []
    bar = ProgressBar(cfg.name, s["steps"])
    tokens_per_step = s["batch_size"] * s["seq_len"]
    model.train()
    for step in range(1, s["steps"] + 1):
        t0 = time.perf_counter()
        x, y = demo_model.sample_batch(train, s["batch_size"], s["seq_len"], data_gen)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # Gradients are cleared before, not after, each step so the last
        # step's gradients still exist when model-state memory is measured.
        opt.zero_grad(set_to_none=True)
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        cfg.clip_grad(opt, model.parameters(), hp["max_grad_norm"])
        opt.step()
        sched.step()
        losses.append(loss.item())  # also waits for the GPU, so the timing below is real
        rates.append(tokens_per_step / (time.perf_counter() - t0))
        bar.update(step, losses[-1], rates[-1])
    bar.close()
    if hasattr(opt, "flush"):
        opt.flush()  # OffloadAdam: the last update's weights are in the parameters before they are read
    compress = model.compress_stats if cfg.compress_bits is not None else None

    if device.type == "cuda":
        peak, peak_kind = torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    else:
        _, peak, peak_kind = rss_now_and_peak()
    params = list(model.parameters())  # tied weights are listed once
    param_bytes = sum(p.nbytes for p in params)
    grad_bytes = sum(p.grad.nbytes for p in params if p.grad is not None)
    state_tensors = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    state_bytes = sum(v.nbytes for v in state_tensors)
    # OffloadAdam keeps its state on the host: the device holds none of it.
    state_elsewhere = sorted({str(v.device) for v in state_tensors if v.device.type != device.type})
    engine = opt.counters() if hasattr(opt, "counters") else None

    model.eval()
    val_gen = torch.Generator().manual_seed(s["seed"] + 1)
    val_losses = []
    with torch.no_grad(), autocast:
        for _ in range(VAL_BATCHES):
            x, y = demo_model.sample_batch(val, s["batch_size"], s["seq_len"], val_gen)
            val_losses.append(model(x.to(device), y.to(device))[1].item())

    timed = rates[WARMUP_STEPS:] if len(rates) > 2 * WARMUP_STEPS else rates[len(rates) // 2:]
    return {
        "name": cfg.name,
        "param_dtype": str(cfg.param_dtype).replace("torch.", ""),
        "optimizer": type(opt).__name__,
        "params": sum(p.numel() for p in params),
        "param_tensors": len(params),
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_state_bytes": state_bytes,
        "optimizer_state_elsewhere": state_elsewhere,
        "offload_counters": engine,
        "model_state_bytes": param_bytes + grad_bytes + state_bytes,
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        "start_memory_bytes": start_bytes,
        "peak_above_start_bytes": None if start_bytes is None else peak - start_bytes,
        "tokens_per_s": statistics.median(timed),
        "first_loss": losses[0],
        "losses": losses,
        "train_loss": statistics.fmean(losses[-LOSS_WINDOW:]),
        "val_loss": statistics.fmean(val_losses),
        # Bytes saved for backward by the last training step, before and after compression.
        "activation_bytes_before": compress.total_bytes_before if compress else None,
        "activation_bytes_after": compress.total_bytes_after if compress else None,
        "compress_stats": compress.as_dict() if compress else None,
        "compress_table": compress.format(max_modules=4) if compress else None,
    }


def demo_worker(spec_json: str) -> int:
    """Entry of the per-configuration process: train, then print the result on stdout."""
    spec = json.loads(spec_json)
    result = train_one(_config_by_name(spec.pop("config")), spec)
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------
# effmem demo: the driver


def format_table(runs: List[dict]) -> str:
    on_cpu = runs[0]["peak_memory_kind"].startswith("process peak RSS")
    peak_label = "peak RSS (process)" if on_cpu else "peak CUDA alloc"
    # (header, formatter): a new column is one more entry here.
    columns = [
        ("configuration", lambda r: r["name"]),
        ("params", lambda r: f"{r['params']:,}"),
        ("optimizer state", lambda r: mib(r["optimizer_state_bytes"]) + "".join(
            f" on {d}" for d in r.get("optimizer_state_elsewhere") or [])),
        ("model state", lambda r: mib(r["model_state_bytes"])),
        (peak_label, lambda r: mib(r["peak_memory_bytes"])),
        ("peak above start", lambda r: "n/a" if r["peak_above_start_bytes"] is None
         else mib(r["peak_above_start_bytes"])),
        ("saved activations", lambda r: "-" if r.get("activation_bytes_before") is None else
         f"{mib(r['activation_bytes_before'])} -> {mib(r['activation_bytes_after'])}"),
        ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
        ("train loss", lambda r: f"{r['train_loss']:.3f}"),
        ("val loss", lambda r: f"{r['val_loss']:.3f}"),
    ]
    cells = [[h for h, _ in columns]] + [[fmt(r) for _, fmt in columns] for r in runs]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    # First column left-aligned (names), numbers right-aligned.
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def loss_curves(runs: List[dict]) -> str:
    """The training loss of FusedAdam and OffloadAdam's modes, mean over each eighth of the run."""
    picked = [r for r in runs if r["name"] in CURVE_CONFIGS]
    steps = len(picked[0]["losses"]) if picked else 0
    if steps < CURVE_POINTS:
        return "loss curves: too few steps to draw"
    edges = [round(i * steps / CURVE_POINTS) for i in range(CURVE_POINTS + 1)]
    head = [f"{b}" for b in edges[1:]]
    lines = ["loss curves (training loss, mean over each eighth of the steps; delay applies each step's "
             "gradient one step late, delay_correction takes it at weights predicted a step ahead after "
             f"{CORRECTION_WARMUP} exact steps (its default warm-up), the others are exact):",
             "  " + "steps up to".ljust(64) + "".join(h.rjust(8) for h in head)]
    for r in picked:
        means = [statistics.fmean(r["losses"][a:b]) for a, b in zip(edges, edges[1:])]
        lines.append("  " + r["name"].ljust(64) + "".join(f"{m:8.3f}" for m in means))
    return "\n".join(lines)


def _default_heads(d_model: int) -> int:
    heads = max(1, d_model // 32)  # head size 32 where it divides evenly
    while d_model % heads:
        heads -= 1
    return heads


def resolve_demo_settings(args, parser) -> dict:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None  # torch's own message lists every backend it knows; only two are supported here
    if dev is None or dev.type not in ("cpu", "cuda"):
        parser.error(f"--device: expected cpu or cuda[:N], got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA GPU is visible to torch (torch.cuda.is_available() is False)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            parser.error(f"--device {device}: only {torch.cuda.device_count()} GPU(s) visible")
    defaults = GPU_DEFAULTS if dev.type == "cuda" else CPU_DEFAULTS
    s = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    s["heads"] = args.heads if args.heads is not None else _default_heads(s["d_model"])
    if s["d_model"] % s["heads"]:
        parser.error(f"--d-model {s['d_model']} is not divisible by --heads {s['heads']}")
    if not 0 <= args.seed < 2 ** 63 - 1:   # torch's generators take 64 bits; the held-out data uses seed + 1
        parser.error(f"--seed: expected an int in [0, 2**63 - 1), got {args.seed}")
    s.update(device=device, seed=args.seed)
    if args.json is not None:
        from effmem.plan.chart import check_output
        try:
            check_output(args.json, "json")
        except ValueError as e:
            parser.error(f"--{e}")
    return s


def cmd_demo(args, parser) -> int:
    s = resolve_demo_settings(args, parser)
    print(f"effmem demo: byte-level GPT, {s['layers']} layers, d_model {s['d_model']}, {s['heads']} heads, "
          f"seq {s['seq_len']}, batch {s['batch_size']}, {s['steps']} steps on {s['device']}; "
          f"corpus: Python {sys.version.split()[0]} standard-library source", flush=True)
    plan_text, predictions = demo_plan(DEMO_CONFIGS, s)
    print("\n" + plan_text + "\n", flush=True)
    start = time.perf_counter()
    runs = []
    for cfg in DEMO_CONFIGS:
        # A fresh interpreter per configuration: peak memory (RSS in particular
        # never goes down) then belongs to that configuration alone.
        cmd = [sys.executable, "-m", "effmem.cli", "_demo_worker", json.dumps({"config": cfg.name, **s})]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # stderr (progress) passes through
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
        if proc.returncode != 0 or not lines:
            sys.stderr.write(proc.stdout)
            print(f"effmem demo: the run for {cfg.name!r} failed (exit code {proc.returncode})", file=sys.stderr)
            return 1
        runs.append(json.loads(lines[-1][len(RESULT_MARKER):]))
    wall = time.perf_counter() - start

    print()
    print(format_table(runs))
    print()
    print("optimizer state: all tensors in opt.state; model state: parameters + gradients + optimizer state.")
    if runs[0]["peak_memory_kind"].startswith("process peak RSS"):
        how = "VmHWM" if "VmHWM" in runs[0]["peak_memory_kind"] else "ru_maxrss"
        print(f"peak RSS: the worker process's peak resident memory ({how}), Python and torch runtime included; "
              "peak above start: minus its RSS just before training.")
    else:
        print("peak CUDA alloc: torch.cuda.max_memory_allocated over training, per worker process; "
              "peak above start: minus the allocation just before training.")
    print(f"train loss: mean of the last {LOSS_WINDOW} steps (first step: {runs[0]['first_loss']:.3f}); "
          f"tokens/s: median after {WARMUP_STEPS} warm-up steps. Total time {wall:.1f} s.")
    for r in runs:
        if r.get("compress_table"):
            print(f"\nsaved activations of the last training step, {r['name']} "
                  "(before -> after compression; parameters are saved by reference and not counted):")
            print(r["compress_table"])
    print("\n" + loss_curves(runs))
    print("\n" + compare(runs, predictions))
    if args.json:
        with open(args.json, "w") as f:
            # What a result is meaningless without: the build, the device (the CPU's name too), the commit
            # (git's where this is a checkout; the GPU machine's copy has none: gpu_check.sh passes it in)
            env = {**collect_info(), "cpu_name": cpu_name(),
                   **{"git_" + k: v for k, v in git_commit().items()}}
            json.dump({"env": env, "settings": s, "hyperparameters": HYPERPARAMETERS, "wall_s": wall, "runs": runs,
                       "plan_predictions": predictions}, f, indent=2)
    return 0


# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="effmem", description="effmem: memory-efficient training for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,demo,plan}")
    info = sub.add_parser("info", help="show how effmem was built and what it finds on this machine")
    info.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    demo = sub.add_parser("demo", help="train a small GPT with each optimizer configuration and compare memory",
                          description="Train a byte-level GPT on Python's standard-library source with "
                          "each optimizer configuration, each in its own process, and compare memory, "
                          "speed and loss. Defaults depend on the device (CPU: small and quick).")
    defaults = "default: %s on CPU, %s on GPU"
    for flag, key in [("--steps", "steps"), ("--layers", "layers"), ("--d-model", "d_model"),
                      ("--seq-len", "seq_len"), ("--batch-size", "batch_size")]:
        demo.add_argument(flag, type=positive_int, default=None,
                          help=defaults % (CPU_DEFAULTS[key], GPU_DEFAULTS[key]))
    demo.add_argument("--heads", type=positive_int, default=None,
                      help="attention heads (default: d_model // 32, at least 1, lowered until it divides d_model)")
    demo.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when a GPU is visible)")
    demo.add_argument("--seed", type=int, default=0, help="seed for weights and data order (default: 0)")
    demo.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH")
    demo.set_defaults(subparser=demo)  # errors found after parsing then show the demo's usage line
    plan_cli.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The per-configuration worker is internal, so it is kept out of --help.
    if argv[:1] == ["_demo_worker"] and len(argv) == 2:
        return demo_worker(argv[1])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "info":
        return cmd_info(args)
    if args.command == "plan":
        return plan_cli.cmd_plan(args)
    return cmd_demo(args, args.subparser)


if __name__ == "__main__":
    sys.exit(main())
