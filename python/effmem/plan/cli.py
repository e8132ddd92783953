"""``effmem plan MODEL``: the command's arguments and body (effmem/cli.py registers it)."""
import argparse
import json
import sys

from effmem.plan.hf_config import preset_names


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan", help="predict where training memory goes and pick the fastest configuration that fits",
        description="Predict each candidate configuration's peak memory (parts: weights, gradients, master, "
        "optimizer state, activations traced from the model on meta tensors, logits, temporaries, reserve) "
        "and step time, and pick the fastest that fits (the most exact of those within 3%). MODEL: a preset ("
        + ", ".join(preset_names()) +
        ") or a Hugging Face config.json (file or folder). Sizes: 80GB (1e9 bytes) or 80GiB (2^30).")
    p.add_argument("model", nargs="?", help="preset name or config.json path")
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step, all GPUs (default 8)")
    p.add_argument("--seq", type=int, default=None,
                   help="tokens per sequence (default 2048, or the model's learned positions if fewer)")
    p.add_argument("--accum", type=int, default=None, help="micro-batches per step (default: searched)")
    p.add_argument("--gpu-memory", default=None,
                   help="memory per GPU (default: this machine's GPU; an H100's 80GB where there is none)")
    p.add_argument("--host-memory", default=None, help="host memory (default: this machine's)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs (default: this machine's, at least 1)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="train on (default: cuda when there is a GPU or --gpu-memory or --gpus is given)")
    p.add_argument("--trainable", default=None, metavar="PATTERN",
                   help="comma-separated regular expressions of the parameters that train; "
                        "REGEX#a:b trains rows a..b-1 of a stacked parameter (experts)")
    p.add_argument("--no-clipping", action="store_true",
                   help="the recipe does not clip by global norm (allows OffloadAdam's overlap mode)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the plan as JSON ('-' for stdout)")
    p.add_argument("--chart", metavar="PATH", default=None, help="draw the parts per candidate (.svg or .png)")
    p.add_argument("--verify", nargs="?", const="best", choices=("best", "all"), default=None,
                   help="train a few steps of the pick (or of every candidate that fits) and compare")
    p.add_argument("--steps", type=int, default=3, help="steps per verified candidate (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them (default 1)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's rates first and keep them for later plans")
    p.set_defaults(subparser=p)
    return p


def cmd_plan(args) -> int:
    # effmem.plan is the function (effmem/__init__.py), so the package's parts are imported by path.
    from effmem.plan.planner import plan as make_plan
    from effmem.plan.rates import calibrate
    from effmem.plan.chart import check_output, check_path as check_chart_path, write_chart
    from effmem.plan.verify import format_verify, verify
    if args.calibrate:
        try:
            rates = calibrate()
        except OSError as e:
            args.subparser.error(f"--{e}")
        print(f"calibrated {rates.device}: {json.dumps(rates.as_dict())}", file=sys.stderr)
        if args.model is None:
            return 0
    if args.model is None:
        args.subparser.error("MODEL is required (a preset or a config.json path) unless --calibrate is given")
    # what can be refused before planning is refused before planning
    if args.steps < 1:
        args.subparser.error(f"--steps: expected an int >= 1, got {args.steps}")
    if args.warmup < 0:
        args.subparser.error(f"--warmup: expected an int >= 0, got {args.warmup}")
    try:
        if args.chart is not None:
            check_chart_path(args.chart)
        if args.json is not None and args.json != "-":
            check_output(args.json, "json")
    except ValueError as e:
        args.subparser.error(f"--{e}")
    try:
        plan = make_plan(args.model, batch=args.batch, seq=args.seq, accum=args.accum,
                             gpu_memory=args.gpu_memory, host_memory=args.host_memory, gpus=args.gpus,
                             trainable=args.trainable, device=args.device, clipping=not args.no_clipping)
    except (ValueError, TypeError, ImportError) as e:
        # effmem.plan names its Python argument (gpu_memory: ...): here the flag that gave it (--gpu-memory: ...)
        name, sep, rest = str(e).partition(":")
        flag = name in ("batch", "seq", "accum", "gpu_memory", "host_memory", "gpus", "trainable", "device")
        args.subparser.error(f"--{name.replace('_', '-')}:{rest}" if sep and flag else str(e))
    except (RuntimeError, IndexError) as e:   # the model's own forward refusing the trace's inputs
        from effmem.plan.trace import TraceFailed
        why = e if isinstance(e, TraceFailed) else f"{type(e).__name__}: {e}"
        args.subparser.error(f"tracing {args.model} at batch x seq = {args.batch} x {args.seq or 'default'} "
                             f"failed in the model's forward ({why}); a --seq within its positions, or a smaller "
                             "model of the same family, may trace")
    data = plan.as_dict()
    if plan.pick is not None:
        from effmem.plan.report import plan_code
        data["code"] = plan_code(plan, plan.pick)
    if args.verify:
        names = [c.name for c in plan.candidates if c.fits] if args.verify == "all" else None
        try:
            data["verify"] = verify(plan, candidates=names, steps=args.steps, warmup=args.warmup)
        except (ValueError, RuntimeError) as e:   # a sharded or partly frozen pick, a GPU this machine lacks
            args.subparser.error(f"--verify: {e}")
    if args.json == "-":
        print(json.dumps(data, indent=1))
    else:
        print(plan)
        if args.verify:
            print("\n" + (format_verify(data["verify"]) if data["verify"] else "verify: nothing fits, so nothing ran"))
    try:   # checked before planning, but a full disk or a path that vanished fails only now
        if args.json and args.json != "-":
            with open(args.json, "w") as f:
                json.dump(data, f, indent=1)
        if args.chart:
            print(f"chart: {write_chart(plan, args.chart)}", file=sys.stderr)
    except (OSError, ImportError) as e:
        args.subparser.error(f"cannot write the results ({type(e).__name__}: {e})")
    return 0 if plan.best else 1
