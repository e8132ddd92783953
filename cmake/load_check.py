"""Loads the built extension into a Python that has imported torch, as `import effmem` will (run after the
link, before anything is installed).

    python load_check.py FILE [--delete-if-bad]

Exits 1 with the reason, and with --delete-if-bad removes FILE, unless it loads with every symbol resolved and
leaves the floating-point environment as it found it. What this catches, whatever flags or compiler wrapper
the environment gave: a library built for another C++ ABI than torch's (it built, then failed to import on an
undefined symbol), and one whose loading changes the floating-point environment (GCC 12 and older link
crtfastmath.o into it for -ffast-math and the like), flushing denormals to zero in every process that loads
it, torch's results there too. cmake/flags.cmake refuses the flags it knows of before the build; this checks
the result. Only the standard library and torch are used.
"""
import argparse
import os
import subprocess
import sys

LOADER = r"""
import ctypes, struct, sys
import torch
tiny = float("5e-324")        # the smallest double, a denormal: read and written at run time (no folding)
before = struct.pack("d", tiny * float("1.0"))
ctypes.CDLL(sys.argv[1])      # RTLD_NOW: every undefined symbol resolved here, static constructors run
after = struct.pack("d", tiny * float("1.0"))
if after != before:           # as bits: under flushed denormals a comparison of floats takes this one for 0
    sys.exit("loading it flushes denormals to zero in the whole process (GCC 12's crtfastmath.o: a -ffast-math, "
             "-Ofast or -funsafe-math-optimizations in CXX, CXXFLAGS or LDFLAGS?)")
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--delete-if-bad", action="store_true")
    args = parser.parse_args(argv)
    try:
        run = subprocess.run([sys.executable, "-c", LOADER, os.path.abspath(args.file)], capture_output=True,
                             text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"effmem: loading the built extension {args.file} next to torch did not finish in 300 s")
    if run.returncode == 0:
        print(f"{args.file}: loads next to torch, denormals kept")
        return
    lines = run.stderr.strip().splitlines()
    why = lines[-1] if lines else f"the loading process exited with {run.returncode}"
    if args.delete_if_bad:
        os.remove(args.file)
    raise SystemExit(f"effmem: the built extension {args.file} does not work next to torch: {why}"
                     + (" (deleted)" if args.delete_if_bad else ""))


if __name__ == "__main__":
    main()
