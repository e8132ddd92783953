"""What FusedAdam and OffloadAdam share: Adam's hyper-parameters, checked param groups, and torch's
load_state_dict hooks around their own loaders."""
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Tuple, Union

import torch
from torch import Tensor

from effmem.optim import _validate, _wrappers
from effmem.optim._offload_lifetime import check_unowned


class AdamBase(torch.optim.Optimizer):
    def __init__(self, params, lr: Union[float, Tensor], betas: Tuple[float, float], eps: float,
                 weight_decay: float, decoupled_weight_decay: bool, bias_correction: bool):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay, bias_correction=bias_correction)
        _validate.hyperparameters(defaults)
        super().__init__(params, defaults)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        _wrappers.forward_to_wrapped(cls)   # Lightning's and Fabric's wrappers: the module says why

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        # torch's adds "differentiable" to the defaults (its load_state_dict calls this too), whence
        # complete_groups put it into every group: neither optimizer has that option
        self.defaults.pop("differentiable", None)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's add_param_group (which fills in the defaults), then the checks; a group that
        fails them is taken out again, so a refused group leaves the optimizer as it was."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _validate.hyperparameters(group, state_bits=self.state_bits)
            _validate.params(group["params"], [p for g in self.param_groups[:-1] for p in g["params"]])
            check_unowned(group["params"], type(self).__name__, me=self)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    def _hooked_state_dict(self, finish: Callable[[Dict[str, Any]], Dict[str, Any]]) -> Dict[str, Any]:
        """torch.optim's state_dict with `finish` (an effmem optimizer's own entries: masters, 8-bit layout)
        applied before the post-hooks, which torch's contract lets see the finished state dict and replace it
        (one that re-keys the state by parameter name broke the 8-bit layout's lookup by index, and an
        OffloadAdam master pending from the parameter went out as zeros: a reviewer's repros)."""
        post = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()
        try:
            sd = torch.optim.Optimizer.state_dict(self)
        finally:
            self._optimizer_state_dict_post_hooks = post
        sd = finish(sd)
        for hook in list(post.values()):
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def _hooked_load(self, state_dict: Any, load: Callable[[Any], None]) -> None:
        """torch.optim's contract for load_state_dict hooks around an effmem loader: the pre-hooks see a
        shallow copy of the whole checkpoint and may edit or replace it before anything is checked; the
        post-hooks run once the state is in place."""
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        load(state_dict)
        for hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            hook(self)

    def _load_groups(self, param_groups: List[Dict[str, Any]]) -> None:
        """The param groups through torch's loader, and none of the state: it would cast the state to the
        parameters' dtype. Its hooks are held back for the duration; _hooked_load runs them."""
        pre, post = self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = OrderedDict(), OrderedDict()
        try:
            torch.optim.Optimizer.load_state_dict(self, {"state": {}, "param_groups": param_groups})
        finally:
            self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = pre, post
        for group in self.param_groups:
            # torch's Adam/AdamW flags, which a torch checkpoint brings (refused where set: _validate.groups), and
            # which our own checkpoints must not carry on: their presence marks a checkpoint of torch's
            # (_validate.checkpoint); "differentiable" also an OffloadAdam checkpoint from before __setstate__
            # dropped it
            for flag in _validate.TORCH_ONLY_FLAGS:
                group.pop(flag, None)
            if "state_bits" in group:   # ZeroRedundancyOptimizer's copy of the keyword: the loading one's
                group["state_bits"] = self.state_bits
        _validate.complete_groups(self)
