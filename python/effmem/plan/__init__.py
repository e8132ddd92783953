"""effmem plan: where a model's training memory goes, and which combination trains fastest without running out.

    plan = effmem.plan("llama-7b", batch=8, seq=4096, gpu_memory="80GB")
    print(plan)                       # the pick, its parts, every rejected candidate and why
    model, opt = plan.apply(model)    # the pick, ready for a training loop
"""
from effmem.plan.hf_config import preset_names
from effmem.plan.planner import Candidate, Plan, plan
from effmem.plan.rates import Rates, calibrate

__all__ = ["plan", "Plan", "Candidate", "Rates", "calibrate", "preset_names"]
