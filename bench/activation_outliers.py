"""What the activation policies' 8-bit saves cost in gradient accuracy when the residual stream has outlier channels.

    python bench/activation_outliers.py [--hidden 512] [--outliers 0 10 30] [--json PATH]

Trained LLMs carry a few hidden channels far larger than the rest in every token (outlier features); random-weight
test models have none. This adds OUTLIER to 4 embedding channels of a bf16 transformers LlamaForCausalLM (2 layers,
random weights, embeddings N(0, 1)) and compares one batch's parameter gradients, plain bf16 and under each policy,
with plain float32's: the worst parameter's relative error |g - g32| / |g32|. The 8-bit codes take a scale per group
of 128 values of a token, so an outlier sets its group's step and its neighbours lose precision ("fast" rebuilds the
norms from those codes, so its attention projections feel it most).
"""
import argparse
import copy
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for common.py
import common  # noqa: E402
import effmem  # noqa: E402

CHANNELS = [3, 77, 200, 401]   # at hidden 512 in 3 of a token's 4 groups of 128 (two share the first)


def model(hidden: int, outlier: float):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, initializer_range=0.05)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        e = m.model.embed_tokens.weight
        e.normal_(0, 1.0)
        e[:, [c % hidden for c in CHANNELS]] += outlier
    return m


def gradients(m, ids):
    m(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}


def worst(got, ref):
    """The parameter whose gradient is furthest from the reference's, relative to the reference's norm."""
    errors = {n: ((got[n] - r).norm() / r.norm()).item() for n, r in ref.items() if r.norm() > 0}
    name = max(errors, key=errors.get)
    return name, errors[name]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=common.count, default=512, help="hidden size (a multiple of 16)")
    parser.add_argument("--outliers", type=common.non_negative, nargs="+", default=[0, 10, 30],
                        help="what the 4 outlier channels add to every token's embedding")
    parser.add_argument("--json", help="write metadata and every row to this file")
    args = parser.parse_args(argv)
    if args.hidden % 16:   # 8 attention heads of an even size (rotary halves each head)
        parser.error(f"--hidden: expected a multiple of 16 (8 attention heads of an even size), got {args.hidden}")
    warnings.simplefilter("ignore")
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    rows = []
    print(f"worst parameter gradient against plain float32 (bf16 Llama, hidden {args.hidden}, 2 layers, 4 x 64 "
          "tokens, 4 outlier channels)")
    for outlier in args.outliers:
        m = model(args.hidden, outlier)
        ref = gradients(copy.deepcopy(m), ids)
        runs = {"plain bf16": copy.deepcopy(m).to(torch.bfloat16)}
        for policy in ("fast", "min"):
            runs[f'"{policy}" bf16'] = effmem.apply_activation_policy(copy.deepcopy(m).to(torch.bfloat16), policy)
        for name, run in runs.items():
            param, error = worst(gradients(run, ids), ref)
            rows.append({"outlier": outlier, "run": name, "worst_param": param, "relative_error": error})
            print(f"  outliers +{outlier:<6g} {name:<12s} {error:6.1%}  ({param})", flush=True)
    if args.json:
        common.write_json(args.json, {"benchmark": "activation_outliers", "env": common.environment(
            torch.device("cpu")), "config": vars(args), "rows": rows})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
