"""Load the compiled core, with clear errors when it is missing or stale."""
import importlib
import os

import torch

BUILD_COMMAND = "pip install --no-build-isolation -e .   (from the effmem source folder, with torch installed)"


ISAS = ("scalar", "avx2", "avx512")


def check_isa_env() -> None:
    """EFFMEM_CPU_ISA caps the CPU kernels' vector unit. The core reads it at the first kernel call and took a
    value it did not know (AVX2, avx-2) for no cap at all, silently: refuse one here, before any kernel
    runs, and pass the core the lower-case name."""
    value = os.environ.get("EFFMEM_CPU_ISA")
    if value is None:
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
    try:
        ext = importlib.import_module("effmem._C")
    except ImportError as err:
        raise ImportError(
            f"effmem's extension failed to load ({err}). Rebuild it with:\n    {BUILD_COMMAND}"
        ) from err
    return ext, build_info
