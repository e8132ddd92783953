"""OffloadAdam(async_step=True)'s forward side (a mixin of OffloadAdam): the hooks that install each
module's new weights before its forward reads them."""
import weakref

import torch


class OffloadForward:
    def attach(self, model: torch.nn.Module) -> torch.nn.Module:
        """async_step: install each parameter's new weights before the forward of the module that owns it
        (a forward pre-hook on every module owning one of this optimizer's parameters); returns the model."""
        if not self._async:
            raise ValueError("attach: only OffloadAdam(async_step=True) installs weights in the forward")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
        self._check_open()
        for h in self._forward_hooks:
            h.remove()
        self._forward_hooks = []
        for module in model.modules():
            ids = [self._index[p] for p in module.parameters(recurse=False) if p in self._index]
            if ids:
                self._forward_hooks.append(module.register_forward_pre_hook(_Installer(self, ids)))
        if not self._forward_hooks:
            raise ValueError("model: none of its modules owns a parameter of this optimizer")
        return model

class _Installer:
    """The forward pre-hook of async_step: the module's parameters' new weights up before it runs. Holds
    the optimizer weakly (no reference cycle through the model's hooks) and reads its engine at each call
    (add_param_group lays out a new one)."""

    def __init__(self, opt, ids):
        self.opt, self.ids = weakref.ref(opt), ids

    def __call__(self, module, args):
        opt = self.opt()
        if opt is not None and opt._engine is not None and not opt._engine.closed:
            opt._engine.install_for_forward(self.ids)
