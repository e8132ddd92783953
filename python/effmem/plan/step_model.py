"""Seconds of one training configuration (plan/costs.py has its bytes): forward FLOPs are counted in the trace
(matmuls by torch's own formulas, attention at a flash kernel's count); backward costs two forwards for trained
weights and one where only the input gradient is needed; checkpointing adds the layers' forward again; eager
PyTorch's host issues every op, a floor under small steps. Transfers and the CPU update use the rates in
rates.py.
"""
from typing import Dict

from effmem.plan.costs import (ADAM8_CPU_RATE, OFFLOAD_BUCKET, PRECISIONS, RECOMPUTED, Config, Model,
                               kept_on_device, resident)
from effmem.plan.rates import Rates


def offloaded_codes(m: Model, r: Rates, precision: str) -> int:
    """The codes fast_offload moves to the host: those of the first layers whose copies the link hides
    behind one layer's forward (effmem.activations.budget.hidden_layers, with the forward's time from
    its FLOPs at this device's rate). 0 without a link."""
    from effmem.activations.budget import hidden_layers
    if not r.link_bw or not m.fast_codes or m.layers < 2:
        return 0
    layer_s = forward_s(m, r, precision) / m.layers
    per_layer = m.fast_codes // m.layers
    return hidden_layers(m.layers, layer_s, per_layer, r.link_bw) * per_layer


def host_adam_s(cfg: Config, r: Rates, n: int) -> float:
    """Seconds of OffloadAdam's host update of n parameters."""
    return n / (r.host_adam * (1.0 if cfg.state_bits == 32 else ADAM8_CPU_RATE))


def gpu_adam_s(cfg: Config, r: Rates, n: int) -> float:
    """Seconds of FusedAdam's step over n parameters: it reads the gradient, reads and writes both moments and
    the master (or the fp32 weight itself), and writes a low-precision weight: 28 B/param for bf16 and fp32."""
    w_b, g_b, master_b, _ = PRECISIONS[cfg.precision]
    weight_bytes = w_b + 2 * master_b if master_b else 2 * w_b
    moment_bytes = 2 * 2 * 4 if cfg.state_bits == 32 else 2 * 2
    return n * (g_b + weight_bytes + moment_bytes) / r.memory_bw


def matmul_rate(m: Model, r: Rates, precision: str) -> float:
    """FLOP/s of this micro-batch's products: the device's rate, lower for few tokens."""
    rate = r.matmul_flops if precision == "bf16" else r.matmul_flops_fp32
    return rate * m.tokens / (m.tokens + r.half_rate_tokens)


def products_s(m: Model, r: Rates, precision: str, matmul_flops: float, attention_flops: float) -> float:
    """Seconds of these products and attention FLOPs (attention at its own rate where one is known)."""
    rate = matmul_rate(m, r, precision)
    attention_rate = rate * r.attention_flops / r.matmul_flops if r.attention_flops else rate
    return matmul_flops / rate + attention_flops / attention_rate


def elementwise_s(m: Model, r: Rates, traffic: float) -> float:
    """Seconds of the memory-bound ops of a forward that moves `traffic` bytes, and of their backward:
    r.elementwise_passes times that traffic at the copy bandwidth (0 where the rates fold them into the
    matmul rate). A third of it is the forward's."""
    return r.elementwise_passes * traffic / r.memory_bw


def forward_s(m: Model, r: Rates, precision: str) -> float:
    """Seconds of one micro-batch's forward (the trace's FLOPs and traffic are per micro-batch)."""
    return products_s(m, r, precision, m.matmul_flops, m.attention_flops) + elementwise_s(m, r, m.elementwise_bytes) / 3


# The time the "fast" and "min" policies' fused functions save on a GPU, in units of the traffic of the
# layers' elementwise ops (Model.selective_recompute_bytes once at the copy bandwidth: 33 ms for TinyLlama at
# batch 8 x 2048), from bench/results/2026-11-27-h100-ad52e0c: "fast" ran 63.2 ms less of torch's elementwise
# kernels than plain and 16.5 ms of its own (gpu_profile.json: 46.7 ms, 1.41 units); "min" took 360.6 ms
# where transformers' checkpointing took 411.8 and its codes 1.9 more (gpu_activations.json: 53.1 ms, 1.61
# units: the recomputed forward runs the fused functions too).
POLICY_FUSED_SAVING = {"fast": 1.41, "fast_offload": 1.41, "checkpoint8": 1.61}


def fused_saving(cfg: Config, m: Model, r: Rates) -> float:
    """Seconds a policy's fused kernels save against autograd's ops: 0 where they do not run (a CPU), and
    for fp32 weights under autocast, where it has not been measured (the measurement above is bf16). A model
    the trace could not run has no elementwise traffic counted, so none either."""
    if not r.policy_codec_bw or cfg.precision != "bf16":
        return 0.0
    return POLICY_FUSED_SAVING.get(cfg.activations, 0.0) * m.selective_recompute_bytes / r.memory_bw


# Backward issues about 1.8 aten ops for each of the forward's: Hugging Face Llamas of 12 and 24 layers, bf16,
# counted with a dispatch mode on 2026-11-27 (1741 for 973, 3445 for 1897).
BACKWARD_OPS = 1.8
# Selective checkpointing runs its policy in a Python dispatch mode for every op of the layers, in forward and
# in the recompute: 3 plain ops' host time each, from the two host-bound selective rows of
# 2026-11-27-h200-68edd28/gpu_plan.json (160M and 410M at batch 4 x 1024: 129 and 312 ms, where the layers'
# ops issued twice at 15 us leave 71 and 197 ms for 960 and 1,920 ops, twice each: 37 and 51 us an op).
SAC_OP_COST = 3.0


def host_s(cfg: Config, m: Model, r: Rates) -> float:
    """Seconds the host takes to issue one micro-batch's ops in eager mode: the forward's ops, backward's
    (BACKWARD_OPS per forward op) and, where layers are recomputed, their forward's again; selective
    checkpointing's policy on each of the layers' ops, in forward and recompute (SAC_OP_COST). 0 where the
    rates count no host time (the CPU defaults: their rates are effective ones, host work included) or the
    trace counted no ops (the closed form). Not counted: the saved-tensor hooks of compress_activations, per saved
    tensor."""
    if not r.host_op_s or not m.forward_ops:
        return 0.0
    ops = m.forward_ops * (1 + BACKWARD_OPS) + (m.block_ops if cfg.activations in RECOMPUTED else 0.0)
    if cfg.activations == "selective":
        ops += 2 * SAC_OP_COST * m.block_ops
    return ops * r.host_op_s


def step_time(cfg: Config, m: Model, r: Rates, world: int) -> Dict[str, float]:
    """Seconds per optimizer step, by part: products and attention ("compute"), the memory-bound ops
    ("elementwise"), what the activation strategy adds, the optimizer, communication."""
    fwd = forward_s(m, r, cfg.precision)   # its elementwise third included: what the offload modes hide behind
    elementwise = elementwise_s(m, r, m.elementwise_bytes)
    if m.backward_flops is None:   # the closed form: input gradients everywhere, weight gradients as trained
        bwd_products = products_s(m, r, cfg.precision,
                                  m.matmul_flops * (1 + m.trainable_matmul_share) + m.head_recompute_flops,
                                  2 * m.attention_flops)
    else:   # traced: no gradient for a frozen weight, nor below the first trained parameter
        bwd_products = products_s(m, r, cfg.precision, m.backward_flops + m.head_recompute_flops,
                                  m.attention_backward_flops)
    bwd = bwd_products + elementwise * 2 / 3
    recompute = 0.0
    if cfg.activations in ("checkpoint", "checkpoint8"):
        # The decoder layers' forward again: their products and attention, and their elementwise ops (what
        # selective checkpointing would recompute: all of a layer's but the products). Without layer counts
        # (the closed form) the whole forward.
        if m.block_matmul_flops:
            recompute = (products_s(m, r, cfg.precision, m.block_matmul_flops, m.attention_flops)
                         + elementwise_s(m, r, m.selective_recompute_bytes) / 3)
        else:
            recompute = fwd
    if cfg.activations == "selective":
        # No product runs again: the norms and elementwise ops do, as the forward ran them; where the rates
        # count no elementwise passes (they fold them into the matmul rate), one pass at the copy bandwidth.
        if r.elementwise_passes:
            recompute = elementwise_s(m, r, m.selective_recompute_bytes) / 3
        else:
            recompute = m.selective_recompute_bytes / r.memory_bw
    extra = 0.0
    # what the policies' fused kernels save in place of autograd's elementwise ops: taken off "elementwise"
    # (so that no part of the step is negative), and off the device's time with it
    saving = fused_saving(cfg, m, r) if cfg.activations in POLICY_FUSED_SAVING else 0.0
    if cfg.activations.startswith("compress"):
        saved = sum(m.activations["none"].values()) - m.activations["none"].get("logits", 0)
        extra = saved / r.compress_bw
    elif cfg.activations in ("fast", "fast_offload"):
        # Its saves quantised and restored, and, where its CUDA kernels run, the one-pass norms and SwiGLU
        # in place of autograd's elementwise ops: time saved (POLICY_FUSED_SAVING). fast_offload's copies
        # are hidden (offloaded_codes offloads no more than that).
        extra = m.fast_compressed / (r.policy_codec_bw or r.compress_bw)
    elif cfg.activations == "checkpoint8":
        # One quantisation and one dequantisation of each layer's input; the recomputed layers run "fast"'s
        # fused functions.
        kept = m.activations["checkpoint"]
        inputs = sum(kept.values()) - kept.get("logits", 0)
        extra = inputs / (r.policy_codec_bw or r.compress_bw)
    elif cfg.activations == "save_on_cpu":
        # save_on_cpu copies each saved tensor off and back, on the compute stream.
        extra = 2 * m.offloaded / r.link_bw if r.link_bw else float("inf")
    out = {"compute": cfg.accumulation * (fwd + bwd - elementwise),
           "elementwise": cfg.accumulation * (elementwise - saving),
           "recompute": cfg.accumulation * recompute, "activations": cfg.accumulation * extra}
    # Eager PyTorch issues every op from the host, ahead of the device; where a micro-batch's device work
    # takes less time than issuing it (small models, few tokens), the device waits for the host.
    # The forward and backward that hide OffloadAdam's and communication's work below then last longer, in
    # proportion (so the windows join the device-bound ones where the host's time meets the device's; the
    # fused kernels' saving shortens the device's work only).
    device, host = fwd + bwd + recompute + extra - saving, host_s(cfg, m, r)
    # A CPU runs each op as its host issues it: the issuing adds to the work (calibrated rates only, which
    # measure the products' peak rate; the defaults' effective rate holds it already).
    out["host"] = cfg.accumulation * (host if r.device == "cpu" else max(0.0, host - device))
    if host > device > 0 and r.device != "cpu":
        stretch = host / max(device, fwd + bwd)
        fwd, bwd = fwd * stretch, bwd * stretch
    w_b, g_b, master_b, _ = PRECISIONS[cfg.precision]
    shard = world if cfg.sharding in ("zero1", "zero2", "zero3") else 1
    t = m.trainable // shard
    # The host's rate is the whole machine's, and its `world` ranks update at once (one machine, as the host
    # memory counts): each rank's update takes the time of all of theirs.
    if cfg.optimizer == "gpu" and r.device == "cpu":
        # training on a CPU: FusedAdam's CPU kernel, at its measured rate (8-bit moments compute-bound there)
        out["optimizer"] = host_adam_s(cfg, r, t * world)
    elif cfg.optimizer == "gpu":
        out["optimizer"] = gpu_adam_s(cfg, r, t)
    else:
        if not r.link_bw:
            out["optimizer"] = float("inf")
        else:
            # device_state: the first kept_t parameters are stepped on the GPU; the host takes the rest.
            kept_t = resident(cfg, m)[0]
            on_gpu = gpu_adam_s(cfg, r, kept_t)
            t = t - kept_t
            cpu = host_adam_s(cfg, r, t * world)
            upload = t * w_b / r.link_bw
            # Gradients stream off during every micro-batch's backward; what backward cannot hide shows.
            # Those kept on the GPU (device_accumulation) go in the last backward only, summed.
            kept = kept_on_device(cfg, m, g_b)
            last = t * g_b / r.link_bw
            earlier = max(0.0, (t * g_b - kept) / r.link_bw - bwd) * (cfg.accumulation - 1)
            down = max(0.0, last - bwd) + earlier
            if cfg.optimizer == "offload_overlap":
                # Updates run as buckets land during the last backward: its downloads and the updates are
                # one pipeline behind that one backward (not each behind a backward of its own), then the
                # weights go up.
                out["optimizer"] = on_gpu + earlier + max(upload, max(last, cpu) + upload - bwd)
            elif cfg.optimizer == "offload_async":
                # Updates run in forward order while the next forward runs, each layer waiting for its
                # own bucket: the first bucket shows (less the forward of the layers kept on the GPU, which
                # comes before it), and what the forward cannot cover.
                first = (cpu + upload) * min(1.0, OFFLOAD_BUCKET / max(1, t))
                lead = fwd * kept_t / max(1, kept_t + t)
                out["optimizer"] = on_gpu + down + max(first - lead, cpu + upload - fwd, 0.0)
            else:
                out["optimizer"] = on_gpu + down + cpu + upload
    if world > 1 and cfg.sharding != "none":
        grad_bytes = m.trainable * g_b
        comm = 2 * grad_bytes * (world - 1) / world  # all-reduce (or reduce-scatter + all-gather)
        if cfg.sharding == "zero3":
            comm += 2 * m.params * w_b * (world - 1) / world * cfg.accumulation  # gathers in fwd and bwd
        comm_s = comm / r.interconnect_bw if r.interconnect_bw else float("inf")
        out["communication"] = max(0.0, comm_s - cfg.accumulation * (bwd + fwd) * 0.8)
    return out
