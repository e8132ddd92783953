"""effmem plan's predictions against measurements on a GPU: peak memory per configuration, and the pick.

    python bench/bench_plan.py [--json PATH] [--steps 3] [--warmup 2]
    python bench/bench_plan.py --smoke      # the same loop on the CPU with a tiny model (tests run it)

For 36 configurations (three Llama-shaped models from transformers, random init, no download; two
batch shapes; six strategies: bf16 with FusedAdam plain, with selective checkpointing (the "selective"
policy), with per-layer checkpointing, with checkpointing of 8-bit layer inputs (apply_activation_policy
"min"), with 8-bit compressed activations, and with OffloadAdam) it asks effmem.plan for its prediction,
trains `warmup` + `steps` steps of that configuration (plan.apply, effmem.plan.verify) and records the
predicted allocated peak against torch.cuda.max_memory_allocated, and the predicted step time
against the measured median. Targets (issue 11): median peak error <= 5%, worst <= 10%; per
model and batch shape, the plan's pick among the six never runs out of memory and its measured
step is within 10% of the fastest measured one that fits. MET / NOT MET lines at the end. The JSON is
written after every configuration, so a run cut off by the device's time limit keeps what it measured.
"""
import argparse
import gc
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import TINY_LLAMA, count, environment, non_negative, write_json  # noqa: E402

import effmem  # noqa: E402
from effmem.plan.verify import verify  # noqa: E402

MODELS = {
    "llama-160m": dict(model_type="llama", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=12, vocab_size=32000),
    "llama-410m": dict(model_type="llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                       num_attention_heads=16, num_key_value_heads=16, vocab_size=32000),
    "tinyllama-1.1b": "tinyllama-1.1b",
}
SHAPES = [(4, 1024), (8, 2048)]
STRATEGIES = [("bf16", "none", "gpu"), ("bf16", "selective", "gpu"), ("bf16", "checkpoint", "gpu"),
              ("bf16", "checkpoint8", "gpu"), ("bf16", "compress8", "gpu"), ("bf16", "none", "offload")]
SMOKE_MODELS = {"llama-tiny": TINY_LLAMA}
SMOKE_SHAPES = [(2, 64)]
SMOKE_STRATEGIES = [("fp32", "none", "gpu"), ("fp32", "checkpoint8", "gpu")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--steps", type=count, default=3, help="timed steps per configuration (their median)")
    ap.add_argument("--warmup", type=non_negative, default=2, help="untimed steps before them")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: runs the loop (its MET / NOT MET "
                    "lines judge a tiny model's few configurations, not the issue's targets)")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("bench_plan: needs a CUDA GPU (it compares predictions with torch.cuda.max_memory_allocated)")
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    models, shapes, strategies = ((SMOKE_MODELS, SMOKE_SHAPES, SMOKE_STRATEGIES) if args.smoke
                                  else (MODELS, SHAPES, STRATEGIES))
    rows, picks = [], []
    env = environment(device)

    def save(targets=None):
        if args.json:
            write_json(args.json, {"benchmark": "plan", "env": env, "rows": rows, "picks": picks,
                                   "targets": targets, "partial": targets is None})
    for model_name, model in models.items():
        for batch, seq in shapes:
            plan = effmem.plan(model, batch=batch, seq=seq, accum=1, device=device.type)
            measured = {}
            for precision, act, opt in strategies:
                cand = next(c for c in plan.candidates if (c.config.precision, c.config.activations,
                                                            c.config.optimizer, c.config.loss, c.config.state_bits)
                            == (precision, act, opt, "standard", 32))
                row = {"model": model_name, "batch": batch, "seq": seq, "candidate": cand.name,
                       "predicted_fits": cand.fits, "predicted_allocated_bytes": cand.cost.allocated_bytes,
                       "predicted_parts": {k: v for k, v in cand.cost.parts.items() if k != "activations_by_kind"},
                       "predicted_step_s": cand.step_time_s}
                try:
                    r = verify(plan, candidates=[cand.name], steps=args.steps, warmup=args.warmup)[0]
                    # GPU: the peak; CPU (smoke): what forward leaves alive, counted by the allocator.
                    got = r.get("measured_max_allocated_bytes", r["measured_activation_bytes"])
                    want = r.get("predicted_allocated_bytes", r["predicted_activation_bytes"])
                    row.update(status="ok", measured_bytes=got, predicted_bytes=want,
                               measured_step_s=r["measured_step_s"], peak_error=want / got - 1)
                    measured[cand.name] = r["measured_step_s"]
                except torch.OutOfMemoryError as e:
                    row.update(status="out of memory", error=str(e).splitlines()[0])
                except Exception as e:  # noqa: BLE001 - a strategy that breaks costs its own row, not the run
                    row.update(status="failed", error=f"{type(e).__name__}: {e}"[:2000])
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                save()
                print(f"{model_name:>15} {batch}x{seq:<5} {cand.name:<34} {row['status']:<14} "
                      f"pred {row.get('predicted_bytes', 0) / 1e9:7.3f} GB  meas "
                      f"{row.get('measured_bytes', 0) / 1e9:7.3f} GB  "
                      f"err {row.get('peak_error', float('nan')):+.1%}  step pred {row['predicted_step_s'] * 1e3:7.0f} "
                      f"ms meas {row.get('measured_step_s', float('nan')) * 1e3:7.0f} ms", flush=True)
            names = [c.name for c in plan.candidates if c.fits and c.config.loss == "standard" and
                     c.config.state_bits == 32 and
                     (c.config.precision, c.config.activations, c.config.optimizer) in strategies]
            pick = names[0] if names else None  # plan.candidates lists the fitting ones fastest first
            fastest = min(measured.values()) if measured else None
            picks.append({"model": model_name, "batch": batch, "seq": seq, "pick": pick,
                          "pick_ran": pick in measured,
                          "pick_vs_fastest": measured[pick] / fastest if pick in measured else None})
    errors = [abs(r["peak_error"]) for r in rows if r["status"] == "ok"]
    targets = [
        ("median |peak error| <= 5%", bool(errors) and statistics.median(errors) <= 0.05,
         statistics.median(errors) if errors else None),
        ("worst |peak error| <= 10%", bool(errors) and max(errors) <= 0.10, max(errors) if errors else None),
        ("the pick runs (no out of memory, no error)", all(p["pick_ran"] for p in picks), None),
        ("the pick's step within 10% of the fastest measured", all(
            p["pick_vs_fastest"] is not None and p["pick_vs_fastest"] <= 1.10 for p in picks),
         max((p["pick_vs_fastest"] or float("inf")) for p in picks)),
        ("no configuration fails with an error (out of memory aside)", not any(r["status"] == "failed" for r in rows),
         sum(r["status"] == "failed" for r in rows)),
    ]
    for name, ok, value in targets:
        print(f"{'MET' if ok else 'NOT MET'}: {name}" + ("" if value is None else f" ({value:.3g})"))
    save([{"name": n, "met": ok, "value": v} for n, ok, v in targets])
    return 0


if __name__ == "__main__":
    sys.exit(main())
