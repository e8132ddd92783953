"""``effmem info``: what effmem was built with and what it finds at run time."""
import re
from typing import Dict

import torch

import effmem


def collect_info() -> Dict[str, object]:
    """What effmem was built with and what it finds at run time, as plain JSON values."""
    ext = effmem._C
    gpu = torch.cuda.is_available()
    info = {
        "effmem_version": effmem.__version__,
        "torch_built": ext.torch_version(),
        "torch_running": torch.__version__,
        "torch_cuda_runtime": torch.version.cuda,
        "cuda_compiled": bool(ext.cuda_compiled),
        "cuda_architectures": [a for a in re.split(r"[;,\s]+", ext.cuda_architectures) if a],
        "nvcc_version": getattr(effmem.build_info, "CUDA_COMPILER_VERSION", "") or None,
        "cpu_isa": ext.cpu_isa(),
        "cpu_isas_supported": [s for s in ext.supported_cpu_isas().split(",") if s],
        "cpu_threads": ext.num_threads(),
        "gpu_available": gpu,
        "gpu_name": None,
        "gpu_compute_capability": None,
    }
    if gpu:
        info["gpu_name"] = torch.cuda.get_device_name()
        info["gpu_compute_capability"] = "%d.%d" % torch.cuda.get_device_capability()
    return info


def _arch_text(arch: str) -> str:
    """A CMake CUDA architecture as what it puts in the binary: "80-real" is sm_80 code,
    "90-virtual" sm_90 PTX only, a bare "90" both."""
    number, _, kind = arch.partition("-")
    return {"real": f"sm_{number}", "virtual": f"sm_{number} PTX"}.get(kind, f"sm_{number} + PTX")


def format_info(info: Dict[str, object]) -> str:
    if info["cuda_compiled"]:
        archs = ", ".join(_arch_text(a) for a in info["cuda_architectures"]) or "architectures unknown"
        cuda = f"yes ({archs}; nvcc {info['nvcc_version'] or 'unknown'})"
    else:
        cuda = "no (CPU kernels only)"
    if info["gpu_available"]:
        gpu = f"{info['gpu_name']} (compute capability {info['gpu_compute_capability']})"
    else:
        gpu = "none visible (torch.cuda.is_available() is False)"
    rows = [
        ("effmem", info["effmem_version"]),
        ("torch (built against)", info["torch_built"]),
        ("torch (running)", info["torch_running"]),
        ("CUDA compiled", cuda),
        ("CPU vector unit", f"{info['cpu_isa']} (supported: {', '.join(info['cpu_isas_supported'])})"),
        ("CPU threads", info["cpu_threads"]),
        ("GPU", gpu),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
