"""The build: what was compiled, and clear errors when the extension does not fit."""
import pathlib
import shutil
import subprocess
import sys
import types

import pytest
import torch

import effmem
from effmem import _load

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_build_matches_running_torch():
    assert effmem.build_info.TORCH_VERSION == torch.__version__ == effmem._C.torch_version()
    assert effmem.build_info.CUDA_COMPILED == effmem._C.cuda_compiled
    assert effmem._C.cpu_isa() in effmem._C.supported_cpu_isas().split(",")


def test_mismatched_torch_is_reported_with_both_versions(monkeypatch):
    fake = types.ModuleType("effmem._build_info")
    fake.TORCH_VERSION = "1.0.0+old"
    monkeypatch.setitem(sys.modules, "effmem._build_info", fake)
    with pytest.raises(ImportError) as err:
        _load.load_extension()
    message = str(err.value)
    assert "1.0.0+old" in message and torch.__version__ in message
    assert "pip install --no-build-isolation -e ." in message


def test_missing_extension_names_the_build_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "effmem._build_info", None)  # makes the import fail
    with pytest.raises(ImportError, match="pip install --no-build-isolation -e ."):
        _load.load_extension()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_multi_tensor_launch_tables(tmp_path):
    """The CUDA launch tables' host logic, compiled and run on the CPU."""
    exe = tmp_path / "test_multi_tensor"
    subprocess.run(["g++", "-std=c++20", "-O1", f"-I{ROOT / 'csrc'}", str(ROOT / "tests/cpp/test_multi_tensor.cpp"),
                    "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "ok"


def test_cuda_was_compiled_when_required():
    """CI sets EFFMEM_CUDA=ON: the CUDA sources must then have been built."""
    import os

    if os.environ.get("EFFMEM_CUDA") != "ON":
        pytest.skip("EFFMEM_CUDA=ON not set")
    assert effmem._C.cuda_compiled
    assert effmem._C.cuda_architectures == os.environ.get("EFFMEM_CUDA_ARCHITECTURES", effmem._C.cuda_architectures)
