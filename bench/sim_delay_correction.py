"""OffloadAdam(delay=True, delay_correction=True)'s prediction simulated in torch ops on effmem demo's model:
what two of its approximations, and each warm-up length, cost in final loss, over seeds, without the engine.

    python bench/sim_delay_correction.py [--variants exact correction correction+warmup40 ...] [--seeds 4]
                                         [--steps 200] [--layers 4] [--d-model 128] [--json PATH]

Trains `effmem demo`'s byte-level GPT in bf16 with AdamW on float32 masters (the engine's update, one float32
operation at a time: effmem.reference.adam_update_f32; the demo's hyper-parameters, learning-rate warm-up and
cosine, clip 1.0, weight decay on matrices) once per variant and seed. Each forward
reads: exact, the master rounded to bf16; correction, what the engine predicts, operation by operation
(effmem.reference.delay_correction_weights, which the tests hold bit for bit to the engine): the previous
update's learning rate and clip factor, and in the momentum's part Adam's v without the new gradient's share.
`+lr` and `+clip` give the prediction the step's own ones, `+warmupN` takes N exact steps first (delay_warmup).
Prints each variant's final training loss (mean of the last 20 steps), its gap to exact per seed and the
mean gap over the seeds. One thread: the runs are deterministic.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for common.py
import common  # noqa: E402
from effmem import cli, demo_model  # noqa: E402
from effmem.optim.clip import clip_coefficient, grad_norm  # noqa: E402
from effmem.reference import adam_coeffs, adam_update_f32, delay_correction_weights  # noqa: E402

FIXES = ("lr", "clip")


def parse_variant(text: str) -> dict:
    """'correction+lr+warmup40' -> {'predict': True, 'lr': True, 'warmup': 40, ...}; 'exact' predicts nothing."""
    head, *parts = text.split("+")
    if head not in ("exact", "correction") or (head == "exact" and parts):
        raise ValueError(f"--variants: expected 'exact' or 'correction' with +lr, +clip, +warmupN; "
                         f"got {text!r}")
    v = {"predict": head == "correction", "warmup": 0, **{f: False for f in FIXES}}
    for p in parts:
        if p in FIXES:
            v[p] = True
        elif p.startswith("warmup") and p[6:].isdigit():
            v["warmup"] = int(p[6:])
        else:
            raise ValueError(f"--variants: {text!r} has an unknown part {p!r} (expected lr, clip or warmupN)")
    return v


def train(variant: dict, seed: int, args, corpus) -> float:
    hp, f = cli.HYPERPARAMETERS, cli.lr_lambda(args.steps)
    torch.manual_seed(seed)
    model = demo_model.ByteGPT(demo_model.GPTConfig(seq_len=args.seq_len, n_layer=args.layers,
                                                    d_model=args.d_model, n_head=cli._default_heads(args.d_model)))
    model = model.to(torch.bfloat16)
    params = [(p, g["weight_decay"]) for g in demo_model.decay_groups(model, hp["weight_decay"]) for p in g["params"]]
    master = [p.detach().float() for p, _ in params]
    m = [torch.zeros_like(w) for w in master]
    v = [torch.zeros_like(w) for w in master]
    (b1, b2), eps = hp["betas"], hp["eps"]
    decays = {wd for _, wd in params}
    groups = {wd: {"betas": (b1, b2), "eps": eps, "weight_decay": wd} for wd in decays}
    lrs = [hp["lr"] * f(i) for i in range(args.steps)]
    gen, losses, prev_c = torch.Generator().manual_seed(seed), [], 1.0
    for t in range(args.steps):   # the update of step k = t + 1
        x, y = demo_model.sample_batch(corpus, args.batch_size, args.seq_len, gen)
        model.zero_grad(set_to_none=True)
        loss = model(x, y)[1]
        loss.backward()
        losses.append(loss.item())
        grads = [p.grad.float() for p, _ in params]
        c = float(clip_coefficient(grad_norm(grads), hp["max_grad_norm"]))   # effmem's clip factor
        lr = lrs[t]
        exact = not variant["predict"] or t < max(1, variant["warmup"])
        lr_p = lr if variant["lr"] or t == 0 else lrs[t - 1]   # the engine's: the previous update's
        c_p = c if variant["clip"] else prev_c
        # the step's constants, once per weight-decay group (not per tensor)
        coeffs = {wd: adam_coeffs(lr, b1, b2, eps, wd, True, True, t + 1.0, c) for wd in decays}
        for i, ((p, wd), g) in enumerate(zip(params, grads)):
            # the engine's (and FusedAdam's) update, one float32 operation at a time
            w1, m1, v1 = adam_update_f32(master[i], m[i], v[i], g, coeffs[wd])
            if exact:
                forward = w1
            else:   # the engine's operations and roundings, from the state before this update and g
                forward = delay_correction_weights(master[i], m[i], v[i], g, torch.bfloat16, groups[wd], lr_p, t,
                                                   c_p)
            master[i], m[i], v[i] = w1, m1, v1
            with torch.no_grad():
                p.copy_(forward)
        prev_c = c
    tail = losses[-20:]
    return sum(tail) / len(tail)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=["exact", "correction", "correction+warmup40"])
    ap.add_argument("--seeds", type=common.count, default=4)
    ap.add_argument("--steps", type=common.count, default=cli.CPU_DEFAULTS["steps"])
    ap.add_argument("--layers", type=common.count, default=cli.CPU_DEFAULTS["layers"])
    ap.add_argument("--d-model", type=common.count, default=cli.CPU_DEFAULTS["d_model"])
    ap.add_argument("--seq-len", type=common.count, default=cli.CPU_DEFAULTS["seq_len"])
    ap.add_argument("--batch-size", type=common.count, default=cli.CPU_DEFAULTS["batch_size"])
    ap.add_argument("--json", help="write metadata and every run's final loss to this file")
    args = ap.parse_args(argv)
    texts = list(dict.fromkeys(["exact"] + args.variants))   # the gaps' reference runs first
    try:
        variants = [parse_variant(t) for t in texts]
    except ValueError as e:
        ap.error(str(e))
    torch.set_num_threads(1)
    corpus = demo_model.split_corpus(demo_model.stdlib_corpus())[0]
    losses = {t: [] for t in texts}
    for seed in range(args.seeds):
        for text, variant in zip(texts, variants):
            losses[text].append(train(variant, seed, args, corpus))
        exact = losses["exact"][-1]
        print(f"seed {seed}: " + ", ".join(f"{t} {losses[t][-1]:.4f} ({losses[t][-1] / exact - 1:+.2%})"
                                           for t in texts), flush=True)
    common.print_seed_gaps("exact", {t: [a / e - 1 for a, e in zip(losses[t], losses["exact"])] for t in texts})
    if args.json:
        common.write_json(args.json, {"benchmark": "sim_delay_correction",
                                      "env": common.environment(torch.device("cpu")),
                                      "config": vars(args),
                                      "final_loss": losses})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
