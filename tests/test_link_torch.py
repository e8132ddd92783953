"""tools/link_torch.py, which gives tools/check_wheel.sh's fresh venv the torch of .venv: the distributions it
links are the ones pip would install for torch (extras' requirements included), and the files it places are
the installed ones, byte for byte."""
import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "link_torch.py"
spec = importlib.util.spec_from_file_location("link_torch", SCRIPT)
link_torch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(link_torch)


def names(dists):
    return {d.metadata["Name"].lower().replace("_", "-") for d in dists}


def test_closure_follows_requirements_and_the_extras_they_ask_for():
    found = names(link_torch.closure("torch"))
    assert {"torch", "filelock", "sympy", "mpmath"} <= found   # mpmath: only through sympy
    assert not {"pytest", "transformers", "effmem"} & found     # installed here, not torch's
    if torch.version.cuda and "cuda-toolkit" in found:
        # torch asks cuda-toolkit for [cufile, ...]; those extras bring the nvidia wheels torch loads.
        assert {"nvidia-cufile", "nvidia-cublas"} <= found


def test_link_tree_places_the_installed_files(tmp_path):
    dists = link_torch.closure("mpmath")      # small and pure Python
    assert names(dists) == {"mpmath"}
    site = tmp_path / "site"
    placed = link_torch.link_tree(dists, site)
    (dist,) = dists
    recorded = {str(rel): src for src, rel in link_torch.installed_files(dist)}
    assert "mpmath/__init__.py" in recorded and placed == len(recorded) > 10
    assert {str(f.relative_to(site)) for f in site.rglob("*") if f.is_file()} == set(recorded)
    assert all((site / rel).read_bytes() == src.read_bytes() for rel, src in recorded.items())
    assert not (tmp_path / "bin").exists()   # nothing outside site-packages


def test_a_python_of_another_version_is_refused(tmp_path, capsys):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho '(2, 7)'\necho /nowhere\n")
    fake.chmod(0o755)
    assert link_torch.main([str(fake)]) == 1
    assert "is Python (2, 7)" in capsys.readouterr().err
    assert link_torch.main([]) == 2 and "OTHER_VENV" in capsys.readouterr().err
