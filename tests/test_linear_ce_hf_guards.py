"""What fuse_linear_cross_entropy refuses rather than get wrong, and its pass-through kept to one thread: a
loss_function of the user's own (fusing would replace it), one set after fusing (it would get hidden states),
forward hooks on lm_head, an lm_head offloaded by accelerate; an inference forward in another thread while a
training forward runs."""
import threading

import pytest
import torch
import torch.nn.functional as F

import effmem

pytest.importorskip("transformers")
from test_linear_ce_hf import FAMILIES, _quiet, batch  # noqa: E402,F401 (_quiet: the autouse fixture)


def z_loss(logits, labels, vocab_size, **kwargs):
    lg = logits.float()[:, :-1].reshape(-1, vocab_size)
    return F.cross_entropy(lg, labels[:, 1:].reshape(-1)) + torch.logsumexp(lg, -1).pow(2).mean()


def test_a_loss_function_of_the_users_own_is_refused_before_and_after_fusing():
    torch.manual_seed(0)
    model = FAMILIES["llama"]()
    x, y = batch()
    model.loss_function = z_loss
    with pytest.raises(TypeError, match="LlamaForCausalLM.loss_function is z_loss, not transformers' causal-LM"):
        effmem.fuse_linear_cross_entropy(model)
    assert "forward" not in model.__dict__   # nothing changed
    del model._loss_function
    effmem.fuse_linear_cross_entropy(model)
    model.loss_function = z_loss
    with pytest.raises(RuntimeError, match="model.loss_function was replaced after fusing"):
        model(input_ids=x, labels=y)


def test_forward_hooks_on_lm_head_are_refused_when_fusing():
    model = FAMILIES["llama"]()
    handle = model.lm_head.register_forward_hook(lambda m, i, o: None)
    with pytest.raises(RuntimeError, match="lm_head has forward hooks, which would see the hidden states"):
        effmem.fuse_linear_cross_entropy(model)
    handle.remove()
    effmem.fuse_linear_cross_entropy(model)


def test_compress_activations_tracking_hooks_on_lm_head_do_not_stop_fusing():
    """compress_activations hooks every module to name its saves; those hooks read no output, so fusing after
    it works (it was refused as if they were the user's), and a hook of the user's beside them still is."""
    model = effmem.compress_activations(FAMILIES["llama"](), bits=8)
    handle = model.lm_head.register_forward_hook(lambda m, i, o: None)
    with pytest.raises(RuntimeError, match="lm_head has forward hooks"):
        effmem.fuse_linear_cross_entropy(model)
    handle.remove()
    effmem.fuse_linear_cross_entropy(model)
    x, y = batch()
    model(input_ids=x, labels=y).loss.backward()
    assert model.compress_stats.num_compressed > 0


def test_an_lm_head_offloaded_by_accelerate_is_refused_when_fusing():
    accelerate = pytest.importorskip("accelerate")
    model = FAMILIES["llama"]()
    x, y = batch()
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    want = model(input_ids=x, labels=y).loss
    with pytest.raises(RuntimeError, match="lm_head is offloaded by accelerate"):
        effmem.fuse_linear_cross_entropy(model)
    assert torch.equal(model(input_ids=x, labels=y).loss, want)


def test_an_inference_forward_in_another_thread_gets_logits_while_a_training_forward_runs():
    torch.manual_seed(0)
    model = effmem.fuse_linear_cross_entropy(FAMILIES["llama"]())
    x, y = batch()
    inside, done, seen = threading.Event(), threading.Event(), {}

    def pause(module, args):   # in the training thread only: holds its forward between the layers and the head
        if threading.current_thread().name == "train":
            inside.set()
            assert done.wait(60)

    hook = model.model.norm.register_forward_pre_hook(pause)
    train = threading.Thread(target=lambda: seen.update(loss=model(input_ids=x, labels=y).loss), name="train")
    train.start()
    assert inside.wait(60)
    with torch.no_grad():
        seen["logits"] = model(input_ids=x).logits
    done.set()
    train.join(60)
    hook.remove()
    assert seen["logits"].shape == (*x.shape, 512)
    want = effmem.unfuse_linear_cross_entropy(model)(input_ids=x, labels=y).loss
    assert torch.allclose(seen["loss"], want, rtol=1e-5)


def test_a_compiled_model_is_told_to_fuse_before_compiling():
    compiled = torch.compile(FAMILIES["llama"]())
    with pytest.raises(TypeError, match="OptimizedModule is torch.compile's wrapper of a LlamaForCausalLM: fuse "
                                        "before compiling"):
        effmem.fuse_linear_cross_entropy(compiled)


def test_nn_data_parallel_replication_is_refused_and_allowed_again_once_unfused():
    """nn.DataParallel's replicas (transformers' Trainer makes them on several GPUs without torchrun) copied
    the model's __dict__, fused forward and loss included, and ran the original model: a replica with zeroed
    weights gave the original's loss (a reviewer's CPU simulation of replicate). torch's replicate calls
    _replicate_for_data_parallel on every module, as here."""
    model = effmem.fuse_linear_cross_entropy(FAMILIES["llama"]())
    with pytest.raises(RuntimeError, match="cannot be replicated by torch.nn.DataParallel"):
        model._replicate_for_data_parallel()
    effmem.unfuse_linear_cross_entropy(model)
    replica = model._replicate_for_data_parallel()
    assert replica._is_replica and "forward" not in replica.__dict__
