"""The "fast" activation policy's elementwise kernels against the torch ops they replace, in one run.

    python bench/bench_elementwise.py [--device cpu|cuda] [--tokens N] [--hidden H] [--intermediate I]
                                      [--repeat R] [--json PATH]

At TinyLlama's shapes by default (16k tokens, hidden 2048, MLP 5632, bf16), each pair timed taking turns
with a float32 copy (the bandwidth reference):
  swiglu           effmem::swiglu             vs F.silu(gate) * up
  swiglu_backward  effmem::swiglu_backward    vs silu_backward(grad * up, gate), grad * F.silu(gate)
  rms_apply        effmem::rms_norm_apply     vs weight * (x.float() * rstd).to(x.dtype)
  rms_backward     aten._fused_rms_norm_backward (CUDA only) vs the "fast" policy's written-out formula
Per row: median ms, the bytes the fused kernel must move (its inputs and outputs once), that over the time
as GB/s and as a fraction of the copy's, and the ratio of the torch ops' time to the kernel's (the speed-up).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for common.py

import torch
import torch.nn.functional as F

import common
from effmem import ops
from effmem.activations import fused


def cases(device, tokens: int, hidden: int, inter: int, dtype=torch.bfloat16):
    """name -> (fused fn, torch-ops fn, bytes the fused kernel moves)."""
    gen = torch.Generator(device=device).manual_seed(0)
    rand = lambda *s: torch.randn(*s, device=device, generator=gen).to(dtype)   # noqa: E731
    gate, up, grad = rand(tokens, inter), rand(tokens, inter), rand(tokens, inter)
    x, gx, w = rand(tokens, hidden), rand(tokens, hidden), rand(hidden)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    e, n, h = dtype.itemsize, gate.numel(), x.numel()
    out = {
        "swiglu": (lambda: ops.swiglu(gate, up), lambda: F.silu(gate) * up, 3 * n * e),
        "swiglu_backward": (lambda: ops.swiglu_backward(grad, gate, up),
                            lambda: (torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)), 5 * n * e),
        "rms_apply": (lambda: ops.rms_norm_apply(x, rstd, w), lambda: w * (x.float() * rstd).to(dtype),
                      2 * h * e + rstd.numel() * 4),
    }
    if fused._aten_rms_backward_applies(x, gx, w):
        out["rms_backward"] = (lambda: fused._aten_rms_backward(gx, x, rstd, w, [True, True]),
                               lambda: fused._rms_norm_backward([True, True], gx, x, rstd, w), 3 * h * e)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_device(ap)
    ap.add_argument("--tokens", type=common.count)
    ap.add_argument("--hidden", type=common.count, default=2048)
    ap.add_argument("--intermediate", type=common.count, default=5632)
    ap.add_argument("--repeat", type=common.count, default=20)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    common.check_device(ap, args.device)
    tokens = args.tokens or (16384 if args.device == "cuda" else 2048)
    copy_fn, copy_bytes = common.make_copy(args.device, 64 << 20)
    rows = []
    for name, (mine, theirs, nbytes) in cases(args.device, tokens, args.hidden, args.intermediate).items():
        t = common.time_interleaved({"effmem": mine, "torch": theirs, "copy": copy_fn}, args.device,
                                    repeat=args.repeat)
        med = {k: common.summarize(v)["median_ms"] for k, v in t.items()}
        copy_bw = copy_bytes / (med["copy"] / 1e3)
        bw = nbytes / (med["effmem"] / 1e3)
        rows.append({"name": name, "effmem_ms": med["effmem"], "torch_ms": med["torch"], "bytes": nbytes,
                     "gb_per_s": bw / 1e9, "copy_gb_per_s": copy_bw / 1e9, "bw_fraction": bw / copy_bw,
                     "speedup_vs_torch": med["torch"] / med["effmem"]})
    print(common.format_table(rows, [("kernel", "name", ""), ("effmem ms", "effmem_ms", ".3f"),
                                     ("torch ops ms", "torch_ms", ".3f"), ("GB/s", "gb_per_s", ".0f"),
                                     ("of copy", "bw_fraction", ".2f"),
                                     ("torch / effmem", "speedup_vs_torch", ".2f")]))
    if args.json:
        common.write_json(args.json, {"benchmark": "elementwise", "env": common.environment(args.device),
                                      "config": {**vars(args), "tokens": tokens, "dtype": "bfloat16"},
                                      "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
