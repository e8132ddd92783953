"""effmem plan's backward products: what backward runs through frozen layers (autograd computes no gradient for a
frozen weight, and none at all below the first trained parameter; the step model charged both), and the fused
loss's."""
import torch

import effmem
from test_plan import TINY


def compute_ms(trainable):
    cfg = dict(TINY, num_hidden_layers=6)
    p = effmem.plan(cfg, batch=4, seq=64, device="cpu", accum=1, trainable=trainable)
    return next(c for c in p.candidates if c.name == "fp32+mb4x1").time_parts["compute"]


def test_no_backward_is_charged_below_the_first_trained_parameter():
    """Measured on this CPU (a 6-layer Llama, hidden 256, batch 4 x 256, fp32; effmem.plan.verify, 3 steps):
    all trained 502 ms (predicted 619 before and after), lm_head alone 172 ms (predicted 423 before, 210 now),
    the last layer alone 229 ms (444 before, 275 now)."""
    full, head, last = compute_ms(None), compute_ms("lm_head"), compute_ms(r"layers\.5\.")
    # the forward is a third of a fully trained step's products; the head's weight gradient adds little
    assert head < 0.45 * full, (head, full)
    assert head < last < 0.6 * full, (head, last, full)


def test_the_fused_loss_backward_products_are_counted_as_the_unfused_heads():
    """The fused loss's kernels run where grad mode is off (an autograd.Function's forward), and backward's
    products were counted by grad mode: its two gradient products were left out, a fused candidate predicted
    at 0.38x of the unfused step's products on a CPU-sized Llama."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from effmem.plan.trace import trace_module
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    head = 2.0 * 2 * 128 * 64 * 8192   # one product of the output layer at batch 2 x 128
    plain = trace_module(model, 2, 128, torch.bfloat16, "cuda")
    for grad_in_forward in (None, True):
        effmem.fuse_linear_cross_entropy(model, grad_in_forward=grad_in_forward)
        fused = trace_module(model, 2, 128, torch.bfloat16, "cuda")
        assert fused.backward_flops == plain.backward_flops > 2 * head
        assert fused.head_recompute_flops == (head if grad_in_forward is None else 0.0)
        effmem.unfuse_linear_cross_entropy(model)


def test_the_printed_code_of_a_model_frozen_in_part_steps_its_trained_parameters_alone():
    """A model that comes frozen in part (LoRA adapters on frozen weights) is planned for its trained parameters,
    but the printed code (and --json's) gave the optimizer model.parameters(): OffloadAdam then kept host state
    for every frozen weight, 16x the plan's prediction in a reviewer's peft run."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from effmem.plan.report import plan_code
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    for name, p in model.named_parameters():
        p.requires_grad_("q_proj" in name)
    plan = effmem.plan(model, batch=2, seq=32, device="cuda", gpu_memory="1GB", host_memory="8GB")
    assert plan.trainable_params < plan.params
    for c in plan.candidates:
        code = plan_code(plan, c)
        assert "(model.parameters()" not in code and "([p for p in model.parameters() if p.requires_grad]" in code
    assert "if p.requires_grad]" in str(plan)
    whole = effmem.plan(TINY, batch=2, seq=32, device="cpu")
    assert "Adam(model.parameters()" in plan_code(whole, whole.pick)


def test_the_policies_keep_nothing_in_frozen_layers_no_gradient_flows_into():
    """Layers before the first trained parameter record no graph: checkpointing and selective keep nothing there,
    and "fast" no longer quantises their norms' and SwiGLU's inputs for nothing. The plan counted their layer
    inputs, products and codes as kept: 14.5, 9.6 and 53.1 MB where 8.4, 6.5 and 17.4 were measured (a
    reviewer's 4-layer Llama, the last layer trained); each prediction now within 6% of verify()'s measure (as
    with every layer trained: -3.6%, -2.7% and -0.7% here)."""
    from effmem.plan.verify import verify
    cfg = dict(TINY, hidden_size=256, intermediate_size=688, num_hidden_layers=3)
    p = effmem.plan(cfg, batch=2, seq=256, device="cpu", trainable=r"model\.layers\.2\.")
    names = [f"fp32+{a}+mb2x1" for a in ("fast", "checkpoint", "selective")]
    rows = {r["name"]: r for r in verify(p, candidates=names, steps=1, warmup=0)}
    for name in names:
        predicted, measured = p.candidate(name).cost.forward_alive, rows[name]["measured_activation_bytes"]
        assert abs(predicted / measured - 1) < 0.06, (name, predicted, measured)


def test_fast_counts_nothing_for_frozen_weights_inside_trained_layers():
    """A LoRA-like model (every layer trained, most weights frozen): the trace's weights were plain meta tensors,
    and "fast" took each frozen one a product saved for a copy of a weight and counted it: 10.84 MB predicted
    where verify() measured 6.84 (a reviewer's run; 13.3 GiB for "fast" against 8.5 for plain on llama-7b with
    q and v trained). They are Parameters now, kept as they are, as in the real forward."""
    from effmem.plan.verify import verify
    cfg = dict(TINY, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_key_value_heads=4)
    p = effmem.plan(cfg, batch=2, seq=256, accum=1, device="cpu", trainable=r"self_attn\.q_proj")
    names = ["fp32+fast+mb2x1", "fp32+mb2x1"]
    rows = {r["name"]: r for r in verify(p, candidates=names, steps=1, warmup=0)}
    for name in names:
        predicted, measured = p.candidate(name).cost.forward_alive, rows[name]["measured_activation_bytes"]
        assert abs(predicted / measured - 1) < 0.05, (name, predicted, measured)


def test_a_peft_wrapped_model_is_offered_the_fused_loss_unless_its_output_layer_is_wrapped():
    """fuse_linear_cross_entropy takes PEFT's PeftModel (its model runs the loss), but the plan asked the wrapper's
    class and offered no fused candidate (0 of 388 where the bare model had 578 of 966, a reviewer's peft run). An
    output layer wrapped (a LoRA on lm_head) or hooked, which fusing refuses, is offered none."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from compress_helpers import Adapter
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))

    def fused(m):
        p = effmem.plan(m, batch=2, seq=32, device="cuda", gpu_memory="1GB", host_memory="8GB")
        return sum("fused" in c.name for c in p.candidates), len(p.candidates)
    bare = fused(model)
    assert bare[0] > 0 and fused(Adapter(model)) == bare
    handle = model.lm_head.register_forward_hook(lambda m, i, o: None)   # fusing refuses a hooked head too
    assert fused(model)[0] == 0
    handle.remove()
    model.lm_head = torch.nn.Sequential(model.lm_head)   # a wrapper of the head, as a LoRA's
    assert fused(Adapter(model))[0] == 0
