"""effmem plan's text: the pick, its parts, the other candidates and why each lost, and the pick as code."""
from typing import List, Optional

from effmem.plan.costs import Config

GB = 10 ** 9
PARTS = ("weights", "grads", "master", "optimizer", "activations", "logits", "temporary", "reserve")


def _gb(n: float) -> str:
    return f"{n / GB:.3g}" if n < 1000 * GB else f"{n / GB:.0f}"   # 1 TB as 1000, not 1e+03


def size_text(n: float, digits: int = 1) -> str:
    """Bytes in the unit of their size (GB = 1e9 bytes): a tiny model's would all read 0.0 GB."""
    for unit, scale in (("GB", GB), ("MB", 10 ** 6), ("kB", 10 ** 3)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"


def _count(n: int) -> str:
    """A parameter count in the unit of its size: a tiny model's read 0.000B."""
    return next((f"{n / scale:.3f}{unit}" for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)) if n >= scale),
                str(n))


def format_plan(plan, max_rows: int = 14) -> str:
    lines: List[str] = []
    lines.append(f"effmem plan: {plan.model}, {_count(plan.params)} parameters "
                 f"({_count(plan.trainable_params)} trained), batch {plan.batch} x {plan.seq} tokens, "
                 f"{plan.gpus} x {plan.device} with {_gb(plan.gpu_memory)} GB, host {_gb(plan.host_memory)} GB")
    lines.append(f"activations: {plan.method}; rates: {plan.rates.device} ({plan.rates.source}); "
                 f"planned in {plan.seconds:.2f} s. GB = 1e9 bytes.")
    for note in plan.notes:
        lines.append(f"note: {note}")
    pick = plan.pick
    if pick is None:
        # the fewest bytes short, GPU and host together, among those more memory would make the pick
        # (candidates are sorted so: choose.judge)
        closest = plan.candidates[0]
        lines.append(f"\nNothing fits. Closest: {closest.name}: {closest.why}")
    else:
        lines.append(f"\npick: {pick.name}  (peak {_gb(pick.cost.peak_bytes)} GB, "
                     f"host {_gb(pick.cost.host_bytes)} GB, step {pick.step_time_s * 1e3:.0f} ms)")
        lines.append("  " + "  ".join(f"{k} {_gb(pick.cost.parts[k])}" for k in PARTS))
        lines.append("\n" + plan_code(plan, pick))
    lines.append("\ncandidates (best micro-batch of each combination; --json has all of them):")
    header = f"  {'name':<44} {'fits':<5} {'peak GB':>8} {'host GB':>8} {'step ms':>9}  why"
    lines.append(header)
    seen = set()
    rows = 0
    for c in plan.candidates:
        cfg = c.config
        key = (cfg.precision, cfg.activations, cfg.optimizer, cfg.sharding, cfg.loss)
        if key in seen:
            continue
        seen.add(key)
        lines.append(f"  {c.name:<44} {'yes' if c.fits else 'no':<5} {_gb(c.cost.peak_bytes):>8} "
                     f"{_gb(c.cost.host_bytes):>8} {c.step_time_s * 1e3:>9.0f}  {c.why}")
        rows += 1
        if rows >= max_rows:
            break
    return "\n".join(lines)


def code_for(cfg: Config, device: str = "cuda", activation_budget: int = 0,
             trainable: Optional[str] = None, frozen: bool = False) -> str:
    """The pick as the lines of a training script (activation_budget: a fast_offload candidate's
    Cost.activation_budget; trainable: the plan's trainable=, whose parameters alone the optimizer gets, as
    it gets the trained ones alone where the model is frozen in part)."""
    out = ["# the pick as code (or: model, opt = plan.apply(model)):"]
    if trainable is not None:
        items = [t.strip() for t in trainable.split(",")]
        # a part (#a:b) trains rows of its parameters: they take gradients, the other rows' the user zeroes
        whole = [t.split("#")[0] for t in items]
        if any("#" in t for t in items):
            out.append(f"# trainable={trainable!r} trains part of a parameter (#a:b): those parameters train "
                       "whole below; zero their other rows' gradients yourself, e.g. with a hook "
                       "(plan.apply() freezes whole parameters only). The optimizer then keeps state for all of "
                       "their rows: more memory than the plan counted for the rows named")
        if whole:
            out.append("import re   # the parameters trainable= names train; the rest stay frozen")
            out.append(f"for name, p in model.named_parameters(): p.requires_grad_(any(re.search(r, name) for r in "
                       f"{whole!r}))")
    if cfg.precision == "bf16":
        out.append(f"model = model.to('{device}', torch.bfloat16)")
    else:
        out.append(f"model = model.to('{device}')" + ("  # fp32 weights; run forward under torch.autocast('cuda', "
                                                       "torch.bfloat16)" if device == "cuda" else ""))
    if cfg.loss == "fused":
        out.append("model = effmem.fuse_linear_cross_entropy(model)   # the labels= loss without logits")
    elif cfg.loss == "fused_gif":
        out.append("model = effmem.fuse_linear_cross_entropy(model, grad_in_forward=True)   # no logits; "
                   "gradients made in forward")
    if cfg.activations == "checkpoint":
        out.append("model = effmem.apply_activation_policy(model, 'checkpoint')   # torch's checkpoint per layer")
    elif cfg.activations == "checkpoint8":
        out.append("model = effmem.apply_activation_policy(model, 'min')   # checkpointed layers, 8-bit inputs")
    elif cfg.activations == "fast_offload":
        budget = int(activation_budget) if activation_budget else "plan.pick.cost.activation_budget"
        out.append(f"model = effmem.apply_activation_policy(model, memory_budget={budget})   # 'fast', the first "
                   "layers' 8-bit codes in host memory (bytes at this micro-batch)")
    elif cfg.activations == "fast":
        out.append("model = effmem.apply_activation_policy(model, 'fast')   # 8-bit saves, norms/activations rebuilt")
    elif cfg.activations == "selective":
        out.append("model = effmem.apply_activation_policy(model, 'selective')   # matmul/attention outputs kept, "
                   "the rest recomputed")
    elif cfg.activations.startswith("compress"):
        out.append(f"model = effmem.compress_activations(model, bits={cfg.activations[len('compress'):]})")
    elif cfg.activations == "save_on_cpu":
        out.append("# run forward inside: with torch.autograd.graph.save_on_cpu(pin_memory=True):")
    if cfg.sharding in ("ddp", "zero1"):   # ZeRO-1: DDP's gradients, the optimizer state sharded
        out.append("model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)")
    elif cfg.sharding in ("zero2", "zero3"):
        resh = "True" if cfg.sharding == "zero3" else "False"
        out.append("from torch.distributed.fsdp import fully_shard")
        out.append("from effmem.plan.model import find_blocks   # the decoder layers")
        out.append(f"for block in find_blocks(model)[1]: fully_shard(block, reshard_after_forward={resh})  # FSDP2")
        out.append(f"fully_shard(model, reshard_after_forward={resh})")
    params = ("[p for p in model.parameters() if p.requires_grad]" if trainable is not None or frozen
              else "model.parameters()")
    opt = {"gpu": f"effmem.FusedAdam({params}, lr=3e-4)",
           "offload": f"effmem.OffloadAdam({params}, lr=3e-4)",
           "offload_overlap": f"effmem.OffloadAdam({params}, lr=3e-4, overlap=True)",
           "offload_async": f"effmem.OffloadAdam({params}, lr=3e-4, async_step=True)"}[cfg.optimizer]
    if cfg.state_bits == 8:
        opt = opt[:-1] + ", state_bits=8)"
    if cfg.device_accumulation:
        opt = opt[:-1] + f", device_accumulation={cfg.device_accumulation})"
    if cfg.device_state:
        opt = opt[:-1] + f", device_state={cfg.device_state})"
    if cfg.sharding == "zero1":
        out.append("from torch.distributed.optim import ZeroRedundancyOptimizer")
        opt = (f"ZeroRedundancyOptimizer({params}, "
               "optimizer_class=effmem.FusedAdam, lr=3e-4" + (", state_bits=8)" if cfg.state_bits == 8 else ")"))
    out.append(f"opt = {opt}")
    if cfg.optimizer == "offload_async":
        out.append("opt.attach(model)   # each module's forward installs its new weights")
    out.append(f"# {cfg.accumulation} micro-batch(es) of {cfg.micro_batch} sequence(s) per optimizer step")
    if cfg.optimizer != "gpu" and cfg.accumulation > 1:
        out.append("# all but the last inside `with opt.accumulating():`"
                   + (" (gradients summed on the GPU, sent once)" if cfg.device_accumulation else ""))
    return "\n".join(out)


def _trainable(plan) -> Optional[str]:
    return getattr(plan.spec, "trainable_text", None)


def plan_code(plan, candidate) -> str:
    """code_for a candidate of a plan: its optimizer over the trained parameters alone where the plan counted
    fewer than the model has (trainable=, or a model that came frozen in part: a LoRA one's printed code gave
    OffloadAdam all the frozen weights too, 16x the host memory the plan predicted, in a reviewer's run)."""
    return code_for(candidate.config, plan.device, candidate.cost.activation_budget, _trainable(plan),
                    frozen=plan.trainable_params < plan.params)
