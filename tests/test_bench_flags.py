"""The benchmarks refuse bad flags by name before any run: argparse's exit 2 and a message naming the flag,
where a negative --warmup timed nothing or divided by zero, a 0 size ran the default, --device cuda without a
GPU or an unknown device gave torch's traceback, and an unknown --rows name was counted as plain."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # the benchmarks import their neighbour common.py

CASES = [
    ("bench_adam", ["--warmup", "-5"], "--warmup: expected a number >= 0"),
    ("bench_adam", ["--device", "xpu"], "--device: invalid choice"),
    ("bench_compress", ["--warmup", "-1"], "--warmup: expected a number >= 0"),
    ("bench_offload", ["--device", "cpu", "--warmup", "-2"], "--warmup: expected a number >= 0"),
    ("bench_elementwise", ["--device", "xpu"], "--device: invalid choice"),
    ("bench_linear_ce", ["--device", "xpu"], "--device: invalid choice"),
    ("bench_activations", ["--smoke", "--seq", "0"], "--seq: expected a number > 0"),
    ("bench_activations", ["--smoke", "--layers", "-2"], "--layers: expected a number > 0"),
    ("bench_activations", ["--smoke", "--lr", "-1"], "--lr: expected a finite number > 0"),
    ("activation_traffic", ["--rows", "plain,bogus"], "--rows: unknown bogus"),
    ("bench_delay_warmup", ["--warmups", "-3"], "--warmups: expected a number >= 0"),
    ("bench_delay_warmup", ["--clip", "-1"], "--clip: expected a finite number >= 0"),
    ("profile_activations", ["--device", "xpu"], "--device: invalid choice"),
]


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script,argv,message", CASES, ids=[f"{c[0]}{' '.join(c[1])}" for c in CASES])
def test_a_bad_flag_is_refused_by_name(script, argv, message, capsys):
    if script in ("bench_activations", "activation_traffic", "profile_activations"):
        pytest.importorskip("transformers")
    with pytest.raises(SystemExit) as e:
        load(script).main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("script", ["bench_adam", "bench_compress", "bench_offload", "bench_linear_ce",
                                    "bench_elementwise"])
def test_device_cuda_without_a_gpu_is_refused_by_name(script, capsys):
    with pytest.raises(SystemExit) as e:
        load(script).main(["--device", "cuda"])
    assert e.value.code == 2 and "--device cuda: no CUDA GPU is visible" in capsys.readouterr().err


def test_capacity_checks_every_size_before_the_first_run(capsys, monkeypatch):
    """--sizes tiny,7b ran tiny (minutes on a GPU) before it found '7b' unknown for --smoke."""
    bench = load("bench_capacity")
    monkeypatch.setattr(bench, "plan_for", lambda *a: pytest.fail("planned before every size was checked"))
    with pytest.raises(SystemExit, match="--sizes: unknown size '7b'"):
        bench.main(["--smoke", "--sizes", "tiny,7b"])
