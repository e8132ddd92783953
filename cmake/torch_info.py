"""Print CMake `set()` lines describing the torch that this interpreter imports.

CMake runs this instead of find_package(Torch): torch's CMake config looks for
CUDA libraries (nvrtc, cuDNN...) in the local toolkit, but pip-installed torch
carries them in separate wheels, so the config fails on exactly the machines
we build on. The extension only needs headers, library folders and the ABI flag.
"""
import sys

import torch
import torch.utils.cpp_extension as ext


def cmake_list(items):
    return ";".join(str(i).replace("\\", "/") for i in items)


def main(out_path):
    cuda = torch.version.cuda is not None
    lines = {
        "EFFMEM_TORCH_VERSION": torch.__version__,
        "EFFMEM_TORCH_CUDA_VERSION": torch.version.cuda or "",
        "EFFMEM_TORCH_HAS_CUDA": "ON" if cuda else "OFF",
        "EFFMEM_TORCH_CXX11_ABI": int(torch._C._GLIBCXX_USE_CXX11_ABI),
        "EFFMEM_TORCH_INCLUDE_DIRS": cmake_list(ext.include_paths("cpu")),
        "EFFMEM_TORCH_LIBRARY_DIRS": cmake_list(ext.library_paths("cpu")),
    }
    with open(out_path, "w") as f:
        for key, value in lines.items():
            f.write(f'set({key} "{value}")\n')


if __name__ == "__main__":
    main(sys.argv[1])
