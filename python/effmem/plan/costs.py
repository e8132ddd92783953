"""Bytes and seconds of one training configuration: the arithmetic behind effmem plan.

Memory: the peak is the larger of two moments of a step.
* Start of backward (the last micro-batch's forward done): weights, the
  gradients accumulated by earlier micro-batches, master weights and Adam
  state, everything forward left alive (activations and logits), plus the
  largest transient of backward: the loss's gradient over the logits, or,
  under checkpointing, one recomputed layer and its gradients.
* Optimizer step: weights, all gradients, master and state.
Parts of the peak are those of the larger moment. Bytes are per GPU (per
rank when sharded); ``host`` is what the host holds for all the GPUs.

Time: plan/step_model.py, from the same Config and Model.
"""
import itertools
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple


# bytes per element: (weights, gradients, fp32 master, Adam state)
PRECISIONS = {
    "bf16": (2, 2, 4, 8),   # bf16 weights and gradients, FusedAdam's fp32 master and moments
    "fp32": (4, 4, 0, 8),   # fp32 weights under bf16 autocast, Adam on them (torch AdamW or FusedAdam)
}


def under_autocast(precision: str, device: str) -> bool:
    """Whether a candidate's forward runs under bf16 autocast: float32 weights on a GPU (plan.apply's code,
    verify and the trace agree on it); on a CPU they train plainly."""
    return precision == "fp32" and device == "cuda"


# checkpoint8: effmem.apply_activation_policy(model, "min"), checkpointed layers with 8-bit inputs.
# fast: effmem.apply_activation_policy(model, "fast"), 8-bit saves with norms and activations rebuilt.
# selective: apply_activation_policy(model, "selective"), torch's selective checkpointing (matmul and
# attention outputs kept, the rest recomputed).
# fast_offload: apply_activation_policy(model, memory_budget=...) where the solver moves the 8-bit codes of as
# many of the first layers to host memory as the link hides (activations/offload.py; GPU only).
ACTIVATIONS = ("none", "fast", "fast_offload", "selective", "checkpoint", "checkpoint8", "compress8", "compress4",
               "save_on_cpu")
TRACED = tuple(a for a in ACTIVATIONS if a != "fast_offload")  # fast_offload is "fast" less what goes to the host
# apply(): the memory_budget (bytes) given to the runtime solver is the plan's, this much larger (its own
# measurement of a layer's bytes may differ a little; where it is tighter it would put a layer under "min").
OFFLOAD_BUDGET_SLACK = 1.05
LAYER_KINDS = ("attention", "mlp", "norm", "block")  # trace kinds that decoder layers' saves fall under
LOSS_NAMES = {"standard": "", "fused": "fused-ce", "fused_gif": "fused-ce-grad-in-fwd"}  # Config.loss, named
RECOMPUTED = ("selective", "checkpoint", "checkpoint8")  # layers run again in backward
LOSSY_ACTIVATIONS = ("fast", "fast_offload", "checkpoint8", "compress8", "compress4")  # saves kept in 8/4 bits
OPTIMIZERS = ("gpu", "offload", "offload_overlap", "offload_async")
SHARDINGS = ("none", "ddp", "zero1", "zero2", "zero3")
OFFLOAD_BUCKET = 1 << 23        # OffloadAdam's default bucket (elements); two are in flight on the GPU
CUDA_CONTEXT = 512 << 20        # the CUDA context and cuBLAS workspace: device memory outside the allocator
FRAGMENTATION = 0.03            # the caching allocator's reserved-but-unused share, measured at a few percent
# Plain OffloadAdam (not overlap) under gradient accumulation peaked 12.0 B/param above its overlap mode on
# the H100 (bench/results/gpu_offload.json, 1.3B, 4 micro-batches: 55.6 GB against 39.4 GB; after the step
# it holds 2.0 B/param). The cause is not found yet; until it is, the plan counts it so that no pick
# runs out of memory. Measured under accumulation only, so counted only there.
OFFLOAD_PLAIN_ACCUM_EXTRA = 12
# state_bits=8 (csrc/common/adam8_math.h): both moments in a byte per element and a float32 scale per 256
# elements each, 2 + 1/32 B/param instead of 8. Its CPU update runs at about half the float32 kernel's rate
# (0.87 against 1.70 G params/s, 16M bf16 params, on a 2-core AVX-512 host; measured before the block maxima
# went into vector lanes, which took a 2-core AVX2 host from 0.42 to 0.51-0.57: bench_adam's adam8 row on the
# GPU machine's host should set it again); a GPU step reads and writes
# grad 2, master 8, codes 4, param 2: 16 B/param for bf16 instead of 28.
ADAM8_CPU_RATE = 0.5
STATE_BITS = (32, 8)


def optimizer_state_bytes(t: int, state_bits: int, blocks: int) -> int:
    """Adam's moments of t parameters: 8 B each in float32; at 8 bits 2 B each and a float32 scale per moment
    per block of a tensor (blocks: their count over the trained tensors, ModelSpec.state_blocks)."""
    return t * 8 if state_bits == 32 else 2 * t + 8 * blocks


@dataclass(frozen=True)
class Config:
    precision: str = "bf16"
    activations: str = "none"
    optimizer: str = "gpu"
    sharding: str = "none"
    micro_batch: int = 1
    accumulation: int = 1
    # or "fused": effmem.linear_cross_entropy, no [tokens, vocab] logits (its default way: logits made again in
    # backward for a trained bf16 head), or "fused_gif": the same with grad_in_forward=True (gradients made in
    # forward: one product fewer, a float32 buffer of the head's size while they are)
    loss: str = "standard"
    state_bits: int = 32     # Adam's moments: 32 (float32) or 8 (FusedAdam/OffloadAdam(state_bits=8))
    # OffloadAdam(device_accumulation=BYTES): gradients of whole buckets, up to these bytes, summed on the GPU
    # over the micro-batches and sent once per step (only with accumulation; 0: every micro-batch sends all).
    device_accumulation: int = 0
    # OffloadAdam(device_state=BYTES): the step state (master, moments, gradient) of the first trained tensors
    # kept on the GPU and stepped there, up to these bytes (0: all of it on the host).
    device_state: int = 0

    @property
    def approximations(self) -> int:
        """How many of its techniques change the numbers against plain training: activations kept in 8 or 4
        bits, 8-bit moments (each measured within 1% of the exact loss, but not the same bits)."""
        return int(self.activations in LOSSY_ACTIVATIONS) + int(self.state_bits == 8)

    @property
    def name(self) -> str:
        parts = [self.precision, self.activations if self.activations != "none" else "",
                 {"gpu": "", "offload": "offload-adam", "offload_overlap": "offload-adam-overlap",
                  "offload_async": "offload-adam-async"}[self.optimizer],
                 self.sharding if self.sharding != "none" else "", LOSS_NAMES[self.loss],
                 "adam8" if self.state_bits == 8 else "", self._device_accumulation_name(),
                 f"state-on-gpu{self.device_state / 1e9:.1f}GB" if self.device_state else "",
                 f"mb{self.micro_batch}x{self.accumulation}"]
        return "+".join(p for p in parts if p)

    def _device_accumulation_name(self) -> str:
        n = self.device_accumulation
        if not n:
            return ""
        return f"grads-on-gpu{n / 1e9:.1f}GB" if n >= 1e9 else f"grads-on-gpu{n / 1e6:.0f}MB"


@dataclass
class Model:
    """What costs.py needs of a model: counts from model.py and activations from trace.py, per micro-batch."""
    params: int
    trainable: int
    activations: Dict[str, Dict[str, int]]   # strategy -> kind -> bytes alive at the end of forward
    offloaded: int                           # bytes save_on_cpu moves to the host
    block_bytes: int                         # one decoder layer's internally saved bytes
    largest_logits: int                      # the largest saved tensor of the loss
    largest_block: int                       # the largest saved tensor inside a layer
    matmul_flops: float                      # forward FLOPs without attention
    attention_flops: float                   # forward FLOPs of attention
    trainable_matmul_share: float = 1.0      # share of matmul FLOPs whose weights train
    layers: int = 1
    tokens: int = 1                          # tokens per micro-batch
    fused_ce_transient: int = 0              # backward buffers of effmem.linear_cross_entropy (fused loss)
    fast_compressed: int = 0                 # plain bytes the "fast" policy quantises (and restores)
    fast_codes: int = 0                      # what they take as 8-bit codes and statistics, all layers
    fast_offloaded: int = 0                  # of those, the codes fast_offload moves to the host (offloaded_codes)
    offload_buckets: tuple = ()              # elements per OffloadAdam bucket, in the engine's order (the planner
                                             # sets it; none: device_accumulation keeps nothing)
    selective_recompute_bytes: float = 0.0   # memory traffic of the ops selective checkpointing recomputes
    elementwise_bytes: float = 0.0           # memory traffic of the forward's ops but products and attention
    block_matmul_flops: float = 0.0          # of matmul_flops, the decoder layers' (0: unknown, all of them)
    head_recompute_flops: float = 0.0        # the fused loss's logits product, made again in backward
    backward_flops: Optional[float] = None   # backward's products, traced (None: the closed form's estimate)
    attention_backward_flops: float = 0.0    # attention's backward, traced
    forward_ops: float = 0.0                 # aten ops of a forward (0: not traced; no host time counted)
    block_ops: float = 0.0                   # of those, the decoder layers'
    state_blocks: int = 0                    # 8-bit Adam's blocks over the trained tensors (ModelSpec.state_blocks)
    trainable_numels: tuple = ()             # trained elements per tensor, the optimizer's order (device_state)


@dataclass
class Cost:
    parts: Dict[str, int]
    peak_bytes: int
    allocated_bytes: int
    host_bytes: int
    states: Dict[str, int] = field(default_factory=dict)  # model states at the optimizer step
    forward_alive: int = 0   # bytes a micro-batch's forward leaves alive: activations, logits and loss
    activation_budget: int = 0      # fast_offload: the memory_budget (bytes) apply() gives the runtime solver


def memory(cfg: Config, m: Model, world: int, device_is_cuda: bool) -> Cost:
    w_b, g_b, master_b, opt_b = PRECISIONS[cfg.precision]
    n, t = m.params, m.trainable
    shard_state = world if cfg.sharding in ("zero1", "zero2", "zero3") else 1
    shard_grads = world if cfg.sharding in ("zero2", "zero3") else 1
    shard_weights = world if cfg.sharding == "zero3" else 1
    weights = n * w_b // shard_weights
    if cfg.sharding == "zero2":
        # FSDP2 without resharding after forward (apply()'s zero2) keeps each rank's shard beside the gathered
        # weights: the shards' 1/world more (measured with two gloo ranks: 1.5x the weights)
        weights += n * w_b // world
    grads = t * g_b // shard_grads
    master = t * master_b // shard_state
    moments = optimizer_state_bytes(t, cfg.state_bits, m.state_blocks)
    optimizer = moments // shard_state
    host = 0
    temporary_step = 0
    if cfg.optimizer != "gpu":
        # OffloadAdam: master and moments on the host, gradients staged there (2 B/param for bf16).
        # async_step stages the next step's gradients beside the weights being computed: a second staging.
        # device_state's prefix keeps master, moments and gradient on the GPU instead.
        kept_t, kept_blocks, _ = resident(cfg, m)
        t_off = t - kept_t
        moments_off = optimizer_state_bytes(t_off, cfg.state_bits, m.state_blocks - kept_blocks)
        staging = (2 if cfg.optimizer == "offload_async" else 1) * t_off * g_b
        host = (t_off * (master_b or 4) + moments_off + staging) // shard_state
        master, optimizer = kept_t * master_b, moments - moments_off
        grads = (min(t_off, 2 * OFFLOAD_BUCKET) + kept_t) * g_b
    kept = kept_on_device(cfg, m, g_b)
    if cfg.optimizer == "offload" and cfg.accumulation > 1:
        temporary_step += OFFLOAD_PLAIN_ACCUM_EXTRA * t // shard_state
    if cfg.sharding == "zero3":
        # FSDP2 gathers a layer's weights ahead of use: about two layers' full weights at a time.
        temporary_step += 2 * n * w_b // max(1, m.layers)
    act = dict(m.activations["fast" if cfg.activations == "fast_offload" else cfg.activations])
    activation_budget = 0
    if cfg.activations == "fast_offload":
        # The runtime's budget: bytes of the decoder layers' saves at this micro-batch, where the runtime
        # counts "fast", "offload" and "min" layers as the trace does (its plain count differs: it runs the
        # policy's fused paths, so a fraction of it would not do). Under "fast" the trace puts the layers'
        # saves under "block"; what stays under the other kinds is saved outside them.
        outside = sum(act[k] for k in LAYER_KINDS if k != "block")
        every_min = sum(m.activations["checkpoint8"][k] for k in LAYER_KINDS) - outside
        # At least what every layer under "min" holds: where the runtime finds the link hides fewer layers
        # than predicted, its solver falls back on "min" layers (slower) instead of raising. It may fill
        # the budget, so the budget is what is counted.
        activation_budget = int(OFFLOAD_BUDGET_SLACK * max(act["block"] - m.fast_offloaded, every_min))
        act["block"] = activation_budget
        # The codes wait in one page-locked buffer (activations/offload.py), which torch's pinned-memory
        # cache rounds up to a power of two; one copy per micro-batch (each backward brings its own back
        # before the next forward).
        host += (1 << (m.fast_offloaded - 1).bit_length()) if m.fast_offloaded else 0
    logits = act.pop("logits", 0)
    early = act.pop("grads", 0)  # gradients the fused loss made in its forward: alive at the start of backward
    activations = sum(act.values())
    if cfg.activations == "save_on_cpu":
        host += m.offloaded
    # The loss's backward: the gradient of the logits beside them (about 2x the largest logits tensor),
    # or the fused loss's chunk buffers. Compressed, the saved log-probabilities come back as a third full
    # copy beside those two (the H200 run of 2026-11-27 measured 4 B per token per vocabulary entry more).
    restored = 3 if cfg.activations.startswith("compress") else 2
    transient = max(m.fused_ce_transient if cfg.loss != "standard" else restored * m.largest_logits,
                    (m.block_bytes if cfg.activations in RECOMPUTED else 0)
                    + 2 * m.largest_block)
    # Under accumulation, the start of the last backward holds what earlier micro-batches left: the
    # gradients (FusedAdam), the buckets in flight (OffloadAdam), and those kept on the GPU to be sent once.
    accumulated = (grads + kept if cfg.accumulation > 1 else 0) + early
    start_backward = weights + accumulated + master + optimizer + activations + logits + transient + temporary_step
    step = weights + grads + master + optimizer + temporary_step
    if start_backward >= step:
        parts = dict(weights=weights, grads=accumulated, master=master, optimizer=optimizer,
                     activations=activations, logits=logits, temporary=transient + temporary_step)
    else:
        parts = dict(weights=weights, grads=grads, master=master, optimizer=optimizer, activations=0, logits=0,
                     temporary=temporary_step)
    allocated = sum(parts.values())
    reserve = (CUDA_CONTEXT + int(FRAGMENTATION * allocated)) if device_is_cuda else 0
    parts["reserve"] = reserve
    parts["activations_by_kind"] = act
    states = dict(weights=weights, grads=grads, master=master, optimizer=optimizer)
    # Host memory is the machine's, shared by all ranks on it (one machine: all `world` GPUs).
    return Cost(parts, allocated + reserve, allocated, host * world, states, activations + logits + early,
                activation_budget)


def offload_buckets(numels, bucket: int = OFFLOAD_BUCKET) -> tuple:
    """Elements per OffloadAdam bucket for trained parameters of these sizes (registration order, one
    dtype), in the engine's order: its own layout (effmem.optim._offload_layout.assign_buckets)."""
    from effmem.optim._offload_layout import assign_buckets
    numels = list(numels)
    bucket_of = assign_buckets([(n, None) for n in numels], bucket)
    sizes = [0] * (max(bucket_of, default=-1) + 1)
    for n, b in zip(numels, bucket_of):
        sizes[b] += n
    return tuple(sizes)


def kept_on_device(cfg: Config, m: "Model", g_b: int) -> int:
    """Gradient bytes OffloadAdam(device_accumulation=...) keeps on the GPU between micro-batches: whole
    buckets in the engine's order while they fit (effmem.optim._offload_layout.leading_buckets)."""
    from effmem.optim._offload_layout import leading_buckets
    if cfg.optimizer == "gpu" or cfg.accumulation < 2 or not cfg.device_accumulation:
        return 0
    sizes = [n * g_b for n in m.offload_buckets]
    return sum(sizes[:leading_buckets(sizes, cfg.device_accumulation)])


def resident(cfg: Config, m: "Model", enough: int = 0) -> Tuple[int, int, int]:
    """(elements, 8-bit blocks, device bytes) of the step state OffloadAdam(device_state=...) keeps on the GPU:
    the longest prefix of the trained tensors whose master, moments and gradient fit in the budget
    (effmem.optim._offload_resident.resident_prefix, the optimizer's own rule), or the shortest that holds
    `enough` elements if that is shorter."""
    from effmem.optim._adam8 import blocks
    from effmem.optim._offload_layout import leading_buckets
    from effmem.optim._offload_resident import step_state_bytes
    if cfg.optimizer == "gpu" or not cfg.device_state:
        return 0, 0, 0
    _, g_b, master_b, _ = PRECISIONS[cfg.precision]
    sizes = [step_state_bytes(n, master_b, g_b, cfg.state_bits) for n in m.trainable_numels]
    k = leading_buckets(sizes, cfg.device_state)
    if enough:   # the shortest prefix holding `enough` elements, if the budget's is longer
        held = itertools.accumulate(m.trainable_numels[:k])
        k = next((j + 1 for j, total in enumerate(held) if total >= enough), k)
    kept = m.trainable_numels[:k]
    return sum(kept), sum(blocks(n) for n in kept), sum(sizes[:k])
