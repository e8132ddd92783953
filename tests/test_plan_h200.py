"""effmem plan against bench/bench_plan.py's first GPU run (H200, commit 68edd28, torch 2.11): 36
configurations, three Llama shapes x two batches x six strategies, each trained for 3 steps.

The peaks are predicted again here, on the CPU, from the same configs traced on meta tensors, and held to
issue 11's targets: median |error| <= 5%, worst <= 10%. The run itself measured the plan of its commit
(median 0.87%, worst 16.3%: the compress8 rows, 4 bytes per token per vocabulary entry short); the plan
has counted the loss's restored log-probabilities since, which is what this checks. The run's small steps
(4 x 1024) waited for the host issuing ops, which the plan has counted since (plan/step_model.py host_s, its rates
from four rows of this run): the steps are checked with it.
"""
import json
import statistics
import sys
from pathlib import Path

import pytest

import effmem

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_plan import MODELS  # noqa: E402

RUN = json.loads((ROOT / "bench" / "results" / "2026-11-27-h200-68edd28" / "gpu_plan.json").read_text())
H200_BYTES = 150_109_880_320   # torch.cuda.get_device_properties(0).total_memory in the run's capacity JSON


@pytest.fixture(scope="module")
def predicted():
    plans, out = {}, []
    for r in RUN["rows"]:
        key = (r["model"], r["batch"], r["seq"])
        if key not in plans:
            plans[key] = effmem.plan(MODELS[r["model"]], batch=r["batch"], seq=r["seq"], accum=1, device="cuda",
                                     gpu_memory=H200_BYTES, host_memory="128GB")
        out.append((r, plans[key].candidate(r["candidate"])))
    return out


def test_the_run_is_there_and_every_configuration_ran():
    assert len(RUN["rows"]) == 36 and all(r["status"] == "ok" for r in RUN["rows"])
    assert RUN["env"]["device_name"] == "NVIDIA H200" and RUN["partial"] is False


def test_predicted_peaks_match_the_h200(predicted):
    errors = {}
    for r, c in predicted:
        assert c.fits, r["candidate"]
        errors[(r["model"], r["batch"], r["candidate"])] = c.cost.allocated_bytes / r["measured_bytes"] - 1
    worst = max(errors, key=lambda k: abs(errors[k]))
    assert abs(errors[worst]) <= 0.10, (worst, errors[worst])
    assert statistics.median(abs(e) for e in errors.values()) <= 0.05, errors
    # the rows the run got wrong: the plan of 68edd28 said the same as now for every other row
    compress = [e for k, e in errors.items() if "compress8" in k[2]]
    assert len(compress) == 6 and max(abs(e) for e in compress) <= 0.05, compress


def test_predicted_steps_with_the_hosts_time(predicted):
    """Every row but compress8's within 0.65x-1.35x of its measured step (0.70-1.14 measured), median within
    15% (10.7%). Small steps wait for the host issuing ops (plan/step_model.py host_s): its per-op time and
    selective checkpointing's policy cost were taken from four of these rows (160M and 410M at 4 x 1024,
    plain and selective); the selective rows it did not see were predicted at 0.36x (TinyLlama, 4 x 1024),
    0.57x and 0.72x (160M and 410M, 8 x 2048) without it and at 0.95x, 1.06x and 1.08x with it (TinyLlama
    at 8 x 2048, where the GPU's work dominates, 1.13x either way). compress_activations' per-tensor hooks
    and kernels are not modelled: its rows measured 1.1-2.3x the prediction at 4 x 1024."""
    ratios = [c.step_time_s / r["measured_step_s"] for r, c in predicted if "compress8" not in r["candidate"]]
    assert len(ratios) == 30
    assert all(0.65 <= x <= 1.35 for x in ratios), sorted(ratios)
    assert statistics.median(abs(x - 1) for x in ratios) <= 0.15, sorted(ratios)


def test_the_7b_capacity_rows_match_the_h200():
    """bench_capacity.py's two 7B runs of the same H200 (batch 32 x 2048 per step, the plan's pick and its
    fastest with 8-bit moments, gpu_capacity.json): the plan, made again with the run's memory figures,
    predicts each GPU peak within 5% (measured -2.0% and -1.1%) and each step within 10% (0.96x both)."""
    import argparse
    import bench_capacity as bench
    run = json.loads((ROOT / "bench" / "results" / "2026-11-27-h200-68edd28" / "gpu_capacity.json").read_text())
    cfg = run["config"]
    args = argparse.Namespace(batch=cfg["batch"], seq=cfg["seq"], device="cuda", gpu_memory=cfg["gpu_memory"],
                              host_memory=cfg["host_memory"])
    plan = bench.plan_for(bench.SIZES["7b"], args)
    assert len(run["rows"]) == 2 and plan.best == run["rows"][0]["candidate"]
    for r in run["rows"]:
        c = plan.candidate(r["candidate"])
        assert r["status"] == "ok" and c.fits
        assert abs(c.cost.allocated_bytes / r["gpu_peak_bytes"] - 1) <= 0.05, (r["candidate"], c.cost.allocated_bytes)
        assert abs(c.step_time_s / statistics.median(r["step_s"]) - 1) <= 0.10, (r["candidate"], c.step_time_s)
