"""``effmem info``: what effmem was built with and what it finds at run time."""
import os
import platform
import re
import subprocess
from typing import Dict, Optional

import torch

import effmem

# the checkout this package was imported from, where it is one (an editable install); a wheel's has no .git
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (platform.processor() is empty on most Linux systems)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit(root: Optional[str] = None) -> Dict[str, object]:
    """HEAD of the checkout at `root` (this package's, by default) and whether its code has local changes;
    EFFMEM_GIT_COMMIT where a copy of the tree has no .git (the GPU machine: gpu_check.sh passes it in)."""
    def git(*args: str) -> Optional[str]:
        try:
            return subprocess.run(["git", *args], cwd=root or _CHECKOUT, capture_output=True, text=True,
                                  check=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    if os.environ.get("EFFMEM_GIT_COMMIT"):
        # it wins over git: such a copy may sit inside some other checkout (seen: a stale one)
        return {"commit": os.environ["EFFMEM_GIT_COMMIT"], "dirty": None, "commit_from": "EFFMEM_GIT_COMMIT"}
    top = git("rev-parse", "--show-toplevel")
    if root is None and (top is None or os.path.realpath(top) != os.path.realpath(_CHECKOUT)
                         or not os.path.isdir(os.path.join(_CHECKOUT, "csrc"))):
        # an installed package: a repository around it (a user's project holding the venv) is not effmem's
        return {"commit": "unknown", "dirty": None}
    commit = git("rev-parse", "HEAD")
    # the code's changes only: a result file a run before this one wrote into bench/results/ is no change to
    # what is measured (every result of a session's runs read dirty after the first)
    status = git("status", "--porcelain", "--", ".", ":(exclude)bench/results")
    return {"commit": commit or "unknown", "dirty": None if status is None else bool(status)}


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
