"""remove_compression after a forward that Ctrl-C interrupted past its exit hook (a reviewer's find)."""
import gc
import weakref

import pytest
import torch
from torch import nn

from effmem.compress import compress_activations, compressor_of, remove_compression
from compress_helpers import no_hooks_left


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


def test_remove_compression_inside_the_forward_is_refused():
    block = _Stop()
    model = compress_activations(block)
    block.undo = model
    with pytest.raises(RuntimeError, match="inside the wrapped module's forward"):
        model(torch.randn(32, 64))
    assert no_hooks_left() and compressor_of(model) is not None
    block.undo = None
    remove_compression(model)
