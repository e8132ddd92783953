"""Clipping by global norm with OffloadAdam through the clip a training loop actually calls.

OffloadAdam takes each gradient off its parameter during backward, so torch.nn.utils.clip_grad_norm_ found
no p.grad, returned 0 and clipped nothing: under Hugging Face's Trainer (max_grad_norm=1.0 by default)
OffloadAdam trained unclipped, silently, where FusedAdam and torch's AdamW clipped. Importing effmem routes
those parameters to the optimizer's own clip (effmem/optim/_clip_route.py)."""
import contextlib
import copy
import warnings

import pytest
import torch

import effmem
from effmem import FusedAdam, OffloadAdam
from offload_helpers import batches, tiny_gpt

CLIP = 0.05   # below every gradient norm of these runs: each step is clipped


def _run(clip, steps=4, accum=2, opt_cls=OffloadAdam):
    """A tiny GPT trained with `clip(model, opt)` between backward and step; the weights, the norms."""
    model = tiny_gpt(torch.float32)
    opt = opt_cls(model.parameters(), lr=1e-2)
    data, norms = batches(steps * accum), []
    for k in range(0, len(data), accum):
        for x, y in data[k:k + accum]:
            (model(x, y)[1] / accum).backward()
        norms.append(float(clip(model, opt)))
        opt.step()
        opt.zero_grad()
    if isinstance(opt, OffloadAdam):
        opt.close()
    return [p.detach().clone() for p in model.parameters()], norms


def test_torch_clip_clips_what_offload_adam_holds_as_its_own_clip_does():
    """torch.nn.utils.clip_grad_norm_(model.parameters()) and opt.clip_grad_norm_ take the same steps, bit for
    bit, and report the same norms; FusedAdam clipped by torch's function agrees to float32 rounding."""
    own_w, own_n = _run(lambda m, opt: opt.clip_grad_norm_(CLIP))
    torch_w, torch_n = _run(lambda m, opt: torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP))
    effmem_w, effmem_n = _run(lambda m, opt: effmem.clip_grad_norm_(m.parameters(), CLIP))
    fused_w, fused_n = _run(lambda m, opt: torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP), opt_cls=FusedAdam)
    assert min(own_n) > CLIP * 10   # every step clipped hard: a clip that did nothing would change the weights
    assert torch_n == own_n == effmem_n
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(own_w, torch_w, effmem_w))
    torch.testing.assert_close(torch_n, fused_n, rtol=1e-5, atol=0)
    for a, b in zip(own_w, fused_w):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)   # lr 1e-2 steps, float32 rounding
    unclipped_w, _ = _run(lambda m, opt: torch.tensor(0.0))
    assert not all(torch.equal(a, b) for a, b in zip(own_w, unclipped_w))


def test_torch_clip_called_twice_clips_the_clipped_gradients_as_torch_does():
    """Two of torch's clips in one step (the loop's, then accelerate's): torch's first scales p.grad, so the
    second reports the clipped norm and clips on top of it. The routed clip kept only the last call's factor
    (a 0.001 clip then a 1.0 clip stepped as clipped to 1.0) and reported the unclipped norm twice."""
    def twice(m, opt):
        torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP / 10)
        return torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
    off_w, off_n = _run(twice)
    fused_w, fused_n = _run(twice, opt_cls=FusedAdam)   # p.grad scaled in place by torch's own function
    assert max(off_n) < CLIP / 10 * 1.001
    torch.testing.assert_close(off_n, fused_n, rtol=1e-5, atol=0)
    for a, b in zip(off_w, fused_w):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    once_w, _ = _run(lambda m, opt: torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP))
    assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(off_w, once_w))


def test_torch_clip_without_the_route_saw_no_gradients():
    """What the route fixes: torch's own function (kept as __wrapped__) returns 0 over OffloadAdam's parameters
    after backward, and the route changes nothing for tensors no OffloadAdam steps."""
    original = torch.nn.utils.clip_grad_norm_.__wrapped__
    model = tiny_gpt(torch.float32)
    opt = OffloadAdam(model.parameters(), lr=1e-2)
    x, y = batches(1)[0]
    model(x, y)[1].backward()
    assert float(original(model.parameters(), CLIP)) == 0.0
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)) > CLIP
    opt.close()
    plain = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    for p, g in zip(plain, (torch.full((3,), 2.0), torch.full((2,), -3.0))):
        p.grad = g
    expect = [p.grad.clone() for p in plain]
    norm = torch.nn.utils.clip_grad_norm_(plain, 1.0)
    torch.testing.assert_close(original([torch.nn.Parameter(torch.ones(1))], 1.0), torch.tensor(0.0))
    assert float(norm) == pytest.approx(float(torch.cat(expect).norm()))
    assert float(torch.cat([p.grad for p in plain]).norm()) == pytest.approx(1.0, rel=1e-5)


def test_routed_clip_refuses_what_one_norm_cannot_cover():
    """A subset of the optimizer's parameters, other parameters with gradients of their own, two optimizers,
    another norm: each a clear error naming the argument, nothing clipped."""
    model = tiny_gpt(torch.float32)
    opt = OffloadAdam(model.parameters(), lr=1e-2)
    other = torch.nn.Parameter(torch.ones(4))
    other.grad = torch.ones(4)
    x, y = batches(1)[0]
    model(x, y)[1].backward()
    params = list(model.parameters())
    with pytest.raises(RuntimeError, match=r"parameters: \d+ parameters of the OffloadAdam .* not among them"):
        torch.nn.utils.clip_grad_norm_(params[:2], CLIP)
    with pytest.raises(RuntimeError, match="parameters: 1 of them .* not stepped by the OffloadAdam"):
        torch.nn.utils.clip_grad_norm_(params + [other], CLIP)
    with pytest.raises(ValueError, match="norm_type: only the L2 norm"):
        torch.nn.utils.clip_grad_norm_(params, CLIP, norm_type=float("inf"))
    second_model = tiny_gpt(torch.float32)
    second = OffloadAdam(second_model.parameters(), lr=1e-2)
    second_model(x, y)[1].backward()
    with pytest.raises(RuntimeError, match="parameters: 2 OffloadAdam optimizers"):
        effmem.clip_grad_norm_(params + list(second_model.parameters()), CLIP)
    assert opt._clip_scale == 1.0 and second._clip_scale == 1.0
    second.close()
    opt.close()


def test_routed_clip_error_if_nonfinite_raises_and_clips_nothing():
    model = tiny_gpt(torch.float32)
    opt = OffloadAdam(model.parameters(), lr=1e-2)
    x, y = batches(1)[0]
    (model(x, y)[1] * float("nan")).backward()
    with pytest.raises(RuntimeError, match="total norm of the gradients is nan"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, error_if_nonfinite=True)
    assert opt._clip_scale == 1.0
    assert torch.isnan(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    opt.close()


def test_hugging_face_trainer_clips_offload_adam_as_it_clips_torch_adamw():
    """The real client: transformers' Trainer (max_grad_norm through accelerate's clip) on a tiny random
    Llama, two micro-batches a step. Its logged grad_norm was 0.0 for OffloadAdam and the steps unclipped;
    now the norms and losses are torch AdamW's to float32 rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 128, (16,), generator=gen) for _ in range(16)]
    data = [{"input_ids": r, "labels": r.clone()} for r in rows]

    def train(make_opt, out):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        opt = make_opt(model.parameters())
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                 max_steps=4, max_grad_norm=0.05, logging_steps=1, report_to=[], use_cpu=True,
                                 save_strategy="no", lr_scheduler_type="constant", disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        if isinstance(opt, OffloadAdam):
            opt.close()
        return [h["loss"] for h in logs], [h["grad_norm"] for h in logs]

    import tempfile
    with tempfile.TemporaryDirectory() as out:
        ref_loss, ref_norm = train(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0), out)
        off_loss, off_norm = train(lambda p: OffloadAdam(p, lr=1e-2), out)
    assert min(ref_norm) > 0.05 * 4   # clipped hard at every step
    torch.testing.assert_close(off_norm, ref_norm, rtol=1e-4, atol=0)
    torch.testing.assert_close(off_loss, ref_loss, rtol=1e-5, atol=0)


def test_torch_clip_inside_a_compiled_step_clips_what_offload_adam_holds():
    """Under torch.compile the wrapper handed every call to torch's function, which found no p.grad: the norms
    were 0 again. While an OffloadAdam is open the compiled code now breaks its graph there and routes."""
    def norms(compiled):
        model = tiny_gpt(torch.float32)
        opt = OffloadAdam(model.parameters(), lr=1e-2)

        def step(x, y):
            model(x, y)[1].backward()
            return torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)

        fn = torch.compile(step) if compiled else step
        out = []
        for x, y in batches(2):
            out.append(float(fn(x, y)))
            opt.step()
            opt.zero_grad()
        opt.close()
        return out

    eager = norms(False)
    assert min(eager) > CLIP and norms(True) == pytest.approx(eager, rel=1e-6)


def test_clip_by_value_over_what_offload_adam_holds_is_refused_with_the_reason():
    """torch's clip_grad_value_ found no p.grad: an unreadable error from its foreach kernel (accelerate's
    clip_grad_value_ calls it), or with device_state a clip of the few gradients left on the device only."""
    model = tiny_gpt(torch.float32)
    opt = OffloadAdam(model.parameters(), lr=1e-2)
    x, y = batches(1)[0]
    model(x, y)[1].backward()
    with pytest.raises(RuntimeError, match=r"parameters: parameter \d+ .* does not clip by value. Clip by the global"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    opt.close()
    plain = torch.nn.Parameter(torch.ones(3))
    plain.grad = torch.full((3,), 5.0)
    torch.nn.utils.clip_grad_value_([plain], 0.1)   # anything else: torch's own
    assert torch.equal(plain.grad, torch.full((3,), 0.1))


def test_overlap_gives_a_norm_only_call_nan_and_refuses_a_clip():
    """transformers' Trainer asks for the norm at every step to log grad_norm (clip_grad_norm_(inf), clipping
    or not): under overlap=True, whose buckets update during backward, that call was refused with the clip's
    message, so Trainer could not run overlap at all, even with max_grad_norm=0 (a reviewer's run). It gets
    NaN now, with a warning once; a real clip is still refused."""
    model = tiny_gpt(torch.float32)
    opt = OffloadAdam(model.parameters(), lr=1e-2, overlap=True)
    for i, (x, y) in enumerate(batches(2)):
        model(x, y)[1].backward()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        assert norm.isnan() and sum("max_norm=inf) returns NaN" in str(w.message) for w in seen) == (i == 0)
        with pytest.raises(RuntimeError, match="cannot clip by the global norm"):
            opt.clip_grad_norm_(1.0)
        assert opt.clip_grad_norm_(torch.tensor(float("inf"))).isnan()
        with pytest.raises(RuntimeError, match=r"no global norm to check \(error_if_nonfinite=True\)"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"), error_if_nonfinite=True)
        opt.step()
        opt.zero_grad()
    opt.close()


@pytest.mark.parametrize("mode", [dict(stream_grads=False), dict(stream_grads=False, delay=True), {}],
                         ids=["held", "held_delay", "streamed"])
def test_a_clip_after_each_micro_batch_gives_the_norm_so_far_and_the_step_takes_the_sum(mode):
    """A norm logged after each micro-batch (or a clip before a step that was not taken): with the gradients
    held in p.grad (stream_grads=False), the second clip returned the first micro-batch's norm, and step()
    refused the sum as changed since the clip, dropping both. Now the clip sends them again: FusedAdam's
    norms and weights, bit for bit."""
    def run(make):
        model = tiny_gpt(torch.float32)
        opt, norms = make(model.parameters()), []
        for k, (x, y) in enumerate(batches(6)):
            first = isinstance(opt, OffloadAdam) and k % 2 == 0
            with opt.accumulating() if first else contextlib.nullcontext():   # (delay: the same weights)
                (model(x, y)[1] / 2).backward()
                norms.append(float(opt.clip_grad_norm_(CLIP)))
            if k % 2:
                opt.step()
                opt.zero_grad()
        if isinstance(opt, OffloadAdam):
            opt.flush()
            opt.close()
        return [p.detach() for p in model.parameters()], norms
    # delay's reference is delay with its gradients streamed (its stale steps are not FusedAdam's)
    ref_w, ref_n = run(lambda ps: OffloadAdam(ps, lr=1e-2, delay=True) if "delay" in mode else FusedAdam(ps, lr=1e-2))
    got_w, got_n = run(lambda ps: OffloadAdam(ps, lr=1e-2, **mode))
    assert got_n == ref_n and len(set(got_n)) == len(got_n)
    assert all(torch.equal(p, q) for p, q in zip(got_w, ref_w))


_ACCELERATE_LOOP = """
import sys
import torch
import effmem

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
ref = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
ref.load_state_dict(model.state_dict())
opt = effmem.OffloadAdam(model.parameters(), lr=1e-2)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
assert "accelerate" not in sys.modules   # imported after effmem and after the optimizer, as a script may
from accelerate import Accelerator
acc = Accelerator(cpu=True)
model, opt = acc.prepare(model, opt)
gen = torch.Generator().manual_seed(1)
for _ in range(3):
    x = torch.randn(8, 16, generator=gen)
    acc.backward(model(x).square().mean())
    norm = acc.clip_grad_norm_(model.parameters(), 0.01)
    opt.step()
    opt.zero_grad()
    ref(x).square().mean().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    ref_opt.step()
    ref_opt.zero_grad()
    print(float(norm), float(ref_norm))
print(max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters())))
"""


def test_accelerate_clip_reaches_offload_adam_when_imported_after_it():
    """accelerate 1.16's Accelerator.clip_grad_norm_ sums p.grad's norms itself (no torch clip to route): it
    returned 0 and clipped nothing. Wrapped once accelerate is imported, here after effmem and after the
    optimizer, in a fresh process: the norms are torch AdamW's, and so are the clipped steps."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _ACCELERATE_LOOP], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    norms = [tuple(map(float, line.split())) for line in lines[:3]]
    assert min(r for _, r in norms) > 0.01 * 4   # clipped hard at every step
    torch.testing.assert_close([n for n, _ in norms], [r for _, r in norms], rtol=1e-5, atol=0)
    assert float(lines[3]) < 1e-5


def test_torch_clip_after_each_micro_batch_is_refused_where_the_engine_holds_the_sum():
    """torch's clip after every micro-batch scales the partial sum in p.grad, so the next backward adds to
    c1*g1; the engine held g1 + g2 and applied c1*c2 to it, silently 5x farther from torch's AdamW than no clip
    at all (a reviewer's run). Now refused at the next clip, the step's gradients dropped, so the loop can go on
    clipping once per step; with a first clip that does not clip, and with stream_grads=False (p.grad scaled as
    torch's), the norms are AdamW's."""
    def run(make, clip, each=True, steps=2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        opt, gen, norms = make(model.parameters()), torch.Generator().manual_seed(1), []
        for _ in range(steps):
            for micro in range(2):
                (model(torch.randn(8, 16, generator=gen)).square().mean() / 2).backward()
                if each or micro == 1:
                    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            opt.zero_grad()
        return model, opt, norms

    adamw = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0)   # noqa: E731
    # device_state=3300: the first Linear's state on the device, its gradients left in p.grad (not sent); the
    # second micro-batch reaching only it, or every parameter
    resident = {"device_state": 3300}
    for kw, second in (({}, None), (resident, 1), (resident, None), ({"async_step": True}, None)):
        model, opt, _ = run(lambda p: OffloadAdam(p, lr=1e-2, **kw), 100.0, steps=0)
        if kw.get("async_step"):
            opt.attach(model)
        gen = torch.Generator().manual_seed(1)
        model(torch.randn(8, 16, generator=gen)).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        model[:second](torch.randn(8, 16, generator=gen)).square().mean().backward()
        with pytest.raises(RuntimeError, match=r"clip_grad_norm_ clipped this step's gradients \(factor 0\.0\d+\), "
                                               "then another backward added to them.*gradients were dropped"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        assert opt._engine.counters()["param_updates"] == 0 and opt._clip_scale == 1.0
        # the loop goes on, clipping once per step: torch AdamW's steps from where the refusal left the model
        ref = copy.deepcopy(model)
        ref_opt = adamw(ref.parameters())
        for m, o in ((model, opt), (ref, ref_opt)):
            m(torch.ones(8, 16)).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
            o.step()
            o.zero_grad()
        opt.close()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    for make, clip in ((lambda p: OffloadAdam(p, lr=1e-2), 100.0),
                       (lambda p: OffloadAdam(p, lr=1e-2, stream_grads=False), 0.01)):
        _, opt, norms = run(make, clip)
        opt.close()
        torch.testing.assert_close(norms, run(adamw, clip)[2], rtol=1e-5, atol=0)


def test_torch_clip_after_each_micro_batch_under_attach_ddp_is_refused_too():
    """attach_ddp's comm hook hands the averaged gradients to the engine itself (not through the backward
    hooks): the second micro-batch after a clip that clipped is refused there too (it stepped 4.8e-2 off torch
    AdamW, farther than no clip, 4.7e-2: a reviewer's run); clipping once per step equals AdamW."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    def run(make, each):
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                                            torch.nn.Linear(16, 4)))
        opt, gen = make(model.parameters()), torch.Generator().manual_seed(1)
        if isinstance(opt, OffloadAdam):
            opt.attach_ddp(model)
        try:
            for _ in range(2):
                for micro in range(2):
                    (model(torch.randn(8, 16, generator=gen)).square().mean() / 2).backward()
                    if each or micro == 1:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                opt.step()
                opt.zero_grad()
        finally:
            if isinstance(opt, OffloadAdam):
                opt.close()
        return [p.detach() for p in model.parameters()]

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        offload = lambda p: OffloadAdam(p, lr=1e-2, stream_grads=False)   # noqa: E731
        with pytest.raises(RuntimeError, match="clipped this step's gradients .* then another backward"):
            run(offload, each=True)
        ref = run(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0), each=False)
        for p, q in zip(run(offload, each=False), ref):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    finally:
        dist.destroy_process_group()
