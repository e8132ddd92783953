"""effmem plan against the H100 measurements committed in bench/results (commit 30c4269, torch 2.11).

Every peak the benchmarks measured with torch.cuda.max_memory_allocated is
predicted here, on the CPU, from bench/llama.py's model traced on meta
tensors: the step benchmark (1.3B, 8 x 2048 tokens, 4 micro-batches) for
FusedAdam, plain OffloadAdam, its overlap and delayed modes, and the capacity search
(1 x 2048, one micro-batch) for torch AdamW under autocast, FusedAdam and
OffloadAdam at 1.3B to 7B, including the two that ran out of memory.
Targets of issue 11: median error <= 5%, worst <= 10%, and what ran out of
memory is predicted not to fit.
"""
import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

import effmem

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import llama  # noqa: E402

RESULTS = ROOT / "bench" / "results"
H100_BYTES = 85_017_362_432  # "total capacity of 79.18 GiB" in the capacity run's out-of-memory message
# benchmark optimizer name -> (precision, optimizer) of the plan's candidates
OPTIMIZERS = {"fused": ("bf16", "gpu"), "offload": ("bf16", "offload"),
              "offload_overlap": ("bf16", "offload_overlap"), "torch_adamw_amp": ("fp32", "gpu"),
              # The delayed mode (not a candidate: it changes the math) holds on the GPU what overlap holds.
              "offload_delay": ("bf16", "offload_overlap")}


def _inputs(b, s, d):
    ids = torch.zeros(b, s, dtype=torch.long, device=d)
    return (ids, ids), {}


def _predict(size, batch, seq, accum, optimizer):
    with torch.device("meta"):
        model = llama.Llama(llama.SIZES[size])
    p = effmem.plan(model, batch=batch * accum, seq=seq, accum=accum, gpu_memory=H100_BYTES, host_memory="2TB",
                    inputs=_inputs, clipping=False)
    precision, opt = OPTIMIZERS[optimizer]
    return next(c for c in p.candidates if (c.config.precision, c.config.activations, c.config.optimizer,
                                            c.config.loss, c.config.state_bits, c.config.device_accumulation,
                                            c.config.device_state)
                == (precision, "none", opt, "standard", 32, 0, 0))


def _rows():
    step = json.loads((RESULTS / "gpu_offload.json").read_text())
    cfg = step["config"]
    for r in step["results"]["step"]:
        yield ("step", cfg["size"], cfg["batch"], cfg["seq"], cfg["accum"], r["name"], r["peak_allocated_bytes"])
    cap = json.loads((RESULTS / "gpu_offload_capacity.json").read_text())
    for r in cap["results"]["capacity"]:
        if r["status"] == "ok" or r["status"] == "out of memory":
            yield ("capacity", r["size"], 1, cap["config"]["capacity_seq"], 1, r["optimizer"],
                   r.get("peak_allocated_bytes"))


ROWS = list(_rows())


def test_the_committed_measurements_are_there():
    assert len(ROWS) == 13 and sum(r[-1] is None for r in ROWS) == 2


@pytest.fixture(scope="module")
def predictions():
    return {row: _predict(*row[1:6]) for row in ROWS}


def test_predicted_peaks_match_the_h100(predictions):
    errors = []
    for row, c in predictions.items():
        measured = row[-1]
        if measured is None:
            continue
        err = c.cost.allocated_bytes / measured - 1
        assert abs(err) <= 0.10, (row, c.cost.allocated_bytes, measured)
        assert c.fits, row  # it ran, so the plan must not reject it
        errors.append(abs(err))
    assert len(errors) == 11
    assert statistics.median(errors) <= 0.05, errors


def test_what_ran_out_of_memory_is_predicted_not_to_fit(predictions):
    for row, c in predictions.items():
        if row[-1] is None:
            assert not c.fits and "does not fit" in c.why, (row, c.cost.peak_bytes)


def _measured_step_s():
    step = json.loads((RESULTS / "gpu_offload.json").read_text())
    out = {("step", r["name"]): r["median_ms"] / 1e3 for r in step["results"]["step"]}
    cap = json.loads((RESULTS / "gpu_offload_capacity.json").read_text())
    for r in cap["results"]["capacity"]:
        if r["status"] == "ok":
            out[("capacity", r["optimizer"], r["size"])] = cap["config"]["capacity_seq"] / r["tokens_per_s"]
    return out


def test_predicted_step_times_and_the_pick_against_the_h100(predictions):
    """Step time within 25% on every row (median within 10%), and per shape the predicted fastest of the
    measured configurations within 10% of the measured fastest. The host Adam rate was taken from one of
    these rows (rates.py: the plain OffloadAdam step row), the GPU's from a TinyLlama step's kernel profile,
    and half_rate_tokens fitted to the capacity rows: a check of the model's shape across sizes and modes."""
    measured = _measured_step_s()
    ratios, groups = [], {}
    for row, c in predictions.items():
        if row[-1] is None or row[5] == "torch_adamw_amp":
            # (the plan's fp32 candidate steps with FusedAdam; that row stepped with torch.optim.AdamW)
            continue
        key = ("step", row[5]) if row[0] == "step" else ("capacity", row[5], row[1])
        ratio = c.step_time_s / measured[key]
        assert 0.75 <= ratio <= 1.25, (row, c.step_time_s, measured[key])
        ratios.append(abs(ratio - 1))
        groups.setdefault(row[:5], []).append((c.step_time_s, measured[key]))
    assert statistics.median(ratios) <= 0.10, ratios
    for shape, rows in groups.items():
        picked = min(rows)[1]
        assert picked <= 1.10 * min(m for _, m in rows), (shape, rows)


def test_activation_strategies_against_the_h100_activation_run():
    """TinyLlama at batch 8 x 2048, bf16, FusedAdam (bench/results/2026-11-27-h100-ad52e0c/gpu_activations.json):
    plain's step within 5% and each strategy's step relative to plain's within 6% of what was measured, and in
    the measured order where the measured steps differ by more than 10%: "fast" under plain, "min" under
    checkpointing. Not independent: the H100 rates (products, attention, elementwise passes) and the
    policies' kernel terms come from the same run's kernel profile; what it checks is that the trace's
    counts turn into the measured steps of the other strategies (checkpointing's recompute, SAC's)."""
    run = json.loads((RESULTS / "2026-11-27-h100-ad52e0c" / "gpu_activations.json").read_text())
    step = {r["name"]: r["step_ms"] for r in run["rows"]}
    p = effmem.plan("tinyllama-1.1b", batch=8, seq=2048, accum=1, gpu_memory="80GB", host_memory="128GB",
                    device="cuda")
    pred = {a: p.candidate("bf16+" + ("" if a == "none" else a + "+") + "mb8x1").step_time_s
            for a in ("none", "fast", "checkpoint8", "selective", "checkpoint")}
    rows = {"fast": "effmem_fast", "checkpoint8": "effmem_min", "selective": "torch_sac",
            "checkpoint": "hf_checkpointing"}
    assert abs(pred["none"] * 1e3 / step["plain"] - 1) <= 0.05, (pred["none"], step["plain"])
    for a, row in rows.items():
        predicted, measured = pred[a] / pred["none"], step[row] / step["plain"]
        assert abs(predicted / measured - 1) <= 0.06, (a, predicted, measured)
    assert pred["fast"] < pred["none"] < pred["checkpoint"] and pred["checkpoint8"] < pred["checkpoint"]
