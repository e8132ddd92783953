"""Make sure effmem's extension uses the shared libstdc++, as torch does.

Why: a C++ compiler that links libstdc++ statically (a wrapper or specs file
adding -static-libstdc++, LDFLAGS=-static-libstdc++, some vendor toolchains)
gives _C.so a private copy of the library. torch loads the shared one, and the
two copies do not share their locale state, so formatting a number into an
error message crashed the process (an H100 machine whose CXX was such a
compiler) or silently dropped the number (Debian's g++ 12 with
LDFLAGS=-static-libstdc++). The user's environment chooses the compiler, so
the build checks instead of hoping.

    python libstdcxx_check.py probe --cxx CXX [--flags "FLAGS"] [--work DIR]
        Builds a small shared library with CXX and FLAGS (compile and link
        flags, as CMake passes them), loads it into a Python that has imported
        torch and formats a number there. Prints "ok", or "link-shared PATH"
        when the compiler links libstdc++ statically but naming its shared
        libstdc++ (PATH) on the link line gives a library that passes. Exits
        1 with a message naming the compiler, the reason and the fix otherwise.

    python libstdcxx_check.py check FILE [--delete-if-bad]
        Exits 1, with the reason, unless FILE (an ELF shared object) has
        libstdc++.so.6 among its NEEDED entries and defines none of the
        symbols that only libstdc++ itself defines; --delete-if-bad removes
        such a FILE (the build runs this on _C.so, so none is ever left).

Only the standard library is used: CMake runs this before anything else of
effmem's exists, and CI runs `check` on the built extension.
"""
import argparse
import os
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile

SHARED_LIBSTDCXX = "libstdc++.so.6"
# Defined by libstdc++ itself and never by code that merely uses it (non-template
# members of std::locale and std::ios_base::Init): a library that defines one
# carries its own copy of libstdc++.
LIBSTDCXX_OWN_SYMBOLS = (
    "_ZNSt6locale7classicEv",   # std::locale::classic()
    "_ZNSt6localeC1Ev",         # std::locale::locale()
    "_ZNSt8ios_base4InitC1Ev",  # std::ios_base::Init::Init()
)

PROBE_SOURCE = r"""
#include <sstream>
#include <string>
// Formats a double and an integer the way TORCH_CHECK formats its message.
extern "C" __attribute__((visibility("default"))) const char* effmem_probe(double x, long long n) {
  static std::string text;
  std::ostringstream out;
  out << "got " << x << " and " << n;
  text = out.str();
  return text.c_str();
}
"""
PROBE_EXPECTED = "got -1.5 and 12345"

PROBE_LOADER = r"""
import ctypes, sys
import torch  # loads the shared libstdc++ first, as in a real process
lib = ctypes.CDLL(sys.argv[1])
lib.effmem_probe.restype = ctypes.c_char_p
lib.effmem_probe.argtypes = [ctypes.c_double, ctypes.c_longlong]
print(lib.effmem_probe(-1.5, 12345).decode())
"""


# ---- ELF: NEEDED entries and defined symbols ------------------------------------

def _elf_sections(data):
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ValueError("only 64-bit little-endian ELF files are read")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = []
    for i in range(shnum):
        name, kind, _flags, _addr, offset, size, link, _info, _align, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", data, shoff + i * shentsize)
        sections.append({"type": kind, "offset": offset, "size": size, "link": link, "entsize": entsize})
    return sections


def _string_at(data, table, index):
    start = table["offset"] + index
    return data[start:data.index(b"\0", start)].decode(errors="replace")


def elf_facts(path):
    """(NEEDED entries, names of defined symbols in .dynsym and .symtab) of an ELF file."""
    with open(path, "rb") as f:
        data = f.read()
    sections = _elf_sections(data)
    needed, defined = [], set()
    for s in sections:
        if s["type"] == 6:  # SHT_DYNAMIC
            strings = sections[s["link"]]
            for off in range(s["offset"], s["offset"] + s["size"], 16):
                tag, value = struct.unpack_from("<qQ", data, off)
                if tag == 0:
                    break
                if tag == 1:  # DT_NEEDED
                    needed.append(_string_at(data, strings, value))
        elif s["type"] in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            strings = sections[s["link"]]
            for off in range(s["offset"], s["offset"] + s["size"], 24):
                name, _info, _other, shndx = struct.unpack_from("<IBBH", data, off)
                if name and shndx != 0:  # SHN_UNDEF: a reference, not a definition
                    defined.add(_string_at(data, strings, name))
    return needed, defined


def library_problem(path):
    """Why the shared object at path does not use the shared libstdc++, or None."""
    needed, defined = elf_facts(path)
    own = sorted(set(LIBSTDCXX_OWN_SYMBOLS) & defined)
    if own:
        return f"it defines libstdc++'s own symbols ({', '.join(own)}): libstdc++ was linked into it statically"
    if SHARED_LIBSTDCXX not in needed:
        return (f"{SHARED_LIBSTDCXX} is not among its NEEDED libraries ({', '.join(needed) or 'none'}): "
                "libstdc++ was linked into it statically")
    return None


# ---- probe -------------------------------------------------------------------------

def _build_and_run(cxx, flags, extra, work, name):
    src = os.path.join(work, "probe.cpp")
    with open(src, "w") as f:
        f.write(PROBE_SOURCE)
    lib = os.path.join(work, name)
    cmd = [cxx, *flags, "-shared", "-fPIC", "-O1", src, "-o", lib, *extra]
    built = subprocess.run(cmd, capture_output=True, text=True)
    if built.returncode != 0:
        return f"compiling a probe failed: {shlex.join(cmd)}\n{built.stderr.strip()}"
    problem = library_problem(lib)
    if problem:
        return problem
    run = subprocess.run([sys.executable, "-c", PROBE_LOADER, lib], capture_output=True, text=True, timeout=120)
    if run.returncode < 0:
        return f"a probe library crashed (signal {-run.returncode}) formatting a number in a process with torch"
    if run.returncode != 0:
        return f"a probe library failed to load next to torch: {run.stderr.strip().splitlines()[-1:]}"
    if run.stdout.strip() != PROBE_EXPECTED:
        return f"a probe library formatted {PROBE_EXPECTED!r} as {run.stdout.strip()!r} next to torch"
    return None


RUNTIME_LIBSTDCXX = r"""
import torch
with open("/proc/self/maps") as maps:
    paths = {line.split()[-1] for line in maps if "/libstdc++.so" in line}
print(sorted(paths)[0] if paths else "")
"""


def shared_libstdcxx_candidates(cxx, flags):
    """Shared libstdc++ files to name on the link line: first the one a process
    that imports torch has loaded (so the extension links against exactly the
    library it will run with), then the compiler's own libstdc++.so."""
    out = []
    run = subprocess.run([sys.executable, "-c", RUNTIME_LIBSTDCXX], capture_output=True, text=True, timeout=120)
    if run.returncode == 0 and run.stdout.strip():
        out.append(run.stdout.strip())
    found = subprocess.run([cxx, *flags, "-print-file-name=libstdc++.so"], capture_output=True, text=True)
    if found.returncode == 0 and os.path.isabs(found.stdout.strip()):
        out.append(found.stdout.strip())
    return [p for i, p in enumerate(out) if os.path.exists(p) and p not in out[:i]]


def probe(cxx, flags, work):
    first = _build_and_run(cxx, flags, [], work, "probe_default.so")
    if first is None:
        return "ok"
    # Static linking comes from -static-libstdc++ or from a compiler whose
    # library path holds only libstdc++.a; either way the archive is searched
    # after everything named on the command line, so naming a shared libstdc++
    # resolves every libstdc++ symbol there and nothing is taken from the archive.
    for shared in shared_libstdcxx_candidates(cxx, flags):
        second = _build_and_run(cxx, flags, [shared], work, "probe_shared.so")
        if second is None:
            return f"link-shared {shared}"
        first += f"; linking {shared} explicitly did not help: {second}"
    alternatives = [c for c in (shutil.which("g++"), "/usr/bin/g++", shutil.which("c++"))
                    if c and os.path.exists(c) and os.path.realpath(c) != os.path.realpath(shutil.which(cxx) or cxx)]
    hint = f"CXX={alternatives[0]} " if alternatives else "CXX=<a g++ that links libstdc++ as a shared library> "
    raise SystemExit(
        f"effmem: the C++ compiler {cxx} (flags: {' '.join(flags) or 'none'}) builds extensions that do not use "
        f"the shared libstdc++: {first}.\nSuch an extension crashes or drops numbers from its error messages "
        f"inside a process that has imported torch. Build with a compiler that links libstdc++ dynamically and "
        f"without -static-libstdc++ in CXXFLAGS/LDFLAGS, e.g.\n    {hint}pip install --no-build-isolation -e .")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--cxx", required=True)
    p.add_argument("--flags", default="", help="compile and link flags, one string")
    p.add_argument("--work", default=None, help="folder for the probe files (default: a temporary one)")
    c = sub.add_parser("check")
    c.add_argument("file")
    c.add_argument("--delete-if-bad", action="store_true")
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        print("ok")  # ELF and libstdc++ as torch loads it: the Linux builds this guards
        return
    if args.command == "check":
        problem = library_problem(args.file)
        if problem:
            if args.delete_if_bad:
                os.remove(args.file)
            raise SystemExit(f"effmem: {args.file} does not use the shared libstdc++: {problem}"
                             + (" (deleted)" if args.delete_if_bad else ""))
        print(f"{args.file}: {SHARED_LIBSTDCXX} is NEEDED and no libstdc++ symbols are defined in it")
        return
    flags = shlex.split(args.flags)
    if args.work:
        os.makedirs(args.work, exist_ok=True)
        print(probe(args.cxx, flags, args.work))
    else:
        with tempfile.TemporaryDirectory() as work:
            print(probe(args.cxx, flags, work))


if __name__ == "__main__":
    main()
