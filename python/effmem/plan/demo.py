"""effmem demo's plan: the plan for the demo's own GPT first, and at the end predicted against measured."""
from typing import List, Tuple

import torch

from effmem.demo_measure import mib
from effmem.plan.costs import PRECISIONS, optimizer_state_bytes

def demo_plan(configs, settings: dict) -> Tuple[str, List[dict]]:
    """The plan for the demo's GPT on this machine, and per demo configuration what it predicts."""
    from effmem import demo_model
    from effmem.plan.planner import plan
    from effmem.plan.extrapolate import trace_spec
    gcfg = demo_model.GPTConfig(seq_len=settings["seq_len"], n_layer=settings["layers"],
                                d_model=settings["d_model"], n_head=settings["heads"])
    with torch.device("meta"):
        model = demo_model.ByteGPT(gcfg)
    device = torch.device(settings["device"]).type
    p = plan(model, batch=settings["batch_size"], seq=settings["seq_len"], accum=1, device=device)
    n = p.params
    predictions = []
    for cfg in configs:
        dtype = cfg.param_dtype
        precision = "bf16" if dtype == torch.bfloat16 else "fp32"
        w_b, g_b, master_b, _ = PRECISIONS[precision]
        offload = "Offload" in cfg.name
        tr = trace_spec(p.spec, settings["batch_size"], settings["seq_len"], dtype, device)
        saved = tr.saved_bytes("none")
        predictions.append({
            "name": cfg.name,
            # OffloadAdam keeps gradients in its engine, not in p.grad; its state is on the host.
            "model_state_bytes": n * w_b + (0 if offload else n * g_b) + n * master_b
            + optimizer_state_bytes(n, cfg.state_bits, p.spec.state_blocks),
            "activation_bytes_before": saved,
            "activation_bytes_after": tr.saved_bytes(f"compress{cfg.compress_bits}") if cfg.compress_bits
            else saved})
    return str(p), predictions


def compare(runs: List[dict], predictions: List[dict]) -> str:
    lines = ["effmem plan, predicted against measured (model state: parameters + gradients + optimizer state; "
             "saved activations of one training step, as compress_activations counts them where it ran):"]
    for r, pr in zip(runs, predictions):
        line = (f"  {r['name']}: model state predicted {mib(pr['model_state_bytes'])}, measured "
                f"{mib(r['model_state_bytes'])}")
        if r.get("activation_bytes_before") is not None:
            line += (f"; saved activations predicted {mib(pr['activation_bytes_before'])} -> "
                     f"{mib(pr['activation_bytes_after'])}, measured {mib(r['activation_bytes_before'])} -> "
                     f"{mib(r['activation_bytes_after'])}")
        lines.append(line)
    return "\n".join(lines)
