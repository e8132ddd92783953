"""Bytes the elementwise ops of one training step move, per activation row, counted on the CPU.

    python bench/activation_traffic.py [--hidden 512] [--layers 2] [--tokens 1024] [--json PATH]

An eager step spends its non-matmul time in elementwise passes that each read and write whole activations,
so their bytes are what a GPU pays for them. This counts, with a dispatch mode, the bytes every aten op
reads and writes (inputs plus outputs; views, allocations and the matmul/attention kernels left out) in one
forward and backward of a bf16 transformers Llama, for plain training, HF checkpointing, torch SAC and the
effmem policies; and for "fast" once more as CUDA runs it (`fast_cuda_paths`): effmem's swiglu kernels
forced on (rms_norm_apply runs on the CPU anyway; both are counted as they run) and aten's fused
RMSNorm backward, which has no CPU kernel, replaced by the written-out formula run uncounted and booked at
10 bytes per element (read grad and x twice, write the gradient). A model of GPU memory traffic, not a
timing: it says nothing about kernels' bandwidth.
"""
import argparse
import collections
import contextlib
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from activation_measure import SacCaches  # noqa: E402
import bench_activations  # noqa: E402
import common  # noqa: E402

FREE = {"view", "_unsafe_view", "reshape", "transpose", "t", "expand", "permute", "slice", "select", "unsqueeze",
        "squeeze", "as_strided", "alias", "detach", "split", "unbind", "split_with_sizes", "_reshape_alias",
        "lift_fresh", "empty", "empty_like", "new_empty", "empty_strided"}
MATMUL = {"mm", "addmm", "bmm", "embedding", "embedding_dense_backward"}


class CountBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name not in FREE and name not in MATMUL and "attention" not in name:
            self.bytes[name] += sum(t.numel() * t.element_size() for t in tree_flatten((args, kwargs, out))[0]
                                    if isinstance(t, torch.Tensor))
        return out


@contextlib.contextmanager
def cuda_paths(counter: CountBytes):
    """The "fast" policy's CUDA branches taken on CPU tensors (see the module's docstring)."""
    from effmem.activations import fused

    def aten_rms_backward(grad, x, rstd, weight, mask, op=None):
        with _disable_current_modes():
            out = fused._rms_norm_backward(mask, grad, x, rstd, weight)[:2]
        counter.bytes["aten_fused_rms_norm_backward (booked)"] += 10 * x.numel()
        return out

    # (rms_norm_apply needs nothing: the CPU takes it already)
    saved = (fused._aten_rms_backward_applies, fused._aten_rms_backward, fused._swiglu_kernel_applies)
    fused._aten_rms_backward_applies = lambda x, g, w: x.dtype == g.dtype == w.dtype
    fused._aten_rms_backward = aten_rms_backward
    fused._swiglu_kernel_applies = lambda *ts: all(t.dtype == ts[0].dtype and t.shape == ts[0].shape for t in ts)
    try:
        yield
    finally:
        fused._aten_rms_backward_applies, fused._aten_rms_backward, fused._swiglu_kernel_applies = saved


def count(row: str, args) -> int:
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                   num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                   num_key_value_heads=max(1, args.hidden // 256), vocab_size=1024,
                                   max_position_embeddings=4096, use_cache=False, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model, _ = bench_activations.setup(row.removesuffix("_cuda_paths"), model, None, SacCaches())
    x = torch.randint(0, 1024, (args.tokens // 256, 256))
    counter = CountBytes()
    with cuda_paths(counter) if row.endswith("_cuda_paths") else contextlib.nullcontext():
        model(input_ids=x, labels=x).loss.backward()        # first step: the policies settle
        model.zero_grad()
        counter.bytes.clear()   # the first step's booked norm backwards too (counted twice before)
        with counter:
            model(input_ids=x, labels=x).loss.backward()
    return sum(counter.bytes.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=common.count, default=512, help="a multiple of 64 (the heads are 64 wide)")
    ap.add_argument("--layers", type=common.count, default=2)
    ap.add_argument("--tokens", type=common.count, default=1024, help="a multiple of 256 (sequences of 256)")
    ap.add_argument("--rows", default="plain,hf_checkpointing,torch_sac,effmem_fast,effmem_fast_cuda_paths,effmem_min")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.hidden % 64 or (args.hidden // 64) % max(1, args.hidden // 256):
        ap.error(f"--hidden: a multiple of 64 (heads of 64) whose heads, hidden / 64, the key/value heads, "
                 f"hidden / 256, divide, got {args.hidden}")
    if args.tokens % 256:
        ap.error(f"--tokens: a multiple of 256 (sequences of 256), got {args.tokens}")
    names = args.rows.split(",")
    # the eager rows of bench_activations, each also with the "fast" policy's CUDA branches (_cuda_paths)
    known = bench_activations.EAGER_ROWS + [r + "_cuda_paths" for r in bench_activations.EAGER_ROWS]
    unknown = [r for r in names if r not in known]
    if unknown:
        ap.error(f"--rows: unknown {', '.join(unknown)} (expected some of {', '.join(known)})")
    rows = {r: count(r, args) for r in names}
    base = rows.get("plain")
    for r, b in rows.items():
        print(f"{r:26s} {b / 1e6:9.1f} MB" + (f"  {b / base:.2f}x plain" if base else ""))
    if args.json:
        common.write_json(args.json, {"benchmark": "activation_traffic", "env": common.environment(torch.device("cpu")),
                                      "config": vars(args), "non_matmul_bytes": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
