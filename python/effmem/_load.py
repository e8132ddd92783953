"""Load the compiled core, with clear errors when it is missing or stale."""
import importlib
import os
import warnings

import torch

BUILD_COMMAND = "pip install --no-build-isolation -e .   (from the effmem source folder, with torch installed)"


ISAS = ("scalar", "avx2", "avx512")
# The oldest torch the whole test suite has passed on (2.11 on an H100, 2.13 and 2.14 on CPUs); pyproject.toml
# asks for it. A build with --no-deps against an older one loads, with this warning.
OLDEST_TESTED_TORCH = (2, 11)


def warn_untested_torch(version: str) -> None:
    """Warn where torch is older than OLDEST_TESTED_TORCH, naming what torch 2.9.1 was seen to break."""
    if torch.torch_version.TorchVersion(version) < OLDEST_TESTED_TORCH:
        warnings.warn(f"effmem is tested with torch {'.'.join(map(str, OLDEST_TESTED_TORCH))} and newer; torch "
                      f"{version} is installed. With torch 2.9.1 OffloadAdam under FSDP2 refused parameters whose "
                      "shards are uneven (FSDP2 re-pads them at the first forward: build the optimizer after it), "
                      "torch.compile of FusedAdam.step and OffloadAdam.step failed, and torch.compile of an "
                      "activation policy's model compiled each layer anew", stacklevel=3)


def check_isa_env() -> None:
    """EFFMEM_CPU_ISA caps the CPU kernels' vector unit. The core reads it at the first kernel call and took a
    value it did not know (AVX2, avx-2) for no cap at all, silently: refuse one here, before any kernel
    runs, and pass the core the lower-case name."""
    value = os.environ.get("EFFMEM_CPU_ISA")
    if value is None:
        return
    if not value.strip():   # set empty (a script's EFFMEM_CPU_ISA=$ISA with ISA unset): no cap, as unset
        del os.environ["EFFMEM_CPU_ISA"]
        return
    name = value.strip().lower()
    if name not in ISAS:
        raise ValueError(f"EFFMEM_CPU_ISA: expected one of {', '.join(ISAS)} (the widest CPU vector unit "
                         f"effmem's kernels may use), got {value!r}")
    os.environ["EFFMEM_CPU_ISA"] = name


def load_extension():
    check_isa_env()
    try:
        build_info = importlib.import_module("effmem._build_info")
    except ImportError as err:
        raise ImportError(
            "effmem's compiled extension is not built or not installed. Build it against the "
            f"installed torch with:\n    {BUILD_COMMAND}"
        ) from err
    if build_info.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"effmem was built for torch {build_info.TORCH_VERSION} but torch {torch.__version__} "
            f"is installed. Rebuild it against this torch with:\n    {BUILD_COMMAND}"
        )
    warn_untested_torch(torch.__version__)
    try:
        ext = importlib.import_module("effmem._C")
    except ImportError as err:
        raise ImportError(
            f"effmem's extension failed to load ({err}). Rebuild it with:\n    {BUILD_COMMAND}"
        ) from err
    return ext, build_info
