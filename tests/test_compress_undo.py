"""Undoing activation hooks after a forward that Ctrl-C interrupted past its exit hook: remove_compression, and
plan.apply's save_on_cpu hooks at the next forward (a reviewer's finds)."""
import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from effmem.compress import compress_activations, compressor_of, remove_compression
from compress_helpers import Adapter, no_hooks_left


class _Stop(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.stop, self.undo = nn.Linear(64, 64), None, None

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.undo is not None:
            remove_compression(self.undo)
        if self.stop is not None:
            raise self.stop
        return h


def test_remove_compression_drops_the_hooks_an_interrupted_forward_left():
    """Only the wrapped model's next forward dropped them (test_compress_usage), and with the hooks removed there
    is none: the saved-tensor hooks and the tracker stayed pushed on the thread, quantising every later save,
    and kept the compressor and the model alive."""
    block = _Stop()
    model = compress_activations(block)
    block.stop = KeyboardInterrupt()
    try:   # not pytest.raises, whose record of the traceback keeps the forward's frames (and the model) alive
        model(torch.randn(32, 64))
        raise AssertionError("the forward was not interrupted")
    except KeyboardInterrupt:
        pass
    block.stop = None
    assert not no_hooks_left()
    compressor = weakref.ref(compressor_of(model))
    remove_compression(model)
    assert no_hooks_left()
    del model, block
    gc.collect()
    assert compressor() is None


def test_remove_compression_drops_the_hooks_of_a_module_wrapped_inside_interrupted_with_it():
    """An exit pops the top of the thread's hook stacks: the wrapped module inside, interrupted with the outer
    one, pushed its hooks after, so dropping the outer's popped the inner's and left the removed one's on,
    quantising the saves of other models (a reviewer's find)."""
    block = _Stop()
    outer = nn.Sequential(block)
    compress_activations(block, bits=4)
    compress_activations(outer)
    block.stop = KeyboardInterrupt()
    try:
        outer(torch.randn(32, 64))
        raise AssertionError("the forward was not interrupted")
    except KeyboardInterrupt:
        pass
    block.stop = None
    remove_compression(outer)
    assert no_hooks_left() and compressor_of(block) is not None
    remove_compression(block)


def test_remove_compression_inside_the_forward_is_refused():
    block = _Stop()
    model = compress_activations(block)
    block.undo = model
    with pytest.raises(RuntimeError, match="inside the wrapped module's forward"):
        model(torch.randn(32, 64))
    assert no_hooks_left() and compressor_of(model) is not None
    block.undo = None
    remove_compression(model)


def _pushed_hooks() -> int:
    """How many saved-tensor hooks the thread has pushed (popped and pushed back)."""
    stack = []
    while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        stack.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
        torch._C._autograd._pop_saved_tensors_default_hooks()
    for pack, unpack in reversed(stack):
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    return len(stack)


def test_plan_apply_save_on_cpu_leaves_no_hooks_after_interrupted_forwards():
    """plan.apply's save_on_cpu hooks overwrote the context an interrupted forward left entered: one more
    save_on_cpu on the thread per Ctrl-C, for good. The next forward exits what is left first now."""
    from effmem.plan.apply import _SaveOnCpu
    block = _Stop()
    block._effmem_save_on_cpu = _SaveOnCpu(block, pin=False)
    block.stop = KeyboardInterrupt()
    for _ in range(3):
        try:
            block(torch.randn(4, 64, requires_grad=True))
        except KeyboardInterrupt:
            pass
        assert _pushed_hooks() == 1
    block.stop = None
    block(torch.randn(4, 64, requires_grad=True)).sum().backward()
    assert _pushed_hooks() == 0


def _hooks(m: nn.Module) -> int:
    return sum(len(s._forward_pre_hooks) + len(s._forward_hooks) for s in m.modules())


def test_remove_compression_finds_the_compressor_an_adapter_hides():
    """compress_activations(base) then get_peft_model: remove_compression(peft_model) read the base's compressor
    through the wrapper and failed with a KeyError, its hooks gone and its attribute left, so the base could not
    be wrapped again (a reviewer's peft run). A module wrapped on its own inside, or a wrapped one's
    submodule, is another matter: left alone, and refused."""
    base = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8))
    compress_activations(base)
    outer = Adapter(base)
    remove_compression(outer)
    assert _hooks(outer) == 0 and compressor_of(base) is None and "compress_stats" not in base.__dict__
    compress_activations(base[0], bits=4)
    compress_activations(base)
    assert _hooks(base) == 2 * len(list(base.modules())) + 2   # base[0]'s own entry and exit besides
    with pytest.raises(ValueError, match="not wrapped"):
        remove_compression(base[1])
    remove_compression(base)
    assert compressor_of(base[0]).config.bits == 4 and _hooks(base) == 2


def test_a_wrapped_model_runs_under_vmap_functional_call():
    """Model ensembling (torch.func.stack_module_state, vmap of functional_call) over a model given to
    compress_activations: its pre-hook named the storages of parameters functional_call had swapped for batched
    tensors, which have none (NotImplementedError; the with-block form ran). The gradients now match plain's."""
    from torch.func import functional_call, stack_module_state, vmap
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))
              for _ in range(3)]
    x = torch.randn(64, 128)

    def grads(base):
        params, buffers = stack_module_state(models)
        out = vmap(lambda p, b, xx: functional_call(base, (p, b), (xx,)), in_dims=(0, 0, None))(params, buffers, x)
        out.square().mean().backward()
        return [p.grad for p in params.values()]
    ref = grads(copy.deepcopy(models[0]).to("meta"))
    got = grads(compress_activations(copy.deepcopy(models[0]).to("meta")))
    assert all(((a - b).norm() / a.norm()).item() < 0.05 for a, b in zip(ref, got))
