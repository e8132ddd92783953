"""Load the compiled core, with clear errors when it is missing or stale."""
import importlib

import torch

BUILD_COMMAND = "pip install --no-build-isolation -e .   (from the effmem source folder, with torch installed)"


def load_extension():
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
