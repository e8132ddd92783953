"""What OffloadAdam(delay=True) costs in loss, with and without delay_warmup, on the CPU.

    python bench/bench_delay_warmup.py [--steps 400] [--warmups 0 50 100 200] [--correction-warmups 0 40]
                                       [--seeds 1] [--clip 1.0] [--noise] [--torch-stale] [--schedule]
                                       [--optimizers] [--state-bits-8] [--policies fast min]

Trains a 2-layer transformers LlamaForCausalLM (hidden 128, byte vocabulary) from scratch on
Python standard-library source, batch 16 x 64, lr 3e-3, weight decay 0.1, clip 1.0 (--clip): plain
OffloadAdam (exact), then delay=True with each warm-up, delay=True with delay_correction=True
with each of --correction-warmups (0 and its default's 40), and (--torch-stale) torch's AdamW fed
one-step-stale gradients, the same math as delay without effmem. --schedule: the learning rate
of effmem demo (linear warm-up over 10% of the steps, cosine decay to 10%) instead of a constant
one. --optimizers: torch's AdamW without momentum and SGD (with and without momentum), each exact
against one-step-stale: which update rules staleness hurts. --noise: torch's AdamW on exact gradients,
how far two exact runs drift apart. --state-bits-8: exact OffloadAdam with 8-bit moments (the bits of
FusedAdam(state_bits=8)), what the 8-bit format costs against float32 moments. --policies: exact OffloadAdam
on the model under effmem.apply_activation_policy (8-bit saved activations), what each policy costs in loss
against the exact run's full-precision activations (issue 10's bound: 0.5%). Prints the mean loss of
the last 10 steps of each and its gap to the exact run, per seed, and with --seeds > 1 each row's mean
gap over the seeds.
"""
import argparse
import dataclasses
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for common.py
import common  # noqa: E402
from effmem import OffloadAdam, apply_activation_policy, demo_model  # noqa: E402
from effmem.optim.offload_adam import CORRECTION_WARMUP  # noqa: E402


@dataclasses.dataclass
class Setting:
    """What the runs of one comparison share. seed: the model's initialisation and the batches' order (0: the
    single-seed figures of docs/offload_adam.md); clip: the global norm clipped to (0: none)."""
    corpus: torch.Tensor
    steps: int
    schedule: bool = False
    seed: int = 0
    clip: float = 1.0


def model(seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def batches(s: Setting):
    g = torch.Generator().manual_seed(1 + s.seed)
    for _ in range(s.steps):
        i = torch.randint(0, len(s.corpus) - 65, (16,), generator=g)
        yield torch.stack([s.corpus[j:j + 64] for j in i])


def scheduler(opt, s: Setting):
    from effmem.cli import lr_lambda
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(s.steps) if s.schedule else (lambda step: 1.0))


def run_offload(s: Setting, delay, warmup, correction=False, state_bits=32, policy=None):
    m = model(s.seed)
    if policy:
        apply_activation_policy(m, policy)
    opt = OffloadAdam(m.parameters(), lr=3e-3, weight_decay=0.1, delay=delay, delay_warmup=warmup,
                      delay_correction=correction, state_bits=state_bits)
    sched = scheduler(opt, s)
    losses = []
    for x in batches(s):
        loss = m(input_ids=x, labels=x).loss
        loss.backward()
        if s.clip:
            opt.clip_grad_norm_(s.clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    opt.close()
    tail = losses[-10:]   # the mean of the last ten (of all, in a shorter run)
    return sum(tail) / len(tail)


def run_torch(s: Setting, stale=True, make_opt=None):
    """torch's AdamW (or `make_opt(params)`), fed one-step-stale gradients (`stale`) or exact ones."""
    m = model(s.seed)
    ps = list(m.parameters())
    opt = make_opt(ps) if make_opt else torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1)
    sched = scheduler(opt, s)
    losses, previous = [], None
    for x in batches(s):
        loss = m(input_ids=x, labels=x).loss
        loss.backward()
        if s.clip:
            torch.nn.utils.clip_grad_norm_(ps, s.clip)
        current = [p.grad.clone() for p in ps]
        if not stale:
            opt.step()
        elif previous is not None:  # the first step has no earlier gradient, as with delay
            for p, g in zip(ps, previous):
                p.grad = g
            opt.step()
        previous = current
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    tail = losses[-10:]   # the mean of the last ten (of all, in a shorter run)
    return sum(tail) / len(tail)


# --optimizers: what staleness costs other update rules, each against itself fed exact gradients (lr 3e-3)
OPTIMIZERS = {"AdamW without momentum (beta1=0)": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1,
                                                                               betas=(0.0, 0.999)),
              "SGD": lambda ps: torch.optim.SGD(ps, lr=3e-3),
              "SGD with momentum 0.9": lambda ps: torch.optim.SGD(ps, lr=3e-3, momentum=0.9)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=common.count, default=400)
    parser.add_argument("--warmups", type=common.non_negative, nargs="*", default=[0, 50, 100, 200])
    parser.add_argument("--correction-warmups", type=common.non_negative, nargs="*", default=[0, CORRECTION_WARMUP],
                        help="delay_correction=True runs, one per warm-up")
    parser.add_argument("--seeds", type=common.count, default=1,
                        help="repeat everything for this many initialisations and batch orders; print each "
                             "row's mean gap to exact over them")
    parser.add_argument("--clip", type=float, default=1.0, help="the global norm clipped to (0: no clipping)")
    parser.add_argument("--noise", action="store_true",
                        help="also torch's AdamW with exact gradients: the same math as exact OffloadAdam, "
                             "other roundings, so its gap is how far two exact runs drift apart")
    parser.add_argument("--torch-stale", action="store_true")
    parser.add_argument("--schedule", action="store_true", help="effmem demo's warm-up and cosine decay")
    parser.add_argument("--optimizers", action="store_true",
                        help="also torch's AdamW without momentum and SGD, each exact against one-step stale")
    parser.add_argument("--state-bits-8", action="store_true",
                        help="also exact OffloadAdam with 8-bit moments, against float32 moments")
    parser.add_argument("--policies", nargs="*", default=[], choices=["fast", "min"],
                        help="also exact OffloadAdam with each activation policy applied to the model")
    parser.add_argument("--json", help="write metadata, each run's final loss and the gaps to this file")
    args = parser.parse_args(argv)
    if not 0 <= args.clip < float("inf"):   # checked here, not after the exact run has trained for minutes
        parser.error(f"--clip: expected a finite number >= 0 (0: no clipping), got {args.clip}")
    warnings.simplefilter("ignore")
    corpus = torch.tensor(list(demo_model.stdlib_corpus(max_bytes=1 << 20)), dtype=torch.long)
    gaps, exacts, optimizers = {}, [], {}
    for seed in range(args.seeds):
        s = Setting(corpus, args.steps, args.schedule, seed, args.clip)
        exact = run_offload(s, False, 0)
        exacts.append(exact)
        print(f"{args.steps} steps, {'warm-up + cosine' if args.schedule else 'constant'} learning rate, seed "
              f"{seed}; final loss (mean of the last 10): exact OffloadAdam {exact:.4f}", flush=True)

        def report(name, loss, exact=exact):
            gaps.setdefault(name, []).append((loss - exact) / exact)
            print(f"  {name:<48s} {loss:.4f}  ({gaps[name][-1]:+.2%})", flush=True)
        for w in args.warmups:
            report(f"delay, delay_warmup={w}", run_offload(s, True, w))
        for w in args.correction_warmups:
            report(f"delay + delay_correction, delay_warmup={w}", run_offload(s, True, w, correction=True))
        if args.noise:
            report("torch AdamW, exact gradients (noise floor)", run_torch(s, stale=False))
        if args.torch_stale:
            report("torch AdamW, one-step-stale gradients", run_torch(s))
        if args.state_bits_8:
            report("exact, state_bits=8", run_offload(s, False, 0, state_bits=8))
        for policy in args.policies:
            report(f'exact, apply_activation_policy "{policy}"', run_offload(s, False, 0, policy=policy))
    if args.seeds > 1:
        common.print_seed_gaps("exact OffloadAdam", gaps, width=48)
    if args.optimizers:
        s = Setting(corpus, args.steps, args.schedule, 0, args.clip)
        for name, make in OPTIMIZERS.items():
            ref = run_torch(s, stale=False, make_opt=make)
            loss = run_torch(s, make_opt=make)
            print(f"  {name}: exact {ref:.4f}, one-step-stale {loss:.4f}  ({(loss - ref) / ref:+.1%})")
            optimizers[name] = {"exact": ref, "one_step_stale": loss}
    if args.json:
        common.write_json(args.json, {"benchmark": "delay_warmup", "env": common.environment(torch.device("cpu")),
                                      "config": vars(args), "exact_final_loss": exacts,
                                      "relative_gap_to_exact": gaps, "optimizers": optimizers})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
