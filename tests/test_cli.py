"""The effmem command line: `effmem info` and a tiny `effmem demo`."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import effmem
from effmem import cli, demo_model
from effmem.optim.offload_adam import CORRECTION_WARMUP

TINY = ["--steps", "8", "--layers", "1", "--d-model", "32", "--seq-len", "16", "--batch-size", "4"]
CONFIG_NAMES = ["torch AdamW (fp32)", "FusedAdam (fp32)", "FusedAdam (bf16 + fp32 master)",
                "FusedAdam (bf16 + fp32 master), 8-bit activations", "FusedAdam (bf16 + fp32 master), 8-bit moments",
                "OffloadAdam (bf16, master + moments on the host)",
                "OffloadAdam async_step (exact, update behind the next forward)",
                "OffloadAdam delay (one-step-stale gradients)",
                "OffloadAdam delay + delay_correction (predicted weights)"]


def test_info_text(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out
    assert effmem._C.cpu_isa() in out
    assert effmem.__version__ in out
    assert ("yes" if effmem._C.cuda_compiled else "no") in out


def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["effmem_version"] == effmem.__version__
    assert info["torch_running"] == torch.__version__
    assert info["torch_built"] == effmem._C.torch_version()
    assert info["cuda_compiled"] is bool(effmem._C.cuda_compiled)
    assert info["cpu_isa"] == effmem._C.cpu_isa()
    assert info["cpu_isa"] in info["cpu_isas_supported"]
    assert info["cpu_isas_supported"] == effmem._C.supported_cpu_isas().split(",")
    assert info["cpu_threads"] == effmem._C.num_threads()
    assert info["gpu_available"] is torch.cuda.is_available()
    if not info["gpu_available"]:
        assert info["gpu_name"] is None and info["gpu_compute_capability"] is None


@pytest.mark.parametrize("module", ["effmem.cli", "effmem"])
def test_python_dash_m_runs_info(module):
    # `python -m effmem.cli` (the __main__ guard) and `python -m effmem` (__main__.py: "No module named
    # effmem.__main__" before), in a fresh interpreter.
    proc = subprocess.run([sys.executable, "-m", module, "info"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert torch.__version__ in proc.stdout


@pytest.mark.parametrize("value, unit", [("avx2", "avx2"), ("AVX2", "avx2"), (" scalar ", "scalar"),
                                         ("avx-2", None), ("foo", None), ("", "widest"), (" ", "widest")])
def test_the_isa_cap_is_a_name_it_knows(value, unit):
    """EFFMEM_CPU_ISA: the core took a name it did not know ('AVX2', 'avx-2') for no cap, silently, and ran
    AVX-512 where the user asked for AVX2. Case and spaces are forgiven; anything else refused by name. Set
    empty (EFFMEM_CPU_ISA=$ISA with ISA unset) it is no cap, as unset: the widest unit the CPU has."""
    env = dict(os.environ, EFFMEM_CPU_ISA=value)
    code = "import effmem._C as c; print(c.cpu_isa())"
    if unit == "widest":
        unset = {k: v for k, v in os.environ.items() if k != "EFFMEM_CPU_ISA"}
        unit = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              env=unset).stdout.strip()
        assert unit in ("avx2", "avx512")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    if unit is None:
        assert proc.returncode != 0 and "EFFMEM_CPU_ISA: expected one of scalar, avx2, avx512" in proc.stderr
    else:   # (the machines this runs on have AVX2)
        assert proc.returncode == 0 and proc.stdout.strip() == unit, proc.stderr


def test_a_cap_wider_than_the_cpu_runs_the_widest_it_has():
    """EFFMEM_CPU_ISA=avx512 on a CPU without AVX-512 died of SIGILL at the first kernel (the AVX-512 table's
    accessor ran before the CPU was asked); it is a cap, so the widest unit under it runs. set_cpu_isa refuses
    a unit the CPU lacks by name."""
    env = dict(os.environ, EFFMEM_CPU_ISA="avx512")
    code = ("import torch, effmem, effmem._C as c\n"
            "p = torch.nn.Parameter(torch.ones(64)); p.grad = torch.ones(64); effmem.FusedAdam([p]).step()\n"
            "print(c.cpu_isa(), c.supported_cpu_isas())\n"
            "try:\n    [c.set_cpu_isa(i) for i in ('avx512', 'avx2', 'scalar')]\n"
            "except ValueError as e:\n    print('refused:', e)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    unit, supported = proc.stdout.split()[:2]
    assert unit == ("avx512" if "avx512" in supported.split(",") else "avx2")
    assert ("refused: isa 'avx512' is not supported by this CPU" in proc.stdout) == (unit != "avx512")


@pytest.mark.parametrize("argv, message", [
    (["demo", "--steps", "0"], "expected a number > 0"),
    (["demo", "--layers", "two"], "expected a whole number"),
    (["demo", "--d-model", "30", "--heads", "4"], "not divisible"),
    (["demo", "--device", "tpu"], "expected cpu or cuda"),
    (["demo", "--json", "/no/such/folder/out.json"], "does not exist"),
    (["demo", "--json", "/"], "is a folder; give a file name"),   # after the demo's runs before
    (["demo", "--json", ""], "expected a file path, got an empty one"),
    (["plan", "gpt2", "--json", "/"], "is a folder"),
    (["plan", "gpt2", "--json", ""], "--json: expected a file path"),   # ignored, silently, before
    (["plan", "gpt2", "--chart", "/"], "is a folder"),
    (["frobnicate"], "invalid choice"),
    (["demo", "--seed", "99999999999999999999"], "--seed: expected an int in [0, 2**63 - 1)"),   # each run failed
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_device_without_gpu_is_an_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit):
        cli.main(["demo", "--device", "cuda"])
    assert "no CUDA GPU" in capsys.readouterr().err


def test_lr_schedule_warms_up_then_decays():
    f = cli.lr_lambda(100)
    assert f(0) == pytest.approx(0.1)
    assert f(9) == pytest.approx(1.0)
    assert f(99) < f(50) < f(10)
    assert f(10_000) == pytest.approx(0.1)


def test_corpus_is_deterministic():
    a = demo_model.stdlib_corpus(max_bytes=1 << 16)
    assert a == demo_model.stdlib_corpus(max_bytes=1 << 16)
    assert len(a) == 1 << 16


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo") / "out.json"
    proc = subprocess.run([sys.executable, "-m", "effmem.cli", "demo", "--device", "cpu", *TINY, "--json", str(path)],
                          capture_output=True, text=True, timeout=240)
    return proc, path


def test_demo_prints_table(tiny_demo):
    proc, _ = tiny_demo
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in CONFIG_NAMES:
        assert name in proc.stdout
    assert "peak RSS" in proc.stdout
    assert proc.stderr.count("8/8") == len(CONFIG_NAMES)  # each progress bar reached the end
    # FusedAdam and OffloadAdam's three modes, their loss per eighth of the run side by side
    curves = proc.stdout[proc.stdout.index("loss curves"):].splitlines()
    assert all(any(line.strip().startswith(n) and len(line.split()) >= 8 for line in curves) for n in cli.CURVE_CONFIGS)
    # The compressed run's statistics follow the table.
    assert "saved activations of the last training step" in proc.stdout
    assert "dtype bfloat16" in proc.stdout


def test_demo_json(tiny_demo):
    proc, path = tiny_demo
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(path.read_text())
    assert result["env"]["torch_running"] == torch.__version__ and "cpu_isa" in result["env"]
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == CONFIG_NAMES
    for r in runs.values():
        for key, value in r.items():
            if key.endswith("loss"):
                assert math.isfinite(value), (r["name"], key, value)
        assert r["tokens_per_s"] > 0
        assert r["peak_memory_bytes"] > 0
        assert r["model_state_bytes"] == r["param_bytes"] + r["grad_bytes"] + r["optimizer_state_bytes"]

    # Count the parameters independently of the demo (1 layer, d_model 32 -> 1 head).
    model = demo_model.ByteGPT(demo_model.GPTConfig(seq_len=16, n_layer=1, d_model=32, n_head=1))
    n = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    for r in runs.values():
        assert (r["params"], r["param_tensors"]) == (n, tensors)

    # Each parameter tensor also has a one-element float32 step count.
    steps = 4 * tensors
    # bf16 params: fp32 master + exp_avg + exp_avg_sq = 12 bytes per parameter.
    bf16 = runs["FusedAdam (bf16 + fp32 master)"]
    assert bf16["optimizer_state_bytes"] == 12 * n + steps
    assert bf16["param_bytes"] == bf16["grad_bytes"] == 2 * n
    # 8-bit moments: a byte each per element and a float32 scale each per block of 256 of a tensor, beside the
    # master; the plan's prediction of the model state is that, byte for byte
    eight = runs["FusedAdam (bf16 + fp32 master), 8-bit moments"]
    blocks = sum(-(-p.numel() // 256) for p in model.parameters())
    assert eight["optimizer_state_bytes"] == 4 * n + 2 * n + 2 * 4 * blocks + steps
    predicted = {p["name"]: p["model_state_bytes"] for p in result["plan_predictions"]}
    for name in (eight["name"], bf16["name"], "FusedAdam (fp32)"):
        assert predicted[name] == runs[name]["model_state_bytes"] - steps, name
    assert eight["losses"][0] == bf16["losses"][0] and eight["losses"][1:] != bf16["losses"][1:]
    # fp32 params: exp_avg + exp_avg_sq only, for torch's AdamW and for FusedAdam.
    assert runs["torch AdamW (fp32)"]["optimizer_state_bytes"] == 8 * n + steps
    assert runs["FusedAdam (fp32)"]["optimizer_state_bytes"] == 8 * n + steps

    # OffloadAdam: the same state, on the host; no gradient left on the device after backward;
    # 2 bytes per parameter down and up per step; the same math, so the same losses bit for bit.
    offload = runs["OffloadAdam (bf16, master + moments on the host)"]
    assert offload["optimizer_state_bytes"] == 12 * n + steps
    assert offload["grad_bytes"] == 0
    assert offload["offload_counters"]["bytes_down"] == offload["offload_counters"]["bytes_up"] == 8 * 2 * n
    assert (offload["first_loss"], offload["train_loss"], offload["val_loss"]) == (
        bf16["first_loss"], bf16["train_loss"], bf16["val_loss"])
    assert bf16["offload_counters"] is None
    # async_step: exact, every step's losses those of FusedAdam; delay: one-step-stale updates, other losses
    exact_mode = runs["OffloadAdam async_step (exact, update behind the next forward)"]
    delayed = runs["OffloadAdam delay (one-step-stale gradients)"]
    assert exact_mode["losses"] == bf16["losses"] and len(bf16["losses"]) == 8
    assert delayed["losses"][0] == bf16["losses"][0] and delayed["losses"][1:] != bf16["losses"][1:]
    # delay_correction: its default warm-up's exact steps outlast these 8, each installing its weights at once
    # (the predictions themselves: tests/test_offload_delay_correction*.py)
    corrected = runs["OffloadAdam delay + delay_correction (predicted weights)"]
    assert CORRECTION_WARMUP > len(bf16["losses"])
    assert corrected["losses"] == bf16["losses"] and corrected["offload_counters"]["bytes_up"] == 8 * 2 * n

    # Compressed activations change neither the parameters nor the optimizer state.
    compressed = runs["FusedAdam (bf16 + fp32 master), 8-bit activations"]
    for key in ("params", "param_bytes", "grad_bytes", "optimizer_state_bytes"):
        assert compressed[key] == bf16[key]
    for name, r in runs.items():
        if name != compressed["name"]:
            assert r["activation_bytes_before"] is None and r["compress_stats"] is None
    # 8-bit codes plus 8 bytes per group of 128, on bf16 activations: about half
    # (the tiny demo's tensors are mostly under the size threshold, so allow more).
    before, after = compressed["activation_bytes_before"], compressed["activation_bytes_after"]
    assert 0 < after < before
    stats = compressed["compress_stats"]
    assert stats["total_bytes_before"] == before and stats["num_compressed"] > 0
    assert set(stats["by_dtype"]) >= {"bfloat16"}


def test_a_model_whose_forward_refuses_the_trace_gets_a_message(tmp_path, capsys, monkeypatch):
    """BERT's learned positions end at max_position_embeddings, which the planner's position check did not
    know: the trace's RuntimeError came out as a traceback. Now the check knows such tables, and any other
    refusal of the model's forward is an argparse error too."""
    transformers = pytest.importorskip("transformers")
    transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                            vocab_size=100, max_position_embeddings=64).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", str(tmp_path), "--batch", "1", "--seq", "128", "--device", "cpu"])
    assert exc.value.code == 2 and "learned positions (max_position_embeddings = 64)" in capsys.readouterr().err
    from effmem.plan import planner

    def refuses(*args, **kwargs):
        raise RuntimeError("The size of tensor a (128) must match the size of tensor b (64)")
    monkeypatch.setattr(planner, "plan", refuses)
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "gpt2", "--device", "cpu"])
    assert exc.value.code == 2
    assert "failed in the model's forward (RuntimeError: The size of tensor a" in capsys.readouterr().err


def test_results_that_cannot_be_written_at_the_end_are_an_error_not_a_traceback(monkeypatch, capsys, tmp_path):
    """The paths are checked before planning, but a write can still fail at the end (a full disk, /proc for
    root, whom os.access lets write anywhere); a .png without matplotlib is refused before planning."""
    out = tmp_path / "plan.json"

    def fail(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(json, "dump", fail)
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "gpt2", "--batch", "2", "--seq", "64", "--json", str(out)])
    assert exc.value.code == 2 and "cannot write the results (OSError: [Errno 28] No space left" in capsys.readouterr().err
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "gpt2", "--chart", str(tmp_path / "c.png")])
    assert exc.value.code == 2 and "a .png needs matplotlib" in capsys.readouterr().err
