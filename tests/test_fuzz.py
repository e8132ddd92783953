"""The property-based fuzz suite (tests/fuzz_cases.py), one process per target and device.

A target that crashes its interpreter or hangs fails here, naming the example it was on; the
others still run. EFFMEM_FUZZ_EXAMPLES sets the examples per target: the default keeps CI to
well under a minute; a nightly-style run uses thousands (and EFFMEM_FUZZ_SEED for new ones).
"""
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
TARGETS = ["quantize", "adam", "norm", "checkpoint", "compress"]
EXAMPLES = int(os.environ.get("EFFMEM_FUZZ_EXAMPLES", "60"))
SEED = int(os.environ.get("EFFMEM_FUZZ_SEED", "0"))
# a generous budget per example: a hang is caught long before pytest-timeout's limit
TIME_LIMIT = min(280, 30 + 2 * EXAMPLES)

pytest.importorskip("hypothesis")


@pytest.mark.timeout(TIME_LIMIT + 30)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("target", TARGETS)
def test_fuzz(target, device, tmp_path):
    log = tmp_path / "examples.log"
    cmd = [sys.executable, str(HERE / "fuzz_cases.py"), target, "--examples", str(EXAMPLES), "--seed", str(SEED),
           "--device", device, "--log", str(log)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIME_LIMIT, cwd=HERE)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{target} on {device} hung (over {TIME_LIMIT} s) on example:\n{_last(log)}")
    if proc.returncode < 0:
        pytest.fail(f"{target} on {device} crashed (signal {-proc.returncode}) on example:\n{_last(log)}\n"
                    f"{proc.stderr[-3000:]}")
    assert proc.returncode == 0, f"{target} on {device}:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    assert f"{EXAMPLES} examples on {device} passed" in proc.stdout


def _last(log: pathlib.Path) -> str:
    lines = log.read_text().splitlines() if log.exists() else []
    return lines[-1] if lines else "(none logged)"
