"""effmem.plan(): every candidate configuration's predicted peak and step time, and the pick."""
import contextlib
import gc
import itertools
import numbers
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from effmem.optim._validate import whole
from effmem.plan import choose, costs, offload_room, step_model
from effmem.plan.activity import Activity, FormulaActivity, hf_config
from effmem.plan.choose import GB, Candidate
from effmem.plan.model import ModelArg, ModelSpec, model_spec, techniques_on
from effmem.plan.rates import Rates, rates_for
from effmem.plan.machine import machine, parse_bytes
from effmem.plan.trace import InputsFn, TraceFailed

HEADROOM = 0.05  # a pick must fit in 95% of the GPU's memory


def _micro_batches(per_gpu: int, accum: Optional[int]) -> List[int]:
    if accum is not None:
        if per_gpu % accum:
            raise ValueError(f"accum: {accum} does not divide the batch per GPU ({per_gpu})")
        return [per_gpu // accum]
    # powers of two that divide it, and the whole batch (a walk over every divisor took seconds at 1e8)
    return sorted({1 << k for k in range(per_gpu.bit_length()) if per_gpu % (1 << k) == 0} | {per_gpu})


@dataclass
class Plan:
    """The answer of effmem plan: every candidate, the pick, and how they were predicted."""
    model: str
    params: int
    trainable_params: int
    gpu_memory: int
    host_memory: int
    gpus: int
    device: str
    batch: int
    seq: int
    rates: Rates
    candidates: List[Candidate]
    best: Optional[str]
    method: str
    seconds: float
    spec: ModelSpec = field(repr=False, default=None)
    notes: List[str] = field(default_factory=list)
    formula_check: Optional[dict] = None   # the trace against plan/formula.py, where it applies
    headroom: float = HEADROOM   # the share of gpu_memory a pick leaves free (fits: peak <= its rest)

    @property
    def usable_memory(self) -> float:
        """gpu_memory less the headroom: what a candidate's peak must stay under to fit."""
        return self.gpu_memory * (1 - self.headroom)

    @property
    def pick(self) -> Optional[Candidate]:
        """The chosen candidate, or None where none fits: among those that fit with headroom and are predicted
        within 3% of the fastest (closer than the step model can tell), exact math first (no 8-bit activations
        or moments), then no host memory, then the fastest; ``pick.why`` says how far it is from the fastest."""
        return next((c for c in self.candidates if c.name == self.best), None)

    def candidate(self, name: str) -> Candidate:
        """The candidate called `name` (as the report and ``as_dict()`` name them); KeyError if there is none."""
        for c in self.candidates:
            if c.name == name:
                return c
        raise KeyError(f"candidate: no {name!r} in this plan (names look like {self.candidates[0].name!r})")

    def as_dict(self) -> dict:
        """The plan as the JSON contract has it (``effmem plan --json``)."""
        return {"model": self.model, "params": self.params, "trainable_params": self.trainable_params,
                "gpu_memory": self.gpu_memory, "host_memory": self.host_memory, "gpus": self.gpus,
                "device": self.device, "batch": self.batch, "seq": self.seq, "method": self.method,
                "rates": self.rates.as_dict(), "plan_seconds": self.seconds, "notes": self.notes,
                "formula_check": self.formula_check,
                "candidates": [c.as_dict() for c in self.candidates], "best": self.best}

    def apply(self, model, candidate: Optional[str] = None, **optimizer_kwargs):
        """(model, optimizer): the model prepared as the pick (or the candidate named `candidate`) says, and
        its optimizer, made with ``optimizer_kwargs`` (lr defaults to 3e-4; the others to the optimizer's own;
        those the candidate sets, state_bits and OffloadAdam's modes, are refused).
        See effmem.plan.apply.apply for what each part of a candidate does to the model."""
        from effmem.plan.apply import apply
        return apply(self, model, candidate, **optimizer_kwargs)

    @staticmethod
    def micro_batch(opt, index: int, accumulation: int):
        """The context to run micro-batch `index` (from 0) of `accumulation` in: OffloadAdam's
        accumulating() for all but the last (device_accumulation keeps gradients on the GPU under it)."""
        from effmem.plan.apply import micro_batch
        return micro_batch(opt, index, accumulation)

    def __str__(self) -> str:
        from effmem.plan.report import format_plan
        return format_plan(self)


def _fusable(spec: ModelSpec) -> bool:
    """Whether effmem.fuse_linear_cross_entropy knows the model's class (or, in PEFT's PeftModel, its model's, as
    fusing takes it) and computes its loss, through a plain output layer that fusing takes (a LoRA on it, or
    forward hooks on it, are refused)."""
    from effmem.linear_ce_hf import _check_hooks, _peft_base, knows, own_loss
    model = spec.module if spec.module is not None else spec.build_layers(1)
    model = _peft_base(model) or model
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not (knows(model) and own_loss(model) and type(head) is nn.Linear):
        return False
    try:
        _check_hooks(head)
    except RuntimeError:
        return False
    return True


def _attention_dropout(cfg: dict) -> float:
    """The attention dropout of a resolved config (hf_config: its class's default where the dict named
    none, GPT-2's 0.1)."""
    return max(float(cfg.get(k) or 0) for k in ("attn_pdrop", "attention_dropout"))


def _cross_check(spec: ModelSpec, act: "Activity", seq: int) -> Optional[dict]:
    """The trace against plan/formula.py for one bf16 sequence, where the formula knows the model."""
    from effmem.plan.formula import saved_bytes
    cfg = hf_config(spec)
    formula = saved_bytes(cfg, 1, seq) if cfg else None
    if formula is None or (act.target == "cpu" and _attention_dropout(cfg) > 0):
        # the formula counts flash attention; a CPU runs attention with dropout (GPT-2's attn_pdrop) as the
        # math, which keeps the [seq, seq] weights: the two would differ by design (42% for a small GPT-2)
        return None
    traced = sum(act.one.activations("none").values())
    return {"formula": formula, "traced": traced, "relative_difference": traced / formula - 1}


def _trainable_share(spec: ModelSpec) -> float:
    """Share of weight elements that train, counted over matrices (the weights matmuls use)."""
    mats = [p for p in spec.params if len(p.shape) >= 2]
    total = sum(p.numel for p in mats)
    return sum(p.trainable for p in mats) / total if total else 1.0


def _position_limit(spec: ModelSpec) -> Optional[Tuple[int, str]]:
    """The longest sequence a model with learned positions takes, and the config key saying so (GPT-2's
    n_positions, OPT's max_position_embeddings); None for rotary positions, which have no table to run off."""
    cfg = hf_config(spec)
    if isinstance(cfg.get("n_positions"), int):
        return cfg["n_positions"], "n_positions"
    most = cfg.get("max_position_embeddings")
    if not isinstance(most, int) or spec.build_layers is None:
        return None
    # a table of learned positions (OPT's, BioGPT's: an embedding of max_position_embeddings rows, 2 more for
    # their offset) besides the tokens': the meta trace never indexes it, so it would plan past its end
    model = spec.build_layers(1)
    tokens = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if any(isinstance(m, nn.Embedding) and m is not tokens and m.num_embeddings in (most, most + 2)
           for m in model.modules()):
        return most, "max_position_embeddings"
    return None


def plan(model: ModelArg, batch: int = 8, seq: Optional[int] = None, accum: Optional[int] = None,
         gpu_memory: Union[str, int, None] = None, host_memory: Union[str, int, None] = None,
         gpus: Optional[int] = None, trainable: Optional[str] = None, device: Optional[str] = None,
         clipping: bool = True, headroom: float = HEADROOM, inputs: Optional[InputsFn] = None,
         rates: Optional[Rates] = None) -> Plan:
    """Predict every candidate configuration's peak memory and step time; pick one that fits (Plan.pick).

    model: a preset name (``from effmem.plan import preset_names``: ``effmem.plan`` is this function, which
    hides the package's modules from attribute access), a config.json path, a Hugging Face config or
    an nn.Module (any device; it is traced on meta tensors). batch: sequences per optimizer step over
    all GPUs; seq: tokens per sequence (default 2048, or fewer where the model's learned positions end);
    accum: micro-batches per step (searched when None).
    gpu_memory / host_memory: sizes ("80GB", "80GiB" or bytes; default: this machine's, and for a plan on cuda
    without a GPU here an H100's 80 GB, planned with its rates). gpus: GPUs (default: this machine's, at least
    1). device: "cuda" or "cpu" (default: cuda when there is a GPU or gpu_memory or gpus was given).
    trainable: regular expressions of the parameters that train (model.py's Trainable). clipping: the recipe
    clips by global norm (rules out OffloadAdam's overlap mode). headroom: the share of gpu_memory a pick
    leaves free. inputs: callable(batch, seq, device) -> (args, kwargs) for the model's training forward
    (default: token ids and labels). rates: a Rates (from effmem.plan.rates import Rates).
    """
    with _collector_paused():
        return _plan(model, batch, seq, accum, gpu_memory, host_memory, gpus, trainable, device, clipping,
                     headroom, inputs, rates)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for the call: a plan builds thousands of modules and meta tensors
    that live until it returns, and the collections they set off each walk the whole heap (torch's and
    transformers' objects included): 10-15% of a 70B preset's plan on a 2-core machine. Nothing is lost:
    the collector runs again when it is switched back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _check_options(headroom, clipping, inputs, rates) -> None:
    """The keywords _plan only compares or calls: a wrong type failed deep inside (a TypeError from a
    comparison, an AttributeError from rates) or, worse, passed: clipping='no' is truthy, and inputs=5 made
    every trace fail, which the planner takes for a model it cannot trace (the closed form, silently)."""
    if isinstance(headroom, bool) or not isinstance(headroom, numbers.Real) or not 0 <= headroom < 1:
        raise ValueError(f"headroom: expected a fraction in [0, 1), got {headroom!r}")
    if not isinstance(clipping, bool):
        raise TypeError(f"clipping: expected True or False, got {clipping!r}")
    if inputs is not None and not callable(inputs):
        raise TypeError(f"inputs: expected a callable(batch, seq, device) -> (args, kwargs), got "
                        f"{type(inputs).__name__}")
    if rates is not None and not isinstance(rates, Rates):
        raise TypeError("rates: expected a Rates (from effmem.plan.rates import Rates, calibrate; calibrate() "
                        f"makes one), got {type(rates).__name__}")


class InputsFailed(ValueError):
    """The user's inputs callable raised, or returned no (args, kwargs): taken for a model that cannot be
    traced, the plan fell back on the closed form, silently."""


def checked_inputs(inputs: Optional[InputsFn]) -> Optional[InputsFn]:
    """The user's inputs callable, its failures raised as InputsFailed (which the planner does not fall back on)."""
    def call(batch, seq, device):
        try:
            got = inputs(batch, seq, device)
        except Exception as e:  # noqa: BLE001
            raise InputsFailed(f"inputs: the callable raised {type(e).__name__}: {e}") from e
        pair = isinstance(got, (tuple, list)) and len(got) == 2
        if not (pair and isinstance(got[0], (tuple, list)) and isinstance(got[1], Mapping)):
            what = (f"({type(got[0]).__name__}, {type(got[1]).__name__})" if pair else
                    f"{type(got).__name__}" + (f" of {len(got)}" if isinstance(got, (tuple, list)) else ""))
            raise InputsFailed(f"inputs: expected the callable to return (args, kwargs), a tuple and a mapping "
                               f"(a dict, a tokenizer's BatchEncoding), got {what}")
        return tuple(got[0]), dict(got[1])
    return None if inputs is None else call


def _raise_hinted(e: Exception, spec: ModelSpec, inputs) -> None:
    """The trace's error, raised (in an except block); for a module traced on the default token ids and labels
    (trace.default_inputs: a config with a vocabulary), with the way out: a classifier or a speech model failed
    deep inside transformers, naming neither (a reviewer's Whisper: "'NoneType' object has no attribute
    'shape'")."""
    if inputs is not None or not hasattr(getattr(spec.module, "config", None), "vocab_size"):
        raise
    why = e if isinstance(e, TraceFailed) else f"{type(e).__name__}: {e}"
    raise TraceFailed(f"{why} (traced on effmem plan's default inputs, input_ids and labels of [batch, seq] as a "
                      "causal LM trains on; for another model pass inputs=callable(batch, seq, device) -> (args, "
                      "kwargs) giving its training forward)") from e


def _cpu_share(gpu_mem: Optional[int], host_mem: int, world: int) -> Tuple[int, Optional[str]]:
    """A CPU rank's memory: gpu_memory where given, at most the host's share per rank; and a note where the
    share cut gpu_memory down (the plan said '1 x cpu with 25.3 GB' for --gpu-memory 80GB, without a word)."""
    share = host_mem // world
    if gpu_mem is None or gpu_mem <= share:
        return gpu_mem or share, None
    per = f" / {world} ranks" if world > 1 else ""
    return share, (f"gpu_memory: {gpu_mem / GB:.3g} GB given, but on device cpu a rank has the host memory's share:"
                   f" planned for {share / GB:.3g} GB (host_memory {host_mem / GB:.3g} GB{per})")


def _plan(model, batch, seq, accum, gpu_memory, host_memory, gpus, trainable, device, clipping, headroom, inputs,
          rates) -> Plan:
    t0 = time.perf_counter()
    batch = whole(batch, "batch", 1)
    if seq is not None:
        seq = whole(seq, "seq", 1)
    if accum is not None:
        accum = whole(accum, "accum", 1)
    _check_options(headroom, clipping, inputs, rates)
    inputs = checked_inputs(inputs)
    here = machine()
    gpu_mem = parse_bytes(gpu_memory, "gpu_memory")
    if device is None:   # GPU memory or a GPU count asks for GPUs, also on a machine without one
        device = "cuda" if (gpu_mem is not None or gpus is not None or here["gpus"]) else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device: expected 'cuda' or 'cpu', got {device!r}")
    host_mem = parse_bytes(host_memory, "host_memory") or here["host_memory"]
    capped = None   # a note where the host's share cut gpu_memory down (device cpu)
    if device == "cpu":
        # One process, or `gpus` CPU ranks under torch.distributed (gloo): what the tests run.
        world = gpus if gpus is not None else 1
        world = whole(world, "gpus", 1)
        # the ranks share the machine's memory: each rank's peak within its share (no candidate keeps state
        # on the host on a CPU, so that is the whole of the fit)
        gpu_mem, capped = _cpu_share(gpu_mem, host_mem, world)
    else:
        world = gpus if gpus is not None else max(1, here["gpus"])
        if gpu_mem is None:  # this machine's GPU, or an 80 GB one where there is none
            gpu_mem = here["gpu_memory"] or 80 * GB
        world = whole(world, "gpus", 1)
    if batch % world:
        raise ValueError(f"batch: {batch} sequences do not split evenly over {world} GPUs")
    rates = rates or rates_for("cpu" if device == "cpu" else (here["gpu_name"] or "NVIDIA H100 80GB HBM3"))

    if isinstance(model, nn.Module):
        on = techniques_on(model, fused_loss=False)
        if on:   # traced with it, every candidate counted it on top of its own (a "fast" model's: 1/18 kept)
            raise ValueError(f"model: {'; '.join(on)} already on it; plan() traces the model as it was built "
                             "and counts each candidate's techniques itself: undo that first")
    spec = model_spec(model, trainable)
    share = _trainable_share(spec)
    notes = [capped] if capped else []
    limit = _position_limit(spec)
    if limit and limit[0] < 1:   # (the default seq would be 0 tokens: a division by zero deep in the step model)
        raise ValueError(f"model: its config's {limit[1]} is {limit[0]}: a model with learned positions needs at "
                         "least one to train on")
    if seq is None:
        seq = min(2048, limit[0]) if limit else 2048
        if seq < 2048:
            notes.append(f"seq: {seq} tokens, the model's {limit[1]} (the default is 2048)")
    elif limit and seq > limit[0]:
        raise ValueError(f"seq: {seq} tokens is more than this model's learned positions ({limit[1]} = "
                         f"{limit[0]}) cover")
    activity: Dict[tuple, Activity] = {}
    # fused_gif for bf16 weights only: a float32 head already makes its gradients in forward by default
    losses = ["standard", "fused", "fused_gif"] if _fusable(spec) else ["standard"]
    for precision, loss in itertools.product(costs.PRECISIONS, losses):
        if loss == "fused_gif" and precision != "bf16":
            continue
        try:
            standard, fused = activity.get((precision, "standard")), activity.get((precision, "fused"))
            activity[precision, loss] = Activity(
                spec, seq, torch.bfloat16 if precision == "bf16" else torch.float32, device, inputs, loss,
                layers_from=standard if isinstance(standard, Activity) else None,
                fast_from=fused if loss == "fused_gif" and isinstance(fused, Activity) else None)
        except InputsFailed:   # the user's own callable: no model's trace to fall back from
            raise
        except Exception as e:  # noqa: BLE001  (a model that cannot run in this dtype: say so, plan the rest)
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            if (precision, loss) == ("bf16", "standard"):
                from effmem.plan.formula import counts
                found = counts(hf_config(spec))
                if found is None:
                    _raise_hinted(e, spec, inputs)
                activity[precision, loss] = FormulaActivity(found, spec, seq, why)
                notes.append(f"the model could not be traced ({why}): activations from the closed form "
                             "(plan/formula.py), bf16 with the standard loss, kept, checkpointed or saved on the "
                             "CPU; no other candidates")
            elif isinstance(activity.get(("bf16", "standard")), FormulaActivity):
                continue  # every trace fails alike; the formula speaks for bf16 only
            elif precision == "bf16":
                _raise_hinted(e, spec, inputs)
            else:
                notes.append(f"{precision} ({loss} loss): the model could not be traced in this dtype "
                             f"({why}); no such candidates")
    base = activity["bf16", "standard"]
    cross_check = None if isinstance(base, FormulaActivity) else _cross_check(spec, base, seq)
    if cross_check is not None:
        notes.append(f"cross-check: the closed-form count (plan/formula.py) of one sequence's saved activations "
                     f"is {cross_check['formula'] / 1e6:.2f} MB, the trace {cross_check['traced'] / 1e6:.2f} MB "
                     f"({cross_check['relative_difference']:+.2%})")
    if any(getattr(a, "selective_refused", False) for a in activity.values()):
        notes.append("selective: left out; a decoder layer writes into a matrix product's output in place (as "
                     "Falcon's mlp_output += attention_output), which the 'selective' policy refuses")
    if any(p.trainable and p.trainable < p.numel for p in spec.params):
        notes.append("trainable: part of a parameter trains (#a:b): counted as such; apply() cannot do that")

    budget = gpu_mem * (1 - headroom)
    buckets = costs.offload_buckets(p.numel for p in spec.params if p.trainable)  # apply() trains whole tensors
    numels = tuple(p.trainable for p in spec.params if p.trainable)
    cands: List[Candidate] = []
    shardings = ["none"] if world == 1 else [s for s in costs.SHARDINGS if s != "none"]
    optimizers = ["gpu"] if device == "cpu" else list(costs.OPTIMIZERS)
    acts = [a for a in costs.ACTIVATIONS if (device == "cuda" or a not in ("save_on_cpu", "fast_offload"))
            and (not a.startswith("fast") or all(t.has_fast for t in activity.values()))]
    from effmem.activations import min_refusal   # effmem.activations imports effmem.plan.model
    refused_min = min_refusal(hf_config(spec))
    if refused_min:   # listed as fitting, and apply() refused it (a Mixtral with its router's loss, a reviewer's run)
        acts.remove("checkpoint8")
        notes.append(f"checkpoint8 (the 'min' policy): left out; {refused_min}")
    for (precision, loss), micro in itertools.product(activity, _micro_batches(batch // world, accum)):
        m = activity[precision, loss].model(spec, micro, share)
        m.fast_offloaded = step_model.offloaded_codes(m, rates, precision)
        m.offload_buckets = buckets
        m.trainable_numels = numels
        known = [a for a in activity[precision, loss].strategies if a != "fast_offload" or m.fast_offloaded]
        for act, opt, shard, bits in itertools.product([a for a in acts if a in known], optimizers, shardings,
                                                        costs.STATE_BITS):
            if opt != "gpu" and shard in ("zero1", "zero2"):
                continue  # OffloadAdam shards with FSDP2 (zero3) or offloads everything under DDP
            cfg = costs.Config(precision, act, opt, shard, micro, batch // world // micro, loss, bits)
            cost = costs.memory(cfg, m, world, device == "cuda")
            cands.append(Candidate(cfg, cost, step_model.step_time(cfg, m, rates, world)))
            for v in offload_room.variants(cfg, cost, budget, m, rates):
                cands.append(Candidate(v, costs.memory(v, m, world, device == "cuda"),
                                       step_model.step_time(v, m, rates, world)))
    best = choose.judge(cands, budget, gpu_mem, host_mem, headroom, clipping)
    return Plan(spec.name, spec.num_params, spec.num_trainable, gpu_mem, host_mem, world, device, batch, seq,
                rates, cands, best.name if best else None, base.method,
                time.perf_counter() - t0, spec, notes, cross_check, headroom)
