#!/usr/bin/env bash
# Builds a wheel with `pip wheel --no-build-isolation` (in .venv, against its
# torch), installs it into a fresh venv holding the same torch, and checks it
# there, away from the source tree: it imports, runs one fused step, needs the
# shared libstdc++ (cmake/libstdcxx_check.py) and its error messages hold
# their numbers (tests/test_error_messages.py).
#
# Then the same for an unkind environment: a CPU-only wheel built with
# LDFLAGS=-static-libstdc++, which makes a plain build carry its own
# libstdc++ (numbers vanish from error messages; on some machines the
# process crashes). The build must notice and link the shared library.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")
# The same torch, its files hard-linked from .venv (tools/link_torch.py: 5 s, where pip unpacking the
# wheels again took 100 s); where that cannot be done, a new venv and pip.
"${PYTHON:-python3}" -m venv "$work/venv"
if ! .venv/bin/python tools/link_torch.py "$work/venv/bin/python"; then
  rm -rf "$work/venv"
  "${PYTHON:-python3}" -m venv "$work/venv"
  "$work/venv/bin/python" -m pip install --quiet "torch==$torch_version"
fi
"$work/venv/bin/python" -m pip install --quiet numpy pytest pytest-timeout

# Installs the wheel in $1 into the fresh venv and checks it there.
check_installed() {
  "$work/venv/bin/python" -m pip install --quiet --no-deps --force-reinstall "$1"/effmem-*.whl
  (cd "$work" && "$work/venv/bin/python" - <<'PY'
import torch, effmem
p = torch.nn.Parameter(torch.randn(1000).bfloat16())
opt = effmem.FusedAdam([p], lr=1e-2)
p.grad = torch.randn(1000).bfloat16()
before = p.detach().clone()
opt.step()
assert not torch.equal(before, p.detach())
assert torch.equal(p.detach(), opt.state[p]["master"].bfloat16())
from effmem.plan import preset_names  # the presets are data files: the wheel must carry them
assert {"llama-7b", "llama-70b", "mixtral-8x7b", "gpt2"} <= set(preset_names()), preset_names()
print("wheel OK:", effmem.__file__, "| torch", torch.__version__, "| isa", effmem._C.cpu_isa(),
      "| CUDA", effmem._C.cuda_compiled, effmem._C.cuda_architectures)
PY
  )
  so=$("$work/venv/bin/python" -c "import effmem._C as c; print(c.__file__)")
  "$work/venv/bin/python" "$root/cmake/libstdcxx_check.py" check "$so"
  (cd "$work" && "$work/venv/bin/python" -m pytest -q -p no:cacheprovider --rootdir "$root/tests" \
      "$root/tests/test_error_messages.py")
  (cd "$work" && "$work/venv/bin/effmem" info >/dev/null)
}

.venv/bin/python -m pip wheel --quiet --no-build-isolation --no-deps -w "$work/dist" .
check_installed "$work/dist"
echo "wheel installs and runs in a fresh venv (built in $root)"

LDFLAGS=-static-libstdc++ EFFMEM_CUDA=OFF .venv/bin/python -m pip wheel --quiet --no-build-isolation --no-deps \
  -C build-dir="$work/build-static" -w "$work/dist-static" .
check_installed "$work/dist-static"
echo "a build with LDFLAGS=-static-libstdc++ still uses the shared libstdc++ and keeps its error messages whole"
