"""bench/bench_activations.py on the CPU: its smoke configuration, run in-process, measures what it claims.

The GPU run is one device call; this runs the same code on a 2-layer Llama (fp32, 4 x 128 tokens, 12
steps) so a typo or an API change cannot first show up there. Compiled rows run with the aot_eager
backend (the partitioner that activation_memory_budget steers, without inductor's code generation);
effmem_fast_compiled and effmem_budget_compiled are left out: the "fast" policy compiles each layer with
inductor whatever the backend, about 15 s on two cores, which would take this test past a minute
(tests/test_activations.py compiles both policies).
"""
import argparse
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_activations.py"


def load_bench(name: str):
    """A script of bench/ as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCH.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load_bench("bench_activations")

CONTRACT = {"plain", "plain_compiled", "hf_checkpointing", "torch_sac", "compile_budget", "effmem_fast",
            "effmem_min", "effmem_min_compiled"}
LEFT_OUT = {"effmem_fast_compiled", "effmem_budget_compiled"}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    if bench.host_in_use() is None:
        pytest.skip("no glibc mallinfo2 here: the benchmark's CPU memory numbers need it")
    out = tmp_path_factory.mktemp("bench") / "activations.json"
    rows = [r for r in bench.ROWS if r not in LEFT_OUT]
    threads = torch.get_num_threads()
    try:  # --smoke runs on one thread (see bench_activations.main) and gives the others back
        rc = bench.main(["--smoke", "--compile", "--compile-backend", "aot_eager", "--rows", ",".join(rows),
                         "--json", str(out)])
    finally:
        torch._dynamo.reset()  # the compiled rows' graphs: nothing of them for the tests after this one
    assert rc == 0 and torch.get_num_threads() == threads
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_every_row_is_measured_and_the_json_keeps_the_contract(result):
    assert result["benchmark"] == "activations" and result["complete"] is True
    for key in ("device", "torch_version", "git_commit"):
        assert result["env"][key], key
    assert result["config"]["model"]["num_hidden_layers"] == 2 and "peak_method" in result["config"]
    rows = {r["name"]: r for r in result["rows"]}
    # Every row is listed (the skipped one says why), one per effmem policy but "checkpoint".
    assert set(rows) == set(bench.ROWS) >= CONTRACT
    assert {f"effmem_{p}" for p in bench.POLICIES if p not in ("checkpoint", "selective")} <= set(rows)
    assert sorted(n for n, r in rows.items() if "skipped" in r) == sorted(LEFT_OUT)
    for name, r in rows.items():
        if name in LEFT_OUT:
            continue
        assert "error" not in r, (name, r["error"])
        assert r["step_ms"] > 0 and r["peak_bytes"] > 0 and r["held_after_forward"] > 0, name
        assert r["vs_plain"] > 0 and r["mem_vs_plain"]["peak_vs_plain"] > 0, name
        if name not in bench.COMPILED_ROWS:  # saved-tensor hooks: eager rows only
            assert r["saved_bytes"] > 0 and 0 < r["layer_saved_bytes"] < r["saved_bytes"], name
    assert rows["plain"]["vs_plain"] == 1 and rows["plain"]["peak_vs_plain"] == 1
    assert {t["name"].split(":")[0] for t in result["targets"]} >= {"effmem_fast", "effmem_min",
                                                                      "effmem_min_compiled"}
    assert all(isinstance(t["met"], bool) and "bound" in t for t in result["targets"])
    # checkpointing and SAC keep plain's math: on the CPU's deterministic kernels they end where plain ends
    assert result["loss_noise_floor"] is not None and result["loss_noise_floor"] < 1e-3


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_memory_numbers_order_the_techniques(result):
    rows = {r["name"]: r for r in result["rows"]}
    layers = {n: r.get("layer_saved_bytes") for n, r in rows.items()}
    # Checkpointing keeps each layer's input; selective checkpointing that and the matmul outputs; plain all.
    assert rows["hf_checkpointing"]["saved_bytes"] < rows["plain"]["saved_bytes"]
    assert layers["hf_checkpointing"] < layers["torch_sac"] < layers["plain"]
    # "min" keeps the same inputs as checkpointing, in 8-bit codes instead of fp32.
    assert layers["effmem_min"] < 0.5 * layers["hf_checkpointing"]
    assert layers["effmem_fast"] < 0.5 * layers["plain"]
    # the hooks' own time per save was measured (its 10 us target is for the report, not for this CPU)
    assert rows["effmem_fast"]["hook_saves"] > 0 and 0 < rows["effmem_fast"]["hook_us_per_save"] < 1000
    # What forward leaves alive follows what is saved; a memory budget of 0.5 makes the compiler keep less.
    assert rows["hf_checkpointing"]["held_after_forward"] < 0.5 * rows["plain"]["held_after_forward"]
    assert rows["compile_budget"]["held_after_forward"] < rows["plain_compiled"]["held_after_forward"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_every_row_trains_from_the_same_start_on_the_same_batches(result):
    rows = [r for r in result["rows"] if "skipped" not in r]
    plain = next(r for r in rows if r["name"] == "plain")
    assert plain["final_loss"] < plain["first_loss"] - 0.2  # it learns the progressions
    for r in rows:
        # Step 0 is the same forward of the same weights on the same batch (effmem's 8-bit saves change
        # only gradients), and after 12 steps every row is still close to plain.
        assert r["first_loss"] == pytest.approx(plain["first_loss"], rel=1e-5), r["name"]
        assert math.isfinite(r["final_loss"]) and abs(r["loss_vs_plain"]) < 0.05, r["name"]


def test_activation_traffic_counts_fewer_bytes_with_the_cuda_kernels(tmp_path):
    """bench/activation_traffic.py: the "fast" policy's elementwise bytes as CUDA runs it (effmem's swiglu and
    rms_norm_apply kernels, aten's fused RMSNorm backward) are below plain training's, where the torch-op
    paths it takes on a CPU move more than plain's (recomputation)."""
    traffic = load_bench("activation_traffic")
    out = tmp_path / "traffic.json"
    assert traffic.main(["--hidden", "128", "--layers", "1", "--tokens", "256",
                         "--rows", "plain,effmem_fast,effmem_fast_cuda_paths", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["non_matmul_bytes"]
    assert rows["effmem_fast_cuda_paths"] < rows["plain"] < rows["effmem_fast"]
    assert data["env"]["torch_version"] == torch.__version__ and "git_commit" in str(data["env"])
    for bad in (["--tokens", "128"], ["--hidden", "32"], ["--layers", "0"]):   # a traceback before
        with pytest.raises(SystemExit):
            traffic.main(bad)
    # the booked norm backwards are the counted step's alone: two a layer (the first step's were booked too)
    booked = []
    real = traffic.CountBytes.__exit__

    def leave(self, *exc):
        booked.append(self.bytes["aten_fused_rms_norm_backward (booked)"])
        return real(self, *exc)
    traffic.CountBytes.__exit__ = leave
    try:
        traffic.count("effmem_fast_cuda_paths", argparse.Namespace(hidden=128, layers=1, tokens=256))
    finally:
        traffic.CountBytes.__exit__ = real
    assert booked == [2 * 10 * 256 * 128]


def test_bench_elementwise_times_each_kernel_against_its_torch_ops(tmp_path):
    """bench/bench_elementwise.py on the CPU (the GPU run is in gpu_check.sh's activations part): a row per
    kernel with its time, the torch ops' time, bytes and the ratio; aten's fused RMSNorm backward is CUDA's."""
    ew = load_bench("bench_elementwise")
    out = tmp_path / "ew.json"
    assert ew.main(["--device", "cpu", "--tokens", "64", "--hidden", "256", "--intermediate", "512",
                    "--repeat", "2", "--json", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"swiglu", "swiglu_backward", "rms_apply"}
    assert rows["swiglu"]["bytes"] == 3 * 64 * 512 * 2 and rows["rms_apply"]["bytes"] == 2 * 64 * 256 * 2 + 64 * 4
    assert all(r["effmem_ms"] > 0 and r["torch_ms"] > 0 and r["speedup_vs_torch"] > 0 for r in rows.values())


def test_profile_activations_names_the_kernels_a_policy_adds(tmp_path):
    """bench/profile_activations.py on the CPU (top-level ops there, kernels on a GPU): the "fast" policy's own
    autograd functions appear in its row and not in plain's, and the JSON keeps a row per policy."""
    prof = load_bench("profile_activations")
    out = tmp_path / "prof.json"
    assert prof.main(["--device", "cpu", "--rows", "plain,effmem_fast", "--layers", "1", "--batch", "1",
                      "--seq", "32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"plain", "effmem_fast"}
    assert any("_SwiGLU" in k for k in rows["effmem_fast"]) and not any("_SwiGLU" in k for k in rows["plain"])
    assert all(us >= 0 for r in rows.values() for us in r.values())


def test_activation_outliers_measures_each_run_against_float32(tmp_path):
    """bench/activation_outliers.py (docs/activation_policies.md's figures for outlier channels): a row per
    outlier size and run, each the worst parameter's gradient error against plain float32, small without
    outliers; with them the policies' 8-bit saves lose more than plain bf16 does."""
    bench = load_bench("activation_outliers")
    out = tmp_path / "o.json"
    bench.main(["--outliers", "0", "30", "--json", str(out)])   # hidden 512: 4 groups of 128 a token
    rows = {(r["outlier"], r["run"]): r["relative_error"] for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(o, r) for o in (0, 30) for r in ("plain bf16", '"fast" bf16', '"min" bf16')}
    assert all(0 < e < 0.1 for (o, _), e in rows.items() if o == 0)
    assert rows[(30, '"fast" bf16')] > 1.5 * rows[(30, "plain bf16")]   # measured: 7.9% and 4.1%
