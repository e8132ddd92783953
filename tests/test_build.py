"""The build: what was compiled, and clear errors when the extension does not fit."""
import os
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


@pytest.mark.parametrize("version,warns", [("2.9.1+cu128", True), ("2.4.0", True), ("2.11.0", False),
                                           ("2.14.1+cu130", False), ("2.12.0a0+git1234", False)])
def test_a_torch_older_than_the_tested_ones_is_warned_about(version, warns):
    """pyproject.toml asked for torch>=2.4, but torch 2.9.1 broke OffloadAdam under FSDP2 and compiled steps; a
    build with --no-deps against such a torch loads, and says what is known to fail."""
    import warnings
    from effmem._load import warn_untested_torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_untested_torch(version)
    assert [str(w.message).startswith(f"effmem is tested with torch 2.11 and newer; torch {version}")
            for w in caught] == ([True] if warns else [])


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


def _cuda_compiler_for_default_build():
    """The nvcc a default build uses (CMakeLists.txt looks at CUDACXX, CUDA_HOME, CUDA_PATH, /usr/local/cuda)."""
    if os.environ.get("CUDACXX"):
        return shutil.which(os.environ["CUDACXX"].split()[0])   # a path or a name on PATH, maybe with flags
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return None


def test_cuda_was_compiled_where_the_default_build_finds_nvcc():
    """The default build compiles CUDA whenever the toolkit is there (CI has one), and it builds for
    the default architectures (no GPU: machine code for sm_80 and sm_90 plus sm_90 PTX)."""
    if os.environ.get("EFFMEM_CUDA", "").upper() in ("OFF", "0", "NO", "FALSE") or torch.version.cuda is None:
        pytest.skip("a CPU-only build was asked for, or torch has no CUDA")
    if _cuda_compiler_for_default_build() is None:
        pytest.skip("no CUDA toolkit found where the build looks for one")
    assert effmem._C.cuda_compiled
    archs = os.environ.get("EFFMEM_CUDA_ARCHITECTURES")
    if archs:
        assert effmem._C.cuda_architectures == archs.replace(";", ",")
    elif not torch.cuda.is_available() and shutil.which("nvidia-smi") is None:
        assert effmem._C.cuda_architectures == "80-real,90"


_BAD_SETTINGS = [
    pytest.param({"EFFMEM_CUDA": "maybe"}, "EFFMEM_CUDA: expected AUTO, ON or OFF, got 'maybe'", False, id="mode"),
    pytest.param({"CUDA_HOME": "/nonexistent/cuda"}, "CUDA_HOME=/nonexistent/cuda: expected a CUDA toolkit's folder",
                 True, id="toolkit"),
    pytest.param({"CUDACXX": "no-such-nvcc"}, "CUDACXX=no-such-nvcc: expected the nvcc executable", True,
                 id="compiler"),
    pytest.param({"EFFMEM_CUDA_ARCHITECTURES": "sm_90"}, "EFFMEM_CUDA_ARCHITECTURES=sm_90: expected CMake's form",
                 True, id="architectures"),
    # built, then the import failed on an undefined symbol (old guides to torch extensions set this flag)
    pytest.param({"CXXFLAGS": f"-O2 -D_GLIBCXX_USE_CXX11_ABI={1 - int(torch._C._GLIBCXX_USE_CXX11_ABI)}"},
                 f"the compiler flags hold -D_GLIBCXX_USE_CXX11_ABI={1 - int(torch._C._GLIBCXX_USE_CXX11_ABI)}, "
                 f"but torch {torch.__version__} was built with _GLIBCXX_USE_CXX11_ABI="
                 f"{int(torch._C._GLIBCXX_USE_CXX11_ABI)}", False, id="abi"),
    # built, and `import effmem` flushed denormals to zero in the whole process
    pytest.param({"CXXFLAGS": "-O3 -ffast-math"}, "the compiler flags hold -ffast-math", False, id="fast-math"),
    pytest.param({"LDFLAGS": "-Ofast"}, "the compiler flags hold -Ofast", False, id="fast-math-link"),
    pytest.param({"CUDAFLAGS": "-ftz=true"}, "the compiler flags hold -ftz=true", False, id="fast-math-nvcc"),
]


def _cmake():
    return shutil.which("cmake", path=os.path.dirname(sys.executable)) or shutil.which("cmake")


def _configure(tmp_path, cmake, env=(), drop=(), args=()) -> subprocess.CompletedProcess:
    """A configure only (no compile, seconds) into tmp_path/build, EFFMEM_CUDA*, CUDACXX and `drop` out of the
    environment and `env` in; `args` before CMake's own."""
    kept = {k: v for k, v in os.environ.items()
            if k not in ("EFFMEM_CUDA", "EFFMEM_CUDA_ARCHITECTURES", "CUDACXX", *drop)}
    return subprocess.run([cmake, *args, "-S", str(ROOT), "-B", str(tmp_path / "build"),
                           f"-DPython_EXECUTABLE={sys.executable}",
                           f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"],
                          env={**kept, **dict(env)}, capture_output=True, text=True, timeout=300)


def _cuda_configure_tools():
    """(cmake, nvcc) for a configure where CUDA would be built; the test is skipped without them."""
    cmake, nvcc = _cmake(), _cuda_compiler_for_default_build()
    if cmake is None or torch.version.cuda is None or nvcc is None:
        pytest.skip("checked where CUDA would be built: cmake, torch with CUDA and a toolkit")
    return cmake, nvcc


def _script(path, body: str):
    """An executable shell script at path (its folder made)."""
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("env,message,needs_cuda", _BAD_SETTINGS)
def test_a_bad_build_setting_stops_the_configure_naming_it(tmp_path, env, message, needs_cuda):
    """Each used to be ignored: an unknown EFFMEM_CUDA built CUDA (or, for "on" without a toolkit, silently
    none), a CUDA_HOME without nvcc was skipped for another toolkit or none, "sm_90" failed in CMake's words.
    A configure only (no compile): seconds."""
    cmake = _cmake()
    if cmake is None:
        pytest.skip("cmake is not installed")
    if needs_cuda:
        _cuda_configure_tools()
    proc = _configure(tmp_path, cmake, env)
    assert proc.returncode != 0
    assert message in " ".join(proc.stderr.split()), proc.stderr[-2000:]


def test_extension_uses_the_shared_libstdcxx():
    """A private libstdc++ inside _C.so breaks number formatting in every error message."""
    sys.path.insert(0, str(ROOT / "cmake"))
    try:
        import libstdcxx_check
    finally:
        sys.path.pop(0)
    needed, defined = libstdcxx_check.elf_facts(effmem._C.__file__)
    assert "libstdc++.so.6" in needed
    assert not set(libstdcxx_check.LIBSTDCXX_OWN_SYMBOLS) & defined
    assert libstdcxx_check.library_problem(effmem._C.__file__) is None


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_libstdcxx_probe_fixes_a_static_link_and_check_rejects_one(tmp_path):
    """The configure-time probe: with -static-libstdc++ it finds the shared library to link instead
    (and verifies the result formats numbers next to torch); the post-build check deletes a library
    that carries its own libstdc++."""
    script = str(ROOT / "cmake" / "libstdcxx_check.py")
    run = lambda *args: subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    plain = run("probe", "--cxx", "g++", "--work", str(tmp_path / "plain"))
    assert plain.returncode == 0 and plain.stdout.strip() == "ok", plain.stderr
    static = run("probe", "--cxx", "g++", "--flags=-static-libstdc++ -O2", "--work", str(tmp_path / "static"))
    assert static.returncode == 0, static.stderr
    assert static.stdout.startswith("link-shared /") and "libstdc++.so" in static.stdout
    bad = tmp_path / "static" / "probe_default.so"  # the probe built before the fix
    check = run("check", str(bad), "--delete-if-bad")
    assert check.returncode == 1 and "libstdc++ was linked into it statically" in check.stderr
    assert not bad.exists()
    good = run("check", str(tmp_path / "static" / "probe_shared.so"))
    assert good.returncode == 0, good.stderr


def test_a_cuda_host_compiler_linking_libstdcxx_statically_stays_off_the_extension_link(tmp_path):
    """CMake adds what nvcc's host compiler links implicitly to the C++ link of _C: a CUDAHOSTCXX linking
    libstdc++ statically (as the GPU machine's /opt/gcc g++ does) put libstdc++.a there, and the check deleted
    the extension after a ten-minute build, naming neither variable (a reviewer's build). A configure only."""
    cmake = _cmake()
    ninja = shutil.which("ninja", path=os.path.dirname(sys.executable)) or shutil.which("ninja")
    gxx = shutil.which("g++")
    if cmake is None or ninja is None or gxx is None:
        pytest.skip("needs cmake, ninja and g++")
    _cuda_configure_tools()
    wrapper = _script(tmp_path / "g++-static", f'exec {gxx} "$@" -static-libstdc++ -static-libgcc')
    proc = _configure(tmp_path, cmake, {"CUDAHOSTCXX": str(wrapper)},
                      args=("-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CUDA kernels for architectures" in proc.stdout
    assert "libstdc++.a" not in (tmp_path / "build" / "build.ninja").read_text()


def test_cudacxx_with_flags_is_not_replaced_by_the_nvcc_on_path(tmp_path):
    """CUDACXX naming nvcc with flags is left to CMake; the symlink-following look on PATH (for when nothing
    names a toolkit) took a PATH nvcc in its place and dropped the user's (a reviewer's configure). A configure
    only, with a broken nvcc first on PATH."""
    cmake, nvcc = _cuda_configure_tools()
    fake = _script(tmp_path / "bin" / "nvcc", "exit 1")
    proc = _configure(tmp_path, cmake, {"CUDACXX": f"{nvcc} -allow-unsupported-compiler",
                                        "PATH": f"{fake.parent}:{os.environ['PATH']}"}, drop=("CUDA_HOME", "CUDA_PATH"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CUDA kernels for architectures" in proc.stdout, proc.stdout[-2000:]


def test_an_nvcc_on_path_through_a_symlink_builds_cuda(tmp_path):
    """With no variable naming a toolkit and none in the usual folder (EFFMEM_DEFAULT_CUDA_ROOT points elsewhere
    here), the nvcc on PATH, a symlink to the toolkit's: CMake's trial with the symlink failed ("Couldn't find CUDA
    library root") and the build went CPU-only saying no CUDA compiler was found (a reviewer's build). Configure
    only."""
    cmake, nvcc = _cuda_configure_tools()
    link = tmp_path / "bin" / "nvcc"
    link.parent.mkdir()
    link.symlink_to(os.path.realpath(nvcc))
    proc = _configure(tmp_path, cmake, {"PATH": f"{link.parent}:{os.environ['PATH']}"}, drop=("CUDA_HOME", "CUDA_PATH"),
                      args=(f"-DEFFMEM_DEFAULT_CUDA_ROOT={tmp_path / 'none'}",))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CUDA kernels for architectures" in proc.stdout, proc.stdout[-2000:]


def test_a_path_holding_a_fast_math_flag_is_no_flag(tmp_path):
    """The flags are matched whole: an include folder named my-Ofast was refused as -Ofast (a reviewer's)."""
    cmake = _cmake()
    if cmake is None:
        pytest.skip("cmake is not installed")
    proc = _configure(tmp_path, cmake, {"EFFMEM_CUDA": "OFF", "CXXFLAGS": "-I/opt/my-Ofast/include -O2"},
                      drop=("LDFLAGS",))
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_compiler_settings_changed_on_a_reused_build_folder_are_refused(tmp_path):
    """CMake reads CXX, CXXFLAGS and LDFLAGS at a folder's first configure only: a -ffast-math unset later stuck
    to pip's reused build folder ("ninja: no work to do"), as did another CXX, without a word (a reviewer's
    builds). The same settings configure again; another value stops, naming the variable and the folder."""
    cmake = _cmake()
    if cmake is None:
        pytest.skip("cmake is not installed")
    first = _configure(tmp_path, cmake, {"EFFMEM_CUDA": "OFF", "CXXFLAGS": "-O2"}, drop=("LDFLAGS",))
    assert first.returncode == 0, first.stderr[-2000:]
    again = _configure(tmp_path, cmake, {"EFFMEM_CUDA": "OFF", "CXXFLAGS": "-O2"}, drop=("LDFLAGS",))
    assert again.returncode == 0, again.stderr[-2000:]
    changed = _configure(tmp_path, cmake, {"EFFMEM_CUDA": "OFF"}, drop=("CXXFLAGS", "LDFLAGS"))
    assert changed.returncode != 0
    assert (f"CXXFLAGS is now '', but this build folder ({tmp_path / 'build'}) was configured with CXXFLAGS='-O2'"
            in " ".join(changed.stderr.split()))


def test_a_visible_gpu_the_toolkit_cannot_build_for_is_left_out_by_name(tmp_path):
    """A V100 (sm_70) under CUDA 13: the architectures taken from nvidia-smi went to CMake's trial compile, which
    failed with a long log naming compute_70 (a reviewer's fake nvidia-smi). It is left out with a warning, the
    kernels built for the others (or the defaults); asked for by "native", it is refused by name."""
    cmake, _ = _cuda_configure_tools()
    smi = _script(tmp_path / "bin" / "nvidia-smi", "echo 7.0; echo 9.0")
    path = {"PATH": f"{smi.parent}:{os.environ['PATH']}"}
    proc = _configure(tmp_path, cmake, path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the visible GPUs' sm_70, older than" in " ".join(proc.stderr.split())
    assert "CUDA kernels for architectures 90" in proc.stdout
    _script(smi, "echo 7.0")
    native = _configure(tmp_path / "native", cmake, {**path, "EFFMEM_CUDA_ARCHITECTURES": "native"})
    assert native.returncode != 0
    assert "EFFMEM_CUDA_ARCHITECTURES=native: the visible GPUs' sm_70" in " ".join(native.stderr.split())
    # one newer than nvcc knows runs the sm_90 PTX (the driver compiles it): no warning that nothing runs
    _script(smi, "echo 99.0")
    newer = _configure(tmp_path / "newer", cmake, {**path, "EFFMEM_CUDA_ARCHITECTURES": "native"})
    assert newer.returncode == 0, newer.stderr[-2000:]
    assert "newer than" in newer.stdout and "CUDA kernels for architectures 90" in newer.stdout
    assert "left out" not in newer.stderr


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_a_built_library_that_breaks_next_to_torch_is_deleted(tmp_path):
    """After the link the build loads _C next to torch (cmake/load_check.py): one built for another C++ ABI
    failed only at import (an undefined symbol), one linked with -ffast-math by GCC 12 flushed denormals to zero
    in the whole process. Whatever flags or wrapper did it, such a library is deleted with the reason; the
    build runs the check after every link (a configure, to read the build's commands)."""
    script = str(ROOT / "cmake" / "load_check.py")
    def built(name, code, *flags):
        (tmp_path / f"{name}.cpp").write_text(code)
        out = tmp_path / f"{name}.so"
        subprocess.run(["g++", "-shared", "-fPIC", *flags, str(tmp_path / f"{name}.cpp"), "-o", str(out)], check=True)
        return out

    # what GCC 12's crtfastmath.o does at load (GCC 13 no longer links it into a shared library): FTZ and DAZ
    fast = built("fast", '#include <xmmintrin.h>\n__attribute__((constructor)) static void ftz() '
                         '{ _mm_setcsr(_mm_getcsr() | 0x8040); }\nextern "C" int plain() { return 1; }')
    unresolved = built("unresolved", 'extern "C" int missing(); extern "C" int uses() { return missing(); }')
    for lib, why in ((fast, "flushes denormals to zero"), (unresolved, "undefined symbol: missing")):
        run = subprocess.run([sys.executable, script, str(lib), "--delete-if-bad"], capture_output=True, text=True)
        assert run.returncode == 1 and why in run.stderr and "(deleted)" in run.stderr, run.stderr
        assert not lib.exists()
    ok = subprocess.run([sys.executable, script, effmem._C.__file__], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    cmake = _cmake()
    ninja = shutil.which("ninja", path=os.path.dirname(sys.executable)) or shutil.which("ninja")
    if cmake is None or ninja is None:
        pytest.skip("needs cmake and ninja to read the build's commands")
    proc = _configure(tmp_path, cmake, {"EFFMEM_CUDA": "OFF"}, drop=("CXXFLAGS", "LDFLAGS"),
                      args=("-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cmake/load_check.py" in (tmp_path / "build" / "build.ninja").read_text()
