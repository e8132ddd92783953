"""Helpers shared by the compress_activations tests (tests/test_compress*.py), and a model wrapper."""
import torch

from effmem import demo_model


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def small_gpt(n_layer=2, d_model=64, seq_len=32, n_head=2):
    torch.manual_seed(0)
    return demo_model.ByteGPT(demo_model.GPTConfig(seq_len=seq_len, n_layer=n_layer, d_model=d_model,
                                                   n_head=n_head))


def batch(corpus, b=8, t=32, seed=0):
    return demo_model.sample_batch(corpus, b, t, torch.Generator().manual_seed(seed))


def grads_of(model, fn):
    model.zero_grad(set_to_none=True)
    fn().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def max_rel_err(got, exact):
    return max(rel_err(got[n], exact[n]) for n in exact)


def no_hooks_left():
    return (torch._C._autograd._top_saved_tensors_default_hooks(False) is None
            and torch._C._len_torch_dispatch_stack() == 0)


class Adapter(torch.nn.Module):
    """peft's PeftModel in brief: it holds the model, and attribute reads it lacks pass through to it."""

    def __init__(self, model):
        super().__init__()
        self.base_model = model

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)

    def get_base_model(self):
        return self.base_model

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.base_model, name)
