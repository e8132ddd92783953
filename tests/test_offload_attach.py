"""opt.attach(model) in every mode: what reads the model (a checkpoint, evaluation) sees every step taken.

With async_step and delay, step() returns before the new weights are in the parameters. Hugging Face's
Trainer saves the model before the optimizer (whose state_dict() flushed), so its checkpoints held the
weights from before the last update and a resumed run diverged; evaluation under delay scored weights one
step old. attach() now hooks the model's state_dict and eval-mode forward to flush first."""
import functools
import os
import tempfile
import warnings

import pytest
import torch

from effmem import OffloadAdam
from offload_helpers import batches, tiny_gpt

MODES = {"async_step": {"async_step": True}, "delay": {"delay": True}}


def _one_step(model, opt):
    for x, y in batches(2):   # the first step's update (delay: installed by the next backward), then another
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("attached", [True, False])
def test_state_dict_of_an_attached_model_holds_the_last_update(mode, attached):
    model = tiny_gpt(torch.float32)
    opt = OffloadAdam(model.parameters(), lr=1e-2, **MODES[mode])
    if attached or mode == "async_step":
        opt.attach(model)
    if not attached and mode == "async_step":   # attached for its forward, without the flush hooks
        _remove_flush_hooks(opt)
    _one_step(model, opt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    opt.flush()
    same = all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert same == attached   # without the hooks the saved weights missed the update in flight
    opt.close()


def _remove_flush_hooks(opt):
    from effmem.optim._offload_forward import _Flush
    for handle in opt._forward_hooks:
        if not hasattr(handle, "hooks_dict_ref"):   # attach()'s zero_grad, not a hook
            continue
        hooks = handle.hooks_dict_ref()
        if hooks is not None and isinstance(hooks.get(handle.id), _Flush):
            handle.remove()


@pytest.mark.parametrize("attached", [True, False])
def test_delay_evaluation_of_an_attached_model_sees_the_last_update(attached):
    model = tiny_gpt(torch.float32)
    opt = OffloadAdam(model.parameters(), lr=1e-2, delay=True)
    if attached:
        opt.attach(model)
    _one_step(model, opt)
    x, y = batches(1, seed=5)[0]
    model.eval()
    with torch.no_grad():
        first = model(x, y)[1]
        opt.flush()
        latest = model(x, y)[1]
    assert torch.equal(first, latest) == attached
    model.train()   # a training forward is not flushed: delay's overlap stays
    _one_step(model, opt)
    opt.close()


def test_delay_training_in_eval_mode_keeps_its_overlap():
    """A training forward with the model in eval mode (dropout off) is not evaluation: flushing there made every
    step exact and synchronous. Only an eval-mode forward without gradients flushes."""
    runs = []
    for attached in (True, False):
        model = tiny_gpt(torch.float32).eval()
        opt = OffloadAdam(model.parameters(), lr=1e-2, delay=True)
        if attached:
            opt.attach(model)
        for x, y in batches(4):
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
        opt.flush()
        runs.append([p.detach().clone() for p in model.parameters()])
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_attach_refuses_a_model_without_the_optimizer_s_parameters():
    model = tiny_gpt(torch.float32)
    with OffloadAdam(model.parameters()) as opt:
        assert opt.attach(model) is model   # plain mode: the checkpoint hooks only
        with pytest.raises(ValueError, match="model: none of its modules owns a parameter of this optimizer"):
            opt.attach(torch.nn.Linear(2, 2))
        with pytest.raises(TypeError, match="model: expected an nn.Module"):
            opt.attach("model")


def test_delay_warns_once_when_micro_batches_are_not_marked():
    """Two backwards before step() outside accumulating(): the second micro-batch ran on newer weights than
    the first. Marked with accumulating(), or during the warm-up (no weights pending), no warning."""
    data = batches(12)

    def run(mark, warmup=0):
        model = tiny_gpt(torch.float32)
        opt = OffloadAdam(model.parameters(), lr=1e-2, delay=True, delay_warmup=warmup)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in range(0, len(data), 2):
                for j, (x, y) in enumerate(data[k:k + 2]):
                    with opt.accumulating() if mark and j == 0 else _Null():
                        model(x, y)[1].backward()
                opt.step()
                opt.zero_grad()
        opt.close()
        return [w for w in caught if "outside opt.accumulating()" in str(w.message)]

    assert len(run(mark=False)) == 1
    assert run(mark=True) == []
    assert run(mark=False, warmup=100) == []


def test_delay_does_not_take_reentrant_checkpointing_for_micro_batches():
    """Reentrant checkpointing runs each layer's backward as a graph task of its own inside the one backward;
    with only the checkpointed layers training (LoRA-like), each looked like a second micro-batch."""
    model = tiny_gpt(torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    # the frozen embedding's output made to require grad, as transformers' enable_input_require_grads does:
    # reentrant checkpointing needs an input that does
    model.tok_emb.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    for block in model.blocks:
        block.requires_grad_(True)
        block.forward = functools.partial(_checkpointed, type(block).forward, block)
    opt = OffloadAdam([p for p in model.parameters() if p.requires_grad], lr=1e-2, delay=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(4):
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
    opt.close()
    assert not [w for w in caught if "outside opt.accumulating()" in str(w.message)]


def _checkpointed(forward, block, x):
    return torch.utils.checkpoint.checkpoint(forward, block, x, use_reentrant=True)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("mode", list(MODES))
def test_trainer_resumes_an_attached_offload_adam_bit_for_bit(mode):
    """Hugging Face's Trainer: checkpoint at step 2 of 4, resume from it in a fresh Trainer, and end on the
    same weights as the uninterrupted run (they differed: the checkpoint missed step 2's update)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": r, "labels": r.clone()} for r in (torch.randint(0, 128, (16,), generator=gen)
                                                            for _ in range(16))]

    def train(out, resume=None):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        opt = OffloadAdam(model.parameters(), lr=1e-2, **MODES[mode])
        opt.attach(model)
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=4, save_strategy="steps",
                                 save_steps=2, report_to=[], use_cpu=True, disable_tqdm=True,
                                 lr_scheduler_type="constant", seed=0, data_seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
        trainer.train(resume_from_checkpoint=resume)
        opt.flush()
        weights = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return weights

    with tempfile.TemporaryDirectory() as out:
        whole = train(out)
        resumed = train(os.path.join(out, "resumed"), resume=os.path.join(out, "checkpoint-2"))
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))


@pytest.mark.parametrize("mode", ["plain", "async_step"])
def test_zero_grad_of_an_attached_model_drops_the_gradients_handed_over(mode):
    """Skipping a bad batch with model.zero_grad() (or the Trainer's own call) after its backward: the
    gradients had left p.grad for the engine, so torch's zero_grad dropped nothing and the batch went into the
    next step. The attached model's zero_grad drops them too; right after step() it waits for nothing."""
    import copy
    import io
    from effmem import FusedAdam
    data = batches(3)
    ref = tiny_gpt(torch.bfloat16)
    model = copy.deepcopy(ref)
    fused = FusedAdam(ref.parameters(), lr=1e-2)
    opt = OffloadAdam(model.parameters(), lr=1e-2, async_step=mode == "async_step")
    opt.attach(model)
    opt.attach(model)   # again (as after add_param_group): one hook still
    assert len(model.__dict__["_effmem_zero_grad"]) == 1
    for m, o in ((ref, fused), (model, opt)):
        m(*data[0])[1].backward()
        m.zero_grad()                    # the bad batch, dropped
        for x, y in data[1:]:
            m(x, y)[1].backward()
            o.step()
            m.zero_grad()                # right after step: nothing pending
    opt.flush()
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
    copied = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (copied, loaded):       # their zero_grad zeroes their own gradients
        other(*data[0])[1].backward()
        other.zero_grad()
        assert all(p.grad is None for p in other.parameters())
    opt.close()
    assert "zero_grad" not in model.__dict__   # close() takes it off


@pytest.mark.parametrize("mode", list(MODES))
def test_copies_and_pickles_of_an_attached_model_hold_the_last_update(mode):
    """torch.save(model) and copy.deepcopy(model) (an EMA or teacher copy) right after step() read the
    parameters without state_dict(): they held the weights from before that step (a reviewer's repro).
    Pickling or copying the model, or a module of it, now waits for the update first; the copy trains apart."""
    import copy
    import io
    model = tiny_gpt(torch.float32)
    opt = OffloadAdam(model.parameters(), lr=1e-2, **MODES[mode])
    opt.attach(model)
    _one_step(model, opt)
    ema = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    layer = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    layer_copy = copy.deepcopy(layer)
    opt.flush()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for copied in (ema, loaded):
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), copied.parameters()))
    assert torch.equal(layer.weight, layer_copy.weight)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batches(1)[0]
    ema(x, y)[1].backward()
    ema.zero_grad()   # the copy's hooks act for no optimizer: the original's weights stay
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    # a copy or a loaded model carries none of attach()'s bound methods: a copy of the loaded model, changed,
    # pickled the loaded model instead (its __reduce_ex__ was bound there, a reviewer's run)
    for copied in (ema, loaded, layer_copy, copy.copy(model)):
        assert not {"__reduce_ex__", "zero_grad"} & set(copied.__dict__)
    second = copy.deepcopy(loaded)
    with torch.no_grad():
        for p in second.parameters():
            p.zero_()
    buf = io.BytesIO()
    torch.save(second, buf)
    buf.seek(0)
    assert all(not p.any() for p in torch.load(buf, weights_only=False).parameters())
    opt.close()
    assert "__reduce_ex__" not in model.__dict__ and "__reduce_ex__" not in layer.__dict__
    copy.deepcopy(model)
