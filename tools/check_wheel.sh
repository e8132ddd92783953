#!/usr/bin/env bash
# Builds a wheel with `pip wheel --no-build-isolation` (in .venv, against its
# torch), installs it into a fresh venv holding the same torch, and checks it
# imports and runs one fused step there, away from the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")
.venv/bin/python -m pip wheel --quiet --no-build-isolation --no-deps -w "$work/dist" .
"${PYTHON:-python3}" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "torch==$torch_version" numpy
"$work/venv/bin/python" -m pip install --quiet --no-deps "$work"/dist/effmem-*.whl
cd "$work"
"$work/venv/bin/python" - <<'PY'
import torch, effmem
p = torch.nn.Parameter(torch.randn(1000).bfloat16())
opt = effmem.FusedAdam([p], lr=1e-2)
p.grad = torch.randn(1000).bfloat16()
before = p.detach().clone()
opt.step()
assert not torch.equal(before, p.detach())
assert torch.equal(p.detach(), opt.state[p]["master"].bfloat16())
print("wheel OK:", effmem.__file__, "| torch", torch.__version__, "| isa", effmem._C.cpu_isa())
PY
"$work/venv/bin/effmem" info >/dev/null
echo "wheel installs and runs in a fresh venv (built in $root)"
