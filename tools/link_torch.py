"""Gives another virtual environment the torch installed here: torch and every distribution it requires,
file for file as their RECORD lists them, hard-linked into that environment's site-packages (copied where
the two folders are on different file systems).

    .venv/bin/python tools/link_torch.py OTHER_VENV/bin/python

tools/check_wheel.sh uses it for its fresh venv: pip unpacking the same 5.5 GB of torch and CUDA wheels
again took 100 s of CI's time; linking the files takes 5 s and gives the same tree. Files that a
distribution keeps outside site-packages (console scripts) are left out: nothing imports them.
"""
import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path


def closure(root: str):
    """The installed distributions that `root` requires, directly or not, itself included, with the
    requirements that the extras asked of them bring (torch asks cuda-toolkit for [cufile, ...], which
    pull in the nvidia-* wheels). A requirement that is not installed (its marker excluded it) is skipped."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found, asked, todo = {}, set(), [(root, frozenset())]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if (key, extras) in asked:
            continue
        asked.add((key, extras))
        try:
            dist = found.get(key) or metadata.distribution(key)
        except metadata.PackageNotFoundError:
            continue
        found[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append((req.name, frozenset(req.extras)))
    return list(found.values())


def installed_files(dist):
    """(file, path relative to site-packages) for each file of dist's RECORD that exists under site-packages:
    console scripts under ../../bin and RECORD entries with no file behind them are left out."""
    base = Path(dist.locate_file("")).resolve()
    for rel in dist.files or []:
        src = Path(dist.locate_file(rel)).resolve()
        if src.is_file() and base in src.parents:
            yield src, src.relative_to(base)


def link_tree(dists, dest: Path) -> int:
    """Links (or copies) each distribution's files into dest; returns how many files it placed."""
    placed = 0
    for dist in dists:
        for src, rel in installed_files(dist):
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            if out.exists():
                out.unlink()
            try:
                os.link(src, out)
            except OSError:
                shutil.copy2(src, out)
            placed += 1
    return placed


def main(argv) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    other = argv[0]
    probe = "import sys, sysconfig; print(sys.version_info[:2]); print(sysconfig.get_paths()['purelib'])"
    version, purelib = subprocess.run([other, "-c", probe], check=True, capture_output=True,
                                      text=True).stdout.splitlines()
    if version != str(sys.version_info[:2]):
        print(f"link_torch: {other} is Python {version}, this is {sys.version_info[:2]}: the files would not "
              "fit it", file=sys.stderr)
        return 1
    dists = closure("torch")
    if not dists:
        print(f"link_torch: {sys.executable} has no torch installed", file=sys.stderr)
        return 1
    n = link_tree(dists, Path(purelib))
    print(f"link_torch: {len(dists)} distributions ({n} files) from {sys.prefix} into {purelib}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
